"""csrc/matmul.c: both variants against the float64 reference and autograd,
the blocked GEMM against the naive loops where its tiles are partial, on
every instruction set this CPU can run."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from llmc_py._native.lib import ffi, lib
from helpers import (FP32_ISAS, TOL, WRITTEN_MASKS, WRITTEN_OUTPUTS, assert_close,
                     assert_thread_invariant, backward_written, randn, t64)
from reference import matmul as ref_matmul

VARIANTS = ["", "naive"]
# generated from what this CPU runs, so an AVX-512 machine also tests the
# AVX2 and portable kernels (and a machine without AVX-512 has no such test)
ISAS = FP32_ISAS
SHAPES = [  # B, T, C, OC
    (4, 64, 768, 768),    # GPT-2 124M attention projection
    (4, 64, 3072, 768),   # GPT-2 124M MLP projection: K=3072 spans 8 KC panels
    (1, 1, 48, 48),
    (2, 37, 67, 45),      # partial MR x NR tiles in every product
]
# The blocked kernel works in MR=6 x NR=32 micro-tiles, parallel tiles of a
# share of the rows or columns, and KC=384-deep panels; these shapes leave
# every one of them partial.
EDGE_SHAPES = [
    (1, 37, 67, 45),      # M=37 (not a multiple of 6), N=45 (>32, not a multiple of 32)
    (3, 130, 400, 33),    # K=C=400 > KC in the forward; K=BT=390 > KC in dweight
    (1, 97, 385, 65),     # K one past a panel
    (2, 3, 5, 7),         # smaller than one micro-tile
    (1, 1, 1, 1),
]


def make_inputs(rng, B, T, C, OC):
    return randn(rng, B, T, C), randn(rng, OC, C), randn(rng, OC), randn(rng, B, T, OC)


def forward(x, w, bias, variant):
    out = np.full(x.shape[:2] + (w.shape[0],), np.nan, np.float32)   # (written)
    K.matmul_forward(out, x, w, bias, variant=variant)
    return out


def backward(dout, x, w, variant, with_bias=True, calls=1):
    dinp, dweight = np.zeros_like(x), np.zeros_like(w)
    dbias = np.zeros(w.shape[0], np.float32) if with_bias else None
    for _ in range(calls):
        K.matmul_backward(dinp, dweight, dbias, dout, x, w, variant=variant)
    return {"dinp": dinp, "dweight": dweight, "dbias": dbias}


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("B,T,C,OC", SHAPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_matmul_matches_reference(rng, variant, B, T, C, OC, with_bias):
    x, w, bias, dout = make_inputs(rng, B, T, C, OC)
    bias = bias if with_bias else None
    out = forward(x, w, bias, variant)
    grads = backward(dout, x, w, variant, with_bias)

    xt, wt = t64(x, grad=True), t64(w, grad=True)
    bt = t64(bias, grad=True) if with_bias else None
    ref = ref_matmul(xt, wt, bt)
    (ref * t64(dout)).sum().backward()

    tol = TOL["matmul"]
    assert_close("out", out, ref, tol["fwd"])
    assert_close("dinp", grads["dinp"], xt.grad, tol["bwd"])
    assert_close("dweight", grads["dweight"], wt.grad, tol["bwd"])
    if with_bias:
        assert_close("dbias", grads["dbias"], bt.grad, tol["bwd"])


@pytest.mark.parametrize("B,T,C,OC", EDGE_SHAPES)
def test_matmul_fast_matches_naive(rng, B, T, C, OC):
    x, w, bias, dout = make_inputs(rng, B, T, C, OC)
    tol = TOL["matmul_variant"]
    assert_close("out", forward(x, w, bias, ""), forward(x, w, bias, "naive"), tol["fwd"])
    fast, naive = backward(dout, x, w, ""), backward(dout, x, w, "naive")
    for name in fast:
        assert_close(name, fast[name], naive[name], tol["bwd"])


# odd shapes for the ISA tests: M not a multiple of MR=6, N not of NR=32 (nor
# of AVX2's 16-column half tiles), K not of KC=384, and a single row
ISA_SHAPES = EDGE_SHAPES + [(1, 1, 67, 67), (1, 43, 515, 81)]


@pytest.mark.parametrize("B,T,C,OC", ISA_SHAPES)
@pytest.mark.parametrize("isa", ISAS)
def test_matmul_isa_matches_naive_and_reference(rng, use_isa, isa, B, T, C, OC):
    x, w, bias, dout = make_inputs(rng, B, T, C, OC)
    naive_out, naive = forward(x, w, bias, "naive"), backward(dout, x, w, "naive")
    use_isa(isa)
    assert llmc_py.get_isa() == isa
    out, grads = forward(x, w, bias, ""), backward(dout, x, w, "")

    xt, wt, bt = t64(x, grad=True), t64(w, grad=True), t64(bias, grad=True)
    ref = ref_matmul(xt, wt, bt)
    (ref * t64(dout)).sum().backward()
    tol, tol_naive = TOL["matmul"], TOL["matmul_variant"]
    assert_close("out", out, naive_out, tol_naive["fwd"])
    assert_close("out", out, ref, tol["fwd"])
    for name, ref_grad in (("dinp", xt.grad), ("dweight", wt.grad), ("dbias", bt.grad)):
        assert_close(name, grads[name], naive[name], tol_naive["bwd"])
        assert_close(name, grads[name], ref_grad, tol["bwd"])


@pytest.mark.parametrize("isa", ISAS)
def test_matmul_isa_thread_invariant(rng, set_threads, use_isa, isa):
    use_isa(isa)
    x, w, bias, dout = make_inputs(rng, 3, 131, 400, 100)   # partial tiles, K > KC
    assert_thread_invariant(set_threads, lambda: {
        "out": forward(x, w, bias, ""), **backward(dout, x, w, "")}, counts=(1, 2, 3))


# The skinny kernel (B*T <= 16 rows: decoding; 8 rows per pass) must give each
# row bitwise what the GEMM gives the same row inside a larger batch; M = 17
# is the GEMM again. C = 35 and 67 leave a
# partial k block of every vector width; OC = 45 and 1007 a partial column
# group (1007 also spreads groups over the threads); C = 16, OC = 16 is one
# whole AVX-512 block; 1 x 1 is a single multiply-add.
SKINNY_SHAPES = [(35, 45), (67, 1007), (16, 16), (1, 1), (300, 100)]
BATCH = 64   # rows of the batch whose product goes through the GEMM


def skinny_vs_gemm(rng, C, OC, with_bias):
    """(rows, gemm): the rows 5 .. 5+M of a batch of BATCH rows, each M = 1..17
    computed alone, and the same rows computed in the batch by the GEMM."""
    x, w, bias, _ = make_inputs(rng, 1, BATCH, C, OC)
    bias = bias if with_bias else None
    gemm = forward(x, w, bias, "")
    rows = {M: forward(np.ascontiguousarray(x[:, 5:5 + M]), w, bias, "") for M in range(1, 18)}
    return rows, {M: gemm[:, 5:5 + M] for M in rows}


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("C,OC", SKINNY_SHAPES)
@pytest.mark.parametrize("isa", ISAS)
def test_matmul_skinny_rows_equal_gemm_rows_bitwise(rng, use_isa, isa, C, OC, with_bias):
    use_isa(isa)
    rows, gemm = skinny_vs_gemm(rng, C, OC, with_bias)
    for M in rows:
        assert np.array_equal(rows[M], gemm[M]), (
            f"M={M}: differs by up to {np.max(np.abs(rows[M] - gemm[M])):.3e}")


@pytest.mark.parametrize("isa", ISAS)
def test_matmul_skinny_isa_matches_reference_and_threads(rng, set_threads, use_isa, isa):
    use_isa(isa)
    x, w, bias, _ = make_inputs(rng, 1, 13, 67, 1007)   # a pass of 8 rows, then 5
    ref = ref_matmul(t64(x), t64(w), t64(bias))
    assert_close("out", forward(x, w, bias, ""), ref, TOL["matmul"]["fwd"])
    assert_thread_invariant(set_threads, lambda: {"out": forward(x, w, bias, "")},
                            counts=(1, 2, 3))


def _cpu_flags():
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines()
                     if line.startswith("flags")), []))


def test_supported_isas_follow_the_cpu():
    flags = _cpu_flags()
    expected = ["portable"]
    if {"avx2", "fma"} <= flags:
        expected.append("avx2")
        if "avx512f" in flags:
            expected.append("avx512")
            if "avx512_bf16" in flags:
                expected.append("avx512bf16")
    assert llmc_py.supported_isas() == expected


def test_set_isa_auto_picks_the_best_and_rejects_the_rest(use_isa):
    use_isa("auto")
    assert llmc_py.get_isa() == llmc_py.supported_isas()[-1]
    for name in ("avx2", "avx512", "avx512bf16"):
        if name in llmc_py.supported_isas():
            continue
        with pytest.raises(llmc_py.UnsupportedError, match="not supported"):
            llmc_py.set_isa(name)
        assert llmc_py.get_isa() == llmc_py.supported_isas()[-1]
    with pytest.raises(ValueError, match="avx2"):
        llmc_py.set_isa("avx9000")
    assert llmc_py.get_isa() == llmc_py.supported_isas()[-1]


def test_raw_set_isa_checks_its_argument():
    from llmc_py._native.lib import lib
    before = lib.llmc_get_isa()
    for bad in (-1, 5, 99):
        assert lib.llmc_set_isa(bad) == lib.LLMC_ERR_RANGE
        assert lib.llmc_isa_supported(bad) == 0
    assert lib.llmc_isa_supported(lib.LLMC_ISA_AUTO) == 0   # a choice, not a kernel
    assert lib.llmc_get_isa() == before


def _import_with_isa(value):
    """Runs `import llmc_py` with LLMC_ISA=value in a fresh interpreter that
    imports this checkout's package; returns the completed process."""
    root = Path(llmc_py.__file__).resolve().parent.parent
    env = dict(os.environ, LLMC_ISA=value, PYTHONPATH=str(root))
    return subprocess.run([sys.executable, "-c", "import llmc_py; print(llmc_py.get_isa())"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_environment_variable_chooses_the_isa():
    result = _import_with_isa(ISAS[0])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ISAS[0]
    result = _import_with_isa("avx9000")
    assert result.returncode != 0 and "unknown instruction set 'avx9000'" in result.stderr


@pytest.mark.parametrize("variant", VARIANTS)
def test_matmul_backward_accumulates(rng, variant):
    x, w, _, dout = make_inputs(rng, 3, 100, 300, 33)
    once = backward(dout, x, w, variant)
    twice = backward(dout, x, w, variant, calls=2)
    for name in once:
        assert_close(name, twice[name], 2.0 * once[name], TOL["matmul"]["bwd"])


@pytest.mark.parametrize("skip", ["dinp", "dweight", "dbias"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_matmul_backward_skips_a_product_given_none(rng, variant, skip):
    """A None output skips its product and leaves the others bitwise as with
    all three; the skipped product's input may then be None in C too."""
    x, w, _, dout = make_inputs(rng, 2, 37, 67, 45)
    full = backward(dout, x, w, variant)
    grads = {name: np.zeros_like(value) for name, value in full.items()}
    grads[skip] = None
    K.matmul_backward(grads["dinp"], grads["dweight"], grads["dbias"], dout, x, w,
                      variant=variant)
    for name, value in grads.items():
        if name != skip:
            np.testing.assert_array_equal(value, full[name], err_msg=name)
    # the C contract: weight is needed only for dinp, inp only for dweight
    fn = lib.matmul_backward_naive if variant == "naive" else lib.matmul_backward
    B, T, C = x.shape
    OC = w.shape[0]
    dbias = np.zeros(OC, np.float32)
    status = fn(ffi.NULL, ffi.NULL, ffi.cast("float*", dbias.ctypes.data),
                ffi.cast("float*", dout.ctypes.data), ffi.NULL, ffi.NULL, B, T, C, OC, 0)
    assert status == lib.LLMC_OK
    np.testing.assert_array_equal(dbias, full["dbias"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_matmul_thread_invariant(rng, set_threads, variant):
    x, w, bias, dout = make_inputs(rng, 3, 100, 300, 100)   # 4x4 parallel tiles
    assert_thread_invariant(set_threads, lambda: {
        "out": forward(x, w, bias, variant), **backward(dout, x, w, variant)})


def test_matmul_rejects_unknown_variant(rng):
    x, w, bias, _ = make_inputs(rng, 1, 2, 3, 4)
    with pytest.raises(ValueError, match="naive"):
        forward(x, w, bias, "avx9000")


@pytest.mark.parametrize("bad", ["weight", "bias", "out"])
def test_matmul_rejects_wrong_shape(rng, bad):
    x, w, bias, _ = make_inputs(rng, 2, 3, 8, 5)
    args = dict(out=np.empty((2, 3, 5), np.float32), inp=x, weight=w, bias=bias)
    args[bad] = np.zeros(args[bad].shape[:-1] + (args[bad].shape[-1] + 1,), np.float32)
    with pytest.raises(llmc_py.ShapeError, match=bad):
        K.matmul_forward(**args)


def test_matmul_rejects_non_contiguous(rng):
    x, w, bias, _ = make_inputs(rng, 2, 3, 8, 8)
    with pytest.raises(llmc_py.ShapeError, match="contiguous"):
        forward(x, w.T, bias, "")


def test_matmul_rejects_wrong_dtype(rng):
    x, w, bias, _ = make_inputs(rng, 2, 3, 8, 5)
    with pytest.raises(TypeError, match="bias"):
        forward(x, w, bias.astype(np.float16), "")


@pytest.mark.parametrize("variant", VARIANTS)
def test_matmul_backward_written_outputs_are_the_sum_into_zeros(rng, set_threads, variant):
    """`written` outputs hold garbage before the call and end bitwise as a
    call adding into zeros; the others still add onto what they hold."""
    x, w, _, dout = make_inputs(rng, 3, 100, 300, 33)
    into_zeros = backward(dout, x, w, variant)
    for written in WRITTEN_MASKS:
        def run():
            return backward_written(K.matmul_backward, into_zeros, written, dout, x, w,
                                    variant=variant)
        twice = backward(dout, x, w, variant, calls=2)
        grads = run()
        for name in into_zeros:
            expected = into_zeros[name] if any(
                written & f and n == name for f, n in WRITTEN_OUTPUTS.items()) else twice[name]
            assert np.array_equal(grads[name], expected), f"{variant} written={written} {name}"
        assert_thread_invariant(set_threads, run)
