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
