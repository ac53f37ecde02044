"""A SuperLink that restarts while an exchange is out (fedefc_server/link_watch.py;
docs/RELIABILITY.md, "A SuperLink restart mid-round").

The grid here is a stand-in for Flower's deployment grid: its Runtime API calls go
through Flower's own retry invoker (``make_simple_http_retry_invoker``, the one
``HttpGrid`` uses), and a call made while "the SuperLink is down" raises the
``httpx.ConnectError`` a refused connection raises, which that invoker retries. The
SuperLink's own error replies are made by Flower's linkstate helper. The real restart,
with Flower's processes, is ``test_deployment_reliability.py``."""

from __future__ import annotations

import httpx
import pytest
from flwr.app import Message, RecordDict
from flwr.common import Error
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_ins_message
from flwr.supercore.retry.http_retry import make_simple_http_retry_invoker
from flwr.superlink.grid.http_grid import HttpGrid
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from fedefc_server import link_watch
from fedefc_server.link_watch import LinkLost, LinkWatchGrid

NODES = (11, 22)


class Link:
    """The SuperLink's side: the messages pushed, the replies the nodes have sent, and
    how many more calls find it down."""

    def __init__(self):
        self.sent: dict[str, Message] = {}
        self.replies: dict[str, Message] = {}
        self.down_calls = 0
        self.reset_calls = 0  # calls on a kept-alive connection it closed: reset, unread

    def answer(self, node: int, error: Error | None = None) -> None:
        """The reply of node ``node`` to the message sent to it."""
        msg = next(m for m in self.sent.values() if m.metadata.dst_node_id == node)
        reply = Message(error, reply_to=msg) if error else Message(RecordDict(), reply_to=msg)
        self.replies[msg.metadata.message_id] = reply


class StandInGrid:
    """A deployment grid: push and pull go through Flower's retry invoker; ``on_poll``
    (number of pulls so far) lets a test act between polls."""

    def __init__(self, link: Link, on_poll=lambda polls: None):
        self.link = link
        self.on_poll = on_poll
        self.polls = 0
        self._retry_invoker = make_simple_http_retry_invoker()

    def _call(self, target, *args):
        def attempt():
            if self.link.down_calls:
                self.link.down_calls -= 1
                raise httpx.ConnectError("[Errno 111] Connection refused")
            if self.link.reset_calls:
                self.link.reset_calls -= 1
                raise httpx.ReadError("[Errno 104] Connection reset by peer")
            return target(*args)
        return self._retry_invoker.invoke(attempt)

    def push_messages(self, messages):
        def push():
            ids = []
            for msg in messages:
                msg.metadata.__dict__["_message_id"] = msg.object_id
                self.link.sent[msg.metadata.message_id] = msg
                ids.append(msg.metadata.message_id)
            return ids
        return self._call(push)

    def pull_messages(self, message_ids):
        self.on_poll(self.polls)
        self.polls += 1
        return self._call(lambda: [self.link.replies.pop(i) for i in list(message_ids)
                                   if i in self.link.replies])


def messages() -> list[Message]:
    return [Message(RecordDict(), dst_node_id=node, message_type="train") for node in NODES]


def watched(link: Link, on_poll) -> LinkWatchGrid:
    inner = StandInGrid(link, on_poll)
    return LinkWatchGrid(inner, inner._retry_invoker)


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(link_watch, "POLL_S", 0.01)


def test_replies_come_back_as_flowers_own_loop_returns_them():
    """No failure: every reply, each answering its own message; nothing is lost."""
    link = Link()
    grid = watched(link, lambda polls: polls == 2 and [link.answer(n) for n in NODES])
    out = messages()
    replies = list(grid.send_and_receive(out))
    assert sorted(r.metadata.reply_to_message_id for r in replies) == sorted(
        m.metadata.message_id for m in out)
    assert grid.polls == 3 and grid.lost is None


def test_a_link_failure_while_a_reply_is_missing_ends_the_exchange():
    """The SuperLink refuses two calls after node 11 replied and before node 22 did: the
    exchange raises at once (it does not wait for 22's reply, which may never come),
    and the link keeps why, for the round loop to check."""
    link = Link()

    def on_poll(polls):
        if polls == 1:
            link.answer(11)
            link.down_calls = 2
    grid = watched(link, on_poll)
    with pytest.raises(LinkLost, match="1 of 2 messages were out without a reply"):
        grid.send_and_receive(messages(), timeout=30)
    assert grid.failures == 2 and "ConnectError" in grid.lost
    assert "1 of 2 messages" in grid.lost


def test_a_reset_connection_of_a_superlink_still_there_loses_nothing():
    """A pull on a kept-alive connection the SuperLink had closed is reset (the request
    unread) and Flower's retry succeeds: the SuperLink never went away, so the exchange
    goes on to its replies and nothing is marked lost (the suite once saw such a reset
    stop a deployment's run in round 3)."""
    link = Link()

    def on_poll(polls):
        if polls == 1:
            link.answer(11)
            link.reset_calls = 1
        if polls == 3:
            link.answer(22)
    grid = watched(link, on_poll)
    assert len(list(grid.send_and_receive(messages(), timeout=30))) == 2
    assert grid.failures == 0 and grid.lost is None


def test_a_reset_and_then_a_refused_connection_is_a_superlink_that_went_away():
    """A SuperLink killed mid-call resets the call, and the retry finds it down: that
    is the outage the watch is for."""
    link = Link()

    def on_poll(polls):
        if polls == 1:
            link.answer(11)
            link.reset_calls, link.down_calls = 1, 1
    grid = watched(link, on_poll)
    with pytest.raises(LinkLost, match="1 of 2 messages"):
        grid.send_and_receive(messages(), timeout=30)
    assert grid.failures == 1 and "ConnectError" in grid.lost


def test_a_link_failure_after_every_reply_came_loses_nothing():
    """Both replies are in by the poll that meets the refused calls: the exchange
    returns them, and nothing is marked lost."""
    link = Link()

    def on_poll(polls):
        if polls == 1:
            link.answer(11)
            link.answer(22)
            link.down_calls = 1
    grid = watched(link, on_poll)
    assert len(list(grid.send_and_receive(messages()))) == 2
    assert grid.failures == 1 and grid.lost is None


def test_a_failure_before_the_exchange_does_not_touch_it():
    """A failure seen before the messages were pushed (the SuperLink was back by then)
    cannot have lost them: the exchange waits for its replies as usual."""
    link = Link()
    grid = watched(link, lambda polls: polls == 3 and [link.answer(n) for n in NODES])
    link.down_calls = 1
    grid.grid._call(lambda: None)  # e.g. the node list refreshed during the outage
    assert grid.failures == 1
    assert len(list(grid.send_and_receive(messages()))) == 2
    assert grid.lost is None


def one_message() -> list[Message]:
    return [Message(RecordDict(), dst_node_id=11, message_type="train")]


def test_a_message_pushed_while_the_superlink_restarts_is_not_lost():
    """Issue 60's trial: the SuperLink killed right after a round; the next round's push
    met refused connections until it was back, and the run stopped as interrupted. A
    push retried after refused connections reached the SuperLink once, after it came
    back: the exchange waits for its reply, and nothing is marked lost."""
    link = Link()
    grid = watched(link, lambda polls: polls == 1 and link.answer(11))
    link.down_calls = 2  # the push finds the SuperLink down twice
    assert len(list(grid.send_and_receive(one_message(), timeout=30))) == 1
    assert grid.failures == 2 and grid.lost is None


def test_a_push_reset_mid_call_may_have_reached_the_superlink_and_counts():
    """A push whose call was reset (the SuperLink read it, maybe stored it, then died) and
    then refused may have handed the message out before it went: still an outage."""
    link = Link()
    grid = watched(link, lambda polls: None)
    link.reset_calls, link.down_calls = 1, 1
    with pytest.raises(LinkLost, match="1 of 1 messages"):
        grid.send_and_receive(one_message(), timeout=30)


def test_after_a_failure_the_superlinks_own_error_counts_as_lost_a_nodes_does_not():
    """After the failure, Flower's "message unavailable" reply for node 22 (the
    SuperLink lost track of it: linkstate's own helper makes it) is no reply; node 11's
    own error (a ClientApp that raised) is one."""
    link = Link()

    def on_poll(polls):
        if polls == 1:
            link.answer(11, Error(code=0, reason="the ClientApp raised"))
            link.down_calls = 1
            lost = next(i for i, m in link.sent.items() if m.metadata.dst_node_id == 22)
            link.replies[lost] = create_message_error_unavailable_ins_message(lost, 0)
    grid = watched(link, on_poll)
    with pytest.raises(LinkLost, match="1 of 2 messages"):
        grid.send_and_receive(messages(), timeout=30)


def test_without_a_failure_the_superlinks_error_is_a_reply():
    """With no failure, a "message unavailable" error is what Flower's own loop
    returns (an expired message, an offline node): the caller counts it as failed."""
    link = Link()

    def on_poll(polls):
        if polls == 0:
            link.answer(11)
            lost = next(i for i, m in link.sent.items() if m.metadata.dst_node_id == 22)
            link.replies[lost] = create_message_error_unavailable_ins_message(lost, 0)
    grid = watched(link, on_poll)
    replies = list(grid.send_and_receive(messages()))
    assert sorted(r.has_error() for r in replies) == [False, True]


def test_a_timeout_still_bounds_the_exchange():
    """``timeout`` (client-timeout) ends an exchange without all its replies, as Flower's
    loop does, returning what came."""
    link = Link()
    grid = watched(link, lambda polls: polls == 0 and link.answer(11))
    replies = list(grid.send_and_receive(messages(), timeout=0.2))
    assert [r.metadata.src_node_id for r in replies] == [11]


def test_flowers_deployment_grid_is_watched_and_its_own_callback_kept():
    """``over`` wraps Flower's HttpGrid: its retry invoker's backoff callback now counts
    a failure and still calls Flower's own (which marks the system unhealthy)."""
    grid = HttpGrid(token="t")
    called = []
    original = grid._retry_invoker.on_backoff
    grid._retry_invoker.on_backoff = lambda state: (called.append(state), original(state))
    watch = LinkWatchGrid.over(grid)
    assert watch is not None and watch.grid is grid

    class State:
        exception = httpx.ConnectError("[Errno 111] Connection refused")
    grid._retry_invoker.on_backoff(State())
    assert watch.failures == 1 and "ConnectError" in watch.last_failure and len(called) == 1
    assert watch.push_messages == grid.push_messages  # everything else is the grid's own


def test_a_simulation_grid_has_no_link_to_watch():
    """Flower's simulation grid (in-memory, no Runtime API calls to retry) is left as
    it is."""
    assert LinkWatchGrid.over(object.__new__(InMemoryGrid)) is None
