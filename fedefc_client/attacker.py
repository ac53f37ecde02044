"""The client's attacker modes (``faults``, :mod:`common.faults`), beside the honest
client (docs/THREAT-MODEL.md): what a lying node does, replayable from a run config.

The honest path (:class:`.client.MethodClient` and the mods of :mod:`.mods`) holds no
fault code; the ClientApp (:mod:`.client_app`) composes the attacker around it, and
without ``faults`` every part here steps aside:

- :class:`LyingClient` wraps the honest client: it fails before training (``raise``,
  ``sleep``, ``exit``), lies in its registration (``claim``, ``private``,
  ``held-out``), trains on labels of its choosing (``label-shift``), lies in a training
  reply (its weights, count, accuracy, partition id) and in an evaluation reply
  (``eval-samples``);
- :func:`before_mask_mod`, between Flower's SecAgg+ client and the secure tail: what a
  client changes before its reply is masked (``weight``: its weight factor;
  ``secure-scale``, ``label-shift``, ``secure-ratio``: its update; it also notes its
  accuracy for ``secure-acc-set`` and its ratio for ``secure-ratio``);
- :func:`after_mask_mod`, around Flower's SecAgg+ client: what it changes in what it
  sends (``secure-acc``, ``secure-acc-set``: its masked accuracy slot;
  ``secure-ratio``: its masked ratio slot; ``garbage``,
  ``garbage-bytes``: its masked vector; ``unmask-nid``, ``bad-shares``,
  ``collude-shares``: its unmask shares; ``bad-dealer``, ``unopenable``,
  ``other-commitment``, ``other-seed``, ``empty-secret``: the shares it deals, signed
  as its own;
  ``bad-key``: its public keys; ``self-share``: where it sends a share),
  restoring the clear count of a ``weight`` fault.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from flwr.app import ConfigRecord, Context, Message
from flwr.app.message_type import MessageType
from flwr.client import Client, NumPyClient
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import (
    bytes_to_ndarray,
    ndarray_to_bytes,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
)
from flwr.compat.common import recorddict_compat as compat

from common.faults import (
    Fault,
    accuracy_excess,
    add_accuracy,
    before_training,
    claimed_partition,
    corrupt_evaluation,
    corrupt_reply,
    corrupt_secure_reply,
    deal_off_by_one,
    deals_wrong,
    false_declaration,
    inflate_count,
    lies_in_dealing,
    lying_deal,
    parse_faults,
    pull_to_bound,
    ratio_excess,
    scale_update,
    shifted_label,
    weight_factor,
)
from common.messages import EvaluateReply, FitConfig
from common.methods import load_run_config
from common.secure_means import SLOTS, UPDATE_RATIO
from common.share_evidence import sign_deal
from common.verifiable_shares import COMMITMENTS, SIGNATURES

from .client import MethodClient
from .local_data import partition_sizes
from .mods import secure_aggregation_mod, update_bound
from .node import partition_of

RATIO_SLOT = [name for name, _ in SLOTS].index(UPDATE_RATIO)

NOTES = "fedefc-attacker"  # context.state: what the attacker noted before masking


class LyingClient(NumPyClient):
    """The honest ``client`` (partition ``client.partition_id``) as ``faults`` make it
    lie (:mod:`common.faults`)."""

    def __init__(self, client: MethodClient, faults: list[Fault]):
        self.client = client
        self.faults = faults
        self.pid = client.partition_id

    def claimed_size(self) -> int | None:
        """A ``claim=P`` fault's lie: partition P's training size in the run's public
        data plan (None without such a fault)."""
        claim = claimed_partition(self.faults, self.pid)
        return None if claim is None else partition_sizes(self.client.cfg, claim)[0]

    def get_properties(self, config):
        return false_declaration(self.faults, self.pid, self.client.get_properties(config),
                                 self.claimed_size())

    def get_parameters(self, config):
        return self.client.get_parameters(config)

    def fit(self, parameters, config):
        server_round = int(config[FitConfig.ROUND])
        before_training(self.faults, self.pid, server_round)
        label = shifted_label(self.faults, self.pid, server_round)
        if label is not None:  # its own samples, every one labelled ``label``
            local = self.client.local
            self.client._local = replace(local, y=torch.full_like(local.y, label),
                                        labels=np.full_like(local.labels, label))
        weights, num_examples, metrics = self.client.fit(parameters, config)
        return corrupt_reply(self.faults, self.pid, server_round, weights, num_examples,
                             metrics, self.claimed_size())

    def evaluate(self, parameters, config):
        loss, num_examples, metrics = self.client.evaluate(parameters, config)
        claim = claimed_partition(self.faults, self.pid)
        if claim is not None:
            metrics[EvaluateReply.PARTITION_ID] = claim
        if num_examples:
            num_examples = corrupt_evaluation(self.faults, self.pid,
                                              int(config.get(FitConfig.ROUND, 0)), num_examples)
        return loss, num_examples, metrics


def lying(client_fn: Callable[[Context], MethodClient]) -> Callable[[Context], Client]:
    """The ClientApp's ``client_fn``: the honest client of ``client_fn``, wrapped in a
    :class:`LyingClient` when the run has ``faults``."""
    def make(context: Context) -> Client:
        client = client_fn(context)
        faults = parse_faults(client.cfg.faults)
        return (LyingClient(client, faults) if faults else client).to_client()
    return make


def _faults(msg: Message, ctxt: Context) -> tuple[list[Fault], int, int]:
    """(the run's faults, this node's partition, the message's round); no faults
    outside a secure run's training messages."""
    cfg = load_run_config(ctxt.run_config)
    if not cfg.secure_aggregation or msg.metadata.message_type != MessageType.TRAIN:
        return [], 0, 0
    faults = parse_faults(cfg.faults)
    if not faults:
        return [], 0, 0
    return faults, partition_of(ctxt, cfg.num_clients), int(msg.metadata.group_id or 0)


def before_mask_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """A secure training reply as the faults change it before Flower's SecAgg+ client
    masks it: its update scaled (``secure-scale``), its count inflated (``weight``, the
    weight factor; :func:`after_mask_mod` restores the clear count); its accuracy and
    its sum's size noted for ``secure-acc-set``."""
    faults, pid, rnd = _faults(msg, ctxt)
    out = call_next(msg, ctxt)
    if not faults or out.has_error():
        return out
    fitres = compat.recorddict_to_fitres(out.content, keep_input=True)
    *update, tail = parameters_to_ndarrays(fitres.parameters)
    clients = int(ctxt.state.config_records[RECORD_KEY_STATE]["sample_num"])
    accuracy = float(tail[1] / tail[0]) if tail[0] else 0.0
    ratio = float(tail[RATIO_SLOT] / tail[0]) if tail[0] else 0.0
    ctxt.state.config_records[NOTES] = ConfigRecord(
        {"excess": accuracy_excess(faults, pid, rnd, accuracy, clients),
         "ratio-excess": ratio_excess(faults, pid, rnd, ratio, clients)})
    bound, _ = update_bound(load_run_config(ctxt.run_config),
                            compat.recorddict_to_fitins(msg.content, keep_input=True))
    update, tail = pull_to_bound(faults, pid, rnd, update, tail, bound, RATIO_SLOT)
    fitres.parameters = ndarrays_to_parameters([*scale_update(faults, pid, rnd, update), tail])
    fitres.num_examples = inflate_count(faults, pid, rnd, fitres.num_examples)
    out.content = compat.fitres_to_recorddict(fitres, keep_input=True)
    return out


def after_mask_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """What a secure client sends as the faults change it after Flower's SecAgg+ client
    (:func:`common.faults.corrupt_secure_reply`; ``secure-acc-set``'s excess added to its
    masked accuracy slot), with a ``weight`` fault's clear count honest."""
    faults, pid, rnd = _faults(msg, ctxt)
    out = call_next(msg, ctxt)
    if (not faults or out.has_error()
            or RECORD_KEY_CONFIGS not in out.content.config_records):
        return out
    stage = dict(out.content.config_records[RECORD_KEY_CONFIGS])
    stage = corrupt_secure_reply(faults, pid, rnd, stage, msg.metadata.dst_node_id)
    if Key.CIPHERTEXT_LIST in stage and lies_in_dealing(faults, pid, rnd):
        state = SecAggPlusState(**ctxt.state.config_records[RECORD_KEY_STATE])
        if deals_wrong(faults, pid, rnd):
            stage = deal_off_by_one(stage, state.ss2_dict)
        stage, own = lying_deal(faults, pid, rnd, stage, state.ss2_dict, state.nid,
                                state.threshold)
        if own is not None:  # its own share of the other seed, which it returns at unmask
            state.rd_seed_share_dict[state.nid] = own
            ctxt.state.config_records[RECORD_KEY_STATE] = ConfigRecord(state.to_dict())
        stage[SIGNATURES] = [  # what it dealt, signed as its own
            sign_deal(state.sk2, state.nid, dst, text, stage[COMMITMENTS])
            for dst, text in zip(stage[Key.DESTINATION_LIST], stage[Key.CIPHERTEXT_LIST])]
    notes = ctxt.state.config_records.get(NOTES)
    if (notes is not None and Key.MASKED_PARAMETERS in stage
            and (notes["excess"] or notes["ratio-excess"])):
        *arrays, tail = [bytes_to_ndarray(b) for b in stage[Key.MASKED_PARAMETERS]]
        tail = add_accuracy(tail, float(notes["excess"]))
        tail = add_accuracy(tail, float(notes["ratio-excess"]), RATIO_SLOT)
        stage[Key.MASKED_PARAMETERS] = [ndarray_to_bytes(a) for a in (*arrays, tail)]
    out.content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(stage)
    factor = weight_factor(faults, pid, rnd)
    if factor > 1 and Key.MASKED_PARAMETERS in stage:  # the clear count stays honest
        count = out.content.metric_records["fitres.num_examples"]
        count["num_examples"] = int(count["num_examples"]) // factor
    return out


def with_attacker(mods: list) -> list:
    """The ClientApp's mods with the attacker's around Flower's SecAgg+ client
    (:func:`.mods.secure_aggregation_mod`): :func:`after_mask_mod` outside it,
    :func:`before_mask_mod` inside."""
    at = mods.index(secure_aggregation_mod)
    return [*mods[:at], after_mask_mod, secure_aggregation_mod, before_mask_mod,
            *mods[at + 1:]]
