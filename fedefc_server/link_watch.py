"""A SuperLink that restarts mid-exchange must not leave a round waiting forever
(docs/RELIABILITY.md, "A SuperLink restart mid-round").

Flower's SuperLink hands a message over at most once: a node's pull marks its
instruction delivered, a ServerApp's pull marks a reply delivered, in the same
transaction that selects them. A SuperLink killed after that commit and before its
answer reached the caller has lost the message: the node never trains, or the ServerApp
never sees the reply, and the SuperLink, back on the same database, keeps the message
as delivered. The node stays online, so Flower generates no error reply either, and a
round without ``client-timeout`` waits for it forever (a two-node run hung for an hour
so, in round 2 of 3).

Which message was lost cannot be told from the ServerApp, but that one may have been
can: the SuperLink was unreachable while the exchange was out. :class:`LinkWatchGrid`
wraps a deployment's grid (the one whose Runtime API calls Flower retries), counts the
retried calls that found the SuperLink unreachable (:data:`UNREACHABLE`: refused, or
no connection in time), and polls an exchange's replies every
:data:`POLL_S` seconds, so that a SuperLink that is away longer than that (a supervisor
waits 2 s before it starts one again, systemd 10 s) is seen by every exchange that was
out. A failure while the exchange pushes its one message loses nothing: the retried
push arrives once the SuperLink is back (a refused connection carries no request).
Such an exchange without all its replies raises :class:`LinkLost`, and the link
keeps the first such reason (:attr:`LinkWatchGrid.lost`): the round loop checks it
before it records a round, and ends the run as interrupted, its checkpoint of the round
before kept, for ``fedefc deploy submit`` to resume (a resumed run equals the
uninterrupted one: RELIABILITY.md, "Checkpoint and resume"). A connection reset on its
own is not counted: a kept-alive connection that the SuperLink closed just as it was
reused fails so, the request unread, and Flower's retry then succeeds (in the test
suite such a reset in round 3 once stopped a run whose SuperLink never went away); a
SuperLink that went down is seen by the retry, which cannot connect. A simulation's
grid has no link and is not wrapped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import httpx
from flwr.app import Message
from flwr.serverapp.grid import Grid

POLL_S = 1.0  # how often an exchange asks for its replies (Flower's own loop: every 3 s)
# the failures of a call that say the SuperLink was away (not a reset kept-alive connection)
UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout)


class LinkLost(RuntimeError):
    """An exchange was out while the SuperLink was unreachable, and some replies have
    not come: they may have been lost with it."""


class LinkWatchGrid:
    """``grid`` (a deployment's), whose exchanges notice a SuperLink that was away
    while they were out (see the module). Everything else is ``grid``'s."""

    def __init__(self, grid: Grid, retry_invoker: Any):
        self.grid = grid
        self.failures = 0  # retried calls that found the SuperLink unreachable so far
        self.resets = 0  # retried calls that failed otherwise (a reset, a read error)
        self.last_failure = ""
        self.lost: str | None = None  # the first exchange that may have lost messages
        self._lock = threading.Lock()
        chained = retry_invoker.on_backoff

        def on_backoff(state) -> None:
            with self._lock:
                if isinstance(state.exception, UNREACHABLE):
                    self.failures += 1
                    self.last_failure = f"{type(state.exception).__name__}: {state.exception}"
                else:
                    self.resets += 1
            if chained is not None:
                chained(state)

        retry_invoker.on_backoff = on_backoff

    @classmethod
    def over(cls, grid: Grid) -> LinkWatchGrid | None:
        """The watched grid over ``grid``, or None for a grid without a retried link
        (Flower's simulation)."""
        invoker = getattr(grid, "_retry_invoker", None)
        return cls(grid, invoker) if invoker is not None else None

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Flower's ``Grid.send_and_receive`` (push, then pull until every reply came or
        ``timeout`` passed), which raises :class:`LinkLost` when the link failed while
        replies were still missing. A reply that is the SuperLink's own error (its
        sender is not the message's node) counts as missing then: it was made up by a
        SuperLink that had lost track of the exchange."""
        messages = list(messages)
        dst = {m.metadata.dst_node_id for m in messages}
        seen, resets = self.failures, self.resets
        pending = set(self.grid.push_messages(messages))
        if len(messages) == 1 and self.resets == resets:
            # its one push failed, if at all, on a refused connection, the request never
            # read: it reached the SuperLink once, after it was back (issue 60's trial: a
            # SuperLink killed just after a round cost the next round a resume)
            seen = self.failures
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            for reply in self.grid.pull_messages(pending):
                pending.discard(reply.metadata.reply_to_message_id)
                if (self.failures != seen and reply.has_error()
                        and reply.metadata.src_node_id not in dst):
                    pending.add(reply.metadata.reply_to_message_id)
                else:
                    replies.append(reply)
            if pending and self.failures != seen:
                reason = (f"the link to the SuperLink failed ({self.last_failure}) while "
                          f"{len(pending)} of {len(messages)} messages were out without a "
                          "reply")
                with self._lock:
                    self.lost = self.lost or reason
                raise LinkLost(reason)
            if not pending or (end is not None and time.monotonic() >= end):
                break
            time.sleep(POLL_S)
        return replies
