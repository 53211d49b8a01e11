"""csrc/encoder.c: token + position embedding and sinusoidal positions against
the float64 reference."""
import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from helpers import TOL, assert_close, assert_thread_invariant, randn, t64
from reference import encoder as ref_encoder
from reference import sinusoidal as ref_sinusoidal

SHAPES = [  # B, T, C, V; small V makes tokens repeat, so dwte rows gather many terms
    (4, 64, 768, 1000),   # GPT-2 124M width
    (1, 1, 48, 7),
    (2, 37, 67, 5),
    (3, 5, 60, 50),
]
EXTRA_POSITIONS = 3      # wpe holds more rows than T, as the model's maxT table does


def make_inputs(rng, B, T, C, V):
    inp = rng.integers(0, V, size=(B, T), dtype=np.int32)
    return inp, randn(rng, V, C), randn(rng, T + EXTRA_POSITIONS, C), randn(rng, B, T, C)


def backward(dout, inp, V, maxT, calls=1):
    dwte = np.zeros((V, dout.shape[2]), np.float32)
    dwpe = np.zeros((maxT, dout.shape[2]), np.float32)
    for _ in range(calls):
        K.encoder_backward(dwte, dwpe, dout, inp)
    return dwte, dwpe


@pytest.mark.parametrize("B,T,C,V", SHAPES)
def test_encoder_matches_reference(rng, isa, B, T, C, V):
    inp, wte, wpe, dout = make_inputs(rng, B, T, C, V)
    out = np.full((B, T, C), np.nan, np.float32)   # (written): must not be read
    K.encoder_forward(out, inp, wte, wpe)
    dwte, dwpe = backward(dout, inp, V, wpe.shape[0])

    wte_t, wpe_t = t64(wte, grad=True), t64(wpe, grad=True)
    ref = ref_encoder(wte_t, wpe_t, t64(inp))
    (ref * t64(dout)).sum().backward()

    assert_close("out", out, ref, TOL["encoder"]["fwd"])
    assert_close("dwte", dwte, wte_t.grad, TOL["encoder"]["bwd"])
    assert_close("dwpe", dwpe, wpe_t.grad, TOL["encoder"]["bwd"])
    assert not dwpe[T:].any(), "dwpe rows past T were written"


@pytest.mark.parametrize("B,T,C,V", [SHAPES[0], SHAPES[2]])
def test_encoder_backward_accumulates(rng, B, T, C, V):
    inp, _, wpe, dout = make_inputs(rng, B, T, C, V)
    once = backward(dout, inp, V, wpe.shape[0])
    twice = backward(dout, inp, V, wpe.shape[0], calls=2)
    for name, a, b in zip(["dwte", "dwpe"], once, twice):
        assert_close(name, b, 2.0 * a, TOL["encoder"]["bwd"])


@pytest.mark.parametrize("B,T,C,V", SHAPES)
def test_encoder_without_wpe_matches_reference(rng, isa, B, T, C, V):
    # wpe / dwpe None (RoPE models): out is the token row itself, bit for bit
    inp, wte, _, dout = make_inputs(rng, B, T, C, V)
    out = np.full((B, T, C), np.nan, np.float32)
    K.encoder_forward(out, inp, wte, None)
    assert np.array_equal(out, wte[inp])
    dwte = np.zeros_like(wte)
    K.encoder_backward(dwte, None, dout, inp)

    wte_t = t64(wte, grad=True)
    (ref_encoder(wte_t, None, t64(inp)) * t64(dout)).sum().backward()
    assert_close("dwte", dwte, wte_t.grad, TOL["encoder"]["bwd"])
    twice = dwte.copy()
    K.encoder_backward(twice, None, dout, inp)   # (+=): a second call doubles
    assert_close("dwte twice", twice, 2.0 * dwte, TOL["encoder"]["bwd"])


def test_encoder_backward_without_dwpe_gives_the_same_dwte(rng):
    inp, _, wpe, dout = make_inputs(rng, 4, 64, 200, 30)
    with_wpe, _ = backward(dout, inp, 30, wpe.shape[0])
    without = np.zeros_like(with_wpe)
    K.encoder_backward(without, None, dout, inp)
    assert np.array_equal(without, with_wpe)


def test_encoder_backward_thread_invariant(rng, isa, set_threads):
    B, T, C, V = 4, 64, 200, 30    # 4 channel blocks, many repeated tokens
    inp, _, wpe, dout = make_inputs(rng, B, T, C, V)
    assert_thread_invariant(set_threads, lambda: dict(
        zip(["dwte", "dwpe"], backward(dout, inp, V, wpe.shape[0]))))


@pytest.mark.parametrize("bad", [-1, 5, 1 << 30])
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_encoder_rejects_token_out_of_range(rng, which, bad):
    B, T, C, V = 2, 3, 8, 5
    inp, wte, wpe, dout = make_inputs(rng, B, T, C, V)
    inp[1, 2] = bad
    with pytest.raises(llmc_py.RangeError, match=rf"inp\[1, 2\] = {bad} is not a token id"):
        if which == "forward":
            K.encoder_forward(np.empty((B, T, C), np.float32), inp, wte, wpe)
        else:
            backward(dout, inp, V, wpe.shape[0])


def test_encoder_rejects_wrong_shapes(rng):
    B, T, C, V = 2, 3, 8, 5
    inp, wte, wpe, _ = make_inputs(rng, B, T, C, V)
    with pytest.raises(llmc_py.ShapeError, match="out"):
        K.encoder_forward(np.empty((B, T, C + 1), np.float32), inp, wte, wpe)
    with pytest.raises(llmc_py.ShapeError, match="wpe"):
        K.encoder_forward(np.empty((B, T, C), np.float32), inp, wte, wpe[:T - 1])
    with pytest.raises(llmc_py.ShapeError, match="wpe"):
        K.encoder_forward(np.empty((B, T, C), np.float32), inp, wte, wpe[:, :C - 1].copy())


def test_encoder_without_wpe_thread_invariant(rng, isa, set_threads):
    B, T, C, V = 4, 64, 200, 30
    inp, wte, _, dout = make_inputs(rng, B, T, C, V)

    def run():
        out, dwte = np.empty((B, T, C), np.float32), np.zeros_like(wte)
        K.encoder_forward(out, inp, wte, None)
        K.encoder_backward(dwte, None, dout, inp)
        return dict(out=out, dwte=dwte)
    assert_thread_invariant(set_threads, run)


def test_encoder_rejects_wrong_dtypes(rng):
    B, T, C, V = 2, 3, 8, 5
    inp, wte, wpe, _ = make_inputs(rng, B, T, C, V)
    out = np.empty((B, T, C), np.float32)
    with pytest.raises(TypeError, match="inp"):
        K.encoder_forward(out, inp.astype(np.int64), wte, wpe)
    with pytest.raises(TypeError, match="wte"):
        K.encoder_forward(out, inp, wte.astype(np.float64), wpe)


# ---- sinusoidal positions ----------------------------------------------------------

@pytest.mark.parametrize("B,T,C", [(2, 37, 67), (1, 1, 1), (3, 5, 60), (2, 64, 768)])
def test_sinusoidal_matches_reference(rng, B, T, C):
    x = randn(rng, B, T, C)
    pos = rng.integers(0, 100_000, size=B, dtype=np.int32)   # far past any trained length
    for positions in (None, pos):
        out = np.full_like(x, np.nan)
        K.sinusoidal_forward(out, x, positions)
        start = np.zeros(B, np.int64) if positions is None else positions.astype(np.int64)
        ref = t64(x) + ref_sinusoidal(t64(start).long(), T, C)
        assert_close("out", out, ref, TOL["sinusoidal"]["fwd"])


def test_sinusoidal_rows_depend_on_position_only(rng):
    # a row at position p adds the same as row p of a full sequence, bitwise:
    # what KV-cache decoding relies on; in place (out = inp) as the model runs it
    x = randn(rng, 1, 50, 33)
    full = x.copy()
    K.sinusoidal_forward(full, full, None)
    for p in (0, 17, 49):
        row = x[:, p:p + 1].copy()
        K.sinusoidal_forward(row, row, np.array([p], np.int32))
        assert np.array_equal(row, full[:, p:p + 1])
    zero = np.zeros((1, 1, 6), np.float32)
    K.sinusoidal_forward(zero, zero, None)   # position 0: sin 0 = 0, cos 0 = 1
    assert zero.reshape(-1).tolist() == [0.0, 1.0] * 3


def test_sinusoidal_thread_invariant_and_checked(rng, set_threads):
    x = randn(rng, 3, 37, 67)
    pos = np.array([0, 5, 4000], np.int32)

    def run():
        out = np.empty_like(x)
        K.sinusoidal_forward(out, x, pos)
        return {"out": out}
    assert_thread_invariant(set_threads, run)
    with pytest.raises(llmc_py.RangeError):
        K.sinusoidal_forward(np.empty_like(x), x, np.array([0, -1, 2], np.int32))
    with pytest.raises(llmc_py.ShapeError, match="pos"):
        K.sinusoidal_forward(np.empty_like(x), x, np.zeros(2, np.int32))
