"""Error-locating decoding of SecAgg+'s Shamir shares (fedefc_server/share_check.py;
docs/THREAT-MODEL.md, "Malformed secure replies"), against Flower's own sharing and
combining (flwr.common.secure_aggregation.crypto.shamir) and PyCryptodome's field."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from Crypto.Protocol.SecretSharing import _Element
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from fedefc_server.secure_round import RoundRefused, ScreeningGrid
from fedefc_server.share_check import (
    UndecidableShares,
    bad_holders,
    gf_inverse,
    gf_mul,
    split_share,
)

RNG = random.Random(29)


def wrong(share: bytes, chunk: int = 0, bit: int = 0) -> bytes:
    """``share`` with one bit of one chunk flipped (still well formed)."""
    raw = bytearray(share)
    raw[4 + 16 * chunk + bit // 8] ^= 1 << (bit % 8)
    return bytes(raw)


def test_the_field_is_pycryptodomes_the_one_flowers_shares_live_in():
    for _ in range(200):
        a, b = RNG.getrandbits(128), RNG.getrandbits(128)
        assert gf_mul(a, b) == int(_Element(a) * _Element(b))
    a = RNG.getrandbits(128) | 1
    assert gf_mul(a, gf_inverse(a)) == 1 and gf_inverse(1) == 1
    with pytest.raises(ZeroDivisionError):
        gf_inverse(0)


def test_honest_shares_name_no_one_and_combine_to_the_secret():
    secret = RNG.randbytes(200)  # 13 chunks, like a serialized private key
    shares = create_shares(secret, 4, 7)
    assert bad_holders(dict(enumerate(shares, start=100)), 4) == set()
    assert split_share(shares[2])[0] == 3 and len(split_share(shares[2])[1]) == 13
    assert combine_shares(shares) == secret


@pytest.mark.parametrize("n, t, bad", [
    (5, 3, {1}), (7, 4, {6}), (9, 5, {0, 4}), (10, 4, {2, 5, 9})],
    ids=["5-of-3", "7-of-4", "two-of-9", "three-of-10"])
def test_wrong_shares_are_located_as_long_as_the_others_outvote_them(n, t, bad):
    """Up to (n - t) // 2 wrong shares (random values, or one bit of one chunk): exactly
    their holders; Flower combines the others to the secret, and all of them to
    something else."""
    secret = RNG.randbytes(32)
    shares = create_shares(secret, t, n)
    sent = {h: (s[:4] + RNG.randbytes(len(s) - 4) if h % 2 else wrong(s, chunk=2, bit=h))
            if h in bad else s for h, s in enumerate(shares)}
    assert bad_holders(sent, t) == bad
    assert combine_shares([s for h, s in sent.items() if h not in bad]) == secret
    try:  # Flower alone: a wrong secret, or none
        combined = combine_shares(list(sent.values()))
    except ValueError:
        combined = None
    assert combined != secret


def test_too_many_wrong_shares_are_undecidable_and_malformed_ones_are_named():
    secret = RNG.randbytes(16)
    shares = create_shares(secret, 3, 5)  # (5 - 3) // 2 = 1 wrong share can be placed
    two = {h: wrong(s) if h in (0, 1) else s for h, s in enumerate(shares)}
    with pytest.raises(UndecidableShares, match="more than 1 of 5 shares"):
        bad_holders(two, 3)
    assert bad_holders({0: shares[0], 1: shares[1], 2: wrong(shares[2])}, 3) == set()
    short = {**dict(enumerate(shares)), 1: shares[1][:-16]}
    assert bad_holders(short, 3) == {1}
    copied = {**dict(enumerate(shares)), 4: shares[0]}  # a share relabelled as another's
    assert bad_holders(copied, 3) == {0, 4}
    zero = {**dict(enumerate(shares)), 2: bytes(4) + shares[2][4:]}
    assert bad_holders(zero, 3) == {2}
    with pytest.raises(ValueError, match="threshold 0 must be at least 1"):
        bad_holders(dict(enumerate(shares)), 0)


def unmask_reply(holder: int, shares: dict[int, bytes]) -> Message:
    """Node ``holder``'s unmask reply: its shares of each owner's secret."""
    request = Message(RecordDict(), dst_node_id=holder, message_type=MessageType.TRAIN)
    content = RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({
        Key.NODE_ID_LIST: list(shares), Key.SHARE_LIST: list(shares.values())})})
    return Message(content, reply_to=request)


def test_a_holder_wrong_for_one_owner_only_takes_that_owner_out_with_it():
    """Node 1003 returns a wrong share of node 1001's secret only: SecAgg+ cannot tell
    whether 1001 dealt it wrong or 1003 returned it wrong, so both leave the run; node
    1003 is the one named in the round's record. Honest shares refuse nothing."""
    secrets = {owner: create_shares(RNG.randbytes(32), 3, 5) for owner in (1000, 1001)}
    holders = range(1000, 1005)
    partitions = SimpleNamespace(partition_of=lambda cid: int(cid) - 1000)
    grid = ScreeningGrid(None, SimpleNamespace(pipeline=SimpleNamespace(registry=partitions)),
                         None, 3)
    grid.threshold = 3
    honest = [unmask_reply(h, {o: s[h - 1000] for o, s in secrets.items()}) for h in holders]
    grid.check_shares(honest)
    assert grid.rejected == []
    lied = [unmask_reply(h, {o: wrong(s[h - 1000]) if (h, o) == (1003, 1001) else s[h - 1000]
                             for o, s in secrets.items()}) for h in holders]
    with pytest.raises(RoundRefused) as refusal:
        grid.check_shares(lied)
    assert sorted(refusal.value.excluded) == ["1001", "1003"]
    assert "dealt wrong by it, or returned wrong by node 1003" in refusal.value.excluded["1001"]
    assert grid.rejected == [{"node": "1003", "partition": 3, "reason": (
        "its unmask shares of the secrets of node(s) [1001] disagree with the other holders' "
        "(off the polynomial they agree on)")}]
