"""The declared-size rule, in one place (docs/PRIVACY.md, "Weights bound to facts").

FedAvg weighs a reply by its sample count, so a count is a claim the server must bound:

1. Every node declares once, when first seen, the partition it serves, the number of
   samples it trains on, the number it holds out for federated evaluation and whether
   they are a partition of the run's dataset or its own data (:class:`Declaration`, the
   ``get_properties`` message).
2. A partition of the run's dataset must declare its sizes in the run's data plan: its
   samples minus the ones it holds out for federated evaluation
   (:func:`common.data_plan.training_size`, which the client's own split follows), and
   the held-out ones (:func:`common.data_plan.held_out_count`). Private data may
   declare at most ``max-client-samples`` of each; when that is 0, at most the training
   set's size if the server holds the dataset, else 10^8. With the operator's allowlist
   (:mod:`.allowlist`) a node must also declare the partition and data kind of its
   entry and at most its entry's sizes.
3. The first accepted declaration of a partition fixes its sizes for the run (and is
   kept in every checkpoint).
4. Every training reply of the partition counts exactly that size; a method that
   trains on a subset and reports its size (``counts_subset``, confident learning's
   kept count) counts 1..that size. Every evaluation reply counts exactly the declared
   held-out size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.config import RunConfig
from common.data_plan import DataPlan, held_out_count, training_size
from common.messages import Declaration as Keys

from .allowlist import AllowedNode

UNBOUNDED_PRIVATE = 10**8  # the bound of private data when nothing else bounds it


@dataclass(frozen=True)
class Declaration:
    """What a node says about itself when it is first seen."""

    partition: int
    num_examples: int
    data: str  # Keys.PARTITION | Keys.PRIVATE
    held_out: int = 0


def read_declaration(props: dict[str, Any]) -> Declaration | str:
    """The declaration in a ``get_properties`` reply, or why it is unusable (a missing
    held-out count is 0: the node may then report no held-out samples)."""
    pid, n, data = (props.get(k) for k in (Keys.PARTITION_ID, Keys.NUM_EXAMPLES, Keys.DATA))
    held = props.get(Keys.HELD_OUT, 0)
    for key, value in ((Keys.PARTITION_ID, pid), (Keys.NUM_EXAMPLES, n), (Keys.HELD_OUT, held)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{key} missing or not an integer >= 0 ({value!r:.40})"
    if data not in Keys.KINDS:
        return f"data {data!r:.40} is not one of {', '.join(Keys.KINDS)}"
    return Declaration(pid, n, data, held)


@dataclass(frozen=True)
class SizeRule:
    """Rule 2 for one run: ``plan_sizes`` and ``plan_held_out`` hold each partition's
    training and held-out sizes in the data plan (None: the server holds no data, so it
    knows no plan); ``max_private`` bounds private data."""

    num_clients: int
    plan_sizes: list[int] | None
    max_private: int
    plan_held_out: list[int] | None = None

    @classmethod
    def for_run(cls, cfg: RunConfig, plan: DataPlan | None) -> SizeRule:
        """The rule of ``cfg``, with the data plan when the server holds the dataset."""
        if plan is None:
            return cls(cfg.num_clients, None, cfg.max_client_samples or UNBOUNDED_PRIVATE)
        return cls(cfg.num_clients,
                   [training_size(cfg, len(ix)) for ix in plan.client_indices],
                   cfg.max_client_samples or len(plan.true_labels),
                   [held_out_count(cfg, len(ix)) for ix in plan.client_indices])

    def vet(self, decl: Declaration, allowed: AllowedNode | None = None) -> str | None:
        """Why a declaration is refused (rule 2; ``allowed``: the node's allowlist
        entry, if the run has an allowlist), or None."""
        if decl.partition >= self.num_clients:
            return f"partition id {decl.partition} outside 0..{self.num_clients - 1}"
        if allowed is not None:
            reason = allowed.vet(decl.partition, decl.data, decl.num_examples, decl.held_out)
            if reason:
                return reason
        if decl.data == Keys.PARTITION and self.plan_sizes is not None:
            size = self.plan_sizes[decl.partition]
            held = self.plan_held_out[decl.partition] if self.plan_held_out else 0
            if decl.num_examples != size:
                return (f"declares {decl.num_examples} samples for partition {decl.partition}, "
                        f"whose size in the run's data plan is {size}")
            if decl.held_out != held:
                return (f"declares {decl.held_out} held-out samples for partition "
                        f"{decl.partition}, whose held-out part in the run's data plan is {held}")
            return None
        for what, n in (("samples", decl.num_examples), ("held-out samples", decl.held_out)):
            if n > self.max_private:
                return (f"declares {n} {what}, above the bound {self.max_private}; raise "
                        "max-client-samples if nodes hold more")
        return None


def bad_count(n: Any, size: int, subset: bool) -> str | None:
    """Why a reply's sample count ``n`` breaks rule 4 for a partition of declared
    ``size``, or None."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= size:
        return f"sample count {n!r:.40} outside 1..{size}, the partition's declared size"
    if not subset and n != size:
        return f"sample count {n} differs from the {size} samples the partition declared"
    return None
