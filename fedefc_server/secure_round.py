"""One training round under secure aggregation: Flower's SecAgg+ workflow driving the
round's strategy (docs/PRIVACY.md, "Secure aggregation"; docs/THREAT-MODEL.md).

:class:`SecureRound` is what the round loop calls instead of ``Server.fit_round`` when
``secure-aggregation = true``: it hands Flower's ``SecAggPlusWorkflow`` the round's
:class:`.strategy.RoundStrategy` (``configure_fit`` gives the planned instructions,
``aggregate_fit`` receives the sum) and the global model. Records, checkpoints and the
summary stay the round loop's, the same in both modes.

What the project adds to Flower's workflow, in the grid the workflow talks to
(:class:`ScreeningGrid`) and in its unmask stage (:class:`CheckedSecAggPlus`):

- **A vector the server received is never unmasked.** The masked replies of the
  collect stage pass the round's screen (:meth:`RoundStrategy.screen_masked`). If one
  is refused, or cannot be read, the grid stops the round before its unmask stage
  (:class:`RoundRefused`): no share of any secret is asked for, and the round starts
  again, with new keys, without the refused nodes (the screen knows them: it read their
  clear fields). Treating such a client as a dropout would have SecAgg+ rebuild its
  pairwise masks and leave its vector under its self-mask alone.
- **Rounds whose secrets a server could rebuild do not run.** The setup stage's
  numbers, as Flower rounded them, must give at least ``min-secure-clients`` clients
  and a strict-majority threshold (:func:`common.config.is_strict_majority`), at least
  ``min-secure-clients`` masked vectors must arrive, and no unmask request may name a
  node whose vector arrived as dropped; else the round is refused.
- **Malformed protocol replies are refused, never a crash.** A setup, share-keys or
  unmask reply that is not what its stage asked for (a key missing, a node id it was
  not asked about, lists of different lengths) becomes an error reply, recorded as a
  rejection: in the setup and share-keys stages the round then starts again, with new
  keys, without its sender (nothing was masked yet; Flower's workflow cannot unmask
  without a node whose keys went out but whose shares did not); in the unmask stage
  its shares are not used. A setup reply must carry two public keys that the other
  clients can use (EC keys on Flower's curve: one that cannot be read made every other
  client fail the next stage), and a share-keys reply one encrypted share for every
  other node of the round and none for itself. An exception Flower raises while it
  unmasks (shares that do not combine) refuses the round.
- **Shares are checked, and a liar named** (:mod:`common.verifiable_shares`,
  :mod:`.share_check`). Each dealer's share-keys reply carries its two commitments and
  its signature of each holder's ciphertext with them (:mod:`common.share_evidence`),
  which the grid checks, keeps and relays to every holder in the collect stage; a
  holder whose dealt shares fail answers with complaints instead of a masked vector,
  each with the channel's key or a proof of it (``fedefc_client/share_holder.py``). A
  complaint names the dealer (or the false complainer), who is left out of the run, and
  the round starts again without it (nothing was unmasked). In the unmask stage every
  returned share is checked against its owner's commitment before Flower combines them
  (in batches): a holder with a wrong one is named and left out of the run's later
  rounds, its wrong shares dropped, and the round goes on where every secret keeps
  threshold-many right shares; else it is refused without starting again (a second
  unmasked sum of the same updates would give a curious server the left-out node's
  update).
- **The sum is checked** (:mod:`.secure_sum`): :class:`CheckedSecAggPlus` reads the
  sum's weight total, which Flower's workflow divides by but does not pass on.

SecAgg+'s ``max_weight`` (the sample count that weighs 1) is the run's M
(:func:`common.data_plan.secure_weight`: ``max-client-samples``, else the data plan's
largest partition), which no declaration may exceed: no honest weight exceeds 1, and
every node derives the same M from the run config and refuses a setup with another
(``fedefc_client/server_checks.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.common import FitRes, Parameters, bytes_to_ndarray, ndarrays_to_parameters
from flwr.common.logger import log
from flwr.common.secure_aggregation.ndarrays_arithmetic import factor_extract
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.server_config import ServerConfig
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation import secaggplus_workflow as flower_secaggplus
from flwr.serverapp.grid import Grid
from flwr.supercore.primitives.asymmetric import bytes_to_public_key, generate_key_pairs

from common import secure_prf, verifiable_shares
from common.config import RunConfig, is_strict_majority
from common.messages import FitReply
from common.seeds import derive_seed
from common.update_bound import secure_range
from common.verifiable_shares import (
    COMMITMENTS,
    COMPLAINT_KEYS,
    COMPLAINT_PROOFS,
    COMPLAINT_REASONS,
    COMPLAINTS,
    SIGNATURES,
)

from .failures import rejection
from .pipeline import Collected, RoundOutcome, RoundPipeline, Screened
from .plan import RoundPlan
from .secure_sum import SecureSum
from .share_check import (
    bad_commitments,
    bad_signatures,
    judge_complaint,
    judge_unopened,
    wrong_returned,
)
from .strategy import RoundStrategy

secure_prf.install()  # SecAgg+'s masks from a full-entropy PRF (flwr#7522)
verifiable_shares.install()  # SecAgg+'s shares with Feldman's commitments


@dataclass(frozen=True)
class Sender:
    """The sender of a reply whose node left the client manager meanwhile (the
    registry still knows its partition by its id)."""

    cid: str


class RoundRefused(Exception):
    """A secure round stopped before anything was unmasked: ``refused`` lists the
    replies refused after their masked vector arrived ({node, partition, reason}; the
    round may start again without their nodes), ``excluded`` the nodes to leave out of
    the run's later rounds ({node id: why}; the round does not start again), ``reason``
    says why."""

    def __init__(self, reason: str, refused: list[dict[str, Any]] | None = None,
                 excluded: dict[str, str] | None = None):
        super().__init__(reason)
        self.reason = reason
        self.refused = refused or []
        self.excluded = excluded or {}


def masked_reply(msg: Message) -> FitRes:
    """A collect-stage reply as a FitRes whose arrays are its masked vector (what the
    screen step checks before the sum); raises on a reply that holds none."""
    stage = msg.content.config_records.get(RECORD_KEY_CONFIGS, {})
    vector = stage.get(Key.MASKED_PARAMETERS)
    if not isinstance(vector, list) or not all(isinstance(b, bytes) for b in vector):
        raise ValueError("no masked vector")
    fitres = compat.recorddict_to_fitres(msg.content, keep_input=True)
    fitres.parameters = ndarrays_to_parameters([bytes_to_ndarray(b) for b in vector])
    return fitres


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value)


def _bytes(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, bytes) for v in value)


def bad_protocol_reply(stage: str, reply: Message, request: Message | None,
                       threshold: int, public_key: bytes | None = None) -> str | None:
    """Why a setup, share-keys or unmask reply is not what ``request`` asked for, or
    None (the checks Flower's workflow leaves to chance: a missing key is a KeyError
    there, an unknown node id in the unmask stage too); a share-keys reply must also
    carry its dealer's two commitments for the round's ``threshold``
    (:func:`.share_check.bad_commitments`) and its signature of each ciphertext with
    them, by the setup key ``public_key`` its node sent (:func:`.share_check.
    bad_signatures`)."""
    if request is None:
        return f"a {stage} reply to no request of this stage"
    got = reply.content.config_records.get(RECORD_KEY_CONFIGS)
    asked = request.content.config_records[RECORD_KEY_CONFIGS]
    if got is None:
        return f"{stage} reply without its SecAgg+ record"
    if stage == Stage.SETUP:
        if not all(isinstance(got.get(k), bytes) for k in (Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2)):
            return "setup reply without its two public keys"
        return next((f"setup reply whose {which} is {problem}" for which in
                     (Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2)
                     if (problem := unusable_key(got[which])) is not None), None)
    own = reply.metadata.src_node_id
    if stage == Stage.SHARE_KEYS:
        ids, items = got.get(Key.DESTINATION_LIST), got.get(Key.CIPHERTEXT_LIST)
        known = {int(k) for k in asked if k != Key.STAGE}
    else:  # Stage.UNMASK
        ids, items = got.get(Key.NODE_ID_LIST), got.get(Key.SHARE_LIST)
        known = {*asked[Key.ACTIVE_NODE_ID_LIST], *asked[Key.DEAD_NODE_ID_LIST]}
    if not (_ints(ids) and _bytes(items) and len(ids) == len(items)):
        return f"{stage} reply whose node ids and payloads are not two lists of one length"
    strangers = sorted(set(ids) - known)
    if strangers:
        return f"{stage} reply naming node ids it was not asked about ({strangers[:3]})"
    if len(set(ids)) != len(ids):
        return f"{stage} reply naming a node id twice"
    if stage == Stage.SHARE_KEYS:
        if own in ids:
            return "share-keys reply addressing a share to its own node"
        withheld = sorted(known - set(ids) - {own})
        if withheld:
            return f"share-keys reply withholding its shares from node(s) {withheld[:3]}"
        return (bad_commitments(got.get(COMMITMENTS), threshold)
                or bad_signatures(got, own, public_key))
    return None


def unusable_key(pem: bytes) -> str | None:
    """Why a setup stage's public key cannot serve the other clients (each derives a
    shared key from it: Flower's ``bytes_to_public_key``, then ECDH on its curve), or
    None."""
    try:
        key = bytes_to_public_key(pem)
    except Exception:  # a client's bytes: any failure to read them
        return "no PEM public key"
    curve = getattr(key, "curve", None)
    if curve is None or curve.name != FLOWER_CURVE:
        return f"a key on {getattr(curve, 'name', type(key).__name__)}, not {FLOWER_CURVE}"
    return None


FLOWER_CURVE = generate_key_pairs()[1].curve.name  # the curve Flower's clients use


class ScreeningGrid:
    """The grid the SecAgg+ workflow talks to: Flower's grid plus the checks of the
    module docstring. ``received``: the nodes whose masked vector arrived; ``rejected``:
    the protocol replies it refused ({node, partition, reason}); ``commitments`` and
    ``dealt``: each dealer's two commitments and its encrypted shares (holder ->
    ciphertext), from the share-keys stage; ``excluded``: the nodes to leave out of the
    run's later rounds although the round went on ({node id: why})."""

    def __init__(self, grid: Grid, strategy: RoundStrategy, client_manager: ClientManager,
                 min_clients: int):
        self.grid = grid
        self.strategy = strategy
        self.client_manager = client_manager
        self.min_clients = min_clients
        self.received: set[int] = set()
        self.rejected: list[dict[str, Any]] = []
        self.unmasking = False  # the unmask stage's replies were handed to Flower
        self.threshold = 0  # the setup's reconstruction threshold, as Flower rounded it
        self.commitments: dict[int, list[bytes]] = {}
        self.dealt: dict[int, dict[int, bytes]] = {}
        self.signed: dict[int, dict[int, bytes]] = {}
        self.public_keys: dict[int, bytes] = {}  # each node's setup key pk2
        self.excluded: dict[str, str] = {}

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        stage = messages[0].content.config_records.get(RECORD_KEY_CONFIGS, {}).get(
            Key.STAGE) if messages else None
        if stage == Stage.SETUP:
            self.check_setup(messages[0].content.config_records[RECORD_KEY_CONFIGS])
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            self.relay_commitments(messages)
        elif stage == Stage.UNMASK:
            self.check_unmask_requests(messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        if stage == Stage.COLLECT_MASKED_VECTORS:
            return self.screen_masked(replies)
        if stage not in (Stage.SETUP, Stage.SHARE_KEYS, Stage.UNMASK):
            return replies
        asked = {m.metadata.dst_node_id: m for m in messages}
        before = len(self.rejected)
        screened = [self.screen_protocol(stage, r, asked.get(r.metadata.src_node_id))
                    for r in replies]
        if stage != Stage.UNMASK and len(self.rejected) > before:
            # Flower's workflow cannot go on without a node that sent its keys but whose
            # shares it did not forward (every other client would need them to unmask):
            # the round starts again, with new keys, without the refused nodes
            refused, self.rejected = self.rejected[before:], self.rejected[:before]
            raise RoundRefused(f"{stage} replies refused before any vector was sent",
                               refused)
        if stage == Stage.SETUP:
            self.public_keys = {r.metadata.src_node_id: r.content.config_records[
                RECORD_KEY_CONFIGS][Key.PUBLIC_KEY_2] for r in screened if not r.has_error()}
        if stage == Stage.SHARE_KEYS:
            for reply in screened:
                if not reply.has_error():
                    self.keep_dealing(reply)
        if stage == Stage.UNMASK:
            self.check_shares(screened, asked)
        self.unmasking = stage == Stage.UNMASK
        return screened

    def keep_dealing(self, reply: Message) -> None:
        """A dealer's commitments and encrypted shares, from its share-keys reply."""
        record = reply.content.config_records[RECORD_KEY_CONFIGS]
        dealer = reply.metadata.src_node_id
        self.commitments[dealer] = list(record[COMMITMENTS])
        self.dealt[dealer] = dict(zip(record[Key.DESTINATION_LIST],
                                      record[Key.CIPHERTEXT_LIST], strict=True))
        self.signed[dealer] = dict(zip(record[Key.DESTINATION_LIST], record[SIGNATURES],
                                       strict=True))

    def relay_commitments(self, messages: list[Message]) -> None:
        """Each collect-stage message also carries the commitments of the sources whose
        shares it forwards, two per source in its source list's order, and each source's
        signature of the holder's shares with them: every holder checks its shares
        against the commitments each dealer sent the server and signed."""
        for msg in messages:
            record = msg.content.config_records[RECORD_KEY_CONFIGS]
            holder = msg.metadata.dst_node_id
            record[COMMITMENTS] = [c for src in record[Key.SOURCE_LIST]
                                   for c in self.commitments[src]]
            record[SIGNATURES] = [self.signed[src][holder] for src in record[Key.SOURCE_LIST]]

    def node(self, node_id: int) -> dict[str, Any]:
        """{node, partition} of a node id, for a rejection's record."""
        cid = str(node_id)
        return {"node": cid, "partition": self.strategy.pipeline.registry.partition_of(cid)}

    def check_setup(self, config: ConfigRecord) -> None:
        """The round's clients, shares and threshold as Flower rounded them."""
        clients, shares = int(config[Key.SAMPLE_NUMBER]), int(config[Key.SHARE_NUMBER])
        threshold = self.threshold = int(config[Key.THRESHOLD])
        if clients < self.min_clients:
            raise RoundRefused(f"{clients} clients in the round, below min-secure-clients="
                               f"{self.min_clients}")
        if not is_strict_majority(threshold, shares, clients):
            raise RoundRefused(f"a threshold of {threshold} of {min(shares, clients)} shares "
                               "is no strict majority: a server could rebuild both secrets "
                               "of a client")

    def check_unmask_requests(self, messages: list[Message]) -> None:
        """No unmask request may name as dropped a node whose vector arrived: its
        holders would send the shares of its pairwise key, and its vector would be left
        under its self-mask alone."""
        for msg in messages:
            dead = set(msg.content.config_records[RECORD_KEY_CONFIGS][Key.DEAD_NODE_ID_LIST])
            if dead & self.received:
                raise RoundRefused(f"the unmask stage would rebuild the masks of node(s) "
                                   f"{sorted(dead & self.received)}, whose vectors arrived")

    def check_shares(self, replies: list[Message], asked: dict[int, Message]) -> None:
        """Before Flower combines them: every returned share is checked against its
        owner's commitment (:func:`.share_check.wrong_returned`). A holder that returned
        one that fails is rejected by name and left out of the run's later rounds (each
        holder checked its shares on arrival, so the wrong one is its own), and its
        wrong shares are taken out of its reply. If a secret is then left with fewer
        shares than the threshold, the round is refused (nothing was unmasked; it does
        not start again: a second unmasked sum of the same updates would give a curious
        server the left-out node's update); else it goes on with the right ones."""
        valid: dict[int, int] = {}
        records = {r.metadata.src_node_id: r.content.config_records[RECORD_KEY_CONFIGS]
                   for r in replies if not r.has_error()}
        wrongs = wrong_returned({holder: (asked[holder].content.config_records[
            RECORD_KEY_CONFIGS], record) for holder, record in records.items()},
            self.commitments)
        for holder, record in records.items():
            wrong = wrongs.get(holder, {})
            kept = [(owner, share) for owner, share in zip(record[Key.NODE_ID_LIST],
                                                           record[Key.SHARE_LIST], strict=True)
                    if owner not in wrong]
            for owner, _ in kept:
                valid[owner] = valid.get(owner, 0) + 1
            if not wrong:
                continue
            record[Key.NODE_ID_LIST] = [owner for owner, _ in kept]
            record[Key.SHARE_LIST] = [share for _, share in kept]
            reason = "; ".join(wrong.values())
            self.rejected.append({**self.node(holder), "reason": reason})
            self.excluded[str(holder)] = f"left out of the run: {reason}"
            log(WARNING, "secure round: node %s %s", holder, reason)
        short = sorted(owner for owner in self.commitments
                       if owner in self.received and valid.get(owner, 0) < self.threshold)
        if self.excluded and short:
            raise RoundRefused(f"node(s) {sorted(map(int, self.excluded))} returned unmask "
                               "shares that fail their owners' commitments, and the secrets "
                               f"of node(s) {short} are left with fewer than the threshold "
                               f"{self.threshold}; nothing was unmasked",
                               excluded=dict(self.excluded))

    def screen_protocol(self, stage: str, reply: Message, request: Message | None) -> Message:
        """``reply``, or an error reply in its place when it is malformed."""
        if reply.has_error():
            return reply
        reason = bad_protocol_reply(stage, reply, request, self.threshold,
                                    self.public_keys.get(reply.metadata.src_node_id))
        if reason is None:
            return reply
        self.rejected.append({**self.node(reply.metadata.src_node_id), "reason": reason})
        log(WARNING, "secure round: refused a %s reply of node %s: %s", stage,
            reply.metadata.src_node_id, reason)
        return Message(error=rejection(reason), metadata=reply.metadata)

    def screen_masked(self, replies: list[Message]) -> list[Message]:
        """The collect stage's replies, if every masked vector passed the screen and
        enough arrived; else :class:`RoundRefused` (before the unmask stage)."""
        proxies = self.client_manager.all()
        results: list[tuple[ClientProxy, FitRes]] = []
        refused: list[dict[str, Any]] = []
        excluded: dict[str, str] = {}
        for msg in replies:
            if msg.has_error():  # it failed before sending a vector: a dropout
                continue
            nid = msg.metadata.src_node_id
            complaints = msg.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(COMPLAINTS)
            if complaints is not None:
                self.judge(msg, refused, excluded)
                continue
            try:
                res = masked_reply(msg)
            except Exception as err:  # a client's bytes: any failure to read them
                refused.append({**self.node(nid),
                                "reason": f"unreadable masked vector ({type(err).__name__})"})
                continue
            results.append((proxies.get(str(nid)) or Sender(str(nid)), res))
        accepted = self.strategy.screen_masked(results)
        if refused:  # complaints: the dealers' shares are in doubt, nothing is unmasked
            raise RoundRefused("dealt shares failed their commitments: "
                               + "; ".join(f"node {r['node']}: {r['reason']}" for r in refused),
                               refused + self.strategy.screened.rejected, excluded)
        refused += self.strategy.screened.rejected
        if refused:
            raise RoundRefused("replies refused after their masked vector arrived", refused)
        if len(accepted) < self.min_clients:
            raise RoundRefused(f"{len(accepted)} masked vectors arrived, below "
                               f"min-secure-clients={self.min_clients}")
        self.received = {msg.metadata.src_node_id for msg in replies if not msg.has_error()}
        return replies


    def judge(self, msg: Message, refused: list[dict[str, Any]],
              excluded: dict[str, str]) -> None:
        """A holder's complaints about the shares it was dealt (``fedefc_client/
        share_holder.py``), each with the key of its channel with the dealer
        (:func:`.share_check.judge_complaint`) or, for shares that do not open, a proof
        of it (:func:`.share_check.judge_unopened`): the dealer, or the holder whose
        complaint does not hold, is refused and left out of the run; a complaint with
        neither names the holder."""
        holder = msg.metadata.src_node_id
        record = msg.content.config_records[RECORD_KEY_CONFIGS]
        try:
            entries = list(zip(record[COMPLAINTS], record[COMPLAINT_KEYS],
                               record[COMPLAINT_PROOFS], record[COMPLAINT_REASONS],
                               strict=True))
        except (KeyError, ValueError):
            entries = []
        named: dict[int, str] = {}
        if not entries:
            named[holder] = "a malformed complaint"
        for dealer, key, proof, _ in entries:
            ciphertext = self.dealt.get(dealer, {}).get(holder)
            if key:
                culprit, reason = judge_complaint(holder, dealer, key, ciphertext,
                                                  self.commitments.get(dealer, []))
            elif proof:
                culprit, reason = judge_unopened(holder, dealer, proof, ciphertext,
                                                 self.public_keys)
            else:
                culprit, reason = holder, (f"it complained about node {dealer}'s shares "
                                           "with neither a key nor a proof")
            named.setdefault(culprit, reason)
        for node, reason in named.items():
            excluded.setdefault(str(node), f"left out of the run: {reason}")
            if all(r["node"] != str(node) for r in refused):
                refused.append({**self.node(node), "reason": reason})
                log(WARNING, "secure round: node %s %s", node, reason)


class CheckedSecAggPlus(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow, whose unmask stage also gives the round's strategy the
    sum's weight total (``RoundStrategy.weight_total``): Flower reads it from the sum's
    weight factor slot (``factor_extract``) and divides by it, but hands the strategy
    only the quotient. The stage runs with that one function wrapped to note it."""

    def unmask_stage(self, grid: Grid, context: LegacyContext, state) -> bool:
        strategy = context.strategy

        def extract(parameters):
            total, rest = factor_extract(parameters)
            strategy.weight_total = int(total)
            return total, rest

        flower_secaggplus.factor_extract = extract
        try:
            return super().unmask_stage(grid, context, state)
        finally:
            flower_secaggplus.factor_extract = factor_extract


@dataclass
class Attempts:
    """What a secure round's tries refused, over all of them."""

    count: int = 0
    rejected: list[dict[str, Any]] = field(default_factory=list)

    def record(self, fields: dict[str, Any]) -> dict[str, Any]:
        rejected = [*self.rejected, *fields.get("rejected_reasons", [])]
        return {**fields, "rejected": len(rejected), "rejected_reasons": rejected,
                "secure_attempts": self.count}


HALTED = "secure aggregation halted"  # SecAgg+ stopped: too few clients answered a stage


def group_plans(plan: RoundPlan, cfg: RunConfig,
                partition_of: Callable[[str], int | None]) -> list[RoundPlan]:
    """The round's plan split into ``secure-groups`` plans of sizes as equal as can be,
    each summed under its own masks (docs/PRIVACY.md, "One client's pull on A(t)"): its
    partitions shuffled by (seed, round), a pure function of the run like the sampling;
    the plan itself with one group."""
    if cfg.secure_groups == 1:
        return [plan]
    rng = np.random.default_rng(derive_seed(cfg.seed, "secure-groups", plan.round))
    order = [int(p) for p in rng.permutation(plan.partitions)]
    node_of = {partition_of(proxy.cid): proxy.cid for proxy, _ in plan.instructions}
    groups = [{int(p) for p in members} for members in np.array_split(order, cfg.secure_groups)]
    return [plan.without({node_of[p] for p in order if p not in members}, partition_of)
            for members in groups]


class SecureRound:
    """``(round strategy, global parameters) -> the round's outcome``: one SecAgg+ round,
    started again without the nodes it refused after their vectors arrived."""

    def __init__(self, grid: Grid, context: Context, client_manager: ClientManager,
                 cfg: RunConfig):
        self.grid = grid
        self.context = context
        self.client_manager = client_manager
        self.cfg = cfg

    def __call__(self, strategy: RoundStrategy, parameters: Parameters) -> RoundOutcome:
        """The round's outcome: the sums of its groups (:func:`group_plans`; one group
        unless ``secure-groups`` > 1, or the culprit search's groups while it goes on:
        :mod:`.culprit_search`; when none of those reaches its sum, the round summed as
        one group without the nodes they refused) aggregated at once
        (:meth:`RoundPipeline.aggregate`). A group refused before its sum (see the module
        docstring; the reason in ``refused_groups``) or that SecAgg+ stopped (too few
        clients answered a stage to rebuild the masks) is left out; a round with no
        group left keeps the global model (``secure_refused`` says why, or
        ``secure_aggregation_halted``)."""
        plan, pipeline, attempts = strategy.plan, strategy.pipeline, Attempts()
        partition_of = pipeline.registry.partition_of
        tests = pipeline.search.groups(plan.partitions, self.cfg.min_secure_clients,
                                       self.cfg.seed, plan.round)
        groups = (group_plans(plan, self.cfg, partition_of) if tests is None else
                  [plan.only(set(members), partition_of) for members in tests])
        collected: list[Collected] = []
        failed: list[dict[str, Any]] = []
        for group in groups:
            result = self.group(strategy if group is plan else
                                RoundStrategy(pipeline, group), parameters, attempts)
            if isinstance(result, Collected):
                collected.append(result)
            else:
                failed.append({"partitions": group.partitions, "reason": result})
        searched = {} if tests is None else {"culprit_search": {
            "suspects": list(pipeline.search.suspects), "groups": tests,
            "left_out": sorted(set(plan.partitions) - {p for g in tests for p in g})}}
        if tests is not None and not collected:  # no group of the search reached its sum
            whole = plan.without({r["node"] for r in attempts.rejected}, partition_of)
            log(WARNING, "round %d: no group of the culprit search reached its sum; the "
                "round is summed as one group without the nodes it refused", plan.round)
            result = self.group(RoundStrategy(pipeline, whole), parameters, attempts)
            if isinstance(result, Collected):
                collected, groups = [result], [whole]
                searched = {"culprit_search": {**searched["culprit_search"], "groups": [
                    whole.partitions], "left_out": [], "tried": tests}}
        if not collected:
            if all(f["reason"] == HALTED for f in failed):
                log(WARNING, "round %d: secure aggregation halted (fewer clients than "
                    "reconstruction-threshold answered a stage): global model kept",
                    plan.round)
                return RoundOutcome(None, attempts.record({
                    "n_clients": 0, "skipped": True, "secure_aggregation_halted": True,
                    **searched}))
            reason = "; ".join(f["reason"] for f in failed)
            log(WARNING, "round %d: secure round refused, global model kept: %s", plan.round,
                reason)
            return RoundOutcome(None, attempts.record({"n_clients": 0, "skipped": True,
                                                       "secure_refused": reason, **searched}))
        accepted = sorted((r for c in collected for r in c.screened.accepted),
                          key=lambda r: int(r[1].metrics[FitReply.PARTITION_ID]))
        screened = Screened(accepted, [x for c in collected for x in c.screened.rejected])
        sums = [c.summed for c in collected if c.summed is not None]
        outcome = pipeline.aggregate(plan, screened, [f for c in collected for f in c.failures],
                                     sums)
        record = {**outcome.record,
                  **self.search_step(plan, pipeline, sums, outcome.record, searched)}
        if len(groups) > 1:
            record = {**record, "secure_groups": [g.partitions for g in groups],
                      "refused_groups": [*failed, *record.get("refused_groups", [])]}
        return RoundOutcome(outcome.parameters, attempts.record(record))

    def search_step(self, plan: RoundPlan, pipeline: RoundPipeline, sums: list[SecureSum],
                    record: dict[str, Any], searched: dict[str, Any]) -> dict[str, Any]:
        """The culprit search after the round's sums were checked
        (:mod:`.culprit_search`): the sums their checks refused go in, and a client
        named comes out, left out of the run. The record's ``culprit_search``: the
        suspects and groups of a search round, and what the search concluded."""
        if len(sums) == 1:
            refused = [list(sums[0].partitions)] if record.get("refused_sum") else []
        else:
            refused = [g["partitions"] for g in record.get("refused_groups", [])]
        named, note = pipeline.search.after(plan.round, refused)
        if not note:
            return searched
        step = {**searched.get("culprit_search", {}), "found": note}
        if named is not None:
            node = next(proxy.cid for proxy, _ in plan.instructions
                        if pipeline.registry.partition_of(proxy.cid) == named)
            pipeline.registry.exclude(node, f"left out of the run: {note}")
            step["named"] = {"partition": named, "node": node}
        log(WARNING, "round %d: culprit search: %s", plan.round, note)
        return {"culprit_search": step}

    def group(self, strategy: RoundStrategy, parameters: Parameters,
              attempts: Attempts) -> Collected | str:
        """One group's secure sum (:class:`.pipeline.Collected`), started again without
        the nodes it refused after their vectors arrived; or why it has none
        (:data:`HALTED`: SecAgg+ stopped)."""
        plan, cfg = strategy.plan, self.cfg
        while True:
            attempts.count += 1
            if len(plan.instructions) < cfg.min_secure_clients:
                return (f"{len(plan.instructions)} clients left, below min-secure-clients="
                        f"{cfg.min_secure_clients}")
            grid = ScreeningGrid(self.grid, strategy, self.client_manager,
                                 cfg.min_secure_clients)
            refusal = self.attempt(grid, strategy, parameters)
            attempts.rejected += grid.rejected
            excluded = {**grid.excluded, **(refusal.excluded if refusal else {})}
            for cid, why in excluded.items():
                strategy.pipeline.registry.exclude(cid, why)
            if refusal is None:
                break
            attempts.rejected += refusal.refused
            nodes = {r["node"] for r in refusal.refused}
            if not nodes:
                return refusal.reason
            log(WARNING, "round %d: %s (nodes %s); nothing was unmasked: the round starts "
                "again without them", plan.round, refusal.reason, sorted(nodes))
            plan = plan.without(nodes, strategy.pipeline.registry.partition_of)
            strategy = RoundStrategy(strategy.pipeline, plan)
        return HALTED if strategy.collected is None else strategy.collected

    def attempt(self, grid: ScreeningGrid, strategy: RoundStrategy,
                parameters: Parameters) -> RoundRefused | None:
        """One run of the workflow over ``grid``; the refusal that stopped it, if any."""
        cfg = self.cfg
        context = LegacyContext(self.context, ServerConfig(num_rounds=cfg.rounds), strategy,
                                self.client_manager)
        context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
            {WorkflowKey.CURRENT_ROUND: strategy.plan.round, WorkflowKey.START_TIME: time.time()})
        context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
            parameters, keep_input=True)
        workflow = CheckedSecAggPlus(num_shares=cfg.num_shares or 1.0,  # 1.0: every client
                                     reconstruction_threshold=cfg.reconstruction_threshold,
                                     max_weight=float(strategy.plan.weight_bound),
                                     clipping_range=secure_range(cfg),
                                     timeout=cfg.client_timeout or None)
        try:
            workflow(grid, context)
        except RoundRefused as refusal:
            return refusal
        except Exception as err:  # Flower's unmasking of clients' shares, nothing of ours
            if not grid.unmasking or strategy.summing:
                raise
            return RoundRefused(f"SecAgg+ could not unmask the sum ({type(err).__name__}: "
                                f"{err})")
        return None
