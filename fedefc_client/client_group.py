"""A simulated node serving a group of clients in one message (``stacked-clients``; the
server's side: :mod:`fedefc_server.client_groups`; docs/BENCHMARKS.md, "Several clients
stepped together").

Each member is the client it would be alone (:class:`.client.MethodClient` for its
partition, a fresh node state: only methods whose clients keep none are grouped,
``common.config.STATELESS_CLIENTS``), run in its own thread. The members take turns
(:class:`TrainGather`'s baton): each runs alone until its local update asks to train
(``LocalJob.train``), then waits there while the next one runs; once every member still
running waits, their training runs stepped together
(:func:`common.stacked_training.train_stacked`), or one after another where it cannot
(:class:`common.stacked_training.NotStackable`, logged once). So everything a member
computes besides training runs as it would alone, in member order of arrival, and a
member whose update never calls ``LocalJob.train`` (another loop, a regularizer, no
samples) trains alone, holding the baton.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from logging import INFO

import torch
from flwr.common.logger import log

from common.messages import FitConfig, FitReply, group_dumps, group_loads
from common.stacked_training import ClientRun, NotStackable, train_stacked
from common.training import SGDSettings, TrainStats, train

_told: set[str] = set()  # the reasons a group trained one member after another, logged once


class TrainGather:
    """The meeting point of a group's members (module docstring)."""

    def __init__(self, members: int):
        self._local = threading.local()  # each member thread's order
        self._cond = threading.Condition()
        self._baton = threading.Lock()
        self._running = members  # members that have not finished
        self._waiting: dict[int, tuple[ClientRun, SGDSettings]] = {}
        self._done: dict[int, TrainStats | BaseException] = {}

    def serve(self, order: int, fit: Callable, *args):
        """Member ``order``'s ``fit(*args)`` in its turn."""
        self._local.order = order
        with self._baton:
            try:
                return fit(*args)
            finally:
                with self._cond:
                    self._running -= 1
                    self._train_if_all_wait()

    def __call__(self, run: ClientRun, settings: SGDSettings) -> TrainStats:
        """A member's training: wait for the others, then its share of the result."""
        me = self._local.order
        with self._cond:
            self._waiting[me] = (run, settings)
            self._train_if_all_wait()
        self._baton.release()
        try:
            with self._cond:
                self._cond.wait_for(lambda: me in self._done)
                out = self._done.pop(me)
        finally:
            self._baton.acquire()
        if isinstance(out, BaseException):
            raise out
        return out

    def _train_if_all_wait(self) -> None:
        """Train the waiting members once every member still running waits (holding
        the condition)."""
        if not self._waiting or len(self._waiting) < self._running:
            return
        order = sorted(self._waiting)
        pairs = [self._waiting[k] for k in order]
        self._waiting.clear()
        try:
            self._done.update(zip(order, train_together(pairs)))
        except Exception as err:  # every waiting member raises it
            self._done.update(dict.fromkeys(order, err))
        self._cond.notify_all()


def train_together(pairs: list[tuple[ClientRun, SGDSettings]]) -> list[TrainStats]:
    """The runs stepped together, or one after another (each with its settings) where
    they cannot be."""
    settings = {s for _, s in pairs}
    try:
        if len(settings) > 1:
            raise NotStackable("the members' training settings differ")
        return train_stacked([run for run, _ in pairs], settings.pop())
    except NotStackable as why:
        if str(why) not in _told:
            _told.add(str(why))
            log(INFO, "a group's clients train one after another: %s", why)
    out = []
    for run, s in pairs:
        torch.manual_seed(run.dropout_seed)  # as LocalJob seeded it for the member alone
        out.append(train(run.model, run.data, run.loss_fn, s, run.generator))
    return out


def fit_group(member: Callable[[int], object], parameters, config: dict
              ) -> tuple[list, int, dict]:
    """The members' fits (``member(partition_id)`` builds one's client): their weights
    one after another, their total count, and their counts and metrics as JSON."""
    listed = group_loads(str(config[FitConfig.GROUP]))
    gather = TrainGather(len(listed))
    clients = []
    for k, (pid, _) in enumerate(listed):
        client = member(int(pid))
        client.trainer, client.slot = gather, f"group-member-{k}"
        clients.append(client)
    with ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(gather.serve, k, client.fit, parameters, dict(cfg))
                   for k, (client, (_, cfg)) in enumerate(zip(clients, listed))]
        replies = [f.result() for f in futures]
    arrays = [a for weights, _, _ in replies for a in weights]
    members = [[int(pid), int(n), metrics] for (pid, _), (_, n, metrics) in zip(listed, replies)]
    return arrays, sum(n for _, n, _ in members), {FitReply.GROUP: group_dumps(members)}
