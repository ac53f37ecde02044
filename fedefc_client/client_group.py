"""A simulated node serving a group of clients in one message (``stacked-clients``; the
server's side: :mod:`fedefc_server.client_groups`; docs/BENCHMARKS.md, "Several clients
stepped together").

Each member is the client it would be alone (:class:`.client.MethodClient` for its
partition, a fresh node state: only methods whose clients keep none are grouped,
``common.config.STATELESS_CLIENTS``), run in its own thread. The members take turns
(:class:`Group`'s baton): each runs alone until its local update asks to train
(``LocalJob.train``), then waits there while the next one runs; once every member still
running waits, their training runs stepped together
(:func:`common.stacked_training.train_stacked`), or one after another where it cannot
(:class:`common.stacked_training.NotStackable`, logged once). A member whose update
never calls ``LocalJob.train`` (another loop, a regularizer, no samples) trains alone,
holding the baton.

The one piece of a member's work besides training that costs a pass over its data, the
received model's predictions (``LocalJob.probs``: FedEFC's A_k and its phase-2 count and
Q, forward correction's and confident learning's estimates), is made once for every
member: the first member that reads its predictions has the received model predict the
samples of all members in one pass (:meth:`Group.predict`), each member reading its
own rows; on a GPU that is one pass and one copy back instead of one per member. Each
member's data is its partition as the process keeps it (``local_data.partition_data``:
sliced once per process from the training set moved to the device once, then kept for
every later message of the run).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from logging import INFO

import numpy as np
import torch
from flwr.common.logger import log

from common.messages import FitConfig, FitReply, group_dumps, group_loads
from common.stacked_training import ClientRun, NotStackable, train_stacked
from common.training import SGDSettings, TrainStats, predict_proba, train

_told: set[str] = set()  # the reasons a group trained one member after another, logged once


class Group:
    """The meeting point of a group's members (module docstring); ``samples`` are the
    members' local samples (``LocalData.x``) in member order."""

    def __init__(self, samples: list[torch.Tensor]):
        self._local = threading.local()  # each member thread's order
        self._cond = threading.Condition()
        self._baton = threading.Lock()
        self._running = len(samples)  # members that have not finished
        self._waiting: dict[int, tuple[ClientRun, SGDSettings]] = {}
        self._done: dict[int, TrainStats | BaseException] = {}
        self._samples = samples
        self._probs: list[np.ndarray] | None = None

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

    def predict(self, model, x: torch.Tensor, transform, batch_size: int) -> np.ndarray:
        """The received model's predictions on a member's samples ``x``
        (``common.training.predict_proba``), made for every member in one pass on the
        first call; ``model`` holds the received weights (a member reads its predictions
        before it trains, and all members received the same model)."""
        me = self._local.order
        if x is not self._samples[me]:  # not the member's own samples: alone
            return predict_proba(model, x, transform, batch_size)
        if self._probs is None:
            every = torch.cat(self._samples) if len(self._samples) > 1 else x
            probs = predict_proba(model, every, transform, batch_size)
            self._probs = np.split(probs, np.cumsum([len(s) for s in self._samples])[:-1])
        return self._probs[me]

    def train(self, run: ClientRun, settings: SGDSettings) -> TrainStats:
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
    clients = [member(int(pid)) for pid, _ in listed]
    group = Group([client.local.x for client in clients])
    for k, client in enumerate(clients):
        client.group, client.slot = group, f"group-member-{k}"
    with ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(group.serve, k, client.fit, parameters, dict(cfg))
                   for k, (client, (_, cfg)) in enumerate(zip(clients, listed))]
        replies = [f.result() for f in futures]
    arrays = [a for weights, _, _ in replies for a in weights]
    members = [[int(pid), int(n), metrics] for (pid, _), (_, n, metrics) in zip(listed, replies)]
    return arrays, sum(n for _, n, _ in members), {FitReply.GROUP: group_dumps(members)}
