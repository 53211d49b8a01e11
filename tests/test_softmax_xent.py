"""csrc/softmax_xent.c: softmax over the real vocabulary and the fused
softmax + cross-entropy (no probabilities kept; the backward in place of the
logits), against the float64 reference and autograd."""
import numpy as np
import pytest
import torch

import llmc_py
from llmc_py import kernels as K
from llmc_py._native.lib import lib
from llmc_py.io.tokens import IGNORE_INDEX
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
    targets = masked_targets(rng, targets, 0.25)

    def run():
        probs = np.empty_like(logits)
        K.softmax_forward(probs, logits, 1000)
        losses, stats = forward(logits, targets, 1000)
        return {"probs": probs, "losses": losses, "stats": stats,
                "dlogits": backward(dlosses, logits, stats, targets, 1000)}
    assert_thread_invariant(set_threads, run)


MASKED_SHAPES = [  # B, T, V, Vp, fraction of targets ignored
    (2, 37, 67, 128, 0.3),
    (3, 5, 1000, 1024, 0.5),
    (1, 1, 67, 128, 1.0),      # the only row ignored
    (2, 3, 64, 64, 1.0),       # every row ignored, no padding
    (1, 3, 1, 4, 0.4),         # one real token
]


def masked_targets(rng, targets, fraction):
    """``targets`` with about ``fraction`` of them (all, at 1.0) set to IGNORE_INDEX."""
    targets = targets.copy()
    targets[rng.random(targets.shape) < fraction] = IGNORE_INDEX
    return targets


def test_ignore_index_is_the_kernels():
    assert IGNORE_INDEX == lib.LLMC_IGNORE_INDEX == -1


@pytest.mark.parametrize("B,T,V,Vp,fraction", MASKED_SHAPES)
def test_ignored_targets_match_torch_cross_entropy(rng, isa, B, T, V, Vp, fraction):
    """Against PyTorch's cross_entropy(ignore_index=-1): an ignored row's loss
    is 0 and its gradient 0 in every column, whatever its dloss."""
    logits, targets, dlosses = make_inputs(rng, B, T, V, Vp)
    targets = masked_targets(rng, targets, fraction)
    ignored = targets == IGNORE_INDEX
    assert ignored.any() and (fraction < 1 or ignored.all())
    losses, stats = forward(logits, targets, V)
    dlogits = backward(dlosses, logits, stats, targets, V)

    logits_t = t64(logits[..., :V], grad=True)
    ref_losses = torch.nn.functional.cross_entropy(
        logits_t.reshape(-1, V), t64(targets).long().reshape(-1), ignore_index=IGNORE_INDEX,
        reduction="none").reshape(B, T)
    (ref_losses * t64(dlosses)).sum().backward()

    assert_close("losses", losses, ref_losses, TOL["crossentropy"]["fwd"])
    assert_close("dlogits[:V]", dlogits[..., :V], logits_t.grad, TOL["crossentropy"]["bwd"])
    assert not losses[ignored].any(), "an ignored row's loss is not exactly 0"
    assert not dlogits[ignored].any(), "an ignored row's dlogits are not exactly 0"
    assert not dlogits[..., V:].any(), "dlogits padding columns are not exactly 0"
    # the stats of every row are still the softmax's, ignored or not
    _, unmasked_stats = forward(logits, make_inputs(rng, B, T, V, Vp)[1], V)
    assert np.array_equal(stats, unmasked_stats)
    in_place = backward(dlosses, logits.copy(), stats, targets, V, in_place=True)
    assert np.array_equal(in_place, dlogits)


def test_kept_rows_are_unchanged_by_ignoring_others(rng, isa):
    """Masking some targets changes nothing in the other rows, to the bit."""
    logits, targets, dlosses = make_inputs(rng, 3, 11, 67, 128)
    masked = masked_targets(rng, targets, 0.5)
    kept = masked != IGNORE_INDEX
    losses, stats = forward(logits, targets, 67)
    losses_m, stats_m = forward(logits, masked, 67)
    assert np.array_equal(losses_m[kept], losses[kept])
    assert np.array_equal(backward(dlosses, logits, stats_m, masked, 67)[kept],
                          backward(dlosses, logits, stats, targets, 67)[kept])


@pytest.mark.parametrize("bad", [-2, 67, 127, 1 << 30, -(1 << 31)])   # 67..127: padding
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_crossentropy_rejects_target_out_of_range(rng, which, bad):
    V, Vp = 67, 128
    logits, targets, dlosses = make_inputs(rng, 2, 3, V, Vp)
    losses, stats = forward(logits, targets, V)
    targets[1, 1] = bad
    with pytest.raises(llmc_py.RangeError,
                       match=rf"targets\[1, 1\] = {bad} is not a token id in \[0, 67\) "
                             rf"or -1 \(ignored\)"):
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


def test_softmax_exponentials_down_to_the_smallest_denormal(rng, isa):
    """Logits 0 to 110 below their row's max: each probability within 2 ulp of
    exp(x - max) / sum in float64 while normal, within 2 ulp of the smallest
    denormal below that, exactly 0 past exp's underflow (x - max < -87.34),
    and a -inf logit's exactly 0; a NaN logit makes its row NaN, a +inf one
    too (inf - inf), as in float64."""
    V = 1000
    logits = -rng.uniform(0, 110, (4, V)).astype(np.float32)
    logits[:, 0] = 0.0
    logits[1, 3] = -np.inf
    logits[2, 5] = np.nan
    logits[3, 7] = np.inf
    probs = np.full_like(logits[None], np.nan)
    K.softmax_forward(probs, logits[None], V)
    probs = probs[0]
    for row in (0, 1):
        x = logits[row].astype(np.float64)
        e = np.exp(x - x.max())
        e[x - x.max() < -87.3365478515625] = 0.0
        ref = e / e.sum()
        ulp = np.spacing(np.maximum(ref, np.finfo(np.float32).tiny).astype(np.float32))
        assert np.all(np.abs(probs[row] - ref) <= 2 * ulp.astype(np.float64)), row
        assert (probs[row][ref == 0] == 0).all()
        assert ((probs[row] > 0) & (probs[row] < np.finfo(np.float32).tiny)).any()
    assert probs[1, 3] == 0.0
    assert np.isnan(probs[2]).all() and np.isnan(probs[3]).all()


def nonpositive_logits(rng, rows, V):
    """Rows of V logits whose bit patterns are spread evenly over every float
    from -0 down to -104 (exp's whole range, its underflow below -87.34 and
    denormal differences), with a 0 that is each row's max and a -inf."""
    bits = rng.integers(0x80000000, 0xC2D00000, size=(rows, V), dtype=np.int64)
    logits = bits.astype(np.uint32).view(np.float32)
    logits[:, 0] = 0.0
    logits[0, 1] = -np.inf
    return logits[None]


@pytest.mark.skipif("avx512" not in llmc_py.supported_isas(), reason="no AVX-512 here")
def test_exponentials_are_the_same_bits_on_every_isa(rng, use_isa):
    """The AVX-512 builds' exponential (floor and 2^n by vrndscaleps and
    vscalefps) is bitwise the portable form's, which the avx2 build compiles
    with the same fused multiply-adds: probabilities, stats, losses and
    gradients all to the bit, at V not a multiple of 16."""
    V = 40_000 + 7
    logits = nonpositive_logits(rng, 3, V)
    targets = rng.integers(0, V, size=(1, 3), dtype=np.int32)
    dlosses = randn(rng, 1, 3)
    results = {}
    for isa_name in ("avx2", "avx512"):
        use_isa(isa_name)
        probs = np.empty_like(logits)
        K.softmax_forward(probs, logits, V)
        losses, stats = forward(logits, targets, V)
        results[isa_name] = (probs, losses, stats, backward(dlosses, logits, stats, targets, V))
    for name, ours, portable in zip(("probs", "losses", "stats", "dlogits"), results["avx512"],
                                    results["avx2"]):
        assert np.array_equal(ours.view(np.uint32), portable.view(np.uint32)), name
    probs = results["avx512"][0]
    assert (probs == 0).any() and ((probs > 0) & (probs < np.finfo(np.float32).tiny)).any()


@pytest.mark.parametrize("V", [1, 15, 16, 17, 63, 64, 65, 130, 200])
def test_row_max_at_every_position(isa, V):
    """A row's max is found wherever it sits (in each of the four vectors
    the max runs on, or the tail): stats[0] is it exactly, and the loss of
    the target at the max is -log of its probability in float64."""
    logits = np.full((1, V, V), -3.0, np.float32)
    logits[0] -= np.arange(V, dtype=np.float32)[None, :] / V   # distinct values
    logits[0, np.arange(V), np.arange(V)] = 2.5                 # row r's max at column r
    targets = np.arange(V, dtype=np.int32)[None]
    losses, stats = forward(logits, targets, V)
    assert np.array_equal(stats[0, :, 0], np.full(V, 2.5, np.float32))
    x = logits[0].astype(np.float64)
    ref = -(2.5 - x.max(-1) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)))
    assert np.allclose(losses[0], ref, rtol=1e-6, atol=1e-6)
