"""csrc/attention.c: causal multi-head attention against the float64
reference and autograd."""
import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from helpers import TOL, assert_close, assert_thread_invariant, randn, t64
from reference import attention as ref_attention

SHAPES = [  # B, T, C, NH
    (4, 64, 768, 12),   # GPT-2 124M: hs = 64
    (1, 1, 48, 4),      # a single position attends only to itself
    (2, 37, 60, 4),     # hs = 15: not a multiple of any vector width
    (1, 5, 67, 1),      # one head over an odd width
    (2, 9, 16, 16),     # hs = 1
]


def make_inputs(rng, B, T, C):
    return randn(rng, B, T, 3 * C), randn(rng, B, T, C)


def forward(qkv, NH):
    B, T, C3 = qkv.shape
    out = np.full((B, T, C3 // 3), np.nan, np.float32)   # (written): must not be read
    att = np.full((B, NH, T, T), np.nan, np.float32)
    K.attention_forward(out, att, qkv, NH)
    return out, att


def backward(dout, qkv, att, NH, calls=1):
    dinp = np.zeros_like(qkv)
    for _ in range(calls):
        K.attention_backward(dinp, dout, qkv, att, NH)
    return dinp


@pytest.mark.parametrize("B,T,C,NH", SHAPES)
def test_attention_matches_reference(rng, B, T, C, NH):
    qkv, dout = make_inputs(rng, B, T, C)
    out, att = forward(qkv, NH)
    dinp = backward(dout, qkv, att, NH)

    qkv_t = t64(qkv, grad=True)
    ref_out, ref_att = ref_attention(qkv_t, NH)
    (ref_out * t64(dout)).sum().backward()

    tol = TOL["attention"]
    assert_close("out", out, ref_out, tol["fwd"])
    assert_close("att", att, ref_att, tol["fwd"])
    assert not np.triu(att, k=1).any(), "att is not exactly 0 above the diagonal"
    assert_close("dinp", dinp, qkv_t.grad, tol["bwd"])


def test_attention_backward_accumulates(rng):
    qkv, dout = make_inputs(rng, 2, 37, 60)
    _, att = forward(qkv, 4)
    once, twice = backward(dout, qkv, att, 4), backward(dout, qkv, att, 4, calls=2)
    assert_close("dinp", twice, 2.0 * once, TOL["attention"]["bwd"])


def test_attention_thread_invariant(rng, set_threads):
    qkv, dout = make_inputs(rng, 3, 20, 60)   # B*NH = 9 (b, h) pairs, uneven over 2 threads

    def run():
        out, att = forward(qkv, 4)
        return {"out": out, "att": att, "dinp": backward(dout, qkv, att, 4)}
    assert_thread_invariant(set_threads, run)


def test_attention_rejects_heads_not_dividing_channels(rng):
    qkv, _ = make_inputs(rng, 1, 3, 10)
    with pytest.raises(llmc_py.ShapeError, match="NH=4"):
        forward(qkv, 4)


@pytest.mark.parametrize("bad", ["att", "dout"])
def test_attention_rejects_wrong_shape(rng, bad):
    qkv, dout = make_inputs(rng, 2, 3, 8)
    _, att = forward(qkv, 2)
    args = dict(dinp=np.zeros_like(qkv), dout=dout, inp=qkv, att=att, NH=2)
    args[bad] = args[bad][..., :-1].copy()
    with pytest.raises(llmc_py.ShapeError, match=bad):
        K.attention_backward(**args)


def test_attention_rejects_wrong_dtype(rng):
    qkv, _ = make_inputs(rng, 2, 3, 8)
    with pytest.raises(TypeError, match="inp"):
        forward(qkv.astype(np.float64), 2)
