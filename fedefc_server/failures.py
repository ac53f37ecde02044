"""How a round's failures are told apart and described in its record, and the failure
of a whole run.

A failure is an exception (a client that did not answer, or Flower's wrapper of an
error reply) or a (node, FitRes) pair with a status other than OK. Under secure
aggregation a reply the strategy refused before the sum becomes an error reply of code
:data:`REJECTED`, so that Flower's SecAgg+ workflow drops its sender and removes its
masks; it is then recorded as a rejection, not a failure (docs/PRIVACY.md).
"""

from __future__ import annotations

import re
from logging import WARNING
from typing import Any

from flwr.app import Error
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.server.client_proxy import ClientProxy

REJECTED = 4601  # the error code of a reply refused before the secure sum
NO_REPLY = "Expected one Message but got: 0"  # Flower's proxy when no reply came in time
# Flower's proxy for a node's error reply (Flower 1.42: compat/grid_client_proxy.py)
ERROR_REPLY = re.compile(r"Message contains an Error \(reason: (.*)\)\. It originated during "
                         r"client-side execution of a message\.", re.DOTALL)

# Ray's memory monitor killing a simulation's ClientApp (docs/RELIABILITY.md, "A
# ClientApp killed by Ray's memory monitor"): the raylet's words, "N worker(s) were
# killed due to the node running low on memory." (Ray 2.55; "Task was killed ..." before),
# reach the ServerApp as the text of Flower's error reply of code UNKNOWN,
# "<class 'ray.exceptions.OutOfMemoryError'>:<'...'>", followed by the memory figures.
RAY_OOM = re.compile(r"killed due to the node running low on memory")
RAY_OOM_USAGE = re.compile(r"was ([\d.]+)GB / ([\d.]+)GB \(([\d.]+)\), which exceeds the memory "
                           r"usage threshold of ([\d.]+)")
MEMORY_KILLED = "Ray's memory monitor killed the ClientApp"
MEMORY_FIX = ("run fewer ClientApps at once on the machine (raise client-resources-num-cpus), "
              "train with a smaller batch-size, give the machine more memory, or set a "
              "higher RAY_memory_usage_threshold (Ray's default 0.95) in the environment "
              "that starts Ray")


# A node's error reply that waiting does not change (docs/RELIABILITY.md, "A run that
# trained nothing fails"): its own policy refuses the run (Flower's code for a mod's
# failed precondition), or its ClientApp refused the run's config (the node's config
# or policy file disagrees with it: the exception's type opens the reply's text).
PERMANENT_CODES = frozenset({ErrorCode.MOD_FAILED_PRECONDITION})
PERMANENT_ERRORS = ("ConfigError:", "PolicyError:")


class NodeRefused(RuntimeError):
    """A node's error reply to a message: its Flower error ``code`` and ``reason``."""

    def __init__(self, code: int, reason: str):
        super().__init__(f"error {code}: {reason}")
        self.code = code
        self.reason = reason

    @property
    def permanent(self) -> bool:
        """Whether the refusal stands until the node's operator changes something: a
        policy refusal or a config mismatch, never a crash or a timeout."""
        return (self.code in PERMANENT_CODES or
                (self.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
                 and self.reason.startswith(PERMANENT_ERRORS)))


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


class NodeFailed(Exception):
    """A message to a node that failed (an exception of Flower's, or the node's error
    reply), with the node and the partition it was sent to (:class:`Attributed`)."""

    def __init__(self, node: str, partition: int | None, cause: BaseException):
        super().__init__(cause)
        self.node = node
        self.partition = partition
        self.cause = cause


class Attributed(ClientProxy):
    """A node's proxy whose failures name it: every call that raises raises
    :class:`NodeFailed` with the node and the partition it serves, so that a round's
    record can say which partition failed and why (Flower's own failures carry
    neither). Everything else is the proxy's."""

    def __init__(self, proxy: ClientProxy, partition: int | None):
        super().__init__(proxy.cid)
        self.proxy = proxy
        self.partition = partition

    def __getattr__(self, name: str) -> Any:
        return getattr(self.proxy, name)

    def _call(self, method, *args):
        try:
            return method(*args)
        except Exception as err:
            raise NodeFailed(self.cid, self.partition, err) from err

    def get_properties(self, ins, timeout, group_id):
        return self._call(self.proxy.get_properties, ins, timeout, group_id)

    def get_parameters(self, ins, timeout, group_id):
        return self._call(self.proxy.get_parameters, ins, timeout, group_id)

    def fit(self, ins, timeout, group_id):
        return self._call(self.proxy.fit, ins, timeout, group_id)

    def evaluate(self, ins, timeout, group_id):
        return self._call(self.proxy.evaluate, ins, timeout, group_id)

    def reconnect(self, ins, timeout, group_id):
        return self._call(self.proxy.reconnect, ins, timeout, group_id)


def attributed_failures(failures: list) -> list[dict[str, Any]]:
    """{node, partition, reason} of the failures that name their node (:class:`Attributed`
    proxies' exceptions, and replies of a status other than OK)."""
    out = []
    for failure in failures:
        if isinstance(failure, NodeFailed):
            out.append({"node": failure.node, "partition": failure.partition,
                        "reason": describe_failure(failure.cause)})
        elif isinstance(failure, tuple):
            proxy, res = failure
            out.append({"node": proxy.cid, "partition": getattr(proxy, "partition", None),
                        "reason": f"status {res.status.code.name} {res.status.message}"})
    return out


def memory_killed(reason: str) -> str | None:
    """The cause and its fix when an error reply's ``reason`` is Ray's memory monitor
    killing the ClientApp (:data:`RAY_OOM`), without Ray's long report (its top memory
    users); None for any other reason."""
    if not RAY_OOM.search(reason):
        return None
    usage = RAY_OOM_USAGE.search(reason)
    at = "" if usage is None else (
        f" (the machine's memory at {float(usage.group(1)):.2f} of "
        f"{float(usage.group(2)):.2f} GB, {100 * float(usage.group(3)):.1f} %, over its "
        f"threshold of {100 * float(usage.group(4)):.0f} %)")
    return f"{MEMORY_KILLED}{at}: {MEMORY_FIX}"


def telling(reasons: list[str]) -> str:
    """The one of a round's failure ``reasons`` that best says why it trained nothing:
    Ray's memory monitor where it killed a ClientApp (the other failures then follow
    from it: Flower hands later messages to the killed actor), else the first."""
    return next((r for r in reasons if MEMORY_KILLED in r), reasons[0])


def describe_failure(failure) -> str:
    """One line for the round record's ``failure_reasons``."""
    if isinstance(failure, NodeFailed):
        pid = "" if failure.partition is None else f" (partition {failure.partition})"
        return f"node {failure.node}{pid}: {describe_failure(failure.cause)}"
    if isinstance(failure, Exception) and failure.args and isinstance(failure.args[0], Error):
        reason = failure.args[0].reason
        return f"error {failure.args[0].code}: {memory_killed(reason) or reason}"
    if isinstance(failure, ValueError) and str(failure) == NO_REPLY:
        return "no reply within client-timeout (Flower returned none)"
    if isinstance(failure, ValueError) and (reply := ERROR_REPLY.fullmatch(str(failure))):
        return f"error reply: {memory_killed(reply.group(1)) or reply.group(1)}"
    if isinstance(failure, BaseException):
        return f"{type(failure).__name__}: {failure}"
    proxy, res = failure
    return f"node {proxy.cid}: status {res.status.code.name} {res.status.message}"


def describe_failures(server_round: int, what: str, failures: list) -> list[str]:
    """Each failure described for the round record (:func:`describe_failure`), and
    logged."""
    failed = [describe_failure(f) for f in failures]
    for reason in failed:
        log(WARNING, "round %d: %s failed: %s", server_round, what, reason)
    return failed
