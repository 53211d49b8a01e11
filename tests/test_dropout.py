"""csrc/dropout.c: the masks' rate, scale and determinism; p = 0 the
identity, bitwise; thread-count invariance; a batch split into row ranges
drawing the same masks. (The attention kernels' dropout is in
test_attention.py.)"""
import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from helpers import assert_thread_invariant, randn

SHAPES = [(4, 64, 256), (1, 1, 1), (2, 9, 17), (3, 5, 67)]   # B, T, C


def dropped(x, p, seed, backward=False):
    out = np.full_like(x, np.nan)   # (written): must not be read
    (K.dropout_backward if backward else K.dropout_forward)(out, x, p, seed)
    return out


@pytest.mark.parametrize("B,T,C", SHAPES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_1_minus_p_and_scales_them(rng, isa, B, T, C, p):
    x = randn(rng, B, T, C) + 3.0   # no zero among the inputs
    out = dropped(x, p, seed=12345)
    kept = out != 0
    # every kept element is x * (1 / (1 - p)) in float32, exactly
    scale = np.float32(1.0) / (np.float32(1.0) - np.float32(p))
    assert np.array_equal(out[kept], x[kept] * scale)
    n = x.size
    if n >= 10000:   # the kept fraction is 1 - p within 5 standard deviations
        assert abs(kept.mean() - (1 - p)) <= 5 * np.sqrt(p * (1 - p) / n)


def test_dropout_masks_are_the_same_on_every_instruction_set(rng, use_isa):
    x = randn(rng, 3, 7, 100)
    outs = {}
    for isa in llmc_py.supported_isas():
        use_isa(isa)
        outs[isa] = dropped(x, 0.3, seed=99)
    first = next(iter(outs.values()))
    assert all(np.array_equal(first, out) for out in outs.values())


def test_dropout_is_a_function_of_seed_and_indices(rng):
    x = randn(rng, 2, 8, 33)
    a, b = dropped(x, 0.5, seed=7), dropped(x, 0.5, seed=7)
    assert np.array_equal(a, b)
    assert not np.array_equal(a != 0, dropped(x, 0.5, seed=8) != 0)
    # rows and columns have masks of their own (none repeats another's)
    mask = dropped(np.ones((4, 16, 64), np.float32), 0.5, seed=7) != 0
    rows = mask.reshape(64, 64)
    assert len({row.tobytes() for row in rows}) == 64
    assert len({col.tobytes() for col in rows.T}) == 64


def test_dropout_rows_of_a_larger_batch_take_its_masks(rng):
    # batch rows b0.. under seed + b0 * DROPOUT_ROW_STEP (mod 2^64) are those
    # rows of the larger batch: how its rows are split never changes a mask
    x = randn(rng, 5, 6, 40)
    seed = 2**64 - 3   # the offset wraps around
    whole = dropped(x, 0.4, seed)
    for b0 in (1, 2, 4):
        part = dropped(x[b0:].copy(), 0.4, (seed + b0 * K.DROPOUT_ROW_STEP) % 2**64)
        assert np.array_equal(part, whole[b0:]), b0


def test_dropout_in_place_and_backward_are_the_same_masking(rng):
    x = randn(rng, 3, 11, 50)
    out = dropped(x, 0.25, seed=5)
    inplace = x.copy()
    K.dropout_forward(inplace, inplace, 0.25, 5)
    assert np.array_equal(inplace, out)
    assert np.array_equal(dropped(x, 0.25, seed=5, backward=True), out)
    K.dropout_backward(inplace, inplace, 0.25, 5)   # the mask again, in place
    assert np.array_equal(inplace, np.where(out != 0, out * np.float32(1 / 0.75), 0))


@pytest.mark.parametrize("backward", [False, True])
def test_dropout_with_p_0_is_the_identity(rng, backward):
    x = randn(rng, 2, 5, 19)
    assert np.array_equal(dropped(x, 0.0, seed=3, backward=backward), x)
    inplace = x.copy()
    (K.dropout_backward if backward else K.dropout_forward)(inplace, inplace, 0.0, 3)
    assert np.array_equal(inplace, x)


def test_dropout_thread_invariant(rng, isa, set_threads):
    x = randn(rng, 3, 17, 70)   # 51 rows, uneven over 2 and 3 threads
    assert_thread_invariant(set_threads, lambda: {"out": dropped(x, 0.3, seed=11),
                                                  "din": dropped(x, 0.3, 11, backward=True)})


@pytest.mark.parametrize("p", [1.0, -0.1, float("nan"), float("inf"), 2.0])
def test_dropout_rejects_a_probability_outside_0_1(p):
    x = np.ones((1, 2, 3), np.float32)
    with pytest.raises(llmc_py.InvalidValueError, match="dropout_forward"):
        K.dropout_forward(x, x, p, 0)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5])
def test_dropout_rejects_a_seed_outside_64_bits(seed):
    x = np.ones((1, 2, 3), np.float32)
    with pytest.raises(ValueError, match="seed"):
        K.dropout_forward(x, x, 0.1, seed)


def test_dropout_rejects_wrong_shape():
    x = np.ones((2, 3, 4), np.float32)
    with pytest.raises(llmc_py.ShapeError, match="out"):
        K.dropout_forward(np.ones((2, 3, 5), np.float32), x, 0.1, 0)
    with pytest.raises(llmc_py.ShapeError, match="dout"):
        K.dropout_backward(x, np.ones((2, 3), np.float32), 0.1, 0)
