"""csrc/lora_bf16.c: the up side of a linear layer's LoRA adapters in bf16
(lora_up_forward_bf16, lora_up_backward_bf16), on every instruction set this
CPU runs.

Each adapter's block is one job of the bf16 GEMM with the operands, sizes and
kinds of a matmul_*_bf16 call on that block alone, so with more rows than the
few-row forward path takes (12) every block is bitwise that call's; at any
size it is within the bf16 GEMM's bound of float64 sums of the rounded
operands (tests/test_matmul_bf16.py: 1.01 gamma_K (|start| + sum |a b|)).
The backward on avx512bf16 is a kernel of its own (one pass over dout): its
d(up) is still bitwise the matmul's, and so is dh where an adapter's columns
are one of its units (up to 256 columns); dh of wider adapters adds the
units' parts, within the bound.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import llmc_py
from llmc_py import kernels as K
from llmc_py.errors import RangeError
from llmc_py.io.files import from_bf16, to_bf16
from llmc_py.model.planning import MATMUL_SCRATCH_PER_THREAD, lora_backward_scratch
from helpers import assert_thread_invariant

ISAS = llmc_py.supported_isas()
U = 2.0 ** -24
CASES = [  # B, T, W, r, the adapters' columns
    (4, 64, 96, 16, [(0, 48), (48, 72), (72, 96)]),   # q, k, v of a qkv layer
    (1, 37, 70, 3, [(0, 35), (35, 70)]),              # gate and up; odd T, W
    (2, 9, 53, 1, [(5, 20), (31, 53)]),               # rank 1, columns left out
    (3, 5, 40, 7, [(0, 40)]),                         # one adapter, few rows
    # the forward's rows in slices of 128 (lora_bf16.c), the last one short
    (3, 100, 200, 16, [(0, 100), (100, 150), (150, 200)]),
    # one block over every column: the adapters' d(input) += dh A (model/lora.py)
    (3, 100, 200, 48, [(0, 200)]),
    # the backward's units (lora_bf16.c): adapters of several chunks of
    # columns, rows in two blocks of 64, the last one odd
    (1, 101, 1400, 16, [(0, 1100), (1100, 1400)]),
    # rank past 16 (two groups of lanes), three chunks, one block
    (2, 21, 700, 20, [(0, 650)]),
]
# the cases whose adapters span several of the backward's units
MANY_UNITS = [6, 7]


def operands(B, T, W, r, columns, seed=0):
    """Random out, dout (B, T, W), h (B, T, n, r), up_t bf16 (n, r, W), rows."""
    rng = np.random.default_rng(seed)
    n = len(columns)
    out, dout = rng.standard_normal((2, B, T, W)).astype(np.float32)
    h = rng.standard_normal((B, T, n, r)).astype(np.float32)
    up_t = to_bf16(rng.standard_normal((n, r, W)).astype(np.float32))
    return out, dout, h, up_t, np.array(columns, np.int32)


def run(out, dout, h, up_t, rows):
    """Both kernels on copies: out after the forward, dh, and dup_t (started at NaN)."""
    out = out.copy()
    K.lora_up_forward_bf16(out, h, up_t, rows)
    dh = np.full(h.shape, np.nan, np.float32)
    dup_t = np.full(up_t.shape, np.nan, np.float32)
    K.lora_up_backward_bf16(dh, dup_t, dout, h, up_t, rows)
    return {"out": out, "dh": dh, "dup_t": dup_t}


def rounded(x):
    return torch.from_numpy(from_bf16(to_bf16(np.ascontiguousarray(x))).astype(np.float64))


def within_bound(ours, start, a, b, K_):
    """ours (M, N) against start + a @ b in float64 (a (M, K), b (K, N)
    already rounded), within the bf16 GEMM's bound."""
    ref = start + a @ b
    scale = start.abs() + a.abs() @ b.abs()
    gamma = K_ * U / (1 - K_ * U)
    excess = (torch.from_numpy(ours.astype(np.float64)) - ref).abs() - 1.01 * gamma * scale
    assert excess.max() <= 0, float(excess.max())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_adapter_is_its_own_product_within_the_bound(use_isa, isa, case):
    use_isa(isa)
    B, T, W, r, columns = CASES[case]
    out, dout, h, up_t, rows = operands(B, T, W, r, columns)
    ours = run(out, dout, h, up_t, rows)
    adapted = np.zeros(W, bool)
    x2 = lambda x: x.reshape(B * T, -1)   # noqa: E731
    up = from_bf16(up_t).astype(np.float64)
    for j, (s, e) in enumerate(columns):
        adapted[s:e] = True
        assert np.isnan(np.delete(ours["dup_t"][j], np.s_[s:e], axis=1)).all()
        h_j, dout_j, up_j = rounded(x2(h[:, :, j])), rounded(x2(dout[..., s:e])), up[j][:, s:e]
        up_j = torch.from_numpy(up_j)
        within_bound(x2(ours["out"][..., s:e]), torch.from_numpy(x2(out[..., s:e])).double(),
                     h_j, up_j, r)
        within_bound(x2(ours["dh"][:, :, j]), torch.zeros(B * T, r, dtype=torch.float64),
                     dout_j, up_j.T, e - s)
        within_bound(ours["dup_t"][j][:, s:e], torch.zeros(r, e - s, dtype=torch.float64),
                     h_j.T, dout_j, B * T)
    # what no adapter owns is left as it was
    assert np.array_equal(ours["out"][..., ~adapted], out[..., ~adapted])
    assert not np.isnan(ours["dh"]).any()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", [0, 1, 4, 5])
def test_each_adapter_is_bitwise_the_matmul_of_its_block(use_isa, isa, case):
    """Above the few-row path (B T > 12): each block bitwise matmul_*_bf16's."""
    use_isa(isa)
    B, T, W, r, columns = CASES[case]
    out, dout, h, up_t, rows = operands(B, T, W, r, columns, seed=1)
    ours = run(out, dout, h, up_t, rows)
    for j, (s, e) in enumerate(columns):
        h_j = np.ascontiguousarray(h[:, :, j])
        dout_j = np.ascontiguousarray(dout[..., s:e])
        up_j = np.ascontiguousarray(up_t[j][:, s:e])   # (r, e - s) bf16
        out_j = np.ascontiguousarray(out[..., s:e])
        K.matmul_backward_bf16(out_j, None, None, h_j, out_j, up_j)   # out_j += h_j up_j
        dh_j = np.empty_like(h_j)
        K.matmul_forward_bf16(dh_j, dout_j, up_j, None)
        dup_j = np.zeros((r, e - s), np.float32)
        K.matmul_backward_bf16(None, dup_j, None, h_j, dout_j, up_j)
        assert np.array_equal(ours["out"][..., s:e], out_j)
        assert np.array_equal(ours["dh"][:, :, j], dh_j)
        assert np.array_equal(ours["dup_t"][j][:, s:e], dup_j)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", MANY_UNITS)
def test_d_up_stays_bitwise_the_matmul_across_units(use_isa, isa, case):
    """Adapters of several units: d(up)'s sums run down every row in the
    GEMM's order (bitwise matmul_backward_bf16's); dh adds the units' parts
    (within the bound: test_each_adapter_is_its_own_product_within_the_bound)."""
    use_isa(isa)
    B, T, W, r, columns = CASES[case]
    out, dout, h, up_t, rows = operands(B, T, W, r, columns, seed=2)
    ours = run(out, dout, h, up_t, rows)
    for j, (s, e) in enumerate(columns):
        dup_j = np.zeros((r, e - s), np.float32)
        K.matmul_backward_bf16(None, dup_j, None, np.ascontiguousarray(h[:, :, j]),
                               np.ascontiguousarray(dout[..., s:e]),
                               np.ascontiguousarray(up_t[j][:, s:e]))
        assert np.array_equal(ours["dup_t"][j][:, s:e], dup_j)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", [0, 4, *MANY_UNITS])
def test_results_do_not_depend_on_the_thread_count(use_isa, set_threads, isa, case):
    use_isa(isa)
    arrays = operands(*CASES[case])
    # dup_t's entries outside each adapter's columns stay NaN: compared as 0
    assert_thread_invariant(set_threads, lambda: {name: np.nan_to_num(x)
                                                  for name, x in run(*arrays).items()})


@pytest.mark.parametrize("columns", [[(0, 10), (5, 20)],     # overlapping
                                     [(10, 20), (0, 5)],     # descending
                                     [(0, 10), (10, 10)],    # empty
                                     [(0, 10), (20, 41)],    # past W
                                     [(-1, 10)]])
def test_bad_columns_are_refused_before_anything_is_written(columns):
    out, dout, h, up_t, rows = operands(1, 3, 40, 2, columns)
    before = out.copy()
    dh, dup_t = np.zeros(h.shape, np.float32), np.zeros(up_t.shape, np.float32)
    with pytest.raises(RangeError):
        K.lora_up_forward_bf16(out, h, up_t, rows)
    with pytest.raises(RangeError):
        K.lora_up_backward_bf16(dh, dup_t, dout, h, up_t, rows)
    assert np.array_equal(out, before) and not dh.any() and not dup_t.any()


def fill_arena_with_nan():
    """The kernels' arena left holding NaNs: a bf16 product of NaN rows packs
    them into its panels (its first few MiB)."""
    x = np.full((4, 256, 1024), np.nan, np.float32)
    weight = to_bf16(np.ones((512, 1024), np.float32))
    K.matmul_forward_bf16(np.empty((4, 256, 512), np.float32), x, weight, None)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", [0, 2, *MANY_UNITS])
def test_a_reused_arena_gives_the_bits_of_a_fresh_one(use_isa, isa, case):
    """The backward's scratch is the arena's (kept between calls, its
    contents undefined): after other kernels left NaNs there, the same bits
    as on a just-released arena."""
    use_isa(isa)
    arrays = operands(*CASES[case])
    llmc_py.release_scratch()
    fresh = run(*arrays)
    fill_arena_with_nan()
    reused = run(*arrays)
    for name in fresh:
        assert np.array_equal(fresh[name], reused[name], equal_nan=True), name


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("isa", ISAS)
def test_the_backward_scratch_is_the_arena_within_the_plan(use_isa, set_threads, isa,
                                                           threads):
    """Its scratch (dh's parts of every unit, B T rows each, and each
    thread's) is held in the arena, so that a step's calls allocate nothing,
    and within memory_plan's estimate (planning.lora_backward_scratch); more
    rows than the matmuls' panels take here (3 adapters of 3 and more units
    each, 2 groups of lanes, 8192 rows)."""
    use_isa(isa)
    set_threads(threads)
    B, T, W, r, columns = 2, 4096, 1600, 20, [(0, 800), (800, 1200), (1200, 1600)]
    arrays = operands(B, T, W, r, columns)
    out, dout, h, up_t, rows = arrays
    dh, dup_t = np.empty(h.shape, np.float32), np.empty(up_t.shape, np.float32)
    llmc_py.release_scratch()
    K.lora_up_backward_bf16(dh, dup_t, dout, h, up_t, rows)
    held = llmc_py.scratch_bytes()
    K.lora_up_backward_bf16(dh, dup_t, dout, h, up_t, rows)
    assert llmc_py.scratch_bytes() == held > 0
    planned = lora_backward_scratch(SimpleNamespace(qkv_channels=W, C=W // 2, fc_channels=W),
                                    B, T, r, threads)
    if isa == "avx512bf16":   # its own kernel (elsewhere the bf16 GEMM's jobs)
        assert MATMUL_SCRATCH_PER_THREAD < held <= planned
