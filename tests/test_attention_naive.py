"""csrc/attention_naive.c: the plain twins against the float64 reference and
autograd, and the tiled kernels against them."""
import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from helpers import TOL, assert_close, assert_thread_invariant, t64
from reference import attention_entropy as ref_attention_entropy
from attention_helpers import (
    GQA_SHAPES, make_gqa_inputs, gqa_forward, gqa_backward, TILE_SHAPES, tiled, naive_forward,
    naive_backward, naive, check_gqa_against_reference, entropy)


@pytest.mark.parametrize("B,T,NH,NKV,hs,slopes", GQA_SHAPES)
def test_attention_naive_matches_reference(rng, B, T, NH, NKV, hs, slopes):
    # the plain twin itself, against float64
    check_gqa_against_reference(rng, naive, naive_backward, B, T, NH, NKV, hs, slopes)


@pytest.mark.parametrize("B,T,NH,NKV,hs,slopes", GQA_SHAPES + TILE_SHAPES)
def test_attention_tiled_matches_naive(rng, isa, B, T, NH, NKV, hs, slopes):
    # the tiled kernels against their plain twin, on every instruction set;
    # each backward reads its own forward's saved tensor
    qkv, dout, slopes = make_gqa_inputs(rng, B, T, NH, NKV, hs, slopes)
    out, stats, att = tiled(qkv, slopes, NH, NKV)
    naive_out, naive_att = naive_forward(qkv, slopes, NH, NKV)
    tol = TOL["attention_variant"]
    assert_close("out", out, naive_out, tol["fwd"])
    assert_close("att", att, naive_att, tol["fwd"])
    assert_close("dinp", gqa_backward(dout, qkv, stats, slopes, NH, NKV),
                 naive_backward(dout, qkv, naive_att, None, NH, NKV), tol["bwd"])


def test_attention_naive_backward_accumulates_and_is_thread_invariant(rng, set_threads):
    qkv, dout, slopes = make_gqa_inputs(rng, 1, 21, 10, 5, 16, "alibi")   # 5 kv heads
    _, att = naive_forward(qkv, slopes, 10, 5)
    assert_close("dinp", naive_backward(dout, qkv, att, None, 10, 5, calls=2),
                 2.0 * naive_backward(dout, qkv, att, None, 10, 5), TOL["attention_gqa"]["bwd"])

    def run():
        out, att = naive_forward(qkv, slopes, 10, 5)
        return {"out": out, "att": att, "dinp": naive_backward(dout, qkv, att, None, 10, 5)}
    assert_thread_invariant(set_threads, run)


def entropy_naive(att):
    B, NH, T, _ = att.shape
    out = np.full((B, NH, T), np.nan, np.float32)
    K.attention_entropy_naive(out, att)
    return out


@pytest.mark.parametrize("B,T,NH,NKV,hs,slopes", GQA_SHAPES + TILE_SHAPES)
def test_attention_entropy_naive_matches_reference_and_tiled(rng, isa, B, T, NH, NKV, hs,
                                                             slopes):
    qkv, _, slopes = make_gqa_inputs(rng, B, T, NH, NKV, hs, slopes)
    _, att = naive_forward(qkv, slopes, NH, NKV)
    ours = entropy_naive(att)
    assert_close("entropy naive", ours, ref_attention_entropy(t64(att)),
                 TOL["attention_entropy"]["fwd"])
    _, stats = gqa_forward(qkv, slopes, NH, NKV)
    assert_close("entropy tiled vs naive", entropy(qkv, stats, slopes, NH, NKV), ours,
                 TOL["attention_entropy"]["variant"])


def test_attention_entropy_naive_rejects_wrong_shape():
    with pytest.raises(llmc_py.ShapeError, match="entropy"):
        K.attention_entropy_naive(np.zeros((1, 2, 4), np.float32),
                                  np.zeros((1, 2, 3, 3), np.float32))
