"""Verifiable shares of SecAgg+'s secrets (common/verifiable_shares.py) and the server's
verdicts on them (fedefc_server/share_check.py; docs/THREAT-MODEL.md, "A lying
dealer"), against the polynomial recovered from the shares by other means (a
Vandermonde system solved over Z_q here), PyCryptodome's points and Flower's own
channel encryption."""

from __future__ import annotations

import importlib
import itertools
import os
import random

import pytest
from Crypto.PublicKey.ECC import EccPoint
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    encrypt,
    generate_shared_key,
)
from flwr.common.secure_aggregation.secaggplus_constants import Key
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat
from flwr.supercore.primitives.asymmetric import (
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)

from common.faults import off_by_one
from common.share_evidence import channel_proof, proven_channel_key, sign_deal
from common.verifiable_shares import (
    COMMITMENTS,
    PATCHED,
    Q,
    SIGNATURES,
    ShareError,
    combine,
    deal,
    deal_for_flower,
    dealing,
    read_share,
    verify,
    verify_batch,
)
from fedefc_server import secure_round  # noqa: F401  (installs the shares, as the app does)
from fedefc_server.share_check import (
    bad_commitments,
    bad_signatures,
    judge_complaint,
    judge_unopened,
    wrong_returned,
    wrong_shares,
)

RNG = random.Random(47)
HOLDERS = [1000, 1001, 1002, 1003, 1004]


def coefficients_from(shares: list[bytes], t: int) -> list[int]:
    """The coefficients a_0..a_{t-1} of the polynomial through the first t shares,
    from their Vandermonde system solved by Gauss-Jordan elimination modulo q."""
    rows = []
    for share in shares[:t]:
        x, y, _ = read_share(share)
        rows.append([pow(x, j, Q) for j in range(t)] + [y])
    for col in range(t):
        pivot = next(r for r in range(col, t) if rows[r][col])
        rows[col], rows[pivot] = rows[pivot], rows[col]
        inv = pow(rows[col][col], -1, Q)
        rows[col] = [v * inv % Q for v in rows[col]]
        for r in range(t):
            if r != col and rows[r][col]:
                factor = rows[r][col]
                rows[r] = [(a - factor * b) % Q for a, b in zip(rows[r], rows[col])]
    return [row[t] for row in rows]


def points_of(commitment: bytes) -> list[EccPoint]:
    t = int.from_bytes(commitment[:2], "big")
    return [EccPoint(int.from_bytes(commitment[i:i + 32], "big"),
                     int.from_bytes(commitment[i + 32:i + 64], "big"), "p256")
            for i in range(2, 2 + 64 * t, 64)]


@pytest.mark.parametrize("t", [1, 3, 4])
def test_the_commitment_commits_to_the_polynomial_the_shares_lie_on(t):
    """The points are a_j G for the coefficients the shares determine (solved here from
    t shares), every other share lies on that polynomial, and f(0) opens the secret."""
    secret = os.urandom(306)  # the length of Flower's sk1 PEM
    commitment, shares = deal(secret, t, HOLDERS)
    a = coefficients_from(shares, t)
    generator = EccPoint(0x6B17D1F2E12C4247F8BCE6E563A440F277037D812DEB33A0F4A13945D898C296,
                         0x4FE342E2FE1A7F9B8EE7EB4A7C0F9E162BCE33576B315ECECBB6406837BF51F5,
                         "p256")  # FIPS 186-4's P-256 base point
    assert points_of(commitment) == [generator * coefficient for coefficient in a]
    for share in shares:
        x, y, carried = read_share(share)
        assert y == sum(c * pow(x, j, Q) for j, c in enumerate(a)) % Q
        assert carried == commitment
    assert all(verify(share, commitment, x) is None for share, x in zip(shares, HOLDERS))


def test_any_threshold_of_shares_combine_to_the_secret_and_fewer_do_not():
    secret = os.urandom(32)
    _, shares = deal(secret, 3, HOLDERS)
    for subset in itertools.combinations(shares, 3):
        assert combine(list(subset)) == secret
    assert combine(shares) == secret
    with pytest.raises(ShareError, match="2 distinct share"):
        combine(shares[:2])
    with pytest.raises(ShareError, match="2 distinct share"):
        combine([shares[0], shares[0], shares[1]])


def test_feldmans_check_refuses_every_share_off_the_committed_polynomial():
    commitment, shares = deal(os.urandom(32), 3, HOLDERS)
    other, _ = deal(os.urandom(32), 3, HOLDERS)
    x, y, _ = read_share(shares[0])
    assert verify(off_by_one(shares[0]), commitment, 1000) == (
        "it fails its dealer's commitment (Feldman's check)")
    for _ in range(20):  # any other value
        value = RNG.randrange(Q)
        if value != y:
            assert verify(x.to_bytes(8, "big") + value.to_bytes(32, "big") + commitment,
                          commitment, 1000) is not None
    assert verify(shares[1], commitment, 1000) == (
        "its index 1001 is not its holder's node id 1000")
    assert verify(shares[0], other, 1000) == "it carries another commitment than the dealer's"
    broken = commitment[:2] + bytes(range(64)) + commitment[66:]
    assert verify(shares[0], broken, 1000) == "a commitment point is not on P-256"
    assert verify(b"short", commitment, 1000) == "a share is too short"


def test_flowers_sharing_and_combining_are_the_verifiable_ones():
    """Both apps install the shares into the two Flower modules that call Shamir's
    functions; dealing outside :func:`dealing` (no holders known) fails loudly."""
    (client, _), (server, _) = PATCHED  # by module path: the packages export functions
    assert importlib.import_module(client).create_shares is deal_for_flower
    assert importlib.import_module(server).combine_shares is combine
    with pytest.raises(RuntimeError, match="outside fedefc's dealing"):
        deal_for_flower(b"seed", 2, 3)
    with dealing(HOLDERS[:3]) as made:
        shares = deal_for_flower(b"seed" * 8, 2, 3)
    assert [read_share(s)[0] for s in shares] == HOLDERS[:3] and len(made) == 1
    assert verify(shares[2], made[0], 1002) is None


def channel(holder_keys, dealer_keys) -> bytes:
    return generate_shared_key(dealer_keys[0], holder_keys[1])


def test_a_provable_complaint_names_the_dealer_or_the_false_complainer():
    """The server opens the dealer's ciphertext it relayed with the complaint's key
    (Flower's Fernet channel): shares failing the dealer's commitments name the dealer;
    shares that pass name the holder; a key that does not open them names the holder."""
    holder, dealer = generate_key_pairs(), generate_key_pairs()
    key = channel(holder, dealer)
    commitments, dealt = zip(*(deal(os.urandom(n), 3, HOLDERS) for n in (32, 306)))
    honest = encrypt(key, share_keys_plaintext_concat(1001, 1000, dealt[0][0], dealt[1][0]))
    lying = encrypt(key, share_keys_plaintext_concat(1001, 1000, dealt[0][0],
                                                     off_by_one(dealt[1][0])))
    culprit, reason = judge_complaint(1000, 1001, key, lying, list(commitments))
    assert culprit == 1001 and reason == ("it dealt node 1000 a share of sk1 that fails its "
                                          "dealer's commitment (Feldman's check)")
    culprit, reason = judge_complaint(1000, 1001, key, honest, list(commitments))
    assert culprit == 1000 and reason.endswith("a false complaint")
    other = channel(generate_key_pairs(), dealer)
    culprit, reason = judge_complaint(1000, 1001, other, lying, list(commitments))
    assert culprit == 1000 and "does not open them" in reason
    assert judge_complaint(1000, 1001, key, None, list(commitments))[0] == 1000


def test_the_server_checks_each_returned_share_and_each_commitment():
    """An unmask reply's shares: b's commitment for the nodes the request calls active,
    sk1's for the dropped; a holder's own share of another owner, or one off the
    polynomial, is wrong. A share-keys reply must carry two commitments of the round's
    threshold."""
    dealings = {owner: [deal(os.urandom(n), 3, HOLDERS) for n in (32, 306)]
                for owner in HOLDERS}
    commitments = {o: [c for c, _ in d] for o, d in dealings.items()}
    share = {o: [s[HOLDERS.index(1002)] for _, s in d] for o, d in dealings.items()}
    request = {Key.ACTIVE_NODE_ID_LIST: [1000, 1001], Key.DEAD_NODE_ID_LIST: [1003]}
    reply = {Key.NODE_ID_LIST: [1000, 1001, 1003],
             Key.SHARE_LIST: [share[1000][0], share[1001][0], share[1003][1]]}
    assert wrong_shares(request, reply, 1002, commitments) == {}
    reply[Key.SHARE_LIST] = [share[1000][1], off_by_one(share[1001][0]), share[1003][1]]
    assert wrong_shares(request, reply, 1002, commitments) == {
        1000: "its share of node 1000's b carries another commitment than the dealer's",
        1001: "its share of node 1001's b fails its dealer's commitment (Feldman's check)"}
    assert bad_commitments(commitments[1000], 3) is None
    assert "has 3 point(s), not the round's threshold 4" in bad_commitments(
        commitments[1000], 4)
    assert bad_commitments([commitments[1000][0]], 3) == (
        "share-keys reply without its two commitments")
    assert "unreadable" in bad_commitments([b"\x00", b"\x00"], 3)


def test_a_commitment_at_infinity_or_sealing_another_length_is_refused_at_share_time():
    """Issue 58: a commitment of points at infinity (all zeros: the key 0, which opens
    the sealed secret for anyone) was read as well formed, and an empty sealed secret
    crashed the unmask step. Both are refused as the share-keys reply arrives, as is a
    seed of another length than SecAgg+'s 32 bytes."""
    sk1 = deal(os.urandom(306), 3, HOLDERS)[0]
    infinity = (3).to_bytes(2, "big") + bytes(3 * 64) + os.urandom(32)
    assert bad_commitments([infinity, sk1], 3) == (
        "share-keys reply whose commitment to b is unreadable (a commitment point is the "
        "point at infinity (a coefficient 0))")
    for seed, sealed in ((b"", 0), (os.urandom(16), 16)):
        assert bad_commitments([deal(seed, 3, HOLDERS)[0], sk1], 3) == (
            f"share-keys reply whose commitment to b seals {sealed} bytes, not the 32 of a "
            "SecAgg+ b")
    assert bad_commitments([deal(os.urandom(32), 3, HOLDERS)[0], sk1], 3) is None


def flower_keys():
    """A SecAgg+ second key pair as Flower's client keeps it: (sk2 bytes, pk2 bytes, the
    private key object)."""
    sk, pk = generate_key_pairs()
    return private_key_to_bytes(sk), public_key_to_bytes(pk), sk


def test_a_holder_proves_its_channel_key_without_giving_its_private_key():
    """The proof gives the server exactly Flower's channel key of the two nodes
    (``generate_shared_key``, the truth), and nothing when a byte of it is changed, when
    it is checked against another dealer's key, or when it is someone else's."""
    holder, dealer, other = flower_keys(), flower_keys(), flower_keys()
    proof = channel_proof(holder[0], holder[1], dealer[1])
    truth = generate_shared_key(holder[2], dealer[2].public_key())
    assert proven_channel_key(proof, holder[1], dealer[1]) == truth
    for i in (0, 100, 150, len(proof) - 1):
        changed = bytearray(proof)
        changed[i] ^= 1
        assert proven_channel_key(bytes(changed), holder[1], dealer[1]) is None
    assert proven_channel_key(proof, holder[1], other[1]) is None
    assert proven_channel_key(proof, other[1], dealer[1]) is None
    assert proven_channel_key(proof[:-1], holder[1], dealer[1]) is None


def test_a_complaint_that_shares_do_not_open_names_the_dealer_or_the_false_complainer():
    """Issue 58 (3): shares that did not open were an unprovable complaint, and the
    dealer went unnamed. With a proof of the channel's key the server sees whether the
    ciphertext the dealer signed opens: random bytes name the dealer; a ciphertext that
    opens, or a proof that fails, names the holder."""
    holder, dealer = flower_keys(), flower_keys()
    keys = {1000: holder[1], 1001: dealer[1]}
    key = generate_shared_key(holder[2], dealer[2].public_key())
    proof = channel_proof(holder[0], holder[1], dealer[1])
    sealed = encrypt(key, share_keys_plaintext_concat(1001, 1000, b"b", b"sk1"))
    culprit, reason = judge_unopened(1000, 1001, proof, os.urandom(len(sealed)), keys)
    assert culprit == 1001 and reason == ("it dealt node 1000 encrypted shares that do not "
                                          "open under their channel's key (the holder "
                                          "proved the key)")
    culprit, reason = judge_unopened(1000, 1001, proof, sealed, keys)
    assert culprit == 1000 and reason.endswith("a false complaint")
    culprit, reason = judge_unopened(1000, 1001, proof[::-1], os.urandom(len(sealed)), keys)
    assert culprit == 1000 and "proves no key" in reason


def test_the_server_checks_that_the_dealer_signed_each_holders_shares():
    """A share-keys reply carries its dealer's signature (its setup key sk2) of each
    holder's ciphertext with its two commitments: a missing signature, a ciphertext or
    commitment changed after signing, or another node's key fails."""
    dealer, other = flower_keys(), flower_keys()
    commitments = [deal(os.urandom(n), 3, HOLDERS)[0] for n in (32, 306)]
    texts = [os.urandom(40), os.urandom(40)]
    record = {Key.DESTINATION_LIST: [1000, 1002], Key.CIPHERTEXT_LIST: texts,
              COMMITMENTS: commitments,
              SIGNATURES: [sign_deal(dealer[0], 1001, d, t, commitments)
                           for d, t in zip([1000, 1002], texts)]}
    assert bad_signatures(record, 1001, dealer[1]) is None
    assert bad_signatures(record, 1001, other[1]) == (
        "share-keys reply whose shares for node 1000 carry no signature of its dealer's "
        "setup key")
    assert "for node 1002" in bad_signatures(
        {**record, Key.CIPHERTEXT_LIST: [texts[0], os.urandom(40)]}, 1001, dealer[1])
    assert bad_signatures({**record, COMMITMENTS: commitments[::-1]}, 1001, dealer[1])
    assert bad_signatures({**record, SIGNATURES: record[SIGNATURES][:1]}, 1001,
                          dealer[1]) == "share-keys reply without one signature per destination"


def test_the_returned_shares_checked_in_batches_name_exactly_whom_one_by_one_names():
    """Issue 58: the server checked every returned share on its own, about n^2 t point
    multiplications a round (3.3 CPU s at 20 nodes). Each owner's shares are now checked
    at once (``verify_batch``); a batch that fails sends its holders to the one-by-one
    check, so the verdict is the same (the truth: ``wrong_shares`` of every holder),
    whether every share is right, one is off its polynomial, another holder's, or of a
    node that dealt none."""
    dealings = {owner: deal(os.urandom(32), 3, HOLDERS) for owner in HOLDERS}
    commitments = {o: [c, c] for o, (c, _) in dealings.items()}
    request = {Key.ACTIVE_NODE_ID_LIST: HOLDERS, Key.DEAD_NODE_ID_LIST: []}

    def returned(change=lambda holder, owner, share: share):
        return {h: (request, {Key.NODE_ID_LIST: list(HOLDERS), Key.SHARE_LIST: [
            change(h, o, dealings[o][1][i]) for o in HOLDERS]}) for i, h in enumerate(HOLDERS)}

    def one_by_one(stage):
        return {h: w for h in stage if (w := wrong_shares(*stage[h], h, commitments))}

    honest = returned()
    assert wrong_returned(honest, commitments) == {} == one_by_one(honest)
    assert verify_batch([(dealings[1001][1][i], h) for i, h in enumerate(HOLDERS)],
                        commitments[1001][0])
    for stage in (returned(lambda h, o, s: off_by_one(s) if (h, o) == (1003, 1001) else s),
                  returned(lambda h, o, s: dealings[o][1][0] if (h, o) == (1002, 1004)
                           else s)):
        assert wrong_returned(stage, commitments) == one_by_one(stage) != {}
    stranger = {1002: (request, {Key.NODE_ID_LIST: [*HOLDERS, 9], Key.SHARE_LIST: [
        *honest[1002][1][Key.SHARE_LIST], b"x" * 60]})}
    assert wrong_returned(stranger, commitments) == {
        1002: {9: "it returned a share of node 9, which dealt none"}}
