"""The plan step of a round: which partitions train, and what each is sent and must reply
(docs/ARCHITECTURE.md, "One round").

:func:`sample_round` draws ``max(1, int(fraction * N))`` partition ids with a generator
seeded by (seed, round): a pure function of (seed, round, the partitions served), so
every run with the same seed trains the same clients, whatever ids Flower gives its
nodes. :func:`round_config` is what every training message tells its client: the round
and the client's own seed, derived from (seed, partition id, round).

A :class:`RoundPlan` is what the later steps of the round read: the instructions sent,
what every reply must look like (:class:`.validation.Expected`) and the plan's fields of
the round's record. It is made once per round and never changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from flwr.common import FitIns, Parameters, Scalar
from flwr.server.client_proxy import ClientProxy

from common.config import RunConfig
from common.messages import FitConfig
from common.seeds import derive_seed

from .validation import Expected


def sample_round(cfg: RunConfig, available: list[int], server_round: int) -> list[int]:
    """max(1, int(fraction * N)) partition ids, sorted: a pure function of (seed, round,
    available ids), so every run with the same seed trains the same clients."""
    rng = np.random.default_rng(derive_seed(cfg.seed, "sample", server_round))
    pool = np.array(sorted(available))
    picked = rng.choice(pool, size=min(cfg.clients_per_round, len(pool)), replace=False)
    return sorted(int(p) for p in picked)


def round_config(cfg: RunConfig, partition_id: int, server_round: int) -> dict[str, Scalar]:
    """What every message of a round tells a client: the round and its own seed."""
    return {FitConfig.ROUND: server_round,
            FitConfig.SEED: derive_seed(cfg.seed, "client", partition_id, server_round)}


@dataclass(frozen=True)
class RoundPlan:
    """One round as planned: the (node, FitIns) pairs to send, what every reply must look
    like, the weight bound of secure aggregation (the run's M,
    :func:`common.data_plan.secure_weight`), the plan's record fields (``sampled``, the
    registry's news, a method's work between rounds) and the global model the round
    sends."""

    round: int
    instructions: list[tuple[ClientProxy, FitIns]]
    expected: Expected
    weight_bound: int = 1
    record: dict[str, Any] = field(default_factory=dict)
    sent: Parameters | None = None

    @property
    def partitions(self) -> list[int]:
        """The sampled partition ids, sorted."""
        return sorted(self.expected.sizes)

    def without(self, nodes: set[str], partition_of: Callable[[str], int | None]) -> RoundPlan:
        """This plan less the instructions to ``nodes`` (a secure round tried again
        without the nodes it refused, :mod:`.secure_round`): the same round, weight
        bound, configs and record."""
        kept = [(proxy, ins) for proxy, ins in self.instructions if proxy.cid not in nodes]
        pids = {partition_of(proxy.cid) for proxy, _ in kept}
        sizes = {pid: n for pid, n in self.expected.sizes.items() if pid in pids}
        return replace(self, instructions=kept, expected=replace(self.expected, sizes=sizes))

    def only(self, partitions: set[int], partition_of: Callable[[str], int | None]
             ) -> RoundPlan:
        """This plan for ``partitions`` alone (one group of a secure round): the plan
        :meth:`without` the nodes of the others."""
        return self.without({proxy.cid for proxy, _ in self.instructions
                             if partition_of(proxy.cid) not in partitions}, partition_of)
