"""csrc/attention_probs.c: the probabilities and the row entropies of the
tiled attention, recomputed from its statistics, against its forward and
the float64 reference."""
import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from helpers import TOL, assert_close, assert_thread_invariant, t64
from reference import attention_gqa as ref_attention_gqa
from reference import attention_entropy as ref_attention_entropy
from attention_helpers import (
    GQA_SHAPES, make_gqa_inputs, gqa_forward, TILE_SHAPES, probs, tiled, entropy)


@pytest.mark.parametrize("B,T,NH,NKV,hs,slopes", [
    (2, 37, 6, 2, 24, "alibi"),
    (1, 200, 4, 4, 64, None),
    (1, 150, 4, 1, 15, "steep"),
])
def test_attention_gqa_probs_are_the_forwards(rng, isa, B, T, NH, NKV, hs, slopes):
    # the probabilities recomputed from stats give out back, and each row is
    # a softmax whose statistics are plausible
    qkv, _, slopes = make_gqa_inputs(rng, B, T, NH, NKV, hs, slopes)
    out, stats, att = tiled(qkv, slopes, NH, NKV)
    v = qkv[..., (NH + NKV) * hs:].reshape(B, T, NKV, hs).transpose(0, 2, 1, 3)
    v = np.repeat(v.astype(np.float64), NH // NKV, axis=1)              # [B, NH, T, hs]
    again = (att.astype(np.float64) @ v).transpose(0, 2, 1, 3).reshape(B, T, NH * hs)
    assert_close("out from probs", out, again, TOL["attention_variant"]["fwd"])
    assert not np.triu(att, k=1).any(), "att is not exactly 0 above the diagonal"
    assert (att >= 0).all() and np.allclose(att.sum(-1, dtype=np.float64), 1.0, atol=1e-5)
    # each row: its largest probability is exp(0) * inv; inv = 1 / a sum of
    # t + 1 terms of at most 1, one of them 1
    maxval, inv = stats[..., 0], stats[..., 1]
    assert np.isfinite(maxval).all()
    assert np.array_equal(att.max(-1), inv)
    count = np.arange(1, T + 1, dtype=np.float64)
    assert ((inv > 0) & (inv <= 1) & (1.0 / inv.astype(np.float64) <= count * (1 + 1e-6))).all()
    assert (inv[:, :, 0] == 1).all() and (att[:, :, 0, 0] == 1).all()   # one key: weight 1


def test_attention_gqa_probs_thread_invariant(rng, isa, set_threads):
    qkv, _, slopes = make_gqa_inputs(rng, 3, 29, 4, 2, 24, "alibi")   # 12 (b, h) pairs
    _, stats = gqa_forward(qkv, slopes, 4, 2)
    assert_thread_invariant(set_threads, lambda: {"att": probs(qkv, stats, slopes, 4, 2)})


@pytest.mark.parametrize("bad", ["att", "stats", "slopes"])
def test_attention_gqa_probs_rejects_wrong_shape(rng, bad):
    qkv, _, slopes = make_gqa_inputs(rng, 2, 3, 4, 2, 8, "alibi")
    _, stats = gqa_forward(qkv, slopes, 4, 2)
    args = dict(att=np.zeros((2, 4, 3, 3), np.float32), inp=qkv, stats=stats, slopes=slopes,
                NH=4, NKV=2)
    args[bad] = args[bad][..., :-1].copy()
    with pytest.raises(llmc_py.ShapeError, match=bad):
        K.attention_gqa_probs(**args)


# ---- row entropies (attention_gqa_entropy) ----------------------------------


ENTROPY_SHAPES = [  # B, T, NH, NKV, hs, slopes; GQA_SHAPES and TILE_SHAPES hit the
                    # tiles' edges (T = 1, odd T, hs = 1, 15, 80, 100, multi-query)
    (1, 1024, 2, 1, 64, "alibi"),   # GPT-2's longest context; rows of 1024 keys
    (1, 1024, 2, 2, 64, "steep"),   # far keys' weights underflow to exactly 0
    (8, 128, 4, 4, 64, None),       # the default training run's attention (d4)
    (1, 64, 3, 3, 7, None),         # odd heads and head size
]


@pytest.mark.parametrize("B,T,NH,NKV,hs,slopes", GQA_SHAPES + TILE_SHAPES + ENTROPY_SHAPES)
def test_attention_gqa_entropy_matches_reference(rng, isa, B, T, NH, NKV, hs, slopes):
    qkv, _, slopes = make_gqa_inputs(rng, B, T, NH, NKV, hs, slopes)
    qkv *= 2.0   # sharper rows than unit scores give: entropies from 0 to near ln(t + 1)
    _, stats = gqa_forward(qkv, slopes, NH, NKV)
    ours = entropy(qkv, stats, slopes, NH, NKV)
    _, ref_att = ref_attention_gqa(t64(qkv), NH, NKV, None if slopes is None else t64(slopes))
    ref = ref_attention_entropy(ref_att)
    assert_close("entropy", ours, ref, TOL["attention_entropy"]["fwd"])
    # between 0 (one key) and ln(t + 1) (uniform), up to rounding
    bound = np.log(np.arange(1, T + 1, dtype=np.float64))
    assert (ours >= -1e-6).all() and (ours <= bound + 1e-5).all()
    assert (ours[:, :, 0] == 0).all(), "a row of one key has entropy 0"


def test_attention_gqa_entropy_of_known_rows():
    # q = 0: every score is 0, each row uniform: entropy ln(t + 1). Then a
    # steep ALiBi slope: each row all but one-hot on its own key: entropy ~0.
    B, T, NH, NKV, hs = 2, 70, 2, 1, 16
    qkv = np.random.default_rng(1).standard_normal((B, T, (NH + 2 * NKV) * hs),
                                                    dtype=np.float32)
    qkv[..., :NH * hs] = 0.0
    _, stats = gqa_forward(qkv, None, NH, NKV)
    uniform = np.broadcast_to(np.log(np.arange(1, T + 1)), (B, NH, T))
    assert_close("uniform rows", entropy(qkv, stats, None, NH, NKV), uniform,
                 TOL["attention_entropy"]["fwd"])
    steep = np.full(NH, 100.0, np.float32)   # the next key is e^-100 as likely
    _, stats = gqa_forward(qkv, steep, NH, NKV)
    assert np.abs(entropy(qkv, stats, steep, NH, NKV)).max() <= 1e-30


def test_attention_gqa_entropy_thread_invariant(rng, isa, set_threads):
    qkv, _, slopes = make_gqa_inputs(rng, 3, 29, 4, 2, 24, "alibi")   # 12 (b, h) pairs
    _, stats = gqa_forward(qkv, slopes, 4, 2)
    assert_thread_invariant(set_threads, lambda: {
        "entropy": entropy(qkv, stats, slopes, 4, 2)})


@pytest.mark.parametrize("bad", ["entropy", "stats", "slopes"])
def test_attention_gqa_entropy_rejects_wrong_shape(rng, bad):
    qkv, _, slopes = make_gqa_inputs(rng, 2, 3, 4, 2, 8, "alibi")
    _, stats = gqa_forward(qkv, slopes, 4, 2)
    args = dict(entropy=np.zeros((2, 4, 3), np.float32), inp=qkv, stats=stats, slopes=slopes,
                NH=4, NKV=2)
    args[bad] = args[bad][..., :-1].copy()
    with pytest.raises(llmc_py.ShapeError, match=bad):
        K.attention_gqa_entropy(**args)
