"""Fault injection and attacker modes: make chosen clients fail or lie on purpose, or
the server deviate from the run, so that every failure and every attack of
docs/THREAT-MODEL.md can be replayed from a run config.

The run-config key ``faults`` holds ``;``-separated entries ``KIND@PIDS`` or
``KIND@PIDS@ROUNDS``; PIDS and ROUNDS are comma lists of numbers or ranges ("0-4,7").
Empty (the default) injects nothing. The kinds that lie at registration (``claim``,
``private``, ``held-out``) ignore ROUNDS: a node registers once. Kinds:

| kind | the client ... |
| --- | --- |
| ``raise`` | raises an exception instead of replying |
| ``sleep=S`` | sleeps S seconds before training (a straggler; pair with ``client-timeout``) |
| ``exit`` | kills its own process (a crash / disconnect) |
| ``nan`` | replies with NaN in its first weight array |
| ``shape`` | replies with a wrongly shaped first array |
| ``drop-array`` | replies with one array missing |
| ``dtype`` | replies with float16 arrays |
| ``samples=N`` | reports N samples (e.g. 0, -5 or 10**12) |
| ``acc=A`` | reports accuracy A in phase 1 (1.0 or 0.0: a lying client; 1.5: out of range) |
| ``no-acc`` | omits its phase-1 accuracy |
| ``pid=P`` | reports partition id P (a string, or another client's id) |
| ``scale=F`` | multiplies its float weights by F (an update of huge norm; plain rounds) |
| ``claim=P`` | registers as partition P with P's size in the public data plan, and replies as P |
| ``private=N`` | registers its data as private with N samples, and replies with N |
| ``held-out=N`` | registers N held-out samples (federated evaluation) |
| ``eval-samples=N`` | reports N held-out samples in its evaluation replies |
| ``secure-acc=A`` | adds A to its accuracy inside the mask, past the quantizer's clipping |
| ``weight=F`` | multiplies its SecAgg+ weight factor by the integer F (clear count honest) |
| ``garbage`` | sends random integers as its masked vector (the right shapes) |
| ``garbage-bytes`` | sends bytes that are no array as its masked vector |
| ``unmask-nid=N`` | adds node id N (with a share) to its unmask-stage reply |
| ``secure-scale=F`` | multiplies its update by F before it is masked (the quantizer then |
|  | clips each coordinate to its range: a scaled update the masks hide) |
| ``secure-acc-set=A`` | adds inside its mask what sets its sum's mean accuracy to A, |
|  | taking the others' for its own (K A - (K - 1) a_k in its slot, K the sum's clients) |
| ``bad-shares`` | sends wrong shares (random bytes) in the unmask stage |
| ``collude-shares`` | returns each unmask share one more than its value (f(x) + 1: on |
|  | the list of several nodes, holders that agree on their lie) |
| ``bad-dealer`` | deals every holder shares one off its committed polynomial, then |
|  | answers the unmask stage honestly |
| ``bad-key`` | sends random bytes as its two public keys in the setup stage |
| ``self-share`` | addresses its first encrypted share to itself in the share-keys stage |
| ``label-shift=L`` | trains with every label set to L; under secure aggregation it sends |
|  | that update lengthened to the round's bound B with a ratio of 1: the |
|  | longest pull an update inside the bound, honestly reported, can make |
| ``unopenable=N`` | deals node N (0: every holder) encrypted shares that do not open, |
|  | signed as its own |
| ``other-commitment=N`` | deals node N (0: every holder) shares that carry another |
|  | commitment than the one it sends the server |
| ``other-seed`` | deals consistent shares of another mask seed than it masks with |
| ``empty-secret`` | deals shares of an empty mask seed |
| ``secure-ratio=F`` | writes its ratio slot so that its sum's mean ratio is 1 (past the |
|  | quantizer's clipping) and multiplies its update by F: the reports then |
|  | allow the decoded mean up to the whole bound |

The attacker lives beside the honest client, in ``fedefc_client/attacker.py``: a
wrapping client for the kinds that act on a reply's content or a registration, and two
mods around Flower's SecAgg+ client for the kinds inside the mask (before it masks:
:func:`inflate_count`, :func:`scale_update`, :func:`accuracy_excess`; after:
:func:`corrupt_secure_reply`).

The run-config key ``server-faults`` holds a dishonest server's modes, ``;``-separated
``KIND`` or ``KIND@ROUNDS`` entries (every round without ROUNDS; the kinds aimed at some
nodes ``KIND@PIDS[@ROUNDS]``, PIDS the partitions of the nodes whose messages change),
applied by a wrapping grid below the project's ServerApp (``fedefc_server/dishonest.py``)
to every message it sends:

| kind | the server ... |
| --- | --- |
| ``clip=F`` | sends ``clipping_norm = F`` in every training message's config |
| ``secagg-threshold=N`` | sends SecAgg+ setups with a reconstruction threshold of N |
| ``secagg-sample=N`` | sends SecAgg+ setups that say the round sums N clients |
| ``secagg-max-weight=F@PIDS`` | sends the nodes of PIDS SecAgg+ setups with ``max_weight`` |
|  | F (the isolation attack: F = 1e12 to every node but one) |
| ``secagg-commitments@PIDS`` | relays the nodes of PIDS forged commitments of the |
|  | dealers' shares (to have them open their channels) |
| ``unmask-both`` | names the first active node dropped too in every unmask request |
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
from flwr.common import bytes_to_ndarray, ndarray_to_bytes
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt
from flwr.common.secure_aggregation.secaggplus_constants import Key
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)

from .messages import Declaration, FitReply
from .secure_means import SLOTS
from .verifiable_shares import (
    COMMITMENTS,
    INDEX,
    SCALAR,
    Q,
    deal,
    read_commitment,
    read_share,
)

KINDS = ("raise", "sleep", "exit", "nan", "shape", "drop-array", "dtype", "samples", "acc",
         "no-acc", "pid", "scale", "claim", "private", "held-out", "eval-samples",
         "secure-acc", "weight", "garbage", "garbage-bytes", "unmask-nid", "secure-scale",
         "secure-acc-set", "bad-shares", "bad-key", "self-share", "collude-shares",
         "bad-dealer", "label-shift", "secure-ratio", "unopenable", "other-commitment",
         "other-seed", "empty-secret")
FLOAT_ARG = ("sleep", "acc", "scale", "secure-acc", "secure-scale", "secure-acc-set",
             "secure-ratio")
INT_ARG = ("samples", "claim", "private", "held-out", "eval-samples", "unmask-nid",
           "label-shift", "unopenable", "other-commitment")
SERVER_KINDS = ("clip", "secagg-threshold", "secagg-sample", "secagg-max-weight",
                "secagg-commitments", "unmask-both")
SERVER_ARG = {"clip": float, "secagg-threshold": int, "secagg-sample": int,
              "secagg-max-weight": float}
AIMED = ("secagg-max-weight", "secagg-commitments")  # aimed at some partitions' nodes


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


def _numbers(text: str) -> frozenset[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


@dataclass(frozen=True)
class Fault:
    kind: str
    arg: str
    pids: frozenset[int]
    rounds: frozenset[int] | None

    def applies(self, pid: int, server_round: int) -> bool:
        return pid in self.pids and (self.rounds is None or server_round in self.rounds)


def parse_faults(text: str) -> list[Fault]:
    """Parse the ``faults`` key; ValueError names the bad entry and the format."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        parts = entry.split("@")
        kind, _, arg = parts[0].partition("=")
        try:
            if kind not in KINDS or len(parts) not in (2, 3):
                raise ValueError
            if kind in FLOAT_ARG:
                float(arg)
            if kind in INT_ARG:
                int(arg)
            if kind == "weight" and int(arg) < 2:
                raise ValueError
            faults.append(Fault(kind, arg, _numbers(parts[1]),
                                _numbers(parts[2]) if len(parts) == 3 else None))
        except ValueError:
            raise ValueError(
                f"faults entry {entry!r} is not KIND@PIDS[@ROUNDS] with KIND one of "
                f"{', '.join(KINDS)} (sleep=S, samples=N, acc=A, pid=P, scale=F, claim=P, "
                "private=N, held-out=N, eval-samples=N, secure-acc=A, unmask-nid=N, "
                "secure-scale=F, secure-acc-set=A, label-shift=L, secure-ratio=F, "
                "unopenable=N, other-commitment=N take a value; weight=F an integer >= 2); "
                "e.g. faults=\"raise@3;acc=1.0@0-9\"") from None
    return faults


@dataclass(frozen=True)
class ServerFault:
    kind: str
    arg: str
    rounds: frozenset[int] | None
    pids: frozenset[int] | None = None  # the partitions aimed at (None: every node)

    def applies(self, server_round: int, pid: int | None = None) -> bool:
        return ((self.rounds is None or server_round in self.rounds)
                and (self.pids is None or pid in self.pids))


def parse_server_faults(text: str) -> list[ServerFault]:
    """Parse the ``server-faults`` key; ValueError names the bad entry and the format."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        parts = entry.split("@")
        kind, _, arg = parts[0].partition("=")
        aimed = kind in AIMED
        try:
            if (kind not in SERVER_KINDS or len(parts) > 2 + aimed or len(parts) < 1 + aimed
                    or bool(arg) != (kind in SERVER_ARG)):
                raise ValueError
            if kind in SERVER_ARG:
                SERVER_ARG[kind](arg)
            rounds = parts[1 + aimed] if len(parts) == 2 + aimed else None
            faults.append(ServerFault(kind, arg, _numbers(rounds) if rounds else None,
                                      _numbers(parts[1]) if aimed else None))
        except ValueError:
            raise ValueError(
                f"server-faults entry {entry!r} is not KIND[@ROUNDS] with KIND one of "
                f"{', '.join(SERVER_KINDS)} (clip=F, secagg-threshold=N, secagg-sample=N "
                "take a value; secagg-max-weight=F@PIDS[@ROUNDS] a value and partitions, "
                "secagg-commitments@PIDS[@ROUNDS] partitions); "
                "e.g. server-faults=\"clip=1e9@1-3;secagg-threshold=1\"") from None
    return faults


def server_fault(faults: list[ServerFault], kind: str, server_round: int,
                 pid: int | None = None) -> ServerFault | None:
    """The first server fault of ``kind`` in ``server_round`` (for the node of partition
    ``pid``, for the kinds aimed at some), or None."""
    return next((f for f in faults if f.kind == kind and f.applies(server_round, pid)),
                None)


def before_training(faults: list[Fault], pid: int, server_round: int) -> None:
    """Faults that strike before the client does any work."""
    for f in faults:
        if not f.applies(pid, server_round):
            continue
        if f.kind == "raise":
            raise InjectedFault(f"injected failure of client {pid} in round {server_round}")
        if f.kind == "sleep":
            time.sleep(float(f.arg))
        if f.kind == "exit":
            os._exit(17)


def _first(faults: list[Fault], kind: str, pid: int, server_round: int | None = None
           ) -> Fault | None:
    """The first fault of ``kind`` for ``pid`` (in ``server_round``; None: any round)."""
    return next((f for f in faults if f.kind == kind and pid in f.pids
                 and (server_round is None or f.applies(pid, server_round))), None)


def claimed_partition(faults: list[Fault], pid: int) -> int | None:
    """The partition a ``claim=P`` node pretends to serve, or None."""
    f = _first(faults, "claim", pid)
    return None if f is None else int(f.arg)


def false_declaration(faults: list[Fault], pid: int, declaration: dict,
                      claimed_size: int | None) -> dict:
    """A node's registration (``get_properties``) as the faults of ``pid`` alter it:
    ``claim`` (with ``claimed_size``, the claimed partition's public plan size),
    ``private`` and ``held-out``."""
    out = dict(declaration)
    if (claim := claimed_partition(faults, pid)) is not None:
        out.update({Declaration.PARTITION_ID: claim, Declaration.NUM_EXAMPLES: claimed_size})
    if (f := _first(faults, "private", pid)) is not None:
        out.update({Declaration.DATA: Declaration.PRIVATE, Declaration.NUM_EXAMPLES: int(f.arg)})
    if (f := _first(faults, "held-out", pid)) is not None:
        out[Declaration.HELD_OUT] = int(f.arg)
    return out


def corrupt_evaluation(faults: list[Fault], pid: int, server_round: int,
                       num_examples: int) -> int:
    """The held-out count of an evaluation reply (``eval-samples``)."""
    f = _first(faults, "eval-samples", pid, server_round)
    return num_examples if f is None else int(f.arg)


def corrupt_reply(faults: list[Fault], pid: int, server_round: int, weights: list[np.ndarray],
                  num_examples: int, metrics: dict, claimed_size: int | None = None
                  ) -> tuple[list[np.ndarray], int, dict]:
    """Faults that alter what the client sends back (``claimed_size``: the size of the
    partition a ``claim`` node pretends to serve)."""
    for f in faults:
        if f.kind in ("claim", "private") and pid in f.pids:  # every reply, like the lie
            num_examples = int(f.arg) if f.kind == "private" else int(claimed_size)
            if f.kind == "claim":
                metrics[FitReply.PARTITION_ID] = int(f.arg)
        if not f.applies(pid, server_round):
            continue
        if f.kind == "nan":
            weights = [np.full_like(weights[0], np.nan), *weights[1:]]
        elif f.kind == "shape":
            weights = [np.zeros(weights[0].size + 1, dtype=weights[0].dtype), *weights[1:]]
        elif f.kind == "drop-array":
            weights = weights[:-1]
        elif f.kind == "dtype":
            weights = [w.astype(np.float16) for w in weights]
        elif f.kind == "samples":
            num_examples = int(f.arg)
        elif f.kind == "acc" and FitReply.ACCURACY in metrics:
            metrics[FitReply.ACCURACY] = float(f.arg)
        elif f.kind == "no-acc":
            metrics.pop(FitReply.ACCURACY, None)
        elif f.kind == "pid":
            metrics[FitReply.PARTITION_ID] = (int(f.arg) if f.arg.lstrip("-").isdigit()
                                              else f.arg)
        elif f.kind == "scale":
            weights = [w * w.dtype.type(float(f.arg)) if w.dtype.kind == "f" else w
                       for w in weights]
    return weights, num_examples, metrics


def inflate_count(faults: list[Fault], pid: int, server_round: int, num_examples: int) -> int:
    """Inside the mask, before Flower's SecAgg+ client turns the reply's count into its
    weight factor: ``weight=F`` multiplies it by F (:func:`corrupt_secure_reply` then
    restores the clear count)."""
    return num_examples * weight_factor(faults, pid, server_round)


def weight_factor(faults: list[Fault], pid: int, server_round: int) -> int:
    """F of a ``weight=F`` fault (1: none): the clear count is the masked one over F."""
    f = _first(faults, "weight", pid, server_round)
    return 1 if f is None else int(f.arg)


def scale_update(faults: list[Fault], pid: int, server_round: int,
                 update: list[np.ndarray]) -> list[np.ndarray]:
    """Before Flower's SecAgg+ client masks it: the update times F (``secure-scale=F``)."""
    f = _first(faults, "secure-scale", pid, server_round)
    return update if f is None else [a * float(f.arg) for a in update]


def shifted_label(faults: list[Fault], pid: int, server_round: int) -> int | None:
    """The label a ``label-shift=L`` client trains every sample with (None: none)."""
    f = _first(faults, "label-shift", pid, server_round)
    return None if f is None else int(f.arg)


def pull_to_bound(faults: list[Fault], pid: int, server_round: int, update: list[np.ndarray],
                  tail: np.ndarray, bound: float | None, ratio_slot: int
                  ) -> tuple[list[np.ndarray], np.ndarray]:
    """Before Flower's SecAgg+ client masks them: a ``label-shift`` client's update
    lengthened to the round's ``bound`` (its float arrays) with its tail's ratio slot
    at 1, what an honest client at the bound reports; ``secure-ratio=F`` then
    multiplies the update by F (its ratio slot is raised after the mask:
    :func:`ratio_excess`)."""
    if bound and _first(faults, "label-shift", pid, server_round) is not None:
        norm = float(np.sqrt(sum(float(np.sum(u.astype(np.float64) ** 2)) for u in update
                                 if u.dtype.kind == "f")))
        if norm > 0:
            update = [u * (bound / norm) if u.dtype.kind == "f" else u for u in update]
            tail = tail.copy()
            tail[ratio_slot] = tail[0]
    f = _first(faults, "secure-ratio", pid, server_round)
    if f is not None:
        update = [u * float(f.arg) if u.dtype.kind == "f" else u for u in update]
    return update, tail


def ratio_excess(faults: list[Fault], pid: int, server_round: int, ratio: float,
                 clients: int) -> float:
    """What ``secure-ratio`` adds to its ratio slot inside its mask (0.0 without it):
    the sum's mean ratio is 1 if the other ``clients`` - 1 report its own honest
    ``ratio``: (K - 1)(1 - ratio), and its own slot already holds 1 when it lengthened
    its update to the bound (``label-shift``), else its ratio."""
    if _first(faults, "secure-ratio", pid, server_round) is None:
        return 0.0
    own = 1.0 if _first(faults, "label-shift", pid, server_round) is not None else ratio
    return (clients - 1) * (1 - ratio) + (1 - own)


def accuracy_excess(faults: list[Fault], pid: int, server_round: int, accuracy: float,
                    clients: int) -> float:
    """What ``secure-acc-set=A`` adds to the client's accuracy inside its mask (0.0
    without it): the sum of ``clients`` accuracies has mean A if the others equal its
    own ``accuracy``, so its slot must hold K A - (K - 1) a, a excess of K (A - a)."""
    f = _first(faults, "secure-acc-set", pid, server_round)
    return 0.0 if f is None else clients * (float(f.arg) - accuracy)


def add_accuracy(tail: np.ndarray, excess: float, slot: int = 1) -> np.ndarray:
    """A masked tail whose accuracy slot (or another ``slot``) grows by ``excess``
    values: masks cancel in the sum, so the sum's slot grows by excess x c/2, excess x
    2^20 quantization steps of 2c / 2^22, past the quantizer's clipping."""
    out = tail.copy()
    out[slot] = (out[slot] + round(excess / SLOTS[slot][1] * 2**20)) % 2**32
    return out


def corrupt_secure_reply(faults: list[Fault], pid: int, server_round: int,
                         stage: dict, nid: int) -> dict:
    """After Flower's SecAgg+ client: its reply record (``secaggplus_configs``) as the
    faults alter it. ``secure-acc=A`` adds A x 2^20 to the accuracy slot of the masked
    tail: masks cancel in the sum, so the sum's slot grows by A x c/2 (a quantization
    step is 2c / 2^22), as if the client's accuracy were A more, past the quantizer's
    clipping (:func:`add_accuracy`). ``garbage`` and ``garbage-bytes`` replace the masked
    vector, ``unmask-nid=N`` adds node N to the unmask-stage shares, ``bad-shares``
    replaces every share by random bytes of its length, ``collude-shares`` every share
    by :func:`off_by_one`'s, ``bad-key`` the setup stage's
    public keys, and ``self-share`` makes the first share-keys destination the client's
    own node id ``nid``."""
    out = dict(stage)
    for f in faults:
        if not f.applies(pid, server_round):
            continue
        if f.kind == "secure-acc" and Key.MASKED_PARAMETERS in out:
            *arrays, tail = [bytes_to_ndarray(b) for b in out[Key.MASKED_PARAMETERS]]
            out[Key.MASKED_PARAMETERS] = [ndarray_to_bytes(a) for a in (
                *arrays, add_accuracy(tail, float(f.arg)))]
        elif f.kind == "garbage" and Key.MASKED_PARAMETERS in out:
            rng = np.random.default_rng()
            out[Key.MASKED_PARAMETERS] = [
                ndarray_to_bytes(rng.integers(0, 2**32, bytes_to_ndarray(b).shape,
                                              dtype=np.int64))
                for b in out[Key.MASKED_PARAMETERS]]
        elif f.kind == "garbage-bytes" and Key.MASKED_PARAMETERS in out:
            out[Key.MASKED_PARAMETERS] = [b"not an array" for _ in out[Key.MASKED_PARAMETERS]]
        elif f.kind == "unmask-nid" and Key.SHARE_LIST in out:
            out[Key.NODE_ID_LIST] = [*out[Key.NODE_ID_LIST], int(f.arg)]
            out[Key.SHARE_LIST] = [*out[Key.SHARE_LIST], out[Key.SHARE_LIST][0]]
        elif f.kind == "bad-shares" and Key.SHARE_LIST in out:
            out[Key.SHARE_LIST] = [os.urandom(len(b)) for b in out[Key.SHARE_LIST]]
        elif f.kind == "collude-shares" and Key.SHARE_LIST in out:
            out[Key.SHARE_LIST] = [off_by_one(b) for b in out[Key.SHARE_LIST]]
        elif f.kind == "bad-key" and Key.PUBLIC_KEY_1 in out:
            for key in (Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2):
                out[key] = os.urandom(len(out[key]))
        elif f.kind == "self-share" and out.get(Key.DESTINATION_LIST):
            out[Key.DESTINATION_LIST] = [nid, *out[Key.DESTINATION_LIST][1:]]
    return out


def deals_wrong(faults: list[Fault], pid: int, server_round: int) -> bool:
    """Whether the client deals wrong shares in this round (``bad-dealer``)."""
    return _first(faults, "bad-dealer", pid, server_round) is not None


DEALING_KINDS = ("bad-dealer", "unopenable", "other-commitment", "other-seed",
                 "empty-secret")


def lies_in_dealing(faults: list[Fault], pid: int, server_round: int) -> bool:
    """Whether the client deals its shares other than honestly in this round (it then
    signs what it sends as its own: ``common/share_evidence.py``)."""
    return any(_first(faults, kind, pid, server_round) is not None for kind in DEALING_KINDS)


def lying_deal(faults: list[Fault], pid: int, server_round: int, stage: dict,
               channel_keys: dict[int, bytes], nid: int, threshold: int
               ) -> tuple[dict, bytes | None]:
    """A share-keys reply (``stage``, of node ``nid``, with its commitments) as the
    dealing faults change it; the channel key with each holder in ``channel_keys``
    (the dealer's SecAgg+ state). ``other-seed`` and ``empty-secret`` deal
    :func:`common.verifiable_shares.deal`'s shares of another seed to every holder and
    to itself, and send that commitment (the second value: the dealer's own share of
    it, None otherwise); ``other-commitment=N`` puts another dealing's commitment into
    node N's shares; ``unopenable=N`` replaces node N's ciphertext by random bytes."""
    out = dict(stage)
    own = None
    seed = (os.urandom(32) if _first(faults, "other-seed", pid, server_round) else
            b"" if _first(faults, "empty-secret", pid, server_round) else None)
    dsts = list(out[Key.DESTINATION_LIST])
    if seed is not None:
        commitment, shares = deal(seed, threshold, [*dsts, nid])
        *dealt, own = shares
        out[COMMITMENTS] = [commitment, *out[COMMITMENTS][1:]]
        out[Key.CIPHERTEXT_LIST] = [
            _reshare(text, channel_keys[dst], lambda b, sk1, new=new: (new, sk1))
            for dst, text, new in zip(dsts, out[Key.CIPHERTEXT_LIST], dealt)]
    texts = list(out[Key.CIPHERTEXT_LIST])
    for kind in ("other-commitment", "unopenable"):
        f = _first(faults, kind, pid, server_round)
        for i, dst in enumerate(dsts):
            if f is None or int(f.arg) not in (0, dst):
                continue
            if kind == "unopenable":
                texts[i] = os.urandom(len(texts[i]))
            else:
                texts[i] = _reshare(texts[i], channel_keys[dst], lambda b, sk1: (
                    _recommitted(b), _recommitted(sk1)))
    out[Key.CIPHERTEXT_LIST] = texts
    return out, own


def _reshare(ciphertext: bytes, key: bytes, change) -> bytes:
    """``ciphertext`` (a holder's two shares) with ``change(b share, sk1 share)``'s."""
    src, dst, b_share, sk1_share = share_keys_plaintext_separate(decrypt(key, ciphertext))
    return encrypt(key, share_keys_plaintext_concat(src, dst, *change(b_share, sk1_share)))


def _recommitted(share: bytes) -> bytes:
    """``share`` carrying a fresh dealing's commitment of the same degree instead of
    its own."""
    x, y, commitment = read_share(share)
    points, sealed = read_commitment(commitment)
    other = deal(os.urandom(len(sealed)), len(points), [1])[0]
    return x.to_bytes(INDEX, "big") + y.to_bytes(SCALAR, "big") + other


def off_by_one(share: bytes) -> bytes:
    """A verifiable share (:mod:`common.verifiable_shares`) whose value is one more:
    well-formed, its holder's, off its dealer's polynomial."""
    x, y, commitment = read_share(share)
    return x.to_bytes(INDEX, "big") + ((y + 1) % Q).to_bytes(SCALAR, "big") + commitment


def deal_off_by_one(stage: dict, channel_keys: dict[int, bytes]) -> dict:
    """A share-keys reply (``bad-dealer``) whose encrypted shares each hold
    :func:`off_by_one`'s, re-encrypted under the channel key with each holder
    (``channel_keys``: holder -> key, the dealer's SecAgg+ state); its commitments
    stay honest."""
    out = dict(stage)
    texts = []
    for dst, ciphertext in zip(out[Key.DESTINATION_LIST], out[Key.CIPHERTEXT_LIST]):
        key = channel_keys[dst]
        src, dst_, b_share, sk1_share = share_keys_plaintext_separate(decrypt(key, ciphertext))
        texts.append(encrypt(key, share_keys_plaintext_concat(
            src, dst_, off_by_one(b_share), off_by_one(sk1_share))))
    out[Key.CIPHERTEXT_LIST] = texts
    return out
