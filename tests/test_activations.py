"""csrc/activations.c: GELU (tanh approximation and exact), ReLU, the gated
MLPs (SwiGLU, GeGLU, ReGLU) and the residual add."""
import numpy as np
import pytest
import torch

import llmc_py
from llmc_py import kernels as K
from helpers import TOL, assert_close, assert_thread_invariant, randn, t64
from reference import gelu as ref_gelu
from reference import gelu_erf as ref_gelu_erf
from reference import geglu as ref_geglu
from reference import reglu as ref_reglu
from reference import relu as ref_relu
from reference import residual as ref_residual
from reference import swiglu as ref_swiglu

SHAPES = [
    (4, 64, 3072),   # GPT-2 124M MLP hidden layer
    (1,),
    (37, 67),
]
# tanh saturation, the origin, and both tails
SPECIAL = np.array([-10.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 10.0], np.float32)


def gelu_inputs(rng, shape):
    x = randn(rng, *shape, scale=3.0)
    n = min(x.size, SPECIAL.size)
    x.reshape(-1)[:n] = SPECIAL[:n]
    return x, randn(rng, *shape)


def gelu_backward(dout, x, calls=1):
    dinp = np.zeros_like(x)
    for _ in range(calls):
        K.gelu_backward(dinp, dout, x)
    return dinp


@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_matches_reference(rng, isa, shape):
    x, dout = gelu_inputs(rng, shape)
    out = np.full_like(x, np.nan)   # (written): must not be read
    K.gelu_forward(out, x)
    dinp = gelu_backward(dout, x)

    xt = t64(x, grad=True)
    ref = ref_gelu(xt)
    (ref * t64(dout)).sum().backward()

    assert_close("out", out, ref, TOL["gelu"]["fwd"])
    assert_close("dinp", dinp, xt.grad, TOL["gelu"]["bwd"])


def test_gelu_backward_accumulates(rng):
    x, dout = gelu_inputs(rng, (37, 67))
    assert_close("dinp", gelu_backward(dout, x, calls=2), 2.0 * gelu_backward(dout, x),
                 TOL["gelu"]["bwd"])


# 7437 elements: uneven shares, a partial block; 18685: above LLMC_PARALLEL_MIN
# (common.h, 16384), below which a forward runs on one thread
@pytest.mark.parametrize("shape", [(3, 37, 67), (5, 37, 101)])
def test_gelu_and_residual_thread_invariant(rng, isa, set_threads, shape):
    x, dout = gelu_inputs(rng, shape)
    other = randn(rng, *x.shape)

    def run():
        out, res = np.empty_like(x), np.empty_like(x)
        K.gelu_forward(out, x)
        K.residual_forward(res, x, other)
        d1, d2 = np.zeros_like(x), np.zeros_like(x)
        K.residual_backward(d1, d2, dout)
        return {"gelu": out, "dgelu": gelu_backward(dout, x), "residual": res, "dinp1": d1,
                "dinp2": d2}
    assert_thread_invariant(set_threads, run)


@pytest.mark.parametrize("shape", SHAPES)
def test_residual_matches_reference(rng, isa, shape):
    a, b, dout = randn(rng, *shape), randn(rng, *shape), randn(rng, *shape)
    out = np.full_like(a, np.nan)
    K.residual_forward(out, a, b)
    assert_close("out", out, ref_residual(t64(a), t64(b)), TOL["residual"]["fwd"])

    da, db = np.ones_like(a), np.full_like(a, 2.0)   # (+=): starts are kept
    K.residual_backward(da, db, dout)
    K.residual_backward(da, db, dout)
    assert_close("dinp1", da, 1.0 + 2.0 * dout.astype(np.float64), TOL["residual"]["bwd"])
    assert_close("dinp2", db, 2.0 + 2.0 * dout.astype(np.float64), TOL["residual"]["bwd"])


@pytest.mark.parametrize("alias", ["inp1", "inp2"])
def test_residual_forward_may_alias_an_input(rng, alias):
    a, b = randn(rng, 37, 67), randn(rng, 37, 67)
    expected = a + b   # fp32, one rounding: the kernel must give exactly this
    out = a if alias == "inp1" else b
    K.residual_forward(out, a, b)
    assert np.array_equal(out, expected)


@pytest.mark.parametrize("kernel", ["gelu_forward", "residual_forward"])
def test_activations_reject_wrong_shape(rng, kernel):
    x = randn(rng, 4, 5)
    args = [np.empty((4, 6), np.float32), x] + ([x] if kernel == "residual_forward" else [])
    with pytest.raises(llmc_py.ShapeError, match="out"):
        getattr(K, kernel)(*args)


def test_activations_reject_wrong_dtype(rng):
    x = randn(rng, 4, 5)
    with pytest.raises(TypeError, match="out"):
        K.gelu_forward(np.empty((4, 5), np.float64), x)
    with pytest.raises(TypeError, match="dinp2"):
        K.residual_backward(np.zeros_like(x), np.zeros((4, 5), np.int32), x)


# ---- SwiGLU -------------------------------------------------------------------

SWIGLU_SHAPES = [  # inp shapes (..., 2FF)
    (4, 64, 2 * 2048),   # Llama-ish MLP: FF = 2048
    (1, 2),              # FF = 1
    (37, 2 * 67),        # FF = 67: every row ends in a partial vector
    (3, 5, 2 * 40),      # two leading dims
    (2 * 17,),           # one row (N = 1)
]
# gates: both saturated tails (e^100 overflows float, but not the kernel), the
# origin, and silu's minimum near -1.28
SWIGLU_SPECIAL = np.array([20.0, -100.0, 100.0, -88.0, 88.0, -20.0, -1.2785, -1e-3, 0.0, 1e-3],
                          np.float32)


def swiglu_inputs(rng, shape):
    x = randn(rng, *shape, scale=3.0)
    FF = shape[-1] // 2
    n = min(FF, SWIGLU_SPECIAL.size)
    x.reshape(-1, 2 * FF)[0, :n] = SWIGLU_SPECIAL[:n]
    return x, randn(rng, *shape[:-1], FF)


def swiglu_forward(x):
    out = np.full(x.shape[:-1] + (x.shape[-1] // 2,), np.nan, np.float32)   # (written)
    K.swiglu_forward(out, x)
    return out


def swiglu_backward(dout, x, calls=1):
    dinp = np.zeros_like(x)
    for _ in range(calls):
        K.swiglu_backward(dinp, dout, x)
    return dinp


@pytest.mark.parametrize("shape", SWIGLU_SHAPES)
def test_swiglu_matches_reference(rng, isa, shape):
    x, dout = swiglu_inputs(rng, shape)
    out = swiglu_forward(x)
    dinp = swiglu_backward(dout, x)

    xt = t64(x, grad=True)
    ref = ref_swiglu(xt)
    (ref * t64(dout)).sum().backward()

    assert_close("out", out, ref, TOL["swiglu"]["fwd"])
    assert_close("dinp", dinp, xt.grad, TOL["swiglu"]["bwd"])


def test_silu_is_accurate_element_by_element(rng):
    # up = 1 and dout = 1 make out = silu(gate), dgate = silu'(gate), dup = silu(gate):
    # each is held to a few ulp of its own size, not of the tensor's largest entry
    gate = np.concatenate([randn(rng, 4000, scale=10.0), SWIGLU_SPECIAL])
    gate = gate[np.abs(gate) <= 80.0]   # silu(-80) ~ -1e-33 still a normal float
    FF = gate.size
    x = np.concatenate([gate, np.ones(FF, np.float32)])
    out = swiglu_forward(x)
    dinp = swiglu_backward(np.ones(FF, np.float32), x)

    g = t64(gate, grad=True)
    ref = ref_swiglu(torch.cat([g, torch.ones_like(g)]))
    ref.sum().backward()
    ref = ref.detach().numpy()
    nonzero = ref != 0
    rel = np.abs(out[nonzero] - ref[nonzero]) / np.abs(ref[nonzero])
    assert rel.max() <= TOL["swiglu"]["silu"], f"silu: worst relative error {rel.max():.2e}"
    assert out[gate == 0].tolist() == [0.0]
    assert np.array_equal(dinp[FF:], out), "dup is not silu(gate)"
    # silu' crosses 0 near -1.28, so it is held against its largest value there
    assert_close("dgate", dinp[:FF], g.grad, TOL["swiglu"]["silu"])


def test_swiglu_extreme_gates_stay_finite():
    # silu(g) -> g and silu'(g) -> 1 for large g; both -> 0 for very negative g
    gate = np.array([-3e38, -1e30, -1e4, -100.0, 100.0, 1e4, 1e30, 3e38], np.float32)
    FF = gate.size
    x = np.concatenate([gate, np.full(FF, 0.5, np.float32)])   # up = 0.5: exact products
    out = swiglu_forward(x)
    dinp = swiglu_backward(np.ones(FF, np.float32), x)
    assert np.isfinite(out).all() and np.isfinite(dinp).all()
    positive = gate > 0
    assert np.array_equal(out, np.where(positive, 0.5 * gate, 0.0))
    assert np.array_equal(dinp[:FF], np.where(positive, 0.5, 0.0))     # up * silu'(gate)
    assert np.array_equal(dinp[FF:], np.where(positive, gate, 0.0))    # silu(gate)


def test_swiglu_propagates_nan():
    x = np.array([np.nan, 1.0, 2.0, np.nan], np.float32)   # FF = 2: gate NaN, up NaN
    out = swiglu_forward(x)
    assert np.isnan(out).all()


def test_swiglu_backward_accumulates(rng):
    x, dout = swiglu_inputs(rng, (37, 2 * 67))
    assert_close("dinp", swiglu_backward(dout, x, calls=2), 2.0 * swiglu_backward(dout, x),
                 TOL["swiglu"]["bwd"])


# one long row: split too; 37 x 467 outputs: above LLMC_PARALLEL_MIN
@pytest.mark.parametrize("shape", [(37, 2 * 67), (1, 2 * 2048), (37, 2 * 467)])
def test_swiglu_thread_invariant(rng, isa, set_threads, shape):
    x, dout = swiglu_inputs(rng, shape)
    assert_thread_invariant(set_threads, lambda: dict(out=swiglu_forward(x),
                                                      dinp=swiglu_backward(dout, x)))


def test_swiglu_rejects_wrong_shapes(rng):
    x, dout = swiglu_inputs(rng, (4, 10))
    with pytest.raises(llmc_py.ShapeError, match="inp"):
        K.swiglu_forward(np.empty((4, 2), np.float32), randn(rng, 4, 5))   # odd: no [gate | up]
    with pytest.raises(llmc_py.ShapeError, match="out"):
        K.swiglu_forward(np.empty((4, 10), np.float32), x)    # out is [N, FF], not [N, 2FF]
    with pytest.raises(llmc_py.ShapeError, match="out"):
        K.swiglu_forward(np.empty((2, 2, 5), np.float32), x)  # leading dims must match
    with pytest.raises(llmc_py.ShapeError, match="dout"):
        K.swiglu_backward(np.zeros_like(x), np.zeros((4, 10), np.float32), x)
    with pytest.raises(llmc_py.ShapeError, match="dinp"):
        K.swiglu_backward(np.zeros((4, 5), np.float32), dout, x)
    with pytest.raises(llmc_py.ShapeError):
        K.swiglu_forward(np.empty((0, 5), np.float32), np.empty((0, 10), np.float32))


def test_swiglu_rejects_wrong_dtype(rng):
    x, dout = swiglu_inputs(rng, (4, 10))
    with pytest.raises(TypeError, match="out"):
        K.swiglu_forward(np.empty((4, 5), np.float64), x)
    with pytest.raises(TypeError, match="inp"):
        K.swiglu_forward(np.empty((4, 5), np.float32), x.tolist())


# ---- ReLU, exact GELU, GeGLU, ReGLU ---------------------------------------------
#
# The element-wise ones share gelu's shapes and special values, the gated ones
# SwiGLU's (a row holds [gate | up]).

ELEMENTWISE = {"relu": ref_relu, "gelu_erf": ref_gelu_erf}
GATED = {"geglu": ref_geglu, "reglu": ref_reglu}


def elementwise_run(name, x, dout, calls=1):
    out = np.full_like(x, np.nan)   # (written): must not be read
    getattr(K, f"{name}_forward")(out, x)
    dinp = np.zeros_like(x)
    for _ in range(calls):
        getattr(K, f"{name}_backward")(dinp, dout, x)
    return out, dinp


def gated_run(name, x, dout, calls=1):
    out = np.full(x.shape[:-1] + (x.shape[-1] // 2,), np.nan, np.float32)
    getattr(K, f"{name}_forward")(out, x)
    dinp = np.zeros_like(x)
    for _ in range(calls):
        getattr(K, f"{name}_backward")(dinp, dout, x)
    return out, dinp


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_activations_match_reference(rng, isa, name, shape):
    x, dout = gelu_inputs(rng, shape)
    out, dinp = elementwise_run(name, x, dout)
    xt = t64(x, grad=True)
    ref = ELEMENTWISE[name](xt)
    (ref * t64(dout)).sum().backward()
    assert_close("out", out, ref, TOL[name]["fwd"])
    assert_close("dinp", dinp, xt.grad, TOL[name]["bwd"])


@pytest.mark.parametrize("shape", SWIGLU_SHAPES)
@pytest.mark.parametrize("name", GATED)
def test_gated_activations_match_reference(rng, isa, name, shape):
    x, dout = swiglu_inputs(rng, shape)
    out, dinp = gated_run(name, x, dout)
    xt = t64(x, grad=True)
    ref = GATED[name](xt)
    (ref * t64(dout)).sum().backward()
    assert_close("out", out, ref, TOL[name]["fwd"])
    assert_close("dinp", dinp, xt.grad, TOL[name]["bwd"])


def test_exact_gelu_differs_from_the_tanh_form_and_keeps_its_left_tail():
    # the two GELUs differ by ~1e-4 near |x| ~ 2; exact GELU at -5 is
    # -5 Phi(-5) = -1.4333e-6, which 1 + erf(-5 / sqrt 2) in float would lose
    x = np.array([-5.0, -2.0, 2.0, 0.0], np.float32)
    exact, tanh_form = np.empty_like(x), np.empty_like(x)
    K.gelu_erf_forward(exact, x)
    K.gelu_forward(tanh_form, x)
    assert np.abs(exact - tanh_form).max() > 5e-5
    ref = ref_gelu_erf(t64(x)).numpy()
    assert abs(exact[0] - ref[0]) <= 1e-5 * abs(ref[0]), (exact[0], ref[0])
    assert exact[3] == 0.0


def test_geglu_gate_is_gelu_forward_bitwise(rng):
    # up = 1: GeGLU's gate runs gelu_forward's very arithmetic
    gate = randn(rng, 67, scale=3.0)
    x = np.concatenate([gate, np.ones_like(gate)])
    out, _ = gated_run("geglu", x, np.ones(67, np.float32))
    expected = np.empty_like(gate)
    K.gelu_forward(expected, gate)
    assert np.array_equal(out, expected)


def test_relu_derivative_at_zero_and_nan():
    x = np.array([-1.0, 0.0, 2.0, np.nan], np.float32)
    out, dinp = elementwise_run("relu", x, np.full(4, 3.0, np.float32))
    assert out[:3].tolist() == [0.0, 0.0, 2.0] and np.isnan(out[3])
    assert dinp[:3].tolist() == [0.0, 0.0, 3.0]   # relu'(0) = 0, as torch


@pytest.mark.parametrize("wide", [1, 7])   # 7: above LLMC_PARALLEL_MIN
@pytest.mark.parametrize("name", list(ELEMENTWISE) + list(GATED))
def test_new_activations_accumulate_and_are_thread_invariant(rng, isa, set_threads, name, wide):
    if name in GATED:
        x, dout = swiglu_inputs(rng, (37, 2 * 67 * wide))
        run = gated_run
    else:
        x, dout = gelu_inputs(rng, (3, 37, 67 * wide))
        run = elementwise_run
    once, twice = run(name, x, dout)[1], run(name, x, dout, calls=2)[1]
    assert_close("dinp", twice, 2.0 * once.astype(np.float64), 2.0 ** -23)
    assert_thread_invariant(set_threads, lambda: dict(zip(("out", "dinp"), run(name, x, dout))))


@pytest.mark.parametrize("name", list(ELEMENTWISE) + list(GATED))
def test_new_activations_reject_wrong_shapes(rng, name):
    x = randn(rng, 4, 10)
    with pytest.raises(llmc_py.ShapeError, match="out"):
        getattr(K, f"{name}_forward")(np.empty((4, 7), np.float32), x)
    with pytest.raises(llmc_py.ShapeError, match="dout"):
        getattr(K, f"{name}_backward")(np.zeros_like(x), np.zeros((4, 7), np.float32), x)


# ---- bf16 outputs: every MLP activation's forward ------------------------------------

@pytest.mark.parametrize("name", K.MLP_ACTIVATIONS)
def test_bf16_output_is_the_float32_output_rounded(rng, isa, set_threads, name):
    """out in bf16 is bitwise float_to_bf16 of the float32 out (nearest even;
    NaN quiet, overflow to inf), whole and partial vectors, rows split across
    threads, at 1, 2 and 3 threads."""
    forward_kernel = K.MLP_ACTIVATIONS[name][0]
    gated = name in ("swiglu", "geglu", "reglu")
    for shape in ([(37, 2 * 67), (2 * 17,), (1, 2 * 2048), (3, 5, 2 * 40)] if gated
                  else [(1,), (37, 67), (2, 3, 1000)]):
        x = randn(rng, *shape, scale=3.0)
        special = np.array([np.nan, np.inf, -np.inf, 3.4e38, 1e-40, -0.0, 1.0 + 2.0 ** -8],
                           np.float32)
        n = min(x.size, special.size)
        x.reshape(-1)[:n] = special[:n]
        out_shape = shape[:-1] + (shape[-1] // 2,) if gated else shape
        assert_bf16_out_rounded(forward_kernel, x, out_shape, set_threads, f"{name} {shape}")


def assert_bf16_out_rounded(forward_kernel, x, out_shape, set_threads, what):
    """forward_kernel's bf16 out of x is bitwise float_to_bf16 of its float32
    out, at 1, 2 and 3 threads; returns the float32 out. Where the float32 out
    is NaN the bf16 out is a quiet NaN of either sign: IEEE 754 leaves a NaN
    result's sign open, and the two paths, inlined apart, may take it from
    different operands (the -O1 sanitizer build gives -NaN and +NaN for
    swiglu's silu(NaN) up)."""
    f32 = np.empty(out_shape, np.float32)
    forward_kernel(f32, x)
    expected = np.empty(out_shape, np.uint16)
    K.float_to_bf16(expected, f32)
    nan = np.isnan(f32)
    quiet_nan = lambda h: ((h & 0x7FFF) > 0x7F80) & ((h & 0x0040) != 0)
    for threads in (1, 2, 3):
        set_threads(threads)
        ours = np.full(out_shape, 0xFFFF, np.uint16)
        forward_kernel(ours, x)
        assert np.array_equal(ours[~nan], expected[~nan]), f"{what}, {threads} threads"
        assert quiet_nan(ours[nan]).all(), f"{what}, {threads} threads: NaN"
    return f32


def test_activation_output_dtype_is_checked(rng):
    from llmc_py._native.lib import ffi, lib
    x = randn(rng, 4, 6)
    with pytest.raises(TypeError, match="out must be a float32 or bf16"):
        K.swiglu_forward(np.empty((4, 3), np.float64), x)
    fp = lambda a: ffi.cast("float*", a.ctypes.data)
    out = np.empty_like(x)
    for kernel in (lib.gelu_forward, lib.relu_forward, lib.gelu_erf_forward):
        assert kernel(fp(out), fp(x), x.size, 2) == lib.LLMC_ERR_VALUE
    assert lib.reglu_forward(fp(out), fp(x), 4, 3, -1) == lib.LLMC_ERR_VALUE


@pytest.mark.parametrize("isa_name", llmc_py.supported_isas())
@pytest.mark.parametrize("name", ["gelu", "relu"])
def test_bf16_output_converted_is_the_integer_rounding(rng, use_isa, set_threads, isa_name,
                                                       name):
    """Every instruction set's bf16 out, avx512bf16's vcvtneps2bf16 too, is
    bitwise float_to_bf16 of the float32 out: over many whole vectors, with
    denormal outputs (which that instruction reads as 0) in some runs of
    vectors and not in others, ties, NaNs with payloads, infinities and the
    largest floats, at 1, 2 and 3 threads."""
    use_isa(isa_name)
    forward_kernel = K.MLP_ACTIVATIONS[name][0]
    N = 64 * 16 * 5 + 7     # five runs of 64 vectors and a partial block
    x = randn(rng, N, scale=3.0)
    bits = x.view(np.uint32)
    # denormals scattered in the second run, and at the edges of the fourth
    bits[1024 + rng.integers(0, 1024, 40)] = rng.integers(1, 0x00800000, 40, dtype=np.uint32)
    bits[3072] = 0x007fffff
    bits[4095] = 0x80008000
    bits[2 * 1024 + 5: 2 * 1024 + 13] = [0x7fc00001, 0xffa00000, 0x7f800000, 0xff800000,
                                          0x7f7fffff, 0x3f808000, 0x3f818000, 0x00800000]
    f32 = assert_bf16_out_rounded(forward_kernel, x, (N,), set_threads, f"{name}, {isa_name}")
    assert ((f32 != 0) & (np.abs(f32) < np.finfo(np.float32).tiny)).sum() >= 10


@pytest.mark.parametrize("name", K.MLP_ACTIVATIONS)
def test_written_backward_is_the_sum_into_zeros_bitwise(rng, isa, set_threads, name):
    """written=True ignores what dinp held (NaN here) and gives bitwise the
    (+=) result on a zeroed dinp, the sign of a zero included."""
    if name in ("swiglu", "geglu", "reglu"):
        x, dout = swiglu_inputs(rng, (37, 2 * 67))
    else:
        x, dout = gelu_inputs(rng, (3, 37, 67))
    dout.reshape(-1)[:5] = -0.0   # a -0 gradient: 0 + (-0) is +0
    backward = K.MLP_ACTIVATIONS[name][1]
    into_zeros = np.zeros_like(x)
    backward(into_zeros, dout, x)

    def run():
        dinp = np.full_like(x, np.nan)
        backward(dinp, dout, x, written=True)
        return {"dinp": dinp}
    assert np.array_equal(run()["dinp"].view(np.uint32), into_zeros.view(np.uint32))
    assert_thread_invariant(set_threads, run)


@pytest.mark.parametrize("isa_name", llmc_py.supported_isas())
@pytest.mark.parametrize("name", ["swiglu", "geglu", "reglu"])
def test_gated_bf16_output_converted_is_the_integer_rounding(rng, use_isa, set_threads,
                                                              isa_name, name):
    """As test_bf16_output_converted_is_the_integer_rounding, for the gated
    kernels, whose runs of vectors stop at each row's end: rows of two runs
    and a partial block, denormal outputs (a gate of 1 times an up of ~1e-39)
    in some runs only, NaN and infinite ups, rows split across threads."""
    use_isa(isa_name)
    forward_kernel = K.MLP_ACTIVATIONS[name][0]
    N, FF = 3, 2 * 64 * 16 + 7
    x = randn(rng, N, 2 * FF, scale=3.0)
    gate, up = x[:, :FF], x[:, FF:]
    cols = 1024 + rng.integers(0, 1024, 40)      # the second run of row 1
    gate[1, cols] = 1.0
    up[1, cols] = rng.integers(0x100, 0x00800000, 40, dtype=np.uint32).view(np.float32)
    gate[2, FF - 3:] = 1.0                        # the partial block of row 2
    up[2, FF - 3:] = np.array([1e-39, np.nan, np.inf], np.float32)
    f32 = assert_bf16_out_rounded(forward_kernel, x, (N, FF), set_threads, f"{name}, {isa_name}")
    assert ((f32 != 0) & (np.abs(f32) < np.finfo(np.float32).tiny)).sum() >= 10


@pytest.mark.skipif("avx512" not in llmc_py.supported_isas(), reason="no AVX-512 here")
@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_gated_kernels_are_the_same_bits_on_every_isa(rng, use_isa, name):
    """SwiGLU's sigmoid on the AVX-512 builds takes exp(-|gate|) by
    vrndscaleps and vscalefps, bitwise the portable form that the avx2 build
    compiles with the same fused multiply-adds: out (float32 and bf16) and
    dinp to the bit, for gates spread over every float from -104 to +104
    and a row that ends in a partial vector."""
    forward_kernel, backward_kernel = K.MLP_ACTIVATIONS[name]
    N, FF = 5, 4096 + 9
    bits = rng.integers(0, 0x42D00000, size=(N, FF), dtype=np.int64).astype(np.uint32)
    bits[rng.random((N, FF)) < 0.5] |= 0x80000000
    x = np.concatenate([bits.view(np.float32), randn(rng, N, FF)], axis=1)
    dout = randn(rng, N, FF)
    results = {}
    for isa_name in [i for i in ("avx2", "avx512", "avx512bf16") if i in llmc_py.supported_isas()]:
        use_isa(isa_name)
        out = np.empty((N, FF), np.float32)
        forward_kernel(out, x)
        out_bf16 = np.empty((N, FF), np.uint16)
        forward_kernel(out_bf16, x)
        dinp = randn(rng, N, 2 * FF)
        backward_kernel(dinp, dout, x, written=True)
        results[isa_name] = (out.view(np.uint32), out_bf16, dinp.view(np.uint32))
    for isa_name, result in results.items():
        for what, ours, portable in zip(("out", "out bf16", "dinp"), result, results["avx2"]):
            assert np.array_equal(ours, portable), f"{what}, {isa_name}"
