"""How a round's failures are told apart and described in its record, and the failure
of a whole run.

A failure is an exception (a client that did not answer, or Flower's wrapper of an
error reply) or a (node, FitRes) pair with a status other than OK. Under secure
aggregation a reply the strategy refused before the sum becomes an error reply of code
:data:`REJECTED`, so that Flower's SecAgg+ workflow drops its sender and removes its
masks; it is then recorded as a rejection, not a failure (docs/PRIVACY.md).
"""

from __future__ import annotations

from flwr.app import Error

REJECTED = 4601  # the error code of a reply refused before the secure sum


class RunFailed(RuntimeError):
    """The run cannot produce a result (its nodes never formed the federation, or a
    round trained no node): the round loop ends it as failed with this reason
    (docs/RELIABILITY.md, "A run that trained nothing fails")."""


def rejection(reason: str) -> Error:
    """The error that replaces a reply refused before the secure sum."""
    return Error(REJECTED, reason)


def is_rejection(failure) -> bool:
    """Whether a failure is a reply the screen step already refused
    (:meth:`.pipeline.RoundPipeline.screen`)."""
    return (isinstance(failure, Exception) and bool(failure.args)
            and isinstance(failure.args[0], Error) and failure.args[0].code == REJECTED)


def distinct_failures(failures: list) -> list:
    """``failures`` without repeats: Flower's SecAgg+ workflow lists a client that failed
    in its collect stage twice (two exceptions wrapping one error)."""
    seen: set[int] = set()
    out = []
    for f in failures:
        key = id(f.args[0]) if isinstance(f, Exception) and f.args else id(f)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def describe_failure(failure) -> str:
    """One line for the round record's ``failure_reasons``."""
    if isinstance(failure, Exception) and failure.args and isinstance(failure.args[0], Error):
        return f"error {failure.args[0].code}: {failure.args[0].reason}"
    if isinstance(failure, BaseException):
        return f"{type(failure).__name__}: {failure}"
    proxy, res = failure
    return f"node {proxy.cid}: status {res.status.code.name} {res.status.message}"
