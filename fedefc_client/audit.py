"""The node's audit of what leaves it (docs/PRIVACY.md §4): one JSON line per reply,
as the reply leaves the client, and the node's privacy ledger (:class:`DpLedger`) that
the noise mod (:mod:`.mods`) keeps. :func:`audit_mod` is among the ClientApp's first
mods (:mod:`.client_app`), which import nothing of the run's training: it reads the
run config and the node's policy only."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from common.config import RunConfig
from common.dp_accounting import epsilon
from common.methods import load_run_config
from common.private_files import make_private_dir, open_private
from common.verifiable_shares import COMPLAINTS

from .policy import NodePolicy, node_policy

AUDIT_DIR = "audit"
DP_LEDGER = "fedefc-dp-ledger"  # context.state: the node's noised releases in this run


@dataclass(frozen=True)
class DpLedger:
    """What this node's noise has given away in this run (docs/PRIVACY.md, "The node's
    own policy"): ``releases`` noised updates that left it, clipped to ``clip`` with noise
    of standard deviation ``noise_std`` (the smallest it applied), and their epsilon at
    ``delta`` (the policy's ``dp-delta``, else the run's), from the accountant of
    :mod:`common.dp_accounting` at the noise multiplier it applied, noise_std / clip.
    Kept in the node's ``context.state`` (never sent to the server), written to its
    audit log with every training reply."""

    releases: int = 0
    clip: float = 0.0
    noise_std: float = 0.0
    delta: float = 1e-5
    epsilon: float = 0.0

    @classmethod
    def of(cls, ctxt: Context) -> DpLedger:
        record = ctxt.state.config_records.get(DP_LEDGER)
        return cls() if record is None else cls(**{k.replace("-", "_"): v
                                                   for k, v in record.items()})

    def released(self, clip: float, noise_std: float, delta: float) -> DpLedger:
        """The ledger after one more release of this clip and noise."""
        std = noise_std if self.releases == 0 else min(self.noise_std, noise_std)
        clip = max(self.clip, clip)
        return DpLedger(self.releases + 1, clip, std, delta,
                        epsilon(std / clip, self.releases + 1, delta))

    def save(self, ctxt: Context) -> None:
        ctxt.state.config_records[DP_LEDGER] = ConfigRecord(
            {k.replace("_", "-"): v for k, v in asdict(self).items()})

    def as_entry(self) -> dict:
        return {k.replace("_", "-"): v for k, v in asdict(self).items()}


def _value_type(value) -> str:
    if isinstance(value, list):
        inner = sorted({type(v).__name__ for v in value}) or ["empty"]
        return f"list[{'|'.join(inner)}]"
    return type(value).__name__


def _value_bytes(value) -> int:
    """Payload size of a record value: bytes and str by length, numbers 8 bytes."""
    if isinstance(value, list):
        return sum(_value_bytes(v) for v in value)
    if isinstance(value, (bytes, str)):
        return len(value)
    return 8


def describe_reply(msg: Message) -> dict:
    """What a reply carries: per record its keys and value types (config and metric
    records) or its array count and bytes (array records), and the payload bytes."""
    entry: dict = {"type": msg.metadata.message_type, "round": msg.metadata.group_id}
    if msg.has_error():
        return {**entry, "error": msg.error.code, "bytes": len(msg.error.reason or "")}
    content = msg.content
    records: dict[str, dict] = {}
    for name, rec in content.array_records.items():
        records[name] = {"kind": "arrays", "arrays": len(rec),
                         "bytes": sum(len(arr.data) for arr in rec.values())}
    for kind, group in (("config", content.config_records), ("metrics", content.metric_records)):
        for name, rec in group.items():
            records[name] = {"kind": kind, "keys": {k: _value_type(v) for k, v in rec.items()},
                             "bytes": sum(_value_bytes(v) for v in rec.values())}
    stage = content.config_records.get(RECORD_KEY_CONFIGS, {})
    if Key.MASKED_PARAMETERS in stage:
        entry["stage"] = "collect_masked_vectors"
    elif stage:
        entry["stage"] = next(s for s, keys in _STAGE_REPLY_KEYS.items() if keys & set(stage))
    return {**entry, "records": records, "bytes": sum(r["bytes"] for r in records.values())}


# What a SecAgg+ client replies in each stage (flwr/client/mod/secure_aggregation).
_STAGE_REPLY_KEYS = {"setup": {Key.PUBLIC_KEY_1}, "share_keys": {Key.CIPHERTEXT_LIST},
                     "unmask": {Key.SHARE_LIST}, "complaints": {COMPLAINTS}}


def audit_path(cfg: RunConfig, partition_id: int | str, policy: NodePolicy | None = None,
               run_id: int = 0) -> Path | None:
    """Where a client writes its audit log: with a node policy's ``audit-dir``, there, as
    run-<run id>-partition-<id>.jsonl, whatever the run says; else with ``audit = true``
    <out-dir>/audit/partition-<id>.jsonl; else nowhere (None)."""
    if policy is not None and policy.audit_dir:
        return Path(policy.audit_dir) / f"run-{run_id}-partition-{partition_id}.jsonl"
    if not cfg.audit:
        return None
    return Path(cfg.out_dir or cfg.resume_from) / AUDIT_DIR / f"partition-{partition_id}.jsonl"


def audit_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Append one JSON line per reply to :func:`audit_path` (when there is one):
    :func:`describe_reply` of the reply as it leaves the client (after every inner mod),
    or the exception that replaced it; a reply that released a noised update also holds
    the node's :class:`DpLedger` (``dp``: its releases so far and their epsilon).
    The log and a folder it creates are owner-only."""
    pid = ctxt.node_config.get("partition-id", "unknown")  # none: the ClientApp refuses
    path = audit_path(load_run_config(ctxt.run_config), pid, node_policy(ctxt), ctxt.run_id)
    if path is None:
        return call_next(msg, ctxt)
    make_private_dir(path.parent)
    entry = {"type": msg.metadata.message_type, "round": msg.metadata.group_id}
    ledger = DpLedger.of(ctxt)
    try:
        out = call_next(msg, ctxt)
        entry = describe_reply(out)
        if DpLedger.of(ctxt) != ledger:  # this reply released a noised update
            entry["dp"] = DpLedger.of(ctxt).as_entry()
    except Exception as err:
        entry["exception"] = type(err).__name__
        raise
    finally:
        entry["time"] = time.time()
        with open_private(path, "a") as fh:
            fh.write(json.dumps(entry, sort_keys=True) + "\n")
    return out
