"""csrc/quant.c: Q8_0 and Q4_0 blocks byte for byte as gguf.quants (llama.cpp's
reference rounding), and the decoding matmul on them, on every path this CPU
runs, against float64 references of the dequantised weights.

The bound. Each input row is quantized to Q8_0 blocks before the integer dot
products, so against the unquantised input the error of out[n, o] is, per
block b of 32 inputs,
    |sum_i w_i (x_i - xhat_i)| <= sum_i |w_i| * 0.563 * max_i |x_i| / 127
(round to nearest: half a step d = amax/127; the fp16 scale: 127 * d * 2^-11;
the float product x/d: 127 * 2^-23 steps), summed over the blocks. Against
the quantised input (gguf's Q8_0 of x) the result is exact up to rounding:
every block's integer sum S_b and the product of its two fp16 scales are
exact in float; each block's S_b * scale is added into float lane b mod 16
by one fused multiply-add, so with m = ceil(blocks / 16) terms a lane
    |out - exact| <= 2^-24 * (m * sum_b |S_b * scale_b| + |exact|)
(the lanes' sum in double and the bias add ~2^-49 more, the final float
rounding the |exact| term)."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import llmc_py
from llmc_py import kernels as K
from llmc_py._native.lib import ffi, lib
from llmc_py.errors import ShapeError, UnsupportedError
from helpers import assert_thread_invariant

QTYPES = ["q8_0", "q4_0"]
PATHS = ["portable", "avx2", "avxvnni", "avx512vnni"]
GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
# the activation error per block, in steps amax/127 (module docstring)
ACT_STEPS = 0.563


def quantize(x, qtype):
    out = np.empty((x.shape[0], x.shape[1] // 32 * K._BLOCK_BYTES[K.QUANT_TYPES[qtype]]),
                   np.uint8)
    K.quantize_rows(out, x, K.QUANT_TYPES[qtype])
    return out


def special_rows(rng, IC):
    """Rows of random values with blocks that test the rounding: exact ties,
    zeros, a largest magnitude twice with both signs, fp16 subnormal and
    overflowing scales."""
    x = rng.standard_normal((6, IC)).astype(np.float32)
    x[0, :32] = np.arange(32) - 16.5              # halves: ties of Q8_0 (d = 1)
    x[0, 0] = 127.0
    x[1, :32] = 0.0
    x[2, :32] = np.where(np.arange(32) % 2, 3.0, -3.0)   # -3 first: the sign of max
    x[2, 5] = 0.5
    x[3, :32] *= 1e-7                             # scale below fp16's normals
    x[4, :32] *= 3e7                              # scale above fp16's max: inf
    x[5, :32] = (np.arange(32) % 17 - 8.5).astype(np.float32)   # Q4_0 ties (d = 1)
    x[5, 0] = -8.0
    return x


@pytest.mark.parametrize("IC", [32, 96, 160, 4096])
@pytest.mark.parametrize("qtype", QTYPES)
def test_quantize_equals_gguf(rng, qtype, IC):
    x = special_rows(rng, IC)
    # and blocks at every magnitude, for the fp16 rounding of the scale
    scales = 10.0 ** rng.uniform(-12, 9, (4, IC // 32, 1))
    x = np.concatenate([x, (rng.standard_normal((4, IC // 32, 32)) * scales)
                        .astype(np.float32).reshape(4, IC)])
    ours = quantize(x, qtype)
    with np.errstate(over="ignore", invalid="ignore"):   # the overflowing scale
        theirs = gguf.quants.quantize(x, GGML[qtype])
        expected = gguf.quants.dequantize(theirs, GGML[qtype])
    assert ours.shape == theirs.shape
    differ = np.argwhere(ours != theirs)
    assert differ.size == 0, f"{qtype}: bytes differ at (row, byte) {differ[:5].tolist()}"

    back = np.full(x.shape, np.nan, np.float32)
    K.dequantize_rows(back, ours, K.QUANT_TYPES[qtype])
    np.testing.assert_array_equal(back.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantize_refuses_partial_blocks_and_unknown_types(qtype):
    x = np.zeros((2, 33), np.float32)
    with pytest.raises(ShapeError, match=r"inp has shape \(2, 33\).*not a multiple of 32"):
        K.quantize_rows(np.zeros((2, 34), np.uint8), x, K.QUANT_TYPES[qtype])
    with pytest.raises(ShapeError, match=r"out has shape \(2, 33\)"):
        K.dequantize_rows(x, np.zeros((2, 34), np.uint8), K.QUANT_TYPES[qtype])
    with pytest.raises(ValueError, match="unknown quantisation type 3"):
        K.quantize_rows(np.zeros((2, 34), np.uint8), np.zeros((2, 32), np.float32), 3)
    # the C functions refuse the same by status, without touching memory
    buf = ffi.new("uint8_t[]", 64)
    fbuf = ffi.new("float[]", 64)
    q = K.QUANT_TYPES[qtype]
    assert lib.quantize_rows(buf, fbuf, 1, 33, q) == lib.LLMC_ERR_SHAPE
    assert lib.dequantize_rows(fbuf, buf, 1, 33, q) == lib.LLMC_ERR_SHAPE
    assert lib.quantize_rows(buf, fbuf, 1, 32, 3) == lib.LLMC_ERR_VALUE
    assert lib.matmul_forward_quant(fbuf, fbuf, buf, ffi.NULL, 1, 33, 1, q) \
        == lib.LLMC_ERR_SHAPE
    assert lib.matmul_forward_quant(fbuf, fbuf, buf, ffi.NULL, 1, 32, 1, 7) \
        == lib.LLMC_ERR_VALUE


def pack(wq, qtype):
    """GGUF blocks in the kernels' layout (quant_pack_rows)."""
    packed = np.empty_like(wq)
    K.quant_pack_rows(packed, wq, K.QUANT_TYPES[qtype])
    return packed


def matmul(x, wq, bias, qtype, variant=""):
    """matmul_forward_quant on GGUF blocks wq (packed first)."""
    out = np.full((x.shape[0], wq.shape[0]), np.nan, np.float32)   # (written)
    try:
        K.matmul_forward_quant(out, x, pack(wq, qtype), bias, K.QUANT_TYPES[qtype],
                               variant=variant)
    except UnsupportedError:
        pytest.skip(f"this CPU or build has no {variant} path")
    return out


def references(x, wq, bias, qtype):
    """(exact, rounding, bound, plain): float64 out on gguf's Q8_0 of x, the
    bound of |out - exact| (module docstring), the bound of |out - plain|,
    and plain = dequantised weights times the unquantised x."""
    w = gguf.quants.dequantize(wq, GGML[qtype]).astype(np.float64)
    xq = gguf.quants.dequantize(gguf.quants.quantize(x, GGML["q8_0"]), GGML["q8_0"])
    b = np.zeros(w.shape[0]) if bias is None else bias.astype(np.float64)
    exact = xq.astype(np.float64) @ w.T + b
    plain = x.astype(np.float64) @ w.T + b
    N, IC = x.shape
    nb = IC // 32
    per_block = np.einsum("nbi,obi->nob", xq.astype(np.float64).reshape(N, nb, 32),
                          w.reshape(-1, nb, 32))
    lanes = -(-nb // 16)
    rounding = 2.0**-24 * (lanes * np.abs(per_block).sum(axis=2) + np.abs(exact))
    amax = np.abs(x).reshape(N, IC // 32, 32).max(axis=2)              # [N, blocks]
    wabs = np.abs(w).reshape(w.shape[0], IC // 32, 32).sum(axis=2)    # [OC, blocks]
    bound = ACT_STEPS / 127 * amax @ wabs.T
    # the per-element activation error behind it, checked on gguf's own rounding
    steps = np.repeat(amax / 127, 32, axis=1)
    assert (np.abs(x - xq) <= ACT_STEPS * steps).all()
    return exact, rounding, bound, plain


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("IC,OC", [(32, 5), (96, 19), (672, 3), (768, 6), (4096, 37)])
@pytest.mark.parametrize("N", [1, 3, 8])
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_matmul_quant_matches_reference(rng, path, qtype, N, IC, OC, with_bias):
    x = rng.standard_normal((N, IC)).astype(np.float32)
    wq = quantize(rng.standard_normal((OC, IC)).astype(np.float32) * 0.1, qtype)
    bias = rng.standard_normal(OC).astype(np.float32) if with_bias else None
    out = matmul(x, wq, bias, qtype, path)
    exact, rounding, bound, plain = references(x, wq, bias, qtype)

    # on the quantised input: exact up to the float lanes' roundings
    err = np.abs(out - exact)
    assert (err <= rounding * (1 + 1e-6) + 1e-30).all(), \
        f"{path}: max|out - exact| / bound = {(err / rounding).max():.3e}"
    # on the unquantised input: within the activation quantisation's bound
    err = np.abs(out - plain)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound * (1 + 1e-6) + 2.0**-23 * np.abs(plain)).all(), \
        f"{path}: |out - plain| = {err[worst]:.3e} above the bound {bound[worst]:.3e} at {worst}"
    # every path, and the one chosen by default, gives the same bits
    np.testing.assert_array_equal(out.view(np.uint32),
                                  matmul(x, wq, bias, qtype, "portable").view(np.uint32))
    np.testing.assert_array_equal(out.view(np.uint32),
                                  matmul(x, wq, bias, qtype).view(np.uint32))


@pytest.mark.parametrize("IC", [96, 768])
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("path", PATHS[1:])
def test_matmul_quant_input_rounding_same_on_every_path(rng, path, qtype, IC):
    """The input rows' Q8_0 rounding (ties, zeros, tiny and overflowing
    scales, every magnitude) is the portable path's on every path (the
    AVX512-VNNI path quantizes them with its own vector code)."""
    x = special_rows(rng, IC)
    scales = 10.0 ** rng.uniform(-12, 9, (4, IC // 32, 1))
    x = np.concatenate([x, (rng.standard_normal((4, IC // 32, 32)) * scales)
                        .astype(np.float32).reshape(4, IC)])
    wq = quantize(rng.standard_normal((21, IC)).astype(np.float32), qtype)
    with np.errstate(over="ignore", invalid="ignore"):
        ours, plain = (matmul(x, wq, None, qtype, p) for p in (path, "portable"))
    # the overflowing scale's row is inf or NaN: NaNs where the plain path's are
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(plain))
    np.testing.assert_array_equal(np.where(np.isnan(ours), 0, ours).view(np.uint32),
                                  np.where(np.isnan(plain), 0, plain).view(np.uint32))


def numpy_pack(wq, qtype):
    """quant.c's packed layout, from its description: per row the blocks'
    fp16 scales, then the quants in groups of 16 blocks (the last group g
    blocks), bytes 4k..4k+3 of block j's quants at (k*g + j)*4."""
    OC, row_bytes = wq.shape
    bb = 34 if qtype == "q8_0" else 18
    nb = row_bytes // bb
    blocks = wq.reshape(OC, nb, bb)
    groups = []
    for b0 in range(0, nb, 16):
        quants = blocks[:, b0:b0 + 16, 2:]                       # [OC, g, qbytes]
        g = quants.shape[1]
        chunks = quants.reshape(OC, g, -1, 4).transpose(0, 2, 1, 3)   # [OC, k, j, 4]
        groups.append(chunks.reshape(OC, -1))
    return np.concatenate([blocks[:, :, :2].reshape(OC, -1)] + groups, axis=1)


@pytest.mark.parametrize("IC", [32, 96, 672, 768, 1024])
@pytest.mark.parametrize("qtype", QTYPES)
def test_pack_rows_is_the_stated_layout(rng, qtype, IC):
    wq = quantize(rng.standard_normal((5, IC)).astype(np.float32), qtype)
    packed = pack(wq, qtype)
    np.testing.assert_array_equal(packed, numpy_pack(wq, qtype))
    back = np.empty_like(packed)
    K.quant_unpack_rows(back, packed, K.QUANT_TYPES[qtype])
    np.testing.assert_array_equal(back, wq)
    with pytest.raises(ShapeError, match=r"blocks has shape \(5, 35\): its rows are not whole"):
        K.quant_pack_rows(np.empty((5, 35), np.uint8), np.empty((5, 35), np.uint8),
                          K.QUANT_TYPES["q8_0"])


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_matmul_quant_rows_do_not_see_each_other(rng, path, qtype):
    """One pass over the weights serves every input row (more than the 64 a
    weight row takes at once too): each row's bits are its own call's."""
    x = rng.standard_normal((70, 160)).astype(np.float32)
    wq = quantize(rng.standard_normal((11, 160)).astype(np.float32), qtype)
    bias = rng.standard_normal(11).astype(np.float32)
    together = matmul(x, wq, bias, qtype, path)
    for n in (0, 7, 63, 64, 69):
        np.testing.assert_array_equal(together[n:n + 1], matmul(x[n:n + 1], wq, bias, qtype, path))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_matmul_quant_thread_invariant(rng, set_threads, path, qtype):
    x = rng.standard_normal((3, 96)).astype(np.float32)
    wq = quantize(rng.standard_normal((67, 96)).astype(np.float32), qtype)
    bias = rng.standard_normal(67).astype(np.float32)
    matmul(x, wq, bias, qtype, path)   # skips a path this CPU lacks
    assert_thread_invariant(set_threads, lambda: {"out": matmul(x, wq, bias, qtype, path)},
                            counts=(1, 2, 3))


@pytest.mark.parametrize("isa", llmc_py.supported_isas())
def test_matmul_quant_follows_the_chosen_isa(rng, use_isa, isa):
    """The default path runs under every instruction set (portable forces
    plain C) and gives the same bits as the portable path."""
    x = rng.standard_normal((2, 64)).astype(np.float32)
    wq = quantize(rng.standard_normal((9, 64)).astype(np.float32), "q4_0")
    use_isa(isa)
    np.testing.assert_array_equal(matmul(x, wq, None, "q4_0"),
                                  matmul(x, wq, None, "q4_0", "portable"))


def test_matmul_quant_refuses_bad_shapes_and_types(rng):
    x = rng.standard_normal((2, 64)).astype(np.float32)
    wq = quantize(rng.standard_normal((4, 64)).astype(np.float32), "q8_0")
    out = np.empty((2, 4), np.float32)
    with pytest.raises(ShapeError, match=r"inp has shape \(2, 48\).*not a multiple of 32"):
        K.matmul_forward_quant(out, x[:, :48].copy(), wq, None, K.QUANT_TYPES["q8_0"])
    with pytest.raises(ShapeError, match=r"weight has shape \(4, 68\), expected \(4, 36\)"):
        K.matmul_forward_quant(out, x, wq, None, K.QUANT_TYPES["q4_0"])
    with pytest.raises(ValueError, match="unknown quantisation type 1"):
        K.matmul_forward_quant(out, x, wq, None, 1)
    with pytest.raises(TypeError, match="weight must be a uint8"):
        K.matmul_forward_quant(out, x, wq.view(np.int8), None, K.QUANT_TYPES["q8_0"])
    with pytest.raises(ValueError, match="unknown variant"):
        K.matmul_forward_quant(out, x, wq, None, K.QUANT_TYPES["q8_0"], variant="sse")


# ---- llmc_py/model/quantized.py: the holder the model decodes with ---------------

@pytest.mark.parametrize("qtype", QTYPES)
def test_quantized_linear_is_the_kernels(rng, qtype):
    from llmc_py.model.quantized import QuantizedLinear
    w = rng.standard_normal((19, 96)).astype(np.float32)
    x = rng.standard_normal((2, 3, 96)).astype(np.float32)
    bias = rng.standard_normal(19).astype(np.float32)
    layer = QuantizedLinear.quantize(w, qtype, name="blocks.0.fc")
    assert layer.shape == (19, 96) and layer.nbytes == 19 * 3 * (34 if qtype == "q8_0" else 18)
    np.testing.assert_array_equal(layer.blocks, gguf.quants.quantize(w, GGML[qtype]))
    # held packed: the same bytes per row, moved within it
    assert not np.array_equal(layer.packed, layer.blocks)
    np.testing.assert_array_equal(np.sort(layer.packed, axis=1), np.sort(layer.blocks, axis=1))
    np.testing.assert_array_equal(layer.dequantize(),
                                  gguf.quants.dequantize(layer.blocks, GGML[qtype]))
    out = np.full((2, 3, 19), np.nan, np.float32)
    layer(out, x, bias)
    np.testing.assert_array_equal(out.reshape(6, 19),
                                  matmul(x.reshape(6, 96), layer.blocks, bias, qtype))
    unbiased = np.empty_like(out)
    layer(unbiased, x)
    np.testing.assert_array_equal(unbiased.reshape(6, 19),
                                  matmul(x.reshape(6, 96), layer.blocks, None, qtype))
    # what the decoding call's own checks leave to the kernel's wrapper: its errors
    with pytest.raises(TypeError, match="inp must be a float32"):
        layer(unbiased, x.astype(np.float64))
    with pytest.raises(TypeError, match="bias must be a float32"):
        layer(unbiased, x, bias.astype(np.float64))
    with pytest.raises(ShapeError, match="bias"):
        layer(unbiased, x, bias[:5])
    # made again from its bytes (as a GGUF tensor is), the same layer
    again = QuantizedLinear(layer.blocks.copy(), 96, qtype)
    out2 = np.empty_like(out)
    again(out2, x, bias)
    np.testing.assert_array_equal(out2, out)


def test_quantized_linear_names_the_tensor_it_refuses(rng):
    from llmc_py.model.quantized import QuantizedLinear
    with pytest.raises(ShapeError, match=r"blocks\.0\.fc has shape \(4, 40\): its input "
                                         r"dimension 40 is not a multiple of 32"):
        QuantizedLinear.quantize(np.zeros((4, 40), np.float32), "q8_0", name="blocks.0.fc")
    with pytest.raises(ValueError, match="unknown quantisation type 'q5_1'"):
        QuantizedLinear.quantize(np.zeros((4, 32), np.float32), "q5_1")
    with pytest.raises(ShapeError, match=r"lm_head: blocks of uint8 \(4, 18\), expected uint8 "
                                         r"\[OC, 34\]"):
        QuantizedLinear(np.zeros((4, 18), np.uint8), 32, "q8_0", name="lm_head")
    layer = QuantizedLinear.quantize(np.ones((4, 32), np.float32), "q4_0", name="attn.c_proj")
    with pytest.raises(ShapeError, match=r"attn\.c_proj \[4, 32\]: input \(1, 33\)"):
        layer(np.empty((1, 4), np.float32), np.empty((1, 33), np.float32))
