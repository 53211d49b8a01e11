"""csrc/attention_decode.c: one position against a KV cache, bitwise the
forward's row, with a full cache and with a rolling one."""
import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from helpers import TOL, assert_close, assert_thread_invariant, t64
from reference import attention_gqa as ref_attention_gqa
from attention_helpers import make_gqa_inputs, tiled, windowed

DECODE_SHAPES = [  # lengths (B = len), maxT, NH, NKV, hs, slopes
    ([1, 23, 7, 16], 23, 8, 1, 16, None),       # multi-query; len 1 and len maxT
    ([1, 23, 7, 16], 23, 8, 1, 16, "alibi"),
    ([5, 64, 33], 64, 12, 4, 64, None),         # a Llama-like layer
    ([5, 64, 33], 64, 12, 4, 64, "alibi"),
    ([3, 1, 13], 13, 6, 6, 15, None),           # NKV == NH; hs = 15
    ([3, 1, 13], 13, 6, 6, 15, "alibi"),        # and NH = 6 slopes
    ([40, 17], 40, 4, 2, 16, "steep"),          # far keys' weights underflow to 0
    ([1], 1, 2, 1, 8, "alibi"),                 # maxT = 1
    ([9, 70, 96], 96, 16, 8, 128, None),        # Qwen3's heads: 2 a kv head, 2 chunks of hs
]


def make_decode_case(rng, lengths, maxT, NH, NKV, hs, slopes):
    """Full sequences qkv[B,maxT,...] and the decode inputs for lengths: row b's
    query at position lengths[b] - 1, its keys and values cached; the cache
    past lengths[b] holds NaN, which must never be read."""
    B = len(lengths)
    qkv, _, slopes = make_gqa_inputs(rng, B, maxT, NH, NKV, hs, slopes)
    lengths = np.array(lengths, np.int32)
    q = qkv[np.arange(B), lengths - 1, :NH * hs].copy()
    k_cache = qkv[:, :, NH * hs:(NH + NKV) * hs].copy()
    v_cache = qkv[:, :, (NH + NKV) * hs:].copy()
    for b, n in enumerate(lengths):
        k_cache[b, n:] = np.nan
        v_cache[b, n:] = np.nan
    return qkv, slopes, (q, k_cache, v_cache, lengths)


def decode(q, k_cache, v_cache, lengths, slopes, NH, NKV):
    B, maxT, _ = k_cache.shape
    out = np.full(q.shape, np.nan, np.float32)   # (written): must not be read
    att = np.full((B, NH, maxT), np.nan, np.float32)
    K.attention_decode(out, att, q, k_cache, v_cache, lengths, slopes, NH, NKV)
    return out, att


@pytest.mark.parametrize("lengths,maxT,NH,NKV,hs,slopes", DECODE_SHAPES)
def test_attention_decode_matches_forward_row(rng, isa, lengths, maxT, NH, NKV, hs, slopes):
    qkv, slopes, cache = make_decode_case(rng, lengths, maxT, NH, NKV, hs, slopes)
    out, att = decode(*cache, slopes, NH, NKV)
    full_out, _, full_att = tiled(qkv, slopes, NH, NKV)
    ref_out, _ = ref_attention_gqa(t64(qkv), NH, NKV, None if slopes is None else t64(slopes))

    tol = TOL["attention_decode"]
    for b, n in enumerate(lengths):
        assert_close(f"out[{b}]", out[b], full_out[b, n - 1], tol["fwd"])
        assert_close(f"att[{b}]", att[b, :, :n], full_att[b, :, n - 1, :n], tol["fwd"])
        assert np.isnan(att[b, :, n:]).all(), f"att[{b}] written past len = {n}"
        # and on its own against the float64 reference
        assert_close(f"out[{b}] vs reference", out[b], ref_out[b, n - 1],
                     TOL["attention_gqa"]["fwd"])


def test_attention_decode_thread_invariant(rng, isa, set_threads):
    # B * NH = 15 (b, h) pairs: uneven over 2 and over 3 threads
    _, slopes, cache = make_decode_case(rng, [9, 2, 30], 30, 5, 1, 16, "alibi")

    def run():
        out, att = decode(*cache, slopes, 5, 1)
        return {"out": out, "att": np.nan_to_num(att)}   # the NaN past len are not written
    assert_thread_invariant(set_threads, run, counts=(1, 2, 3))


@pytest.mark.parametrize("bad_len", [0, -1, 8])
def test_attention_decode_rejects_length_out_of_range(rng, bad_len):
    _, _, (q, k_cache, v_cache, lengths) = make_decode_case(rng, [3, 7], 7, 4, 2, 8, None)
    lengths[1] = bad_len                                      # maxT = 7
    with pytest.raises(llmc_py.RangeError, match="attention_decode"):
        decode(q, k_cache, v_cache, lengths, None, 4, 2)


def test_attention_decode_rejects_heads_not_dividing(rng):
    _, _, cache = make_decode_case(rng, [3, 7], 7, 6, 6, 8, None)
    with pytest.raises(llmc_py.ShapeError, match="NH=6 is not a multiple of NKV=4"):
        K.attention_decode(np.zeros((2, 48), np.float32), np.zeros((2, 6, 7), np.float32),
                           cache[0], cache[1][..., :32].copy(), cache[2][..., :32].copy(),
                           cache[3], None, 6, 4)


@pytest.mark.parametrize("bad", ["out", "att", "q", "v_cache", "lengths", "slopes"])
def test_attention_decode_rejects_wrong_shape(rng, bad):
    _, slopes, (q, k_cache, v_cache, lengths) = make_decode_case(rng, [3, 7], 7, 4, 2, 8,
                                                                 "alibi")
    args = dict(out=np.zeros_like(q), att=np.zeros((2, 4, 7), np.float32), q=q,
                k_cache=k_cache, v_cache=v_cache, lengths=lengths, slopes=slopes, NH=4, NKV=2)
    args[bad] = args[bad][..., :-1].copy()
    with pytest.raises(llmc_py.ShapeError, match=bad):
        K.attention_decode(**args)


def test_attention_decode_rejects_wrong_lengths_dtype(rng):
    _, _, (q, k_cache, v_cache, lengths) = make_decode_case(rng, [3, 7], 7, 4, 2, 8, None)
    with pytest.raises(TypeError, match="lengths"):
        decode(q, k_cache, v_cache, lengths.astype(np.int64), None, 4, 2)


@pytest.mark.parametrize("T,NH,NKV,hs,slopes", [
    (37, 6, 2, 24, "alibi"),   # T not a multiple of any tile; hs = 24
    (21, 4, 1, 15, "alibi"),   # multi-query; hs = 15
    (19, 12, 4, 64, None),     # a Llama-like head
    (40, 4, 2, 16, "steep"),   # far keys' weights underflow to 0
    (1, 2, 1, 8, "alibi"),     # T = 1
])
def test_attention_decode_equals_forward_row_bitwise(rng, isa, T, NH, NKV, hs, slopes):
    # the first, second, middle and last two positions, each a row of the batch;
    # att: the decode's softmax against attention_gqa_probs' recomputation
    positions = sorted({0, 1, T // 2, T - 2, T - 1} & set(range(T)))
    lengths = [t + 1 for t in positions]
    qkv, slopes, cache = make_decode_case(rng, lengths, T, NH, NKV, hs, slopes)
    out, att = decode(*cache, slopes, NH, NKV)
    full_out, _, full_att = tiled(qkv, slopes, NH, NKV)
    bits = lambda x: np.ascontiguousarray(x).view(np.uint32)   # -0.0 != 0.0 too
    for b, n in enumerate(lengths):
        assert np.array_equal(bits(out[b]), bits(full_out[b, n - 1])), f"out at t = {n - 1}"
        assert np.array_equal(bits(att[b, :, :n]), bits(full_att[b, :, n - 1, :n])), \
            f"att at t = {n - 1}"


# ---- a rolling cache (a sliding window) -------------------------------------


def ring_cache(qkv, NH, NKV, hs, t, window, slots):
    """The decode inputs of query position t of every row of qkv with a
    rolling cache of ``slots`` slots: position p in slot p % slots for the
    window's positions; the other slots hold NaN, which must not be read."""
    B = qkv.shape[0]
    k_cache = np.full((B, slots, NKV * hs), np.nan, np.float32)
    v_cache = np.full_like(k_cache, np.nan)
    for p in range(max(0, t - window + 1), t + 1):
        k_cache[:, p % slots] = qkv[:, p, NH * hs:(NH + NKV) * hs]
        v_cache[:, p % slots] = qkv[:, p, (NH + NKV) * hs:]
    q = qkv[:, t, :NH * hs].copy()
    return q, k_cache, v_cache, np.full(B, t + 1, np.int32)


@pytest.mark.parametrize("T,NH,NKV,hs,slopes,window,slots", [
    (40, 4, 2, 24, "alibi", 7, 7),      # the ring of exactly the window wraps
    (40, 4, 1, 15, None, 16, 16),
    (45, 6, 2, 64, "steep", 9, 12),     # a ring larger than the window
    (20, 2, 2, 8, "alibi", 1, 1),       # one slot: each position sees itself
    (33, 4, 4, 32, None, 40, 40),       # a window longer than the sequence
])
def test_attention_decode_with_a_rolling_cache_equals_forward_bitwise(
        rng, isa, T, NH, NKV, hs, slopes, window, slots):
    qkv, _, slopes = make_gqa_inputs(rng, 2, T, NH, NKV, hs, slopes)
    full_out, _, full_att = windowed(qkv, slopes, NH, NKV, window)
    bits = lambda x: np.ascontiguousarray(x).view(np.uint32)
    for t in range(T):
        q, k_cache, v_cache, lengths = ring_cache(qkv, NH, NKV, hs, t, window, slots)
        out = np.full(q.shape, np.nan, np.float32)
        att = np.full((2, NH, slots), np.nan, np.float32)
        K.attention_decode(out, att, q, k_cache, v_cache, lengths, slopes, NH, NKV, window)
        lo = max(0, t - window + 1)
        assert np.array_equal(bits(out), bits(full_out[:, t])), f"out at t = {t}"
        assert np.array_equal(bits(att[:, :, :t + 1 - lo]), bits(full_att[:, :, t, lo:t + 1])), \
            f"att at t = {t}"


def test_attention_decode_rejects_a_window_longer_than_the_ring(rng):
    qkv, _, _ = make_gqa_inputs(rng, 1, 12, 2, 1, 8)
    q, k_cache, v_cache, lengths = ring_cache(qkv, 2, 1, 8, 11, 6, 6)
    out, att = np.zeros_like(q), np.zeros((1, 2, 5), np.float32)
    with pytest.raises(llmc_py.RangeError, match="attention_decode"):   # 6 keys, 5 slots
        K.attention_decode(out, att, q, k_cache[:, :5].copy(), v_cache[:, :5].copy(), lengths,
                           None, 2, 1, 6)
