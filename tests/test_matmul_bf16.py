"""csrc/matmul_bf16.c: the bf16 linear layer on every instruction set this CPU
runs, against float64 products of the bf16-rounded operands.

The bound. Every path sums the same exact terms: a product of two bf16
numbers has at most 16 significant bits, so it is exact in float32 (no test
product comes near underflow or overflow). Each output element is then one
chain of K float32 additions onto its start value s (the bias, 0, or what a
(+=) output held), in an order that depends on the path (k = 0, 1, ... for the
widened paths and the naive loops; pairs (2p+1, 2p) for vdpbf16ps). With
u = 2^-24, recursive summation of n = K + 1 terms is off by at most
gamma_K * (|s| + sum_k |a_k b_k|), gamma_K = K u / (1 - K u), whatever the
order (Higham, Accuracy and Stability of Numerical Algorithms, 4.2); the
float64 reference adds at most K 2^-53 of that again. So, element-wise,
    |ours - ref| <= 1.01 * gamma_K * (|s| + sum_k |a_k b_k|).
This bound is loose (errors grow like sqrt(K), not K), but it is a proof, not
a guess, and at K <= 1000 dropping a single term breaks it at most elements
(checked in test_bound_is_not_vacuous). For the larger K the structure is
checked exactly instead: the widened paths bitwise against the naive loops,
the dot-product path bitwise against a float32 emulation of its pair order.
"""
import functools

import numpy as np
import pytest
import torch

import llmc_py
from llmc_py import kernels as K
from llmc_py._native.lib import ffi, lib
from helpers import (TOL, WRITTEN_MASKS, WRITTEN_OUTPUTS, assert_close, assert_thread_invariant,
                     backward_written)

ISAS = llmc_py.supported_isas()
WIDENED = [isa for isa in ISAS if isa != "avx512bf16"]   # round, widen, float32 GEMM
DOT = [isa for isa in ISAS if isa == "avx512bf16"]        # vdpbf16ps
U = 2.0 ** -24
F32 = lib.LLMC_DTYPE_F32

SHAPES = [  # B, T, C, OC
    (4, 64, 768, 2304),   # GPT-2 124M at B*T = 256: qkv
    (4, 64, 768, 768),    # attention projection
    (4, 64, 768, 3072),   # MLP up
    (4, 64, 3072, 768),   # MLP down: K = 3072 is four K blocks
    (1, 8, 768, 50304),   # lm_head at decoding size (the skinny forward)
    (1, 24, 768, 50304),  # lm_head through the GEMM: dinp's K = 50304
    (1, 1, 768, 768),     # B = T = 1
    (2, 17, 67, 45),      # nothing a multiple of the 8 x 48 tile
    (1, 37, 37, 29),      # K odd in every product (C, OC and B*T)
    (3, 13, 100, 97),     # M = 39 not a multiple of 8, N = 97 of 48
    (1, 5, 130, 200),     # skinny, 5 rows
    (1, 12, 33, 50),      # skinny, the most rows it takes (8 + 4)
    (1, 13, 33, 50),      # one row more: the GEMM, with an edge tile
    (1, 16, 33, 50),      # the GEMM, two whole row tiles
    (2, 9, 1000, 70),     # forward K = 1000: two K blocks of 250 pairs
    (1, 801, 40, 1001),   # dweight K = 801, dinp K = 1001: two odd K blocks
]
# smaller shapes for what is slow in numpy or in the naive loops
EXACT_SHAPES = [(1, 32, 768, 768), (2, 17, 67, 45), (1, 37, 37, 29), (3, 13, 100, 97),
                (1, 5, 130, 200), (1, 12, 33, 50), (1, 13, 33, 50), (2, 9, 1000, 70),
                (1, 801, 40, 1001), (1, 1, 1, 1)]
# weights the widened path widens in blocks of 384 rows (C > 2730): three
# blocks, the last partial (two at OC 385); few rows (the skinny kernel) and the GEMM
WIDENED_BLOCK_SHAPES = [(1, 5, 2900, 800), (2, 9, 2900, 800), (1, 3, 4096, 385)]


def rounded(x):
    """float64 of bf16(x), rounded by torch (nearest, ties to even)."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).to(torch.float64).numpy()


def widen(w16):
    """The float32 values of bf16 numbers (uint16)."""
    return (w16.astype(np.uint32) << 16).view(np.float32)


@functools.lru_cache(maxsize=3)
def layer(B, T, C, OC):
    """Seeded operands of one shape (the same for every instruction set, so
    the reference is computed once): inp, bf16 weight, bias, dout, and the
    float64 reference of each product with its bound."""
    rng = np.random.default_rng([B, T, C, OC])
    x = rng.standard_normal((B, T, C), dtype=np.float32)
    w16 = np.empty((OC, C), np.uint16)
    K.float_to_bf16(w16, rng.standard_normal((OC, C), dtype=np.float32))
    bias = rng.standard_normal(OC, dtype=np.float32)
    dout = rng.standard_normal((B, T, OC), dtype=np.float32)
    xb, db = rounded(x).reshape(-1, C), rounded(dout).reshape(-1, OC)
    wb = widen(w16).astype(np.float64)
    ax, ad, aw = np.abs(xb), np.abs(db), np.abs(wb)
    ref = {
        "out": (xb @ wb.T + bias, gamma(C) * (ax @ aw.T + np.abs(bias))),
        "dinp": (db @ wb, gamma(OC) * (ad @ aw)),
        "dweight": (db.T @ xb, gamma(B * T) * (ad.T @ ax)),
    }
    return x, w16, bias, dout, ref


def gamma(n):
    """1.01 * gamma_n: the summation bound's factor, with room for the float64
    reference's own rounding."""
    return 1.01 * n * U / (1 - n * U)


def assert_within(name, ours, ref, bound):
    ours = np.asarray(ours, np.float64).reshape(ref.shape)
    assert np.isfinite(ours).all(), f"{name}: not finite"
    excess = np.abs(ours - ref) / bound
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[worst] <= 1.0, (
        f"{name}: |ours - ref| = {abs(ours[worst] - ref[worst]):.3e} at {worst} exceeds the "
        f"bound {bound[worst]:.3e} (ours {ours[worst]:.9g}, ref {ref[worst]:.9g})")


def forward(x, w16, bias, variant=""):
    out = np.full(x.shape[:2] + (w16.shape[0],), np.nan, np.float32)   # (written)
    K.matmul_forward_bf16(out, x, w16, bias, variant=variant)
    return out


def backward(dout, x, w16, variant="", start=None):
    """dinp, dweight, dbias of one call, accumulated onto start (zeros if None)."""
    grads = start or {"dinp": np.zeros_like(x), "dweight": np.zeros(w16.shape, np.float32),
                      "dbias": np.zeros(w16.shape[0], np.float32)}
    grads = {name: value.copy() for name, value in grads.items()}
    K.matmul_backward_bf16(grads["dinp"], grads["dweight"], grads["dbias"], dout, x, w16,
                           variant=variant)
    return grads


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("B,T,C,OC", SHAPES)   # outermost: one reference serves every isa
def test_products_within_bound(use_isa, isa, B, T, C, OC):
    x, w16, bias, dout, ref = layer(B, T, C, OC)
    use_isa(isa)
    ours = {"out": forward(x, w16, bias), **backward(dout, x, w16)}
    for name in ("out", "dinp", "dweight"):
        assert_within(f"{isa} {name}", ours[name], *ref[name])
    # dbias sums dout itself, unrounded, as the float32 layer does
    assert_close("dbias", ours["dbias"], dout.astype(np.float64).sum(axis=(0, 1)),
                 TOL["matmul"]["bwd"])


@pytest.mark.parametrize("B,T,C,OC", [s for s in SHAPES if max(s[2], s[3], s[0] * s[1]) <= 1000])
def test_bound_is_not_vacuous(B, T, C, OC):
    """Where K <= 1000, leaving out one term (the last k, which the odd-K and
    K-block tails handle) breaks the bound at most elements of every product."""
    x, w16, _, dout, ref = layer(B, T, C, OC)
    xb, db, wb = rounded(x).reshape(-1, C), rounded(dout).reshape(-1, OC), widen(w16)
    last_term = {"out": np.outer(xb[:, -1], wb[:, -1]), "dinp": np.outer(db[:, -1], wb[-1]),
                 "dweight": np.outer(db[-1], xb[-1])}
    for name, term in last_term.items():
        broken = np.mean(np.abs(term) > ref[name][1])
        assert broken > 0.5, f"{name}: a missing term breaks the bound at only {broken:.0%}"


@pytest.mark.parametrize("isa", WIDENED)
@pytest.mark.parametrize("B,T,C,OC", EXACT_SHAPES + WIDENED_BLOCK_SHAPES)
def test_widened_equals_naive_bitwise(use_isa, isa, B, T, C, OC):
    """Rounded operands, widened, through the float32 kernels: each product is
    exact, so fused or not, each element is the naive loops' k = 0, 1, ...
    chain, bit for bit (dbias aside: column sums in chunks)."""
    x, w16, bias, dout, _ = layer(B, T, C, OC)
    naive_out, naive = forward(x, w16, bias, "naive"), backward(dout, x, w16, "naive")
    use_isa(isa)
    assert np.array_equal(forward(x, w16, bias), naive_out), "out"
    ours = backward(dout, x, w16)
    for name in ("dinp", "dweight"):
        assert np.array_equal(ours[name], naive[name]), name


def pair_chain(a, b, start):
    """float32 emulation of the dot-product path: s = start, then for each
    pair p: s += a[:, 2p+1] b[2p+1, :], then s += a[:, 2p] b[2p, :], each
    rounded to float32 (vdpbf16ps adds the odd element first; a padded odd K
    adds a zero product). a, b hold bf16 values as float32."""
    s = np.array(start, np.float32, copy=True)
    for p in range((a.shape[1] + 1) // 2):
        if 2 * p + 1 < a.shape[1]:
            s += np.outer(a[:, 2 * p + 1], b[2 * p + 1])
        else:
            s += np.float32(0.0)
        s += np.outer(a[:, 2 * p], b[2 * p])
    return s


@pytest.mark.parametrize("B,T,C,OC", EXACT_SHAPES)
@pytest.mark.parametrize("isa", DOT)
def test_dot_product_path_is_the_pair_chain_bitwise(use_isa, isa, B, T, C, OC):
    """Every element is one chain over the pairs in order, whatever the tile,
    K block, skinny kernel or edge: bitwise a float32 emulation of it."""
    x, w16, bias, dout, _ = layer(B, T, C, OC)
    use_isa(isa)
    xb = rounded(x).astype(np.float32).reshape(-1, C)
    db = rounded(dout).astype(np.float32).reshape(-1, OC)
    w = widen(w16)
    start = np.random.default_rng(7).standard_normal((B * T, C), dtype=np.float32)
    grads = backward(dout, x, w16, start={"dinp": start.reshape(x.shape),
                                          "dweight": np.zeros(w16.shape, np.float32),
                                          "dbias": np.zeros(OC, np.float32)})
    expected = {"out": pair_chain(xb, w.T, np.broadcast_to(bias, (B * T, OC))),
                "dinp": pair_chain(db, w, start),
                "dweight": pair_chain(db.T, xb, np.zeros((OC, C), np.float32))}
    ours = {"out": forward(x, w16, bias).reshape(-1, OC), "dinp": grads["dinp"].reshape(-1, C),
            "dweight": grads["dweight"]}
    for name, value in expected.items():
        diff = np.abs(ours[name] - value)
        assert np.array_equal(ours[name], value), (
            f"{name}: {np.count_nonzero(diff)} elements differ, by up to {diff.max():.3e}")


# the classifier's dinp: a block of rows, N = C not a multiple of the 48
# columns of a tile (16 or 32 left over), K a long vocabulary (odd)
HEAD_SHAPES = [(1, 203, 100, 7001),   # an edge row panel, a 4-column tile
               (2, 64, 560, 6000)]    # 11 whole column panels and 32 columns


@pytest.mark.parametrize("B,T,C,OC", HEAD_SHAPES)
@pytest.mark.parametrize("isa", DOT)
def test_head_dinp_is_the_pair_chain_on_every_thread_count(set_threads, use_isa, isa,
                                                           B, T, C, OC):
    """dinp of few rows over a long K (added onto a start, or written) is
    bitwise the pair chain on 1, 2 and 3 threads (the weight's rows zipped
    into pairs, the last columns' narrow tiles), and dweight beside it the
    same on each."""
    x, w16, _, dout, _ = layer(B, T, C, OC)
    use_isa(isa)
    db = rounded(dout).astype(np.float32).reshape(-1, OC)
    start = np.random.default_rng(7).standard_normal((B * T, C), dtype=np.float32)
    expected = {0: pair_chain(db, widen(w16), start),
                K.WRITE_DINP: pair_chain(db, widen(w16), np.zeros_like(start))}
    dweights = []
    for n in (1, 2, 3):
        set_threads(n)
        for written, value in expected.items():
            dinp = start.reshape(x.shape).copy() if written == 0 else np.full(x.shape, np.nan,
                                                                            np.float32)
            dweight = np.zeros(w16.shape, np.float32)
            K.matmul_backward_bf16(dinp, dweight, None, dout, x, w16, written=written)
            assert np.array_equal(dinp.reshape(-1, C), value), f"{n} threads, written={written}"
            dweights.append(dweight)
    assert all(np.array_equal(dw, dweights[0]) for dw in dweights), "dweight"


@pytest.mark.parametrize("T", [5, 41])   # the skinny forward and the GEMM
@pytest.mark.parametrize("isa", ISAS)
def test_denormal_inputs_round_as_float_to_bf16(use_isa, isa, T):
    """float32 denormals within half a bf16 ulp of 2^-126 round up to that
    normal bf16 (float_to_bf16); vcvtne2ps2bf16 alone would flush them to 0,
    so the packing corrects them. Each float32 operand in turn holds only
    such values, against 2^100-scaled partners, so that every product is a
    normal ~2^-26 and every output depends on the rounding."""
    rng = np.random.default_rng(T)
    B, C, OC = 1, 67, 53
    band = np.array([0x007F8000, 0x007FC000, 0x007FFFFF, 0x807F8000, 0x807FFFFF],
                    np.uint32).view(np.float32)
    x_band = rng.choice(band, (B, T, C))
    dout_band = rng.choice(band, (B, T, OC))
    x_big = (rng.standard_normal((B, T, C)) * 2.0 ** 100).astype(np.float32)
    dout_big = (rng.standard_normal((B, T, OC)) * 2.0 ** 100).astype(np.float32)
    w16 = np.empty((OC, C), np.uint16)
    K.float_to_bf16(w16, (rng.standard_normal((OC, C)) * 2.0 ** 100).astype(np.float32))
    use_isa(isa)
    out = forward(x_band, w16, None)
    dinp = backward(dout_band, x_band, w16)["dinp"]
    dweight_a = backward(dout_band, x_big, w16)["dweight"]   # dout^T rounded while packed
    dweight_b = backward(dout_big, x_band, w16)["dweight"]   # inp rounded while packed
    xb, xg = rounded(x_band).reshape(T, C), rounded(x_big).reshape(T, C)
    db, dg = rounded(dout_band).reshape(T, OC), rounded(dout_big).reshape(T, OC)
    assert np.abs(xb).min() == 2.0 ** -126 and np.abs(db).min() == 2.0 ** -126
    wb = widen(w16).astype(np.float64)
    for name, ours, a, b in (("out", out, xb, wb.T), ("dinp", dinp, db, wb),
                             ("dweight inp", dweight_a, db.T, xg),
                             ("dweight dout", dweight_b, dg.T, xb)):
        exact, bound = a @ b, gamma(a.shape[1]) * (np.abs(a) @ np.abs(b))
        # flushed to 0, these inputs would give 0: out of bounds nearly everywhere
        assert np.mean(np.abs(exact) > bound) > 0.9, name
        assert_within(f"{isa} {name}", ours, exact, bound)


@pytest.mark.parametrize("T", [5, 41])   # the skinny forward and the GEMM
@pytest.mark.parametrize("isa", ISAS)
def test_non_finite_values_stay_in_their_rows_and_columns(use_isa, isa, T):
    """An inf or NaN reaches exactly the outputs whose sums contain it. With K
    odd, the pad of a row's last pair sits where the next row begins: a
    kernel that read one element too far would multiply that neighbour's inf
    by the partner's zero pad, a NaN one row or column off."""
    rng = np.random.default_rng(T)
    B, C, OC = 1, 37, 29
    x = rng.standard_normal((B, T, C), dtype=np.float32)
    dout = rng.standard_normal((B, T, OC), dtype=np.float32)
    w = rng.standard_normal((OC, C), dtype=np.float32)
    x[0, 3, 0], dout[0, 2, 0], w[3, 0] = np.inf, np.nan, -np.inf
    w16 = np.empty((OC, C), np.uint16)
    K.float_to_bf16(w16, w)
    use_isa(isa)
    out = forward(x, w16, None)[0]
    grads = backward(dout, x, w16)
    expected_bad = {   # output -> (rows, columns) that hold a non-finite term
        "out": ({3}, {3}), "dinp": ({2}, {0}), "dweight": ({0}, {0})}
    for name, value in (("out", out), ("dinp", grads["dinp"][0]),
                        ("dweight", grads["dweight"])):
        rows, cols = expected_bad[name]
        bad = np.zeros(value.shape, bool)
        bad[list(rows), :] = True
        bad[:, list(cols)] = True
        assert np.isfinite(value[~bad]).all(), f"{name}: non-finite outside its rows/columns"
        assert not np.isfinite(value[bad]).any(), f"{name}: a non-finite term got lost"


@pytest.mark.parametrize("isa", ISAS)
def test_thread_count_does_not_change_a_bit(rng, set_threads, use_isa, isa):
    use_isa(isa)
    for B, T, C, OC in [(3, 131, 800, 100), (1, 801, 70, 130), (1, 11, 67, 1007)]:
        x, w16, bias, dout, _ = layer(B, T, C, OC)
        assert_thread_invariant(set_threads, lambda: {
            "out": forward(x, w16, bias), **backward(dout, x, w16)}, counts=(1, 2, 3))


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("isa", ISAS)
def test_skinny_rows_equal_gemm_rows_bitwise(use_isa, isa, with_bias):
    """A row's result does not depend on the rows beside it: rows 5 .. 5+M of
    a 64-row batch (the GEMM), computed alone for M = 1 .. 17 (the skinny
    kernel up to 12 on avx512bf16, 16 on the widened paths), are bitwise the
    batch's."""
    use_isa(isa)
    for C, OC in [(35, 45), (67, 1007), (32, 16), (1, 1)]:
        x, w16, bias, _, _ = layer(1, 64, C, OC)
        bias = bias if with_bias else None
        gemm = forward(x, w16, bias)
        for M in range(1, 18):
            alone = forward(np.ascontiguousarray(x[:, 5:5 + M]), w16, bias)
            assert np.array_equal(alone, gemm[:, 5:5 + M]), f"C={C} OC={OC} M={M}"


@pytest.mark.parametrize("variant", ["", "naive"])
@pytest.mark.parametrize("isa", ISAS)
def test_backward_accumulates(use_isa, isa, variant):
    """A second call adds onto what the first left: within the bound with the
    first result as the start value (and so about twice one call)."""
    B, T, C, OC = 2, 37, 130, 97
    x, w16, _, dout, ref = layer(B, T, C, OC)
    use_isa(isa)
    once = backward(dout, x, w16, variant)
    twice = backward(dout, x, w16, variant, start=once)
    for name, k in (("dinp", OC), ("dweight", B * T)):
        exact, bound = ref[name]
        first = once[name].reshape(exact.shape).astype(np.float64)
        assert_within(f"{name} twice", twice[name], first + exact,
                      bound + gamma(k) * np.abs(first))
    assert_close("dbias", twice["dbias"], 2.0 * once["dbias"], TOL["matmul"]["bwd"])


@pytest.mark.parametrize("skip", ["dinp", "dweight", "dbias"])
@pytest.mark.parametrize("variant", ["", "naive"])
@pytest.mark.parametrize("isa", ISAS)
def test_backward_skips_a_product_given_none(use_isa, isa, variant, skip):
    x, w16, _, dout, _ = layer(2, 17, 67, 45)
    use_isa(isa)
    full = backward(dout, x, w16, variant)
    grads = {name: np.zeros_like(value) for name, value in full.items()}
    grads[skip] = None
    K.matmul_backward_bf16(grads["dinp"], grads["dweight"], grads["dbias"], dout, x, w16,
                           variant=variant)
    for name, value in grads.items():
        if name != skip:
            np.testing.assert_array_equal(value, full[name], err_msg=name)
    # the C contract: weight is needed only for dinp, inp only for dweight
    fn = lib.matmul_backward_bf16_naive if variant == "naive" else lib.matmul_backward_bf16
    dbias = np.zeros(45, np.float32)
    status = fn(ffi.NULL, ffi.NULL, ffi.cast("float*", dbias.ctypes.data),
                ffi.cast("float*", dout.ctypes.data), ffi.NULL, ffi.NULL, 2, 17, 67, 45,
                lib.LLMC_DTYPE_F32, 0)
    assert status == lib.LLMC_OK
    np.testing.assert_array_equal(dbias, full["dbias"])


@pytest.mark.parametrize("isa", ISAS)
def test_dbias_is_the_float32_layers_column_sums(use_isa, isa):
    x, w16, _, dout, _ = layer(4, 64, 768, 768)
    use_isa(isa)
    ours = backward(dout, x, w16)["dbias"]
    fp32 = np.zeros(768, np.float32)
    K.matmul_backward(None, None, fp32, dout, x, widen(w16))
    assert np.array_equal(ours, fp32)


def test_float_to_bf16_rounds_as_torch():
    """The rounding every float32 operand goes through (the references above
    round with torch): nearest, ties to even, NaN stays NaN, overflow to inf."""
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(1000, dtype=np.float32),
                        np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00000001, 0x807FFFFF,
                                  0x007F8000, 0x7F800000, 0xFF800000], np.uint32).view(np.float32)])
    ours = np.empty(x.shape, np.uint16)
    K.float_to_bf16(ours, x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)
    nan = np.array([np.nan], np.float32)
    K.float_to_bf16(ours[:1], nan)
    assert np.isnan(widen(ours[:1]))[0]


@pytest.mark.parametrize("variant", ["", "naive"])
def test_rejects_bad_shapes_and_null(variant):
    x, w16, bias, dout, _ = layer(2, 17, 67, 45)
    out = np.empty((2, 17, 45), np.float32)
    with pytest.raises(llmc_py.ShapeError, match="weight"):
        K.matmul_forward_bf16(out, x, w16[:, :-1], bias, variant=variant)
    with pytest.raises(llmc_py.ShapeError, match="bias"):
        K.matmul_forward_bf16(out, x, w16, bias[:-1], variant=variant)
    with pytest.raises(llmc_py.ShapeError, match="dout"):
        K.matmul_backward_bf16(np.zeros_like(x), None, None, dout[:, :-1], x, w16,
                               variant=variant)
    with pytest.raises(TypeError, match="weight"):
        K.matmul_forward_bf16(out, x, widen(w16), bias, variant=variant)
    fwd = lib.matmul_forward_bf16_naive if variant == "naive" else lib.matmul_forward_bf16
    bwd = lib.matmul_backward_bf16_naive if variant == "naive" else lib.matmul_backward_bf16
    fp = lambda a: ffi.cast("float*", a.ctypes.data)
    hp = ffi.cast("uint16_t*", w16.ctypes.data)
    assert fwd(fp(out), fp(x), hp, ffi.NULL, 0, 17, 67, 45, F32) == lib.LLMC_ERR_SHAPE
    assert fwd(fp(out), fp(x), hp, ffi.NULL, 2, 17, 67, -1, F32) == lib.LLMC_ERR_SHAPE
    assert fwd(ffi.NULL, fp(x), hp, ffi.NULL, 2, 17, 67, 45, F32) == lib.LLMC_ERR_NULL
    assert fwd(fp(out), fp(x), ffi.NULL, ffi.NULL, 2, 17, 67, 45, F32) == lib.LLMC_ERR_NULL
    dinp = np.zeros_like(x)
    assert bwd(fp(dinp), ffi.NULL, ffi.NULL, ffi.NULL, fp(x), hp, 2, 17, 67, 45, F32, 0) \
        == lib.LLMC_ERR_NULL                                        # no dout
    assert bwd(fp(dinp), ffi.NULL, ffi.NULL, fp(dout), fp(x), ffi.NULL, 2, 17, 67, 45, F32, 0) \
        == lib.LLMC_ERR_NULL                                        # dinp needs the weight
    assert bwd(ffi.NULL, fp(dinp), ffi.NULL, fp(dout), ffi.NULL, hp, 2, 17, 67, 45, F32, 0) \
        == lib.LLMC_ERR_NULL                                        # dweight needs inp
    assert bwd(fp(dinp), ffi.NULL, ffi.NULL, fp(dout), fp(x), hp, 2, 0, 67, 45, F32, 0) \
        == lib.LLMC_ERR_SHAPE


# shapes for the bf16 inp: the skinny forward, edge tiles, odd K, two K blocks
BF16_INP_SHAPES = [(2, 17, 67, 45), (1, 37, 37, 29), (3, 13, 100, 97), (1, 5, 130, 200),
                   (1, 12, 33, 50), (1, 13, 33, 50), (2, 9, 1000, 70), (1, 801, 40, 1001),
                   (1, 1, 1, 1), (2, 64, 768, 768)]


def special_inputs(x):
    """x with some elements replaced by values whose rounding is special: the
    float32 denormals that round up to 2^-126, bf16 denormals, an infinity,
    values past the largest bf16 and halfway cases (ties to even)."""
    x = x.copy()
    specials = np.array([0x007F8000, 0x807FFFFF, 0x00010000, 0x80030000, 0x7F800000,
                         0x7F7FFFFF, 0x3F808000, 0x3F818000, 0xBF808000], np.uint32)
    flat = x.reshape(-1)
    where = np.random.default_rng(flat.size).choice(flat.size, min(flat.size, 9),
                                                    replace=False)
    flat[where] = specials[:len(where)].view(np.float32)
    return x


@pytest.mark.parametrize("variant", ["", "naive"])
@pytest.mark.parametrize("isa", ISAS)
def test_bf16_inp_gives_bitwise_its_float32_sources_results(set_threads, use_isa, isa,
                                                             variant):
    """inp given as bf16 (a norm's or an activation's bf16 output) is read as
    it is where a float32 inp is rounded: the forward, dinp, dweight and dbias
    are bitwise those of the float32 array it was rounded from, on every path
    (skinny rows, GEMM tiles, widened copies, the naive loops), at 1, 2 and 3
    threads."""
    use_isa(isa)
    for B, T, C, OC in BF16_INP_SHAPES:
        if variant == "naive" and B * T * C * OC > 10**7:
            continue
        x, w16, bias, dout, _ = layer(B, T, C, OC)
        x = special_inputs(x)
        x16 = np.empty(x.shape, np.uint16)
        K.float_to_bf16(x16, x)
        zeros = {"dinp": np.zeros(x.shape, np.float32), "dweight": np.zeros(w16.shape, np.float32),
                 "dbias": np.zeros(OC, np.float32)}
        expected = {"out": forward(x, w16, bias, variant),
                    **backward(dout, x, w16, variant, start=zeros)}
        for threads in (1, 2, 3):
            set_threads(threads)
            ours = {"out": forward(x16, w16, bias, variant),
                    **backward(dout, x16, w16, variant, start=zeros)}
            for name, value in expected.items():
                assert np.array_equal(ours[name].view(np.uint32), value.view(np.uint32)), (
                    f"{name} at {(B, T, C, OC)}, {threads} threads")


def test_inp_dtype_is_checked():
    x, w16, bias, _, _ = layer(2, 17, 67, 45)
    out = np.empty((2, 17, 45), np.float32)
    with pytest.raises(TypeError, match="inp must be a float32 or bf16"):
        K.matmul_forward_bf16(out, x.astype(np.float64), w16, bias)
    fp = lambda a: ffi.cast("float*", a.ctypes.data)
    hp = ffi.cast("uint16_t*", w16.ctypes.data)
    assert lib.matmul_forward_bf16(fp(out), fp(x), hp, ffi.NULL, 2, 17, 67, 45, 2) \
        == lib.LLMC_ERR_VALUE
    assert lib.matmul_backward_bf16_naive(ffi.NULL, fp(out), ffi.NULL, fp(out), fp(x), hp,
                                          2, 17, 67, 45, -1, 0) == lib.LLMC_ERR_VALUE


# the dinp GEMM (K = OC) and the dweight GEMM (K = B*T) each over several K blocks
WRITTEN_SHAPES = [(2, 37, 130, 97), (1, 5, 67, 1100), (4, 300, 67, 45)]


@pytest.mark.parametrize("B,T,C,OC", WRITTEN_SHAPES)
@pytest.mark.parametrize("variant", ["", "naive"])
@pytest.mark.parametrize("isa", ISAS)
def test_written_outputs_are_the_sum_into_zeros_bitwise(set_threads, use_isa, isa, variant,
                                                        B, T, C, OC):
    """`written` outputs hold garbage before the call and end bitwise as a
    call adding into zeros; the others still add onto what they hold."""
    x, w16, _, dout, _ = layer(B, T, C, OC)
    use_isa(isa)
    start = backward(dout, x, w16, variant)   # nonzero start values
    into_zeros = backward(dout, x, w16, variant)
    for written in WRITTEN_MASKS:
        def run():
            return backward_written(K.matmul_backward_bf16, start, written, dout, x, w16,
                                    variant=variant)
        expected = backward(dout, x, w16, variant, start=start)
        for flag, name in WRITTEN_OUTPUTS.items():
            if written & flag:
                expected[name] = into_zeros[name]
        grads = run()
        for name in expected:
            assert np.array_equal(grads[name].view(np.uint32), expected[name].view(np.uint32)), \
                f"{isa} {variant} written={written} {name}"
        assert_thread_invariant(set_threads, run)


# the few-row forward (unfused there), edge tiles, two K blocks, GPT-2's fc at B*T = 64
GELU_SHAPES = [(1, 5, 67, 45), (2, 17, 67, 45), (3, 13, 100, 97), (1, 37, 700, 130),
               (1, 64, 768, 3072)]


@pytest.mark.parametrize("B,T,C,OC", GELU_SHAPES)
@pytest.mark.parametrize("act_dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("isa", ISAS)
def test_gelu_epilogue_is_the_product_then_gelu_forward_bitwise(set_threads, use_isa, isa,
                                                                act_dtype, B, T, C, OC):
    x, w16, bias, _, _ = layer(B, T, C, OC)
    x = x.copy()
    x[0, 0, :3] = [30.0, -30.0, 0.0]   # GELU's saturated tails in the products
    x16 = np.empty(x.shape, np.uint16)
    K.float_to_bf16(x16, x)
    use_isa(isa)
    for inp in (x, x16):
        for b in (bias, None):
            out = forward(inp, w16, b)
            act = np.empty(out.shape, act_dtype)
            K.gelu_forward(act, out)

            def run():
                ours = {"out": np.full(out.shape, np.nan, np.float32),
                        "act": np.full(out.shape, 0x7FC1, act_dtype)}   # (written)
                K.matmul_gelu_forward_bf16(ours["out"], ours["act"], inp, w16, b)
                return ours
            ours = run()
            assert np.array_equal(ours["out"], out), f"{isa} out"
            assert np.array_equal(ours["act"].view(act.dtype), act), f"{isa} act"
    assert_thread_invariant(set_threads, run)


def test_gelu_epilogue_checks_its_arguments():
    x, w16, bias, _, _ = layer(2, 17, 67, 45)
    out = np.empty((2, 17, 45), np.float32)
    with pytest.raises(TypeError, match="act_out"):
        K.matmul_gelu_forward_bf16(out, np.empty((2, 17, 45), np.float64), x, w16, bias)
    with pytest.raises(llmc_py.ShapeError, match="act_out"):
        K.matmul_gelu_forward_bf16(out, np.empty((2, 17, 44), np.float32), x, w16, bias)
    fp = lambda a: ffi.cast("float*", a.ctypes.data)
    hp = ffi.cast("uint16_t*", w16.ctypes.data)
    fused = lib.matmul_gelu_forward_bf16
    assert fused(fp(out), fp(out), fp(x), hp, ffi.NULL, 2, 17, 67, 45, 0, 2) == lib.LLMC_ERR_VALUE
    assert fused(fp(out), ffi.NULL, fp(x), hp, ffi.NULL, 2, 17, 67, 45, 0, 0) == lib.LLMC_ERR_NULL
