"""The exact values the texts our users learn from state (shared/CLAIMS.md),
against our kernels. Our values are checked against the float64 formulas
(1e-6); each claim, printed to 2-4 decimals, is then checked to one unit of
its last digit (some texts truncate). One claim does not hold: softmax([2, 1,
0]) at temperature 0.5 is [0.867, 0.117, 0.016], not the claimed [0.84, 0.11,
0.04] (which does not sum to 1); the test records that finding."""
import math

import numpy as np
import pytest

from llmc_py import kernels as K


def test_gelu_values():
    x = np.array([0.5, 1, 2, 3, -0.5, -1, -2, -3], np.float32)
    out = np.empty_like(x)
    K.gelu_forward(out, x)
    exact = [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
             for v in x.astype(np.float64)]
    np.testing.assert_allclose(out, exact, atol=1e-6)
    claimed = [0.346, 0.841, 1.954, 2.996, -0.154, -0.159, -0.046, -0.004]
    np.testing.assert_allclose(out, claimed, atol=1e-3)


def test_layernorm_values():
    x = np.array([[[10, 20, 30, 40]]], np.float32)
    out, mean, rstd = np.empty_like(x), np.empty((1, 1), np.float32), np.empty((1, 1), np.float32)
    K.layernorm_forward(out, mean, rstd, x, np.ones(4, np.float32), np.zeros(4, np.float32),
                        eps=0.0)
    exact = (np.array([10, 20, 30, 40]) - 25) / math.sqrt(125)
    np.testing.assert_allclose(out[0, 0], exact, atol=1e-6)
    np.testing.assert_allclose(out[0, 0], [-1.3416, -0.4472, 0.4472, 1.3416], atol=1e-4)
    assert abs(rstd[0, 0] - 0.08944) < 1e-5 and mean[0, 0] == 25


@pytest.mark.parametrize("logits,temperature,claimed,holds", [
    ([2, 1, 0.1], 1.0, [0.66, 0.24, 0.10], True),
    ([2, 1, 0], 1.0, [0.67, 0.24, 0.09], True),
    ([2, 1, 0], 0.5, [0.84, 0.11, 0.04], False),   # a finding: [0.867, 0.117, 0.016]
    ([2, 1, 0], 2.0, [0.51, 0.31, 0.19], True),
])
def test_softmax_values(logits, temperature, claimed, holds):
    x = (np.array(logits, np.float32) / np.float32(temperature)).reshape(1, 1, 3)
    probs = np.empty_like(x)
    K.softmax_forward(probs, x, 3)
    scaled = np.array(logits, np.float64) / temperature
    exact = np.exp(scaled - scaled.max()) / np.exp(scaled - scaled.max()).sum()
    np.testing.assert_allclose(probs[0, 0], exact, atol=1e-6)
    assert bool(np.all(np.abs(probs[0, 0] - claimed) <= 1e-2)) == holds
