"""The declared-size rule, in one place (docs/PRIVACY.md, "Weights bound to facts").

FedAvg weighs a reply by its sample count, so a count is a claim the server must bound:

1. Every node declares once, when first seen, the partition it serves, the number of
   samples it trains on, the number it holds out for federated evaluation and whether
   they are a partition of the run's dataset or its own data (:class:`Declaration`, the
   ``get_properties`` message).
2. A partition of the run's dataset must declare its sizes in the run's data plan: its
   samples minus the ones it holds out for federated evaluation, and the held-out ones
   (:func:`common.sample_roles.declared_sizes`, the counts of the roles the client's
   own split draws, :class:`common.sample_roles.SampleRoles`). Any other declaration
   (private data; any data where the server knows no plan) may declare at most the
   run's bound (:meth:`SizeRule.for_run`): ``max-client-samples`` of each; when that is
   0, the largest training and held-out sizes of a partition in the data plan. With the
   operator's allowlist (:mod:`.allowlist`) a node must also declare the partition and
   data kind of its entry and at most its entry's sizes. Which nodes may declare at all
   is the run's admission mode (:func:`admission`; docs/THREAT-MODEL.md, "Identity and
   partitions").
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

from common.config import ConfigError, RunConfig
from common.data_plan import DataPlan, secure_weight
from common.messages import Declaration as Keys
from common.sample_roles import declared_sizes

from .allowlist import AllowedNode

ADMISSION_MODES = ("allowlist", "simulation", "open-deployment")


@dataclass(frozen=True)
class Declaration:
    """What a node says about itself when it is first seen."""

    partition: int
    num_examples: int
    data: str  # Keys.PARTITION | Keys.PRIVATE
    held_out: int = 0
    class_map: str | None = None  # its own data's class map, fingerprinted (Keys.CLASS_MAP)


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
    class_map = props.get(Keys.CLASS_MAP)
    if class_map is not None and not isinstance(class_map, str):
        return f"{Keys.CLASS_MAP} is not text ({class_map!r:.40})"
    return Declaration(pid, n, data, held, class_map)


def class_map_refusal(decl: Declaration, federation: tuple[str, int]) -> str | None:
    """Why ``decl``'s class map is not the federation's (``federation``: the map's
    fingerprint and the partition whose declaration fixed it), or None: a node whose
    data names no classes declares none, and is not compared (docs/OWN-DATA.md,
    "Preparing a folder of images")."""
    fixed, first = federation
    if decl.class_map is None or decl.class_map == fixed:
        return None
    return (f"partition {decl.partition}'s data has class map {map_text(decl.class_map)}, "
            f"but the federation's is {map_text(fixed)} (declared by partition {first}): "
            "the same label would mean another class there. Prepare its data again with "
            "the federation's map: fedefc data SOURCE OUT --class-map <the shared "
            "classes.json> (a site lacking a class keeps the map; docs/OWN-DATA.md, "
            "\"Preparing a folder of images\")")


def map_text(fingerprint: str) -> str:
    """A declared class map in words: its K and its hash (the names stay on the node)."""
    k, _, digest = fingerprint.partition(":")
    return f"{k} classes #{digest}" if digest else repr(fingerprint[:40])


@dataclass(frozen=True)
class SizeRule:
    """Rule 2 for one run: ``plan_sizes`` and ``plan_held_out`` hold each partition's
    training and held-out sizes in the data plan (None: the server holds no data, so it
    knows no plan); ``max_private`` and ``max_held_out`` bound every other declaration's
    training and held-out counts (None: nothing bounds them, which only an allowlist's
    entries may make up for: :func:`admission`; ``max_held_out`` None with a
    ``max_private``: the same bound); ``derived``: the bounds come from the plan, not
    from ``max-client-samples``, and yield to a node's allowlist entry;
    ``secure_weight``: in a secure run, M of :func:`common.data_plan.secure_weight` (the
    samples that weigh 1 in its sums: no declaration may exceed it; None: no secure
    aggregation, or no M can be derived)."""

    num_clients: int
    plan_sizes: list[int] | None
    max_private: int | None
    plan_held_out: list[int] | None = None
    max_held_out: int | None = None
    derived: bool = False
    secure_weight: int | None = None

    @classmethod
    def for_run(cls, cfg: RunConfig, plan: DataPlan | None) -> SizeRule:
        """The rule of ``cfg``, with the data plan when the server holds the dataset.
        The bound is ``max-client-samples`` when set; else, with a plan, the largest
        training size and the largest held-out size of a partition in it: a node with
        data of its own weighs at most what the largest partition of the run would
        (docs/PRIVACY.md, "Weights bound to facts"); else none."""
        weight = secure_weight(cfg, plan) if cfg.secure_aggregation else None
        if plan is None:
            return cls(cfg.num_clients, None, cfg.max_client_samples or None,
                       secure_weight=weight)
        counts = [declared_sizes(cfg, len(ix)) for ix in plan.client_indices]
        sizes, held = [size for size, _ in counts], [out for _, out in counts]
        if cfg.max_client_samples:
            return cls(cfg.num_clients, sizes, cfg.max_client_samples, held,
                       secure_weight=weight)
        return cls(cfg.num_clients, sizes, max(sizes), held, max(held), derived=True,
                   secure_weight=weight)

    @property
    def held_out_bound(self) -> int | None:
        return self.max_private if self.max_held_out is None else self.max_held_out

    @property
    def source(self) -> str:
        """Where the bound on a declaration comes from, as a reader would look it up."""
        if self.max_private is None:
            return "none: no data plan and max-client-samples = 0"
        return ("the data plan's largest partition, as max-client-samples = 0" if self.derived
                else "max-client-samples")

    def vet(self, decl: Declaration, allowed: AllowedNode | None = None) -> str | None:
        """Why a declaration is refused (rule 2; ``allowed``: the node's allowlist
        entry, if the run has an allowlist; in a secure run, any count above
        ``secure_weight``), or None."""
        if decl.partition >= self.num_clients:
            return f"partition id {decl.partition} outside 0..{self.num_clients - 1}"
        if self.secure_weight is not None and decl.num_examples > self.secure_weight:
            return (f"declares {decl.num_examples} samples, above {self.secure_weight}, the "
                    "samples that weigh 1 in the run's secure sums (max-client-samples, or "
                    "the data plan's largest partition); raise max-client-samples if nodes "
                    "hold more")
        if allowed is not None:
            reason = allowed.vet(decl.partition, decl.data, decl.num_examples, decl.held_out)
            if reason or (self.derived and decl.data != Keys.PARTITION):
                return reason  # the operator's entry bounds its private data
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
        for what, n, bound in (("samples", decl.num_examples, self.max_private),
                               ("held-out samples", decl.held_out, self.held_out_bound)):
            if bound is not None and n > bound:
                return (f"declares {n} {what}, above the bound {bound} ({self.source}); "
                        "raise max-client-samples if nodes hold more")
        return None


def admission(cfg: RunConfig, simulation: bool, rule: SizeRule) -> dict[str, Any]:
    """Who may declare, and up to what, for the run of ``cfg`` (docs/THREAT-MODEL.md,
    "Identity and partitions"): ``allowlist`` (the operator's entries), ``simulation``
    (Flower's simulation engine gives node i partition i) or ``open-deployment`` (a
    deployment without an allowlist: any node that connects, which the coordinator must
    ask for with ``open-deployment = true``). Outside an allowlist every declaration
    the data plan does not fix must be bounded by ``rule``. Returns what the run's
    summary says of it; :class:`ConfigError` naming the key to set otherwise."""
    if cfg.allowlist:
        mode = "allowlist"
    elif simulation:
        mode = "simulation"
    elif cfg.open_deployment:
        mode = "open-deployment"
    else:
        raise ConfigError(
            "a deployment without an allowlist admits any node that connects, with any "
            "partition and any data it declares; set allowlist to the absolute path of the "
            "operator's allowlist (docs/THREAT-MODEL.md, \"Identity and partitions\"), or "
            "open-deployment = true to run without one (declared sizes then bounded by "
            "max-client-samples)")
    if mode != "allowlist" and rule.max_private is None:
        raise ConfigError(
            f"{mode}: the server holds no data plan, so no bound on what one node declares "
            "can be derived from the run, and max-client-samples is 0; set "
            "max-client-samples to the most training (and held-out) samples one node may "
            "declare, or give the server the dataset (docs/PRIVACY.md, \"Weights bound to "
            "facts\")")
    if cfg.secure_aggregation and rule.secure_weight is None:
        raise ConfigError(
            "secure aggregation weighs every update by its samples over one bound that "
            "every node derives from the run config (SecAgg+'s max_weight), and this run "
            "has none: the server holds no data plan and max-client-samples is 0; set "
            "max-client-samples to the most training samples one node may declare "
            "(docs/THREAT-MODEL.md, \"A dishonest server and the node\")")
    if mode == "allowlist" and (rule.derived or rule.max_private is None):
        return {"mode": mode, "max_declared_samples": None, "max_declared_held_out": None,
                "bound": "each node's allowlist entry"}
    return {"mode": mode, "max_declared_samples": rule.max_private,
            "max_declared_held_out": rule.held_out_bound, "bound": rule.source}


def bad_count(n: Any, size: int, subset: bool) -> str | None:
    """Why a reply's sample count ``n`` breaks rule 4 for a partition of declared
    ``size``, or None."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= size:
        return f"sample count {n!r:.40} outside 1..{size}, the partition's declared size"
    if not subset and n != size:
        return f"sample count {n} differs from the {size} samples the partition declared"
    return None
