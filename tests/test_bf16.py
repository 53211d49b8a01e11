"""bf16.c: float_to_bf16 and bf16_to_float against torch's conversions."""
import numpy as np
import pytest
import torch

import llmc_py
from llmc_py import kernels as K


def _torch_bits(x):
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_float_to_bf16_rounds_to_nearest_even_like_torch(rng):
    x = rng.standard_normal(10_001).astype(np.float32) * np.float32(1e3)
    x[:6] = [np.inf, -np.inf, 3.4e38, -0.0, 1e-40, 1.0 + 2.0 ** -8]   # 2^-8: a tie, to even
    ours = np.empty(x.shape, np.uint16)
    K.float_to_bf16(ours, x)
    assert np.array_equal(ours, _torch_bits(x))
    back = np.empty_like(x)
    K.bf16_to_float(back, ours)
    assert np.array_equal(back, torch.from_numpy(ours.view(np.int16)).view(torch.bfloat16)
                          .float().numpy())
    nan = np.array([np.nan, -np.nan], np.float32)
    out = np.empty(2, np.uint16)
    K.float_to_bf16(out, nan)
    assert np.isnan((out.astype(np.uint32) << 16).view(np.float32)).all()


@pytest.mark.parametrize("N", [1, 15, 16, 17, 100_003])
def test_conversions_at_any_length_and_thread_count(rng, set_threads, N):
    x = rng.standard_normal(N).astype(np.float32)
    results = []
    for threads in (1, 2, 3):
        set_threads(threads)
        out = np.empty(N, np.uint16)
        K.float_to_bf16(out, x)
        results.append(out)
    assert all(np.array_equal(r, results[0]) for r in results)
    assert np.array_equal(results[0], _torch_bits(x))


def test_conversions_check_their_arguments():
    x = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="uint16"):
        K.float_to_bf16(np.empty(4, np.float32), x)
    with pytest.raises(llmc_py.ShapeError, match="out has shape"):
        K.float_to_bf16(np.empty(5, np.uint16), x)
    with pytest.raises(TypeError, match="float32"):
        K.bf16_to_float(np.empty(4, np.float64), np.zeros(4, np.uint16))


def _bits_formula(x):
    """The model files' bf16 rounding before they called the kernel: the same
    bit formula in numpy (NaN: its upper half with the quiet bit set)."""
    bits = x.view(np.uint32)
    out = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return out


def test_conversions_match_the_bit_formula_on_special_values_and_random_bits(rng):
    """The model files and Hugging Face export round with the kernel; the
    result is bit for bit the formula they used before: every class of float
    (NaNs of any payload and sign, infinities, the largest finite, denormals,
    ties on either side of even) and random bit patterns."""
    special = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000,
                        0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF,
                        0xFFFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,
                        0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x00018000,
                        0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x00800000],
                       np.uint32)
    bits = np.concatenate([special, rng.integers(0, 1 << 32, 200_003, dtype=np.uint32),
                           # every upper half with a tie below: all signs, exponents
                           (np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000])
    x = bits.view(np.float32)
    ours = np.empty(x.shape, np.uint16)
    K.float_to_bf16(ours, x)
    assert np.array_equal(ours, _bits_formula(x))
    back = np.empty(x.shape, np.float32)
    K.bf16_to_float(back, ours)
    assert np.array_equal(back.view(np.uint32), ours.astype(np.uint32) << 16)
