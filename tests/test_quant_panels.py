"""csrc/quant.c's many-row products (matmul_forward_quant_panels,
matmul_backward_quant_panels): the Q8_0/Q4_0 weight dequantised to bf16 a
tile at a time and multiplied by the bf16 GEMM.

What they compute, stated two ways:
  - bitwise matmul_forward_bf16 / matmul_backward_bf16's dinp on
    W' = bf16(d*q) (d*q exact in float32, rounded to the nearest bf16), under
    every instruction set (vdpbf16ps, and the widened float32 fallback that
    portable, AVX2 and AVX-512F run), for any thread count;
  - against a float64 reference of the dequantised weights W = d*q: bf16
    rounds x and W by at most 2^-8 of themselves each (8 significant bits,
    to nearest), so a product is off by at most 2^-7 + 2^-16 of |x w|; the
    float32 sum of K terms adds at most (K + 1) 2^-24 of the sum of |terms|.
    With S = |bias| + sum_k |x_k| |w_k|:
        |out - ref| <= S (2^-7 + 2^-16) + S (1 + 2^-7) (K + 1) 2^-24."""
import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from llmc_py.errors import ShapeError
from llmc_py.io.files import to_bf16
from helpers import assert_thread_invariant

QTYPES = ["q8_0", "q4_0"]
ISAS = llmc_py.supported_isas()
# (N, IC, OC): odd row counts and widths; the last two span several tiles
# (a tile is 192 columns when 8 MiB of bf16 holds fewer), forward's over OC
# and backward's over IC
SHAPES = [(13, 32, 1), (37, 96, 70), (64, 224, 200), (19, 22016, 450), (17, 480, 22016)]


def blocks_of(rng, OC, IC, qtype):
    w = rng.standard_normal((OC, IC)).astype(np.float32)
    kind = K.QUANT_TYPES[qtype]
    blocks = np.empty((OC, IC // 32 * K._BLOCK_BYTES[kind]), np.uint8)
    K.quantize_rows(blocks, w, kind)
    dequantised = np.empty((OC, IC), np.float32)
    K.dequantize_rows(dequantised, blocks, kind)
    packed = np.empty_like(blocks)   # the layout the products read (quant_pack_rows)
    K.quant_pack_rows(packed, blocks, kind)
    return packed, dequantised


def products(x, dout, dinp0, blocks, bias, qtype):
    kind = K.QUANT_TYPES[qtype]
    out = np.empty((x.shape[0], blocks.shape[0]), np.float32)
    K.matmul_forward_quant_panels(out, x, blocks, bias, kind)
    dinp = dinp0.copy()
    K.matmul_backward_quant_panels(dinp, dout, blocks, kind)
    return {"out": out, "dinp": dinp}


def case(rng, N, IC, OC, qtype):
    blocks, w = blocks_of(rng, OC, IC, qtype)
    x = rng.standard_normal((N, IC)).astype(np.float32)
    dout = rng.standard_normal((N, OC)).astype(np.float32)
    dinp0 = rng.standard_normal((N, IC)).astype(np.float32)
    bias = rng.standard_normal(OC).astype(np.float32)
    return blocks, w, x, dout, dinp0, bias


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("N,IC,OC", SHAPES)
def test_panels_are_the_bf16_gemm_on_the_rounded_weight(rng, use_isa, isa, qtype, N, IC, OC):
    blocks, w, x, dout, dinp0, bias = case(rng, N, IC, OC, qtype)
    use_isa(isa)
    ours = products(x, dout, dinp0, blocks, bias, qtype)
    w_bf16 = to_bf16(w)
    out = np.empty((1, N, OC), np.float32)
    K.matmul_forward_bf16(out, x[None], w_bf16, bias)
    dinp = dinp0.copy()[None]
    K.matmul_backward_bf16(dinp, None, None, dout[None], x[None], w_bf16)
    np.testing.assert_array_equal(ours["out"].view(np.uint32), out[0].view(np.uint32))
    np.testing.assert_array_equal(ours["dinp"].view(np.uint32), dinp[0].view(np.uint32))


def within(name, ours, exact, S, K_terms):
    bound = S * (2.0 ** -7 + 2.0 ** -16) + S * (1 + 2.0 ** -7) * (K_terms + 1) * 2.0 ** -24
    excess = np.abs(ours - exact) - bound
    assert np.all(excess <= 0), f"{name}: beyond the bound by up to {excess.max():.3e}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("N,IC,OC", SHAPES[:3])
def test_panels_within_bound_of_float64_dequantised(rng, use_isa, isa, qtype, N, IC, OC):
    blocks, w, x, dout, dinp0, bias = case(rng, N, IC, OC, qtype)
    use_isa(isa)
    ours = products(x, dout, dinp0, blocks, bias, qtype)
    x64, w64, d64 = x.astype(np.float64), w.astype(np.float64), dout.astype(np.float64)
    within("out", ours["out"], x64 @ w64.T + bias, np.abs(x64) @ np.abs(w64).T + np.abs(bias),
           IC)
    within("dinp", ours["dinp"], dinp0 + d64 @ w64, np.abs(dinp0) + np.abs(d64) @ np.abs(w64),
           OC)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("N,IC,OC", [SHAPES[1], SHAPES[3]])
def test_panels_thread_invariant(rng, set_threads, qtype, N, IC, OC):
    blocks, _, x, dout, dinp0, bias = case(rng, N, IC, OC, qtype)
    assert_thread_invariant(set_threads, lambda: products(x, dout, dinp0, blocks, bias, qtype))


def test_panels_refuse_bad_shapes_and_types():
    x = np.zeros((20, 33), np.float32)
    blocks = np.zeros((4, 34), np.uint8)
    with pytest.raises(ShapeError, match=r"inp has shape \(20, 33\).*not a multiple of 32"):
        K.matmul_forward_quant_panels(np.zeros((20, 4), np.float32), x, blocks, None,
                                      K.QUANT_TYPES["q8_0"])
    with pytest.raises(ValueError, match="unknown quantisation type 5"):
        K.matmul_backward_quant_panels(np.zeros((20, 32), np.float32),
                                       np.zeros((20, 4), np.float32), blocks, 5)
    with pytest.raises(ShapeError, match="weight"):
        K.matmul_forward_quant_panels(np.zeros((20, 4), np.float32), np.zeros((20, 32), np.float32),
                                      np.zeros((4, 18), np.uint8), None, K.QUANT_TYPES["q8_0"])


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantized_linear_picks_the_kernel_by_row_count(rng, qtype):
    """Up to FEW_ROWS rows (decoding): matmul_forward_quant's bits, as before
    the panel path existed; more: the panel path's. Backward: the panel path."""
    from llmc_py.model.quantized import FEW_ROWS, QuantizedLinear
    kind = K.QUANT_TYPES[qtype]
    layer = QuantizedLinear.quantize(rng.standard_normal((40, 64)).astype(np.float32), qtype)
    bias = rng.standard_normal(40).astype(np.float32)
    for rows, kernel in ((1, K.matmul_forward_quant), (FEW_ROWS, K.matmul_forward_quant),
                         (FEW_ROWS + 1, K.matmul_forward_quant_panels)):
        x = rng.standard_normal((1, rows, 64)).astype(np.float32)
        out, want = np.empty((1, rows, 40), np.float32), np.empty((rows, 40), np.float32)
        layer(out, x, bias)
        kernel(want, x[0], layer.packed, bias, kind)
        np.testing.assert_array_equal(out[0].view(np.uint32), want.view(np.uint32))
    dout = rng.standard_normal((3, 40)).astype(np.float32)
    dinp, want = np.ones((3, 64), np.float32), np.ones((3, 64), np.float32)
    layer.backward(dinp, dout)
    K.matmul_backward_quant_panels(want, dout, layer.packed, kind)
    np.testing.assert_array_equal(dinp, want)
    with pytest.raises(ShapeError, match=r"weight \[40, 64\]: input gradient \(3, 32\) and output "
                                      r"gradient \(3, 40\) do not fit it"):
        layer.backward(np.ones((3, 32), np.float32), dout)
