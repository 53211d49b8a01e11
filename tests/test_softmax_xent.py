"""csrc/softmax_xent.c: softmax over the real vocabulary, cross-entropy and
their fused backward, against the float64 reference and autograd."""
import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from helpers import TOL, assert_close, assert_thread_invariant, randn, t64
from reference import crossentropy as ref_crossentropy
from reference import softmax as ref_softmax

SHAPES = [  # B, T, V, Vp
    (1, 2, 50257, 50304),   # GPT-2's vocabulary, padded to a multiple of 128
    (4, 64, 1000, 1024),
    (2, 37, 67, 128),
    (1, 1, 67, 128),
    (2, 3, 64, 64),         # no padding
    (1, 3, 1, 4),           # one real token: probability 1, loss 0
]


def make_inputs(rng, B, T, V, Vp):
    logits = randn(rng, B, T, Vp, scale=3.0)
    logits[..., V:] = np.nan    # padding is never read: garbage there must not leak
    targets = rng.integers(0, V, size=(B, T), dtype=np.int32)
    return logits, targets, randn(rng, B, T)


def forward(logits, targets, V):
    B, T, Vp = logits.shape
    probs = np.full((B, T, Vp), np.nan, np.float32)   # (written): must not be read
    losses = np.full((B, T), np.nan, np.float32)
    K.softmax_forward(probs, logits, V)
    K.crossentropy_forward(losses, probs, targets, V)
    return probs, losses


def with_nan_padding(probs, V):
    """probs with NaN in the padding, which the backward must not read."""
    probs = probs.copy()
    probs[..., V:] = np.nan
    return probs


def backward(dlosses, probs, targets, V, calls=1):
    dlogits = np.zeros_like(probs)
    for _ in range(calls):
        K.crossentropy_softmax_backward(dlogits, dlosses, probs, targets, V)
    return dlogits


@pytest.mark.parametrize("B,T,V,Vp", SHAPES)
def test_softmax_crossentropy_match_reference(rng, isa, B, T, V, Vp):
    logits, targets, dlosses = make_inputs(rng, B, T, V, Vp)
    probs, losses = forward(logits, targets, V)
    assert not probs[..., V:].any(), "probs padding columns are not exactly 0"
    dlogits = backward(dlosses, with_nan_padding(probs, V), targets, V)

    logits_t = t64(logits, grad=True)
    ref_probs = ref_softmax(logits_t, V)
    ref_losses = ref_crossentropy(ref_probs, t64(targets))
    (ref_losses * t64(dlosses)).sum().backward()

    assert_close("probs", probs, ref_probs, TOL["softmax"]["fwd"])
    assert_close("losses", losses, ref_losses, TOL["crossentropy"]["fwd"])
    assert_close("dlogits[:V]", dlogits[..., :V], logits_t.grad[..., :V],
                 TOL["crossentropy"]["bwd"])
    assert not dlogits[..., V:].any(), "dlogits padding columns got a gradient"


def test_softmax_xent_thread_invariant(rng, isa, set_threads):
    logits, targets, dlosses = make_inputs(rng, 3, 37, 1000, 1024)   # 111 rows

    def run():
        probs, losses = forward(logits, targets, 1000)
        return {"probs": probs, "losses": losses,
                "dlogits": backward(dlosses, probs, targets, 1000)}
    assert_thread_invariant(set_threads, run)


def test_crossentropy_backward_accumulates(rng):
    V, Vp = 67, 128
    logits, targets, dlosses = make_inputs(rng, 2, 37, V, Vp)
    probs, _ = forward(logits, targets, V)
    once, twice = backward(dlosses, probs, targets, V), backward(dlosses, probs, targets, V, 2)
    assert_close("dlogits", twice, 2.0 * once, TOL["crossentropy"]["bwd"])
    assert not twice[..., V:].any(), "dlogits padding columns got a gradient"


@pytest.mark.parametrize("bad", [-1, 67, 127, 1 << 30])   # 67..127: padding is not a token
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_crossentropy_rejects_target_out_of_range(rng, which, bad):
    V, Vp = 67, 128
    logits, targets, dlosses = make_inputs(rng, 2, 3, V, Vp)
    probs, losses = forward(logits, targets, V)
    targets[1, 1] = bad
    with pytest.raises(llmc_py.RangeError, match=rf"targets\[1, 1\] = {bad} is not a token id"):
        if which == "forward":
            K.crossentropy_forward(losses, probs, targets, V)
        else:
            backward(dlosses, probs, targets, V)


@pytest.mark.parametrize("V", [0, 129])   # no real column, or more real columns than Vp
def test_softmax_rejects_bad_vocab_size(rng, V):
    logits = randn(rng, 2, 3, 128)
    with pytest.raises(llmc_py.ShapeError):
        K.softmax_forward(np.empty_like(logits), logits, V)


def test_softmax_xent_reject_wrong_shape(rng):
    logits, targets, dlosses = make_inputs(rng, 2, 3, 5, 8)
    probs, _ = forward(logits, targets, 5)
    with pytest.raises(llmc_py.ShapeError, match="targets"):
        K.crossentropy_forward(np.empty((2, 3), np.float32), probs, targets[:, :2].copy(), 5)
    with pytest.raises(llmc_py.ShapeError, match="dlosses"):
        backward(dlosses.reshape(3, 2), probs, targets, 5)


def test_softmax_xent_reject_wrong_dtype(rng):
    logits, targets, dlosses = make_inputs(rng, 2, 3, 5, 8)
    probs, _ = forward(logits, targets, 5)
    with pytest.raises(TypeError, match="targets"):
        backward(dlosses, probs, targets.astype(np.int64), 5)
    with pytest.raises(TypeError, match="logits"):
        K.softmax_forward(probs, logits.astype(np.float64), 5)
