"""csrc/activations.c: GELU (tanh approximation) and the residual add."""
import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from helpers import TOL, assert_close, randn, t64
from reference import gelu as ref_gelu
from reference import residual as ref_residual

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
def test_gelu_matches_reference(rng, shape):
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


@pytest.mark.parametrize("shape", SHAPES)
def test_residual_matches_reference(rng, shape):
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
