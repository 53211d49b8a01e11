"""csrc/softmax_xent.c: softmax over the real vocabulary and the fused
softmax + cross-entropy (no probabilities kept; the backward in place of the
logits), against the float64 reference and autograd."""
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
    losses = np.full((B, T), np.nan, np.float32)     # (written): must not be read
    stats = np.full((B, T, 2), np.nan, np.float32)
    kept = logits.copy()
    K.softmax_crossentropy_forward(losses, stats, logits, targets, V)
    assert np.array_equal(logits, kept, equal_nan=True), "the forward changed the logits"
    return losses, stats


def backward(dlosses, logits, stats, targets, V, in_place=False):
    dlogits = logits if in_place else np.full_like(logits, np.nan)   # (written)
    K.softmax_crossentropy_backward(dlogits, logits, stats, dlosses, targets, V)
    return dlogits


@pytest.mark.parametrize("B,T,V,Vp", SHAPES)
def test_softmax_crossentropy_match_reference(rng, isa, B, T, V, Vp):
    logits, targets, dlosses = make_inputs(rng, B, T, V, Vp)
    probs = np.full((B, T, Vp), np.nan, np.float32)
    K.softmax_forward(probs, logits, V)
    assert not probs[..., V:].any(), "probs padding columns are not exactly 0"
    losses, stats = forward(logits, targets, V)
    dlogits = backward(dlosses, logits, stats, targets, V)

    logits_t = t64(logits, grad=True)
    ref_probs = ref_softmax(logits_t, V)
    ref_losses = ref_crossentropy(ref_probs, t64(targets))
    (ref_losses * t64(dlosses)).sum().backward()

    assert_close("probs", probs, ref_probs, TOL["softmax"]["fwd"])
    assert_close("losses", losses, ref_losses, TOL["crossentropy"]["fwd"])
    assert_close("dlogits[:V]", dlogits[..., :V], logits_t.grad[..., :V],
                 TOL["crossentropy"]["bwd"])
    assert not dlogits[..., V:].any(), "dlogits padding columns are not exactly 0"


@pytest.mark.parametrize("B,T,V,Vp", SHAPES[1:4])
def test_fused_equals_softmax_then_crossentropy_bitwise(rng, isa, B, T, V, Vp):
    """The fused pair's probabilities are softmax_forward's, product for
    product: the loss is -log p[target] and the gradient (p - onehot) * dloss
    to the bit, also when the gradient overwrites the logits."""
    logits, targets, dlosses = make_inputs(rng, B, T, V, Vp)
    probs = np.empty_like(logits)
    K.softmax_forward(probs, logits, V)
    p_target = np.take_along_axis(probs, targets[..., None].astype(np.int64), -1)[..., 0]
    expected = probs * dlosses[..., None]
    np.put_along_axis(expected, targets[..., None].astype(np.int64),
                      p_target[..., None] * dlosses[..., None] - dlosses[..., None], -1)
    losses, stats = forward(logits, targets, V)
    # the loss is libm's -logf(p): within an ulp of log in float64 rounded to float32
    ref_losses = -np.log(p_target.astype(np.float64)).astype(np.float32)
    assert np.all(np.abs(losses - ref_losses) <= np.spacing(ref_losses))
    assert np.array_equal(backward(dlosses, logits, stats, targets, V), expected)
    assert np.array_equal(backward(dlosses, logits.copy(), stats, targets, V, in_place=True),
                          expected)


def test_softmax_xent_thread_invariant(rng, isa, set_threads):
    logits, targets, dlosses = make_inputs(rng, 3, 37, 1000, 1024)   # 111 rows

    def run():
        probs = np.empty_like(logits)
        K.softmax_forward(probs, logits, 1000)
        losses, stats = forward(logits, targets, 1000)
        return {"probs": probs, "losses": losses, "stats": stats,
                "dlogits": backward(dlosses, logits, stats, targets, 1000)}
    assert_thread_invariant(set_threads, run)


@pytest.mark.parametrize("bad", [-1, 67, 127, 1 << 30])   # 67..127: padding is not a token
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_crossentropy_rejects_target_out_of_range(rng, which, bad):
    V, Vp = 67, 128
    logits, targets, dlosses = make_inputs(rng, 2, 3, V, Vp)
    losses, stats = forward(logits, targets, V)
    targets[1, 1] = bad
    with pytest.raises(llmc_py.RangeError, match=rf"targets\[1, 1\] = {bad} is not a token id"):
        if which == "forward":
            K.softmax_crossentropy_forward(losses, stats, logits, targets, V)
        else:
            backward(dlosses, logits, stats, targets, V)


@pytest.mark.parametrize("V", [0, 129])   # no real column, or more real columns than Vp
def test_softmax_rejects_bad_vocab_size(rng, V):
    logits = randn(rng, 2, 3, 128)
    with pytest.raises(llmc_py.ShapeError):
        K.softmax_forward(np.empty_like(logits), logits, V)


def test_softmax_xent_reject_wrong_shape(rng):
    logits, targets, dlosses = make_inputs(rng, 2, 3, 5, 8)
    losses, stats = forward(logits, targets, 5)
    with pytest.raises(llmc_py.ShapeError, match="targets"):
        K.softmax_crossentropy_forward(losses, stats, logits, targets[:, :2].copy(), 5)
    with pytest.raises(llmc_py.ShapeError, match="stats"):
        K.softmax_crossentropy_forward(losses, stats[:, :2].copy(), logits, targets, 5)
    with pytest.raises(llmc_py.ShapeError, match="dlosses"):
        backward(dlosses.reshape(3, 2), logits, stats, targets, 5)


def test_softmax_xent_reject_wrong_dtype(rng):
    logits, targets, dlosses = make_inputs(rng, 2, 3, 5, 8)
    losses, stats = forward(logits, targets, 5)
    with pytest.raises(TypeError, match="targets"):
        backward(dlosses, logits, stats, targets.astype(np.int64), 5)
    with pytest.raises(TypeError, match="logits"):
        K.softmax_forward(np.empty_like(logits), logits.astype(np.float64), 5)
