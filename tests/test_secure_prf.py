"""SecAgg+'s masks from a full-entropy PRF (common/secure_prf.py; docs/PRIVACY.md,
"The masks"): Flower's generator folds every seed to 32 bits (flwr#7522); ours keys
ChaCha20 with SHA-256 of the whole seed, in both apps, and the secure sum still decodes
to the plain one."""

import hashlib
import importlib
import struct

import numpy as np
import pytest
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation import secaggplus_utils

from common import secure_prf
from fedefc_client.client_app import app as client_app
from fedefc_server.failures import NodeFailed
from tests.helpers import InProcessGrid, RoundDriver
from tests.test_privacy import micro_config, secure_round, server

CLIENT_MOD = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
WORKFLOW = importlib.import_module("flwr.server.workflow.secure_aggregation.secaggplus_workflow")
SHAPES = [(3, 4), (5,), ()]


def folded_twin(seed: bytes) -> bytes:
    """Another seed whose 4-byte words XOR to the same 32 bits as ``seed``'s: words 0 and
    1 both flipped by one mask (a difference only above bit 32)."""
    flip = b"\x5a\xc3\x0f\xf0"
    twin = bytearray(seed)
    for word in (0, 1):
        for i in range(4):
            twin[4 * word + i] ^= flip[i]
    return bytes(twin)


def test_flowers_folding_gives_two_seeds_one_mask_and_ours_does_not():
    """The upstream bug, shown on Flower's own function, and gone from the generator that
    Flower's client mod and server workflow call once the apps are imported."""
    seed = hashlib.sha256(b"a private mask seed").digest()
    twin = folded_twin(seed)
    assert twin != seed
    flower = [secaggplus_utils.pseudo_rand_gen(s, 2**32, SHAPES) for s in (seed, twin)]
    assert all(np.array_equal(a, b) for a, b in zip(*flower))  # the 32-bit folding
    for module in (CLIENT_MOD, WORKFLOW):
        ours = [module.pseudo_rand_gen(s, 2**32, SHAPES) for s in (seed, twin)]
        assert not np.array_equal(ours[0][0], ours[1][0]), module.__name__
        assert not np.array_equal(ours[0][0], flower[0][0])
    assert secure_prf.installed()


def test_the_prf_is_a_pure_function_of_every_bit_of_the_seed():
    seed = bytes(range(32))
    first = secure_prf.pseudo_rand_gen(seed, 2**32, [(4096,)])[0]
    np.testing.assert_array_equal(first, secure_prf.pseudo_rand_gen(seed, 2**32, [(4096,)])[0])
    for bit in (0, 31, 32, 63, 64, 128, 200, 255):
        other = bytearray(seed)
        other[bit // 8] ^= 1 << (bit % 8)
        flipped = secure_prf.pseudo_rand_gen(bytes(other), 2**32, [(4096,)])[0]
        # independent streams: about half of the 32 x 4096 bits differ, and a value
        # agrees with its counterpart about once in 2**32
        differing = np.unpackbits((first ^ flipped).astype("<u4").view(np.uint8)).mean()
        assert 0.48 < differing < 0.52, bit
        assert np.count_nonzero(first == flipped) <= 1, bit
    # a 44-byte seed (Flower's pairwise keys are base64 text) counts whole too
    key = b"A" * 44
    assert not np.array_equal(secure_prf.pseudo_rand_gen(key, 2**32, [(64,)])[0],
                              secure_prf.pseudo_rand_gen(key[:-1] + b"B", 2**32, [(64,)])[0])


def test_the_masks_have_flowers_shapes_and_dtype_and_cover_the_whole_range():
    arrays = secure_prf.pseudo_rand_gen(b"k" * 32, 2**32, SHAPES)
    assert [a.shape for a in arrays] == SHAPES and all(a.dtype == np.int64 for a in arrays)
    # one stream over the arrays, in order
    flat = secure_prf.pseudo_rand_gen(b"k" * 32, 2**32, [(18,)])[0]
    np.testing.assert_array_equal(np.concatenate([a.ravel() for a in arrays]), flat)
    small = secure_prf.pseudo_rand_gen(b"k" * 32, 2**4, [(160_000,)])[0]
    counts = np.bincount(small, minlength=16)
    assert small.min() == 0 and small.max() == 15 and len(counts) == 16  # 15 = m - 1 too
    expected = len(small) / 16  # chi-square, 15 degrees of freedom: 37.7 is p = 0.001
    assert ((counts - expected) ** 2 / expected).sum() < 37.7
    full = secure_prf.pseudo_rand_gen(b"k" * 32, 2**32, [(100_000,)])[0]
    assert 0 <= full.min() and full.max() < 2**32 and full.max() > 2**32 * 0.99
    for bad in (0, 3, 2**33, 2**32 + 1):
        with pytest.raises(ValueError, match="power of two"):
            secure_prf.pseudo_rand_gen(b"k" * 32, bad, SHAPES)


# -- a known answer: ChaCha20 (RFC 8439) written out here, independent of `cryptography`
def _quarter(s, a, b, c, d):
    def rotl(v, n):
        return ((v << n) | (v >> (32 - n))) & 0xFFFFFFFF
    s[a] = (s[a] + s[b]) & 0xFFFFFFFF
    s[d] = rotl(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & 0xFFFFFFFF
    s[b] = rotl(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b]) & 0xFFFFFFFF
    s[d] = rotl(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & 0xFFFFFFFF
    s[b] = rotl(s[b] ^ s[c], 7)


def chacha20_block(key: bytes, counter: int, nonce: bytes) -> list[int]:
    """RFC 8439 §2.3: one 64-byte block as 16 little-endian words."""
    init = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574, *struct.unpack("<8I", key),
            counter, *struct.unpack("<3I", nonce)]
    s = list(init)
    for _ in range(10):
        for q in ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
                  (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14)):
            _quarter(s, *q)
    return [(x + y) & 0xFFFFFFFF for x, y in zip(s, init)]


def test_the_reference_chacha20_gives_rfc_8439s_first_test_vector():
    """RFC 8439 Appendix A.1, test vector #1: key, nonce and counter all zero."""
    block = struct.pack("<16I", *chacha20_block(bytes(32), 0, bytes(12)))
    assert block.hex() == (
        "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
        "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586")


def test_the_masks_are_chacha20_keyed_by_sha256_of_the_domain_and_the_seed():
    seed = bytes(range(100, 132))
    key = hashlib.sha256(b"fedefc/secagg+/mask/v1\x00" + seed).digest()
    # cryptography's 16-byte ChaCha20 nonce is RFC 8439's 32-bit counter + 96-bit nonce
    words = chacha20_block(key, 0, bytes(12)) + chacha20_block(key, 1, bytes(12))
    masks = secure_prf.pseudo_rand_gen(seed, 2**32, [(20,)])[0]
    assert masks.tolist() == words[:20]
    low = secure_prf.pseudo_rand_gen(seed, 2**10, [(20,)])[0]
    assert low.tolist() == [w & 1023 for w in words[:20]]


def test_a_secure_round_decodes_the_plain_sum_with_the_new_masks(micro_mnist_dir, tmp_path,
                                                                 monkeypatch):
    """Five clients, one failing in training: the server removes four private masks and
    reconstructs the failed client's pairwise masks, all from the new PRF (counted on each
    side), and the sum is FedAvg's of the four others within the quantization step."""
    calls = {"client": 0, "server": 0}

    def counted(side):
        def gen(seed, num_range, shapes):
            calls[side] += 1
            return secure_prf.pseudo_rand_gen(seed, num_range, shapes)
        return gen

    monkeypatch.setattr(CLIENT_MOD, "pseudo_rand_gen", counted("client"))
    monkeypatch.setattr(WORKFLOW, "pseudo_rand_gen", counted("server"))
    flat = micro_config(micro_mnist_dir, tmp_path / "s", 5, **{"secure-aggregation": True,
                                                               "faults": "raise@4@1"})
    fields, params = secure_round(flat, InProcessGrid(client_app, flat, 5))
    assert fields["partition_ids"] == [0, 1, 2, 3] and fields["failures"] == 1
    # each of the 4 masking clients: its private mask and one pairwise mask per other
    # client that shared keys (4); the server: 4 private masks, the failed one's 4 pairs
    assert calls == {"client": 4 * (1 + 4), "server": 4 + 4}
    # the plain reference: the same round without secure aggregation, the same failure
    plain = micro_config(micro_mnist_dir, tmp_path / "p", 5, faults="raise@4@1")
    grid = InProcessGrid(client_app, plain, 5)
    cfg, pipeline, mgr, init = server(plain, grid)
    ref_strategy = RoundDriver(pipeline)
    instructions = ref_strategy.configure_fit(1, ndarrays_to_parameters(init), mgr)
    results, failures = [], []
    for proxy, ins in instructions:
        try:
            results.append((proxy, proxy.fit(ins, None, 1)))
        except NodeFailed as err:  # the round's proxy names a failed client
            failures.append(err)
    ref_params, _ = ref_strategy.aggregate_fit(1, results, failures)
    ref = ref_strategy.fields()
    assert ref["partition_ids"] == [0, 1, 2, 3]
    assert fields["A"] == pytest.approx(ref["A"], abs=1e-6)
    for got, want in zip(parameters_to_ndarrays(params), parameters_to_ndarrays(ref_params)):
        np.testing.assert_allclose(got, want, atol=2e-5)
