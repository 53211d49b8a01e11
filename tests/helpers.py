"""Shared test helpers: tolerances, the comparison, and small converters."""
import numpy as np
import torch

import llmc_py
from llmc_py import kernels as K

# The instruction sets the float32 kernels are tested on: all this CPU runs
# but avx512bf16, whose float32 kernels are the avx512 build itself (only the
# bf16 matmul has kernels of its own; test_bf16.py checks that).
FP32_ISAS = [isa for isa in llmc_py.supported_isas() if isa != "avx512bf16"]

# Tolerances for fp32 kernels against the float64 reference, as an error
# relative to the tensor's largest entry: max|ours - ref| <= tol * max|ref|.
# Scaling by the maximum (not per element) keeps the check meaningful for sums
# whose terms cancel, where an element-wise rtol would demand more than fp32
# can give. fp32 rounds at 2^-24 ~ 6e-8 (relative); each bound below is about
# 10x the worst error seen on the test shapes, and far below what a wrong
# index, a missing term or a kernel that skips an edge would give (>= 1e-2).
# "fwd" bounds outputs, "bwd" gradients; a (+=) backward called twice is held
# to its family's "bwd" against twice one call.
TOL = {
    # out: one fp32 add per element, so within half an ulp: 2^-24 (exact bound).
    # grads: sums of up to B*T rows of dout (seen 1.4e-7)
    "encoder": {"fwd": 2.0 ** -24, "bwd": 1e-6},
    # fwd: C-term fp32 sums for mean and variance; with inputs offset by 10
    # the mean's rounding dominates (seen 3.5e-6 at C=768; a one-pass
    # E[x^2] - mean^2 variance would give ~1e-4, so 1e-5 also guards that).
    # bwd: two C-term reductions per row, then B*T-term sums (seen 3.6e-6)
    "layernorm": {"fwd": 1e-5, "bwd": 3e-5},
    # fwd: a C-term sum of squares on 16 lanes, a sqrtf and two products (seen
    # 1.8e-7 at C=768). bwd: a C-term dot per row for dinp (seen 2.2e-7), then
    # B*T-term sums for dweight (seen 6.8e-7 at B*T=256)
    "rmsnorm": {"fwd": 2e-6, "bwd": 7e-6},
    # K-term dot products, K up to 768 (seen 1.2e-6 fwd, 1.3e-6 bwd)
    "matmul": {"fwd": 1e-5, "bwd": 1e-5},
    # fast vs naive: same k order, they differ only by FMA contraction
    # (seen 2.5e-7 fwd; the gradients came out bitwise equal)
    "matmul_variant": {"fwd": 1e-6, "bwd": 1e-6},
    # hs-term dots, a T-term softmax and weighted sums (seen 2.9e-7 fwd,
    # 4.7e-7 bwd)
    "attention": {"fwd": 3e-6, "bwd": 5e-6},
    # rotations of fp32 pairs by float cos/sin of a double angle: two products
    # and an add per element (seen 1.1e-7 fwd and bwd, also at positions 1e5)
    "rope": {"fwd": 1e-6, "bwd": 1e-6},
    # as "attention", with the ALiBi bias in the scores (seen 2.6e-7 fwd);
    # dk, dv sum over the NH/NKV query heads of a group as well as over T
    # (seen 1.3e-6 bwd at T=256 with 3 heads a group)
    "attention_gqa": {"fwd": 3e-6, "bwd": 1e-5},
    # tiled vs naive, both fp32 (different summation orders and exponentials;
    # seen 5.4e-7 fwd, 1.8e-7 bwd on every instruction set)
    "attention_variant": {"fwd": 3e-6, "bwd": 2e-6},
    # row entropies (ln t terms summed, at most ln T ~ 7 at T = 1024): the
    # scores' rounding moves each P by ~1e-7 relative (seen 1.0e-6 against
    # the row maxima of every shape, also with far keys underflowing to 0;
    # the naive twin 1.2e-6); tiled vs naive, two fp32 sums (seen 1.2e-6)
    "attention_entropy": {"fwd": 1e-5, "variant": 5e-6},
    # decode vs the forward's row at the same position: both run one row
    # function, so seen 0 (bitwise); 1e-6 still fails a wrong key, length or
    # slope distance by orders of magnitude
    "attention_decode": {"fwd": 1e-6},
    # tanhf is within ~2 ulp (seen 1.4e-8); the derivative's 1 - tanh^2
    # cancels near saturation, times |x| du/dx ~ 10 (seen 3.9e-7)
    "gelu": {"fwd": 2e-7, "bwd": 2e-6},
    # SwiGLU: a vector exp (2 ulp) and one division give the sigmoid.
    #   fwd, bwd: against the tensor's largest entry (seen 8.2e-8, 1.2e-7);
    #   silu: silu(g) and silu'(g) each against its own size (seen 2.4e-7)
    "swiglu": {"fwd": 7e-7, "bwd": 1.2e-6, "silu": 2e-6},
    # sinusoidal positions: sin/cos of a double angle rounded to float, one
    # add (seen 5.2e-8, also at positions near 1e5)
    "sinusoidal": {"fwd": 2.4e-7},
    # exact GELU: libm's erfcf and expf, a few ulp each (seen 2.8e-8, 1.0e-7)
    "gelu_erf": {"fwd": 3e-7, "bwd": 1e-6},
    # ReLU: a select, exact (seen 0); ReGLU: then one or two products, each
    # half an ulp of itself (seen 4.1e-8, 1.4e-8)
    "relu": {"fwd": 0.0, "bwd": 0.0},
    "reglu": {"fwd": 1.2e-7, "bwd": 2.4e-7},
    # GeGLU: gelu_forward's arithmetic times up (seen 2.7e-8, 4.4e-8)
    "geglu": {"fwd": 5e-7, "bwd": 2e-6},
    # fwd: one add, half an ulp; bwd: two (+=) calls onto a non-zero start,
    # two roundings
    "residual": {"fwd": 2.0 ** -24, "bwd": 2e-7},
    # expf, a double normaliser, one scale (seen 3.4e-8)
    "softmax": {"fwd": 3e-7},
    # -logf of an fp32 prob (seen 8e-8); p - 1[target] times dloss (seen 4.8e-8)
    "crossentropy": {"fwd": 5e-7, "bwd": 3e-7},
    # five steps with fp32 state from params at GPT-2's init scale (0.02):
    #   param: a few roundings a step (seen 3.2e-7);
    #   update (param after - before, ~lr): the param's own ulp and powf's
    #     rounding of beta2^t against 1 - beta2^t ~ 1e-3 (seen 6.6e-6);
    #   m, v: two roundings a step (seen 1.0e-7)
    "adamw": {"param": 1e-6, "update": 5e-5, "state": 1e-6},
    # squares of fp32 values are exact in double; only the double sums round
    "global_norm": {"fwd": 1e-12},
    # MoE (moe.c): fwd, a softmax over E, k-term combines and C-term GEMM
    # sums; bwd, C- and R-term sums (R = N k rows per expert). The issue's
    # bounds, far above fp32's rounding and far below a wrong row or term
    "moe": {"fwd": 1e-5, "bwd": 1e-4},
}


def assert_close(name, ours, ref, tol):
    """Fails, naming the tensor, unless max|ours - ref| <= tol * max|ref|."""
    ours = np.asarray(ours, dtype=np.float64)
    ref = np64(ref)
    assert ours.shape == ref.shape, f"{name}: shape {ours.shape}, reference {ref.shape}"
    assert np.isfinite(ours).all(), f"{name}: {np.count_nonzero(~np.isfinite(ours))} non-finite"
    diff = np.abs(ours - ref)
    worst = np.unravel_index(np.argmax(diff), diff.shape) if diff.size else ()
    err, scale = float(diff.max(initial=0.0)), float(np.abs(ref).max(initial=0.0))
    assert err <= tol * scale, (
        f"{name}: max|ours - ref| = {err:.3e} at {worst} (ours {ours[worst]:.9g}, "
        f"ref {ref[worst]:.9g}) exceeds {tol:g} * max|ref| = {tol * scale:.3e}")


def t64(x, grad=False):
    """A float64 torch leaf from a numpy array (int arrays become long)."""
    if np.issubdtype(np.asarray(x).dtype, np.integer):
        return torch.tensor(x, dtype=torch.long)
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def np64(x):
    """A float64 numpy copy of a tensor or array."""
    if isinstance(x, torch.Tensor):
        x = x.detach().numpy()
    return np.asarray(x, dtype=np.float64)


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def assert_thread_invariant(set_threads, run, counts=(1, 2, 3)):
    """Runs ``run()`` (returning {name: array}) on each thread count in
    ``counts`` (1, 2 and 3 unless given) and requires bitwise-equal results. (A
    build without OpenMP always runs on one thread; the check then still
    compares the runs.)"""
    results = []
    for n in counts:
        set_threads(n)
        assert llmc_py.get_num_threads() == (n if llmc_py.has_openmp() else 1)
        results.append(run())
    for n, result in zip(counts[1:], results[1:]):
        for name in results[0]:
            one, other = results[0][name], result[name]
            assert np.array_equal(one, other), (
                f"{name}: {counts[0]} vs {n} threads differ by up to "
                f"{np.max(np.abs(one - other)):.3e}")


# matmul_backward's `written` outputs by flag, and every mask of them
WRITTEN_OUTPUTS = {K.WRITE_DINP: "dinp", K.WRITE_DWEIGHT: "dweight"}
WRITTEN_MASKS = (K.WRITE_DINP, K.WRITE_DWEIGHT, K.WRITE_DINP | K.WRITE_DWEIGHT)


def backward_written(kernel, start, written, *args, **kwargs):
    """Copies of ``start`` {dinp, dweight, dbias} after kernel(dinp, dweight,
    dbias, *args, written=written): the written ones NaN before the call."""
    grads = {name: value.copy() for name, value in start.items()}
    for flag, name in WRITTEN_OUTPUTS.items():
        if written & flag:
            grads[name][...] = np.nan
    kernel(grads["dinp"], grads["dweight"], grads["dbias"], *args, written=written, **kwargs)
    return grads
