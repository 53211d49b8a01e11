"""csrc/norms.c: LayerNorm and RMSNorm against the float64 reference and autograd."""
import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from helpers import TOL, assert_close, assert_thread_invariant, randn, t64
from reference import layernorm as ref_layernorm
from reference import head_rmsnorm as ref_head_rmsnorm
from reference import rmsnorm as ref_rmsnorm

SHAPES = [  # B, T, C
    (4, 64, 768),   # GPT-2 124M
    (1, 1, 48),
    (2, 37, 67),    # C=67: no vector width divides it; B*T not a multiple of 8
    (3, 5, 60),
]


def make_inputs(rng, B, T, C, offset=0.0):
    x = randn(rng, B, T, C) + np.float32(offset)
    w = randn(rng, C) + np.float32(1.0)
    b = randn(rng, C, scale=0.1)
    return x, w, b, randn(rng, B, T, C)


def forward(x, w, b):
    B, T, C = x.shape
    out = np.full((B, T, C), np.nan, np.float32)   # (written): must not be read
    mean, rstd = np.full((B, T), np.nan, np.float32), np.full((B, T), np.nan, np.float32)
    K.layernorm_forward(out, mean, rstd, x, w, b)
    return out, mean, rstd


def backward(dout, x, w, mean, rstd, calls=1):
    grads = np.zeros_like(x), np.zeros_like(w), np.zeros_like(w)
    for _ in range(calls):
        K.layernorm_backward(*grads, dout, x, w, mean, rstd)
    return grads


@pytest.mark.parametrize("offset", [0.0, 10.0])   # a mean far from 0 relative to the spread
@pytest.mark.parametrize("B,T,C", SHAPES)
def test_layernorm_matches_reference(rng, isa, B, T, C, offset):
    x, w, b, dout = make_inputs(rng, B, T, C, offset)
    out, mean, rstd = forward(x, w, b)
    dinp, dweight, dbias = backward(dout, x, w, mean, rstd)

    xt, wt, bt = t64(x, grad=True), t64(w, grad=True), t64(b, grad=True)
    ref, ref_mean, ref_rstd = ref_layernorm(xt, wt, bt)
    (ref * t64(dout)).sum().backward()

    tol = TOL["layernorm"]
    for name, ours, theirs, kind in [("out", out, ref, "fwd"), ("mean", mean, ref_mean, "fwd"),
                                     ("rstd", rstd, ref_rstd, "fwd"),
                                     ("dinp", dinp, xt.grad, "bwd"),
                                     ("dweight", dweight, wt.grad, "bwd"),
                                     ("dbias", dbias, bt.grad, "bwd")]:
        assert_close(name, ours, theirs, tol[kind])


def test_layernorm_backward_accumulates(rng):
    x, w, b, dout = make_inputs(rng, 2, 37, 67)
    _, mean, rstd = forward(x, w, b)
    once = backward(dout, x, w, mean, rstd)
    twice = backward(dout, x, w, mean, rstd, calls=2)
    for name, a, b2 in zip(["dinp", "dweight", "dbias"], once, twice):
        assert_close(name, b2, 2.0 * a, TOL["layernorm"]["bwd"])


def test_layernorm_backward_thread_invariant(rng, isa, set_threads):
    # 268 rows: 5 chunks of the parameter-gradient sums, the last partial
    x, w, b, dout = make_inputs(rng, 4, 67, 300)
    _, mean, rstd = forward(x, w, b)
    assert_thread_invariant(set_threads, lambda: dict(
        zip(["dinp", "dweight", "dbias"], backward(dout, x, w, mean, rstd))))


def test_layernorm_rejects_negative_eps(rng):
    x, w, b, _ = make_inputs(rng, 1, 2, 8)
    out, mean, rstd = forward(x, w, b)
    for eps in (-1e-5, np.nan):
        with pytest.raises(llmc_py.InvalidValueError, match="outside its domain"):
            K.layernorm_forward(out, mean, rstd, x, w, b, eps=eps)


@pytest.mark.parametrize("bad", ["weight", "bias", "mean", "out"])
def test_layernorm_rejects_wrong_shape(rng, bad):
    x, w, b, _ = make_inputs(rng, 2, 3, 8)
    args = dict(out=np.empty_like(x), mean=np.empty((2, 3), np.float32),
                rstd=np.empty((2, 3), np.float32), inp=x, weight=w, bias=b)
    args[bad] = np.zeros(args[bad].shape[:-1] + (args[bad].shape[-1] + 1,), np.float32)
    with pytest.raises(llmc_py.ShapeError, match=bad):
        K.layernorm_forward(**args)


def test_layernorm_rejects_wrong_dtype(rng):
    x, w, b, dout = make_inputs(rng, 2, 3, 8)
    _, mean, rstd = forward(x, w, b)
    with pytest.raises(TypeError, match="dout"):
        backward(dout.astype(np.float64), x, w, mean, rstd)


# ---- RMSNorm ----------------------------------------------------------------

RMS_SHAPES = [  # B, T, C
    (4, 64, 768),    # Llama-ish width
    (1, 256, 768),
    (1, 1, 48),
    (2, 37, 67),     # C=67: no vector width divides it; B*T not a multiple of 8
    (3, 5, 2),
]


def rms_forward(x, w, eps=1e-5):
    B, T, C = x.shape
    out = np.full((B, T, C), np.nan, np.float32)   # (written): must not be read
    rstd = np.full((B, T), np.nan, np.float32)
    K.rmsnorm_forward(out, rstd, x, w, eps)
    return out, rstd


def rms_backward(dout, x, w, rstd, calls=1):
    grads = np.zeros_like(x), np.zeros_like(w)
    for _ in range(calls):
        K.rmsnorm_backward(*grads, dout, x, w, rstd)
    return grads


# scale 1e-3: mean(x^2) ~ 1e-6 is below eps = 1e-5, so a misplaced eps shows
@pytest.mark.parametrize("scale", [1.0, 1e-3])
@pytest.mark.parametrize("B,T,C", RMS_SHAPES)
def test_rmsnorm_matches_reference(rng, isa, B, T, C, scale):
    x, w, _, dout = make_inputs(rng, B, T, C)
    x *= np.float32(scale)
    out, rstd = rms_forward(x, w)
    dinp, dweight = rms_backward(dout, x, w, rstd)

    xt, wt = t64(x, grad=True), t64(w, grad=True)
    ref, ref_rstd = ref_rmsnorm(xt, wt)
    (ref * t64(dout)).sum().backward()

    tol = TOL["rmsnorm"]
    for name, ours, theirs, kind in [("out", out, ref, "fwd"), ("rstd", rstd, ref_rstd, "fwd"),
                                     ("dinp", dinp, xt.grad, "bwd"),
                                     ("dweight", dweight, wt.grad, "bwd")]:
        assert_close(name, ours, theirs, tol[kind])


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("B,T,C", RMS_SHAPES)
def test_norm_backward_written_is_the_sum_into_zeros_bitwise(rng, isa, set_threads, B, T, C,
                                                             norm, frozen):
    """written=True ignores what dinp held (NaN here) and gives bitwise the
    (+=) result on a zeroed dinp, the sign of a zero included (a token's
    gradient of -0); the parameter gradients unchanged."""
    x, w, b, dout = make_inputs(rng, B, T, C)
    dout[0, 0] = -0.0   # 0 + (-0) is +0
    if norm == "layernorm":
        _, mean, rstd = forward(x, w, b)
        into_zeros = backward(dout, x, w, mean, rstd)
    else:
        _, rstd = rms_forward(x, w)
        into_zeros = rms_backward(dout, x, w, rstd)
    assert not np.signbit(into_zeros[0][0, 0]).any()

    def run():
        dinp = np.full_like(x, np.nan)
        params = [None if frozen else np.zeros_like(w) for _ in into_zeros[1:]]
        if norm == "layernorm":
            K.layernorm_backward(dinp, *params, dout, x, w, mean, rstd, written=True)
        else:
            K.rmsnorm_backward(dinp, *params, dout, x, w, rstd, written=True)
        return {f"d{i}": g for i, g in enumerate([dinp] + params) if g is not None}
    for name, ours in run().items():
        theirs = into_zeros[int(name[1:])]
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), name
    assert_thread_invariant(set_threads, run)


def test_rmsnorm_passes_eps_through(rng):
    x, w, _, _ = make_inputs(rng, 2, 3, 16)
    x *= np.float32(1e-2)                        # mean(x^2) ~ 1e-4, against eps = 1e-3
    out, rstd = rms_forward(x, w, eps=1e-3)
    ref, ref_rstd = ref_rmsnorm(t64(x), t64(w), eps=1e-3)
    assert_close("out", out, ref, TOL["rmsnorm"]["fwd"])
    assert_close("rstd", rstd, ref_rstd, TOL["rmsnorm"]["fwd"])


def test_rmsnorm_backward_accumulates(rng):
    x, w, _, dout = make_inputs(rng, 2, 37, 67)
    _, rstd = rms_forward(x, w)
    once = rms_backward(dout, x, w, rstd)
    twice = rms_backward(dout, x, w, rstd, calls=2)
    for name, a, b2 in zip(["dinp", "dweight"], once, twice):
        assert_close(name, b2, 2.0 * a, TOL["rmsnorm"]["bwd"])


def test_rmsnorm_thread_invariant(rng, isa, set_threads):
    # 268 rows: 5 chunks of the parameter-gradient sums, the last partial
    x, w, _, dout = make_inputs(rng, 4, 67, 300)

    def run():
        out, rstd = rms_forward(x, w)
        dinp, dweight = rms_backward(dout, x, w, rstd)
        return dict(out=out, rstd=rstd, dinp=dinp, dweight=dweight)
    assert_thread_invariant(set_threads, run)


def test_rmsnorm_rejects_negative_eps(rng):
    x, w, _, _ = make_inputs(rng, 1, 2, 8)
    out, rstd = rms_forward(x, w)
    for eps in (-1e-5, np.nan):
        with pytest.raises(llmc_py.InvalidValueError, match="outside its domain"):
            K.rmsnorm_forward(out, rstd, x, w, eps=eps)


@pytest.mark.parametrize("bad", ["weight", "rstd", "out"])
def test_rmsnorm_rejects_wrong_shape(rng, bad):
    x, w, _, _ = make_inputs(rng, 2, 3, 8)
    args = dict(out=np.empty_like(x), rstd=np.empty((2, 3), np.float32), inp=x, weight=w)
    args[bad] = np.zeros(args[bad].shape[:-1] + (args[bad].shape[-1] + 1,), np.float32)
    with pytest.raises(llmc_py.ShapeError, match=bad):
        K.rmsnorm_forward(**args)


@pytest.mark.parametrize("bad", ["dinp", "dweight", "rstd"])
def test_rmsnorm_backward_rejects_wrong_shape(rng, bad):
    x, w, _, dout = make_inputs(rng, 2, 3, 8)
    _, rstd = rms_forward(x, w)
    args = dict(dinp=np.zeros_like(x), dweight=np.zeros_like(w), dout=dout, inp=x, weight=w,
                rstd=rstd)
    args[bad] = np.zeros(args[bad].shape[:-1] + (args[bad].shape[-1] + 1,), np.float32)
    with pytest.raises(llmc_py.ShapeError, match=bad):
        K.rmsnorm_backward(**args)


def test_rmsnorm_rejects_wrong_dtype(rng):
    x, w, _, dout = make_inputs(rng, 2, 3, 8)
    _, rstd = rms_forward(x, w)
    with pytest.raises(TypeError, match="dout"):
        rms_backward(dout.astype(np.float64), x, w, rstd)


# ---- per-head RMSNorm on packed q, k, v (Qwen3's q_norm, k_norm) -----------

HEAD_SHAPES = [  # B, T, NH, NKV, hs
    (2, 64, 16, 8, 128),   # Qwen3-0.6B's heads
    (1, 1, 4, 1, 24),
    (3, 37, 6, 3, 15),     # hs=15: no vector width divides it
]


def head_forward(x, qw, kw, NH, NKV, eps=1e-6):
    B, T, _ = x.shape
    out = np.full_like(x, np.nan)                       # (written): must not be read
    rstd = np.full((B, T, NH + NKV), np.nan, np.float32)
    K.head_rmsnorm_forward(out, rstd, x, qw, kw, NH, NKV, eps)
    return out, rstd


def head_backward(dout, x, qw, kw, rstd, NH, NKV):
    grads = np.zeros_like(x), np.zeros_like(qw), np.zeros_like(kw)
    K.head_rmsnorm_backward(*grads, dout, x, qw, kw, rstd, NH, NKV)
    return grads


def head_inputs(rng, B, T, NH, NKV, hs):
    x = randn(rng, B, T, (NH + 2 * NKV) * hs)
    return x, randn(rng, hs) + np.float32(1.0), randn(rng, hs) + np.float32(1.0), \
        randn(rng, *x.shape)


@pytest.mark.parametrize("B,T,NH,NKV,hs", HEAD_SHAPES)
def test_head_rmsnorm_matches_reference(rng, isa, B, T, NH, NKV, hs):
    x, qw, kw, dout = head_inputs(rng, B, T, NH, NKV, hs)
    out, rstd = head_forward(x, qw, kw, NH, NKV)
    dinp, dqw, dkw = head_backward(dout, x, qw, kw, rstd, NH, NKV)

    xt, qt, kt = t64(x, grad=True), t64(qw, grad=True), t64(kw, grad=True)
    ref, ref_rstd = ref_head_rmsnorm(xt, qt, kt, NH, NKV, eps=1e-6)
    (ref * t64(dout)).sum().backward()
    tol = TOL["rmsnorm"]
    for name, ours, theirs, kind in [("out", out, ref, "fwd"), ("rstd", rstd, ref_rstd, "fwd"),
                                     ("dinp", dinp, xt.grad, "bwd"),
                                     ("dqweight", dqw, qt.grad, "bwd"),
                                     ("dkweight", dkw, kt.grad, "bwd")]:
        assert_close(name, ours, theirs, tol[kind])
    # the v heads pass through unchanged, both ways
    v0 = (NH + NKV) * hs
    assert np.array_equal(out[..., v0:], x[..., v0:])
    assert np.array_equal(dinp[..., v0:], dout[..., v0:])


def test_head_rmsnorm_in_place_and_rows_as_rmsnorm(rng):
    """In place gives the same bits; each head is bitwise rmsnorm_forward's row."""
    NH, NKV, hs = 4, 2, 24
    x, qw, kw, _ = head_inputs(rng, 2, 5, NH, NKV, hs)
    out, rstd = head_forward(x, qw, kw, NH, NKV)
    inplace = x.copy()
    K.head_rmsnorm_forward(inplace, np.empty_like(rstd), inplace, qw, kw, NH, NKV, 1e-6)
    assert np.array_equal(inplace, out)
    heads = x.reshape(2, 5, NH + 2 * NKV, hs)
    q_out, q_rstd = rms_forward(np.ascontiguousarray(heads[:, :, :NH]).reshape(2, 5 * NH, hs),
                                qw, eps=1e-6)
    assert np.array_equal(q_out.reshape(2, 5, NH * hs), out[..., :NH * hs])
    assert np.array_equal(q_rstd.reshape(2, 5, NH), rstd[..., :NH])


def test_head_rmsnorm_thread_invariant(rng, isa, set_threads):
    x, qw, kw, dout = head_inputs(rng, 3, 41, 8, 2, 40)

    def run():
        out, rstd = head_forward(x, qw, kw, 8, 2)
        dinp, dqw, dkw = head_backward(dout, x, qw, kw, rstd, 8, 2)
        return dict(out=out, rstd=rstd, dinp=dinp, dqw=dqw, dkw=dkw)
    assert_thread_invariant(set_threads, run)


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("B,T,NH,NKV,hs", HEAD_SHAPES)
def test_head_rmsnorm_backward_written_is_the_sum_into_zeros_bitwise(rng, isa, set_threads, B,
                                                                     T, NH, NKV, hs, frozen):
    """written=True ignores what dinp held (NaN here) and gives bitwise the
    (+=) result on a zeroed dinp, the sign of a zero included (a token's
    gradient of -0, q, k and v heads); the weights' gradients unchanged."""
    x, qw, kw, dout = head_inputs(rng, B, T, NH, NKV, hs)
    dout[0, 0, :] = -0.0   # 0 + (-0) is +0
    _, rstd = head_forward(x, qw, kw, NH, NKV)
    into_zeros = head_backward(dout, x, qw, kw, rstd, NH, NKV)
    assert np.signbit(into_zeros[0][0, 0]).sum() == 0

    def run():
        dinp = np.full_like(x, np.nan)
        dqw, dkw = (None, None) if frozen else (np.zeros_like(qw), np.zeros_like(kw))
        K.head_rmsnorm_backward(dinp, dqw, dkw, dout, x, qw, kw, rstd, NH, NKV, written=True)
        return {"dinp": dinp} if frozen else {"dinp": dinp, "dqw": dqw, "dkw": dkw}
    for name, ours in run().items():
        theirs = into_zeros[("dinp", "dqw", "dkw").index(name)]
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), name
    assert_thread_invariant(set_threads, run)


@pytest.mark.parametrize("bad", ["qweight", "kweight", "rstd"])
def test_head_rmsnorm_rejects_wrong_shape(rng, bad):
    x, qw, kw, _ = head_inputs(rng, 2, 3, 4, 2, 8)
    args = dict(out=np.empty_like(x), rstd=np.empty((2, 3, 6), np.float32), inp=x,
                qweight=qw, kweight=kw, NH=4, NKV=2)
    args[bad] = np.zeros(args[bad].shape[:-1] + (args[bad].shape[-1] + 1,), np.float32)
    with pytest.raises(llmc_py.ShapeError, match=bad):
        K.head_rmsnorm_forward(**args)
    with pytest.raises(llmc_py.InvalidValueError, match="outside its domain"):
        K.head_rmsnorm_forward(np.empty_like(x), np.empty((2, 3, 6), np.float32), x, qw, kw,
                               4, 2, eps=np.nan)


def test_frozen_norms_skip_their_weight_gradients_and_keep_dinp(rng):
    """dweight (and dbias) None: the same dinp to the bit, no sums (LoRA's frozen base)."""
    x, w, b, dout = make_inputs(rng, 2, 37, 67)
    _, mean, rstd = forward(x, w, b)
    dinp = np.zeros_like(x)
    K.layernorm_backward(dinp, None, None, dout, x, w, mean, rstd)
    assert np.array_equal(dinp, backward(dout, x, w, mean, rstd)[0])
    _, rstd = rms_forward(x, w)
    dinp = np.zeros_like(x)
    K.rmsnorm_backward(dinp, None, dout, x, w, rstd)
    assert np.array_equal(dinp, rms_backward(dout, x, w, rstd)[0])
    NH, NKV, hs = 4, 2, 16
    x, qw, kw, dout = head_inputs(rng, 2, 5, NH, NKV, hs)
    _, rstd = head_forward(x, qw, kw, NH, NKV)
    dinp = np.zeros_like(x)
    K.head_rmsnorm_backward(dinp, None, None, dout, x, qw, kw, rstd, NH, NKV)
    assert np.array_equal(dinp, head_backward(dout, x, qw, kw, rstd, NH, NKV)[0])
    with pytest.raises(llmc_py.NullPointerError):   # one of the two alone
        K.head_rmsnorm_backward(dinp, qw.copy(), None, dout, x, qw, kw, rstd, NH, NKV)


# ---- bf16 outputs and the fused residual add -------------------------------------

def bf16_of(x):
    """x rounded to bf16 (uint16) by float_to_bf16, nearest even."""
    out = np.empty(x.shape, np.uint16)
    K.float_to_bf16(out, np.ascontiguousarray(x))
    return out


def run_norm(norm, out, stats, x, w, b):
    """layernorm_forward (stats: mean, rstd) or rmsnorm_forward (stats: rstd) into out."""
    if norm == "layernorm":
        K.layernorm_forward(out, *stats, x, w, b)
    else:
        K.rmsnorm_forward(out, stats[1], x, w)


def norm_outputs(norm, x, w, b, dtype, residual_of=None):
    """{out, mean, rstd} of norm on x, out in dtype; with residual_of = (a, c)
    the fused kernel on a + c instead (x unused), adding "residual"."""
    B, T, C = (residual_of[0] if residual_of else x).shape
    out = np.full((B, T, C), 0xFFFF if dtype == np.uint16 else np.nan, dtype)
    stats = np.full((B, T), np.nan, np.float32), np.full((B, T), np.nan, np.float32)
    if residual_of is None:
        run_norm(norm, out, stats, x, w, b)
        return {"out": out, "mean": stats[0], "rstd": stats[1]}
    residual = np.full((B, T, C), np.nan, np.float32)
    if norm == "layernorm":
        K.residual_layernorm_forward(residual, out, *stats, *residual_of, w, b)
    else:
        K.residual_rmsnorm_forward(residual, out, stats[1], *residual_of, w)
    return {"out": out, "mean": stats[0], "rstd": stats[1], "residual": residual}


def bits(arrays):
    return {name: a.view(np.uint16 if a.dtype == np.uint16 else np.uint32)
            for name, a in arrays.items()}


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("B,T,C", SHAPES + [(1, 3, 1), (2, 3, 17)])
def test_bf16_output_is_the_float32_output_rounded(rng, isa, set_threads, norm, B, T, C):
    """out in bf16 is bitwise float_to_bf16 of the float32 out (the same value
    rounded, nearest even), the statistics bitwise the same, on every
    instruction set and thread count."""
    x, w, b, _ = make_inputs(rng, B, T, C)
    x.reshape(-1)[:3] = [np.inf, 1e38, -3e-39]   # overflow to inf, a denormal
    f32 = norm_outputs(norm, x, w, b, np.float32)
    expected = bits({**f32, "out": bf16_of(f32["out"])})
    for threads in (1, 2, 3):
        set_threads(threads)
        ours = bits(norm_outputs(norm, x, w, b, np.uint16))
        for name, value in expected.items():
            assert np.array_equal(ours[name], value), f"{name}, {threads} threads"


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("B,T,C", SHAPES + [(1, 3, 1)])
def test_residual_norm_is_residual_forward_then_the_norm_bitwise(rng, isa, set_threads, norm,
                                                                 dtype, B, T, C):
    """residual_*norm_forward: residual = inp1 + inp2 and the norm of it, in
    one pass, bitwise residual_forward followed by the norm (out float32 or
    bf16), at 1, 2 and 3 threads."""
    a, w, b, c = make_inputs(rng, B, T, C, offset=3.0)
    residual = np.empty_like(a)
    K.residual_forward(residual, a, c)
    expected = bits({**norm_outputs(norm, residual, w, b, dtype), "residual": residual})
    for threads in (1, 2, 3):
        set_threads(threads)
        ours = bits(norm_outputs(norm, None, w, b, dtype, residual_of=(a, c)))
        for name, value in expected.items():
            assert np.array_equal(ours[name], value), f"{name}, {threads} threads"


def test_norm_output_dtype_is_checked(rng):
    from llmc_py._native.lib import ffi, lib
    x, w, b, _ = make_inputs(rng, 1, 2, 8)
    stat = np.empty((1, 2), np.float32)
    with pytest.raises(TypeError, match="out must be a float32 or bf16"):
        K.layernorm_forward(np.empty(x.shape, np.float64), stat, stat, x, w, b)
    with pytest.raises(TypeError, match="out must be a float32 or bf16"):
        K.residual_rmsnorm_forward(np.empty_like(x), np.empty(x.shape, np.int32), stat, x, x, w)
    fp = lambda a: ffi.cast("float*", a.ctypes.data)
    out = np.empty_like(x)
    assert lib.rmsnorm_forward(fp(out), fp(stat), fp(x), fp(w), 1, 2, 8, 1e-5, 2) \
        == lib.LLMC_ERR_VALUE
    assert lib.residual_layernorm_forward(fp(out), fp(out), fp(stat), fp(stat), fp(x), ffi.NULL,
                                          fp(w), fp(b), 1, 2, 8, 1e-5, 0) == lib.LLMC_ERR_NULL
