"""csrc/rope.c: rotary position embedding (half-split pairs, and Meta's
interleaved ones) against the float64 reference and autograd."""
import numpy as np
import pytest
import torch

import llmc_py
from llmc_py import kernels as K
from llmc_py._native.lib import ffi, lib
from helpers import TOL, assert_close, assert_thread_invariant, randn, t64
from reference import rope as ref_rope

SHAPES = [  # B, T, NH, NKV, hs
    (4, 64, 12, 4, 64),    # Llama-ish: C = NH hs = 768, 3 query heads per kv head
    (1, 256, 12, 4, 64),
    (1, 1, 1, 1, 2),       # one position, one pair per head
    (2, 37, 3, 3, 10),     # NKV == NH (multi-head)
    (3, 5, 8, 1, 6),       # NKV == 1 (multi-query)
    (2, 7, 2, 1, 130),     # hs/2 = 65 pairs: two angle chunks, the second of one pair
]
THETAS = [10000.0, 500000.0]   # Llama 2, Llama 3


def make_inputs(rng, B, T, NH, NKV, hs):
    CH = (NH + 2 * NKV) * hs
    return randn(rng, B, T, CH), randn(rng, B, T, CH)


def make_pos(rng, B, kind):
    """None, or a start position per row: one at 1000 and, with B > 1, one far
    out at 100000 (angles of 1e5 radians for the first pair)."""
    if kind is None:
        return None
    pos = rng.integers(0, 2000, size=B, dtype=np.int32)
    pos[0] = 1000
    if B > 1:
        pos[-1] = 100000
    return pos


def forward(x, pos, NH, NKV, theta=10000.0, interleaved=False):
    out = np.full_like(x, np.nan)   # (written): must not be read
    K.rope_forward(out, x, pos, NH, NKV, theta, interleaved=interleaved)
    return out


def backward(dout, pos, NH, NKV, theta=10000.0, calls=1, interleaved=False):
    dinp = np.zeros_like(dout)
    for _ in range(calls):
        K.rope_backward(dinp, dout, pos, NH, NKV, theta, interleaved=interleaved)
    return dinp


@pytest.mark.parametrize("theta", THETAS)
@pytest.mark.parametrize("pos_kind", [None, "offset"])
@pytest.mark.parametrize("B,T,NH,NKV,hs", SHAPES)
def test_rope_matches_reference(rng, isa, B, T, NH, NKV, hs, pos_kind, theta):
    x, dout = make_inputs(rng, B, T, NH, NKV, hs)
    pos = make_pos(rng, B, pos_kind)
    out = forward(x, pos, NH, NKV, theta)
    dinp = backward(dout, pos, NH, NKV, theta)

    xt = t64(x, grad=True)
    ref = ref_rope(xt, None if pos is None else t64(pos), NH, NKV, theta)
    (ref * t64(dout)).sum().backward()

    assert_close("out", out, ref, TOL["rope"]["fwd"])
    assert_close("dinp", dinp, xt.grad, TOL["rope"]["bwd"])
    v = slice((NH + NKV) * hs, None)
    assert np.array_equal(out[..., v], x[..., v]), "v heads changed"
    assert np.array_equal(dinp[..., v], dout[..., v]), "v head gradients changed"


def test_rope_rotates_the_right_pairs():
    # hs = 4, one q head: pairs (0, 2) and (1, 3). At position 1 with theta = 1
    # both pairs turn by 1 radian; a pairing of (0, 1), (2, 3) would differ
    x = np.array([[[1.0, 2.0, 3.0, 4.0] + [0.0] * 8]], np.float32)   # NH=1, NKV=1, hs=4
    out = forward(x, np.array([1], np.int32), 1, 1, theta=1.0)
    c, s = np.cos(1.0), np.sin(1.0)
    expected = [1 * c - 3 * s, 2 * c - 4 * s, 3 * c + 1 * s, 4 * c + 2 * s]
    assert_close("q head", out[0, 0, :4], expected, TOL["rope"]["fwd"])


@pytest.mark.parametrize("B,T,NH,NKV,hs", SHAPES)
def test_interleaved_rope_matches_reference(rng, isa, B, T, NH, NKV, hs):
    # Meta's pairs (2i, 2i + 1), against the reference's complex rotation
    x, dout = make_inputs(rng, B, T, NH, NKV, hs)
    pos = make_pos(rng, B, "offset")
    out = forward(x, pos, NH, NKV, interleaved=True)
    dinp = backward(dout, pos, NH, NKV, interleaved=True)
    xt = t64(x, grad=True)
    ref = ref_rope(xt, t64(pos), NH, NKV, interleaved=True)
    (ref * t64(dout)).sum().backward()
    assert_close("out", out, ref, TOL["rope"]["fwd"])
    assert_close("dinp", dinp, xt.grad, TOL["rope"]["bwd"])
    if hs > 2:   # with more than one pair per head, the half-split layout differs
        assert not np.allclose(forward(x, pos, NH, NKV), out)


def test_interleaved_rope_rotates_neighbours():
    # hs = 4, one q head: pairs (0, 1) and (2, 3); at position 1 with theta = 1
    # the first pair turns by 1 radian, the second by 1 / 1 = 1 as well
    x = np.array([[[1.0, 2.0, 3.0, 4.0] + [0.0] * 8]], np.float32)
    out = forward(x, np.array([1], np.int32), 1, 1, theta=1.0, interleaved=True)
    c, s = np.cos(1.0), np.sin(1.0)
    expected = [1 * c - 2 * s, 2 * c + 1 * s, 3 * c - 4 * s, 4 * c + 3 * s]
    assert_close("q head", out[0, 0, :4], expected, TOL["rope"]["fwd"])


def test_rope_backward_accumulates(rng):
    x, dout = make_inputs(rng, 2, 37, 3, 1, 10)
    pos = make_pos(rng, 2, "offset")
    once = backward(dout, pos, 3, 1)
    twice = backward(dout, pos, 3, 1, calls=2)
    assert_close("dinp", twice, 2.0 * once, TOL["rope"]["bwd"])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("pos_kind", [None, "offset"])
@pytest.mark.parametrize("B,T,NH,NKV,hs", [(3, 37, 12, 4, 64), (2, 7, 2, 1, 130),
                                          (1, 1, 1, 1, 2)])
def test_rope_backward_written_is_the_sum_into_zeros_bitwise(rng, isa, set_threads, B, T, NH,
                                                             NKV, hs, pos_kind, interleaved):
    """written=True ignores what dinp held (NaN here) and gives bitwise the
    (+=) result on a zeroed dinp, the sign of a zero included."""
    _, dout = make_inputs(rng, B, T, NH, NKV, hs)
    dout[0, 0, :] = -0.0   # a -0 gradient (q, k and v heads): 0 + (-0) is +0
    pos = make_pos(rng, B, pos_kind)
    into_zeros = backward(dout, pos, NH, NKV, interleaved=interleaved)
    assert np.signbit(into_zeros[0, 0]).sum() == 0

    def run():
        dinp = np.full_like(dout, np.nan)
        K.rope_backward(dinp, dout, pos, NH, NKV, interleaved=interleaved, written=True)
        return {"dinp": dinp}
    assert np.array_equal(run()["dinp"].view(np.uint32), into_zeros.view(np.uint32))
    assert_thread_invariant(set_threads, run)


def test_rope_null_pos_is_position_zero(rng):
    x, dout = make_inputs(rng, 3, 5, 4, 2, 8)
    zeros = np.zeros(3, np.int32)
    assert np.array_equal(forward(x, None, 4, 2), forward(x, zeros, 4, 2))
    assert np.array_equal(backward(dout, None, 4, 2), backward(dout, zeros, 4, 2))


def test_rope_offset_continues_the_sequence(rng):
    # what a KV cache relies on: T tokens started at pos p turn exactly as the
    # last T tokens of a sequence of p + T started at 0
    p, T = 1000, 9
    x_all, _ = make_inputs(rng, 1, p + T, 4, 2, 16)
    tail = np.ascontiguousarray(x_all[:, p:])
    full = forward(x_all, None, 4, 2, theta=500000.0)
    part = forward(tail, np.array([p], np.int32), 4, 2, theta=500000.0)
    assert np.array_equal(part, full[:, p:])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("B,T,NH,NKV,hs", [(3, 37, 12, 4, 64), (2, 7, 2, 1, 130)])
def test_rope_angles_shared_by_rows_are_the_rows_own(rng, isa, B, T, NH, NKV, hs, interleaved):
    """Without pos the rows share one table of each t's cos and sin; given
    pos (here all 0) each row computes its own: the same bits."""
    x, _ = make_inputs(rng, B, T, NH, NKV, hs)
    zeros = np.zeros(B, np.int32)
    for run in (forward, backward):
        shared = run(x, None, NH, NKV, 500000.0, interleaved=interleaved)
        own = run(x, zeros, NH, NKV, 500000.0, interleaved=interleaved)
        assert np.array_equal(shared, own)


@pytest.mark.parametrize("pos_kind", [None, "offset"])
@pytest.mark.parametrize("B,T,NH,NKV,hs", [(3, 37, 12, 4, 64), (2, 7, 2, 1, 130)])
def test_rope_thread_invariant(rng, isa, set_threads, B, T, NH, NKV, hs, pos_kind):
    x, dout = make_inputs(rng, B, T, NH, NKV, hs)
    pos = make_pos(rng, B, pos_kind)
    assert_thread_invariant(set_threads, lambda: dict(
        out=forward(x, pos, NH, NKV), dinp=backward(dout, pos, NH, NKV)))


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_rope_rejects_negative_pos(rng, which):
    x, dout = make_inputs(rng, 3, 2, 2, 1, 4)
    pos = np.array([0, 5, -1], np.int32)
    with pytest.raises(llmc_py.RangeError):
        if which == "forward":
            forward(x, pos, 2, 1)
        else:
            backward(dout, pos, 2, 1)


@pytest.mark.parametrize("theta", [0.0, -10000.0, np.inf, np.nan])
def test_rope_rejects_bad_theta(rng, theta):
    x, dout = make_inputs(rng, 1, 2, 2, 1, 4)
    with pytest.raises(llmc_py.InvalidValueError, match="theta"):
        forward(x, None, 2, 1, theta)
    with pytest.raises(llmc_py.InvalidValueError, match="theta"):
        backward(dout, None, 2, 1, theta)


@pytest.mark.parametrize("NH,NKV,CH", [
    (2, 1, 12),   # hs = 3: odd, no pairs
    (2, 1, 10),   # 10 channels are not (2 + 2) heads
    (0, 1, 8),
    (2, 0, 8),
    (-2, 2, 8),
])
def test_rope_rejects_bad_head_layout(NH, NKV, CH):
    x = np.zeros((1, 2, CH), np.float32)
    with pytest.raises(llmc_py.ShapeError):
        K.rope_forward(np.empty_like(x), x, None, NH, NKV)
    with pytest.raises(llmc_py.ShapeError):
        K.rope_backward(np.zeros_like(x), x, None, NH, NKV)


def test_rope_rejects_non_integer_head_counts():
    x = np.zeros((1, 2, 16), np.float32)
    with pytest.raises(TypeError, match="NH"):
        K.rope_forward(np.empty_like(x), x, None, 2.0, 1)
    with pytest.raises(TypeError, match="NKV"):
        K.rope_backward(np.zeros_like(x), x, None, 2, None)


def test_rope_c_rejects_odd_head_size_and_bad_values():
    # the C checks behind the wrapper's: odd hs, theta <= 0, a negative start,
    # frequencies that are not positive and finite
    buf = ffi.new("float[]", 64)
    pos = ffi.new("int[]", [3, -2])
    N = ffi.NULL
    assert lib.rope_forward(buf, buf, N, N, 1, 2, 2, 1, 3, 1e4, 0) == lib.LLMC_ERR_SHAPE
    assert lib.rope_backward(buf, buf, N, N, 1, 2, 2, 1, 3, 1e4, 0, 0) == lib.LLMC_ERR_SHAPE
    assert lib.rope_forward(buf, buf, N, N, 1, 2, 2, 1, 4, 0.0, 0) == lib.LLMC_ERR_VALUE
    assert lib.rope_backward(buf, buf, N, N, 1, 2, 2, 1, 4, -1.0, 0, 0) == lib.LLMC_ERR_VALUE
    assert lib.rope_forward(buf, buf, pos, N, 2, 1, 2, 1, 4, 1e4, 0) == lib.LLMC_ERR_RANGE
    assert lib.rope_backward(buf, buf, pos, N, 2, 1, 2, 1, 4, 1e4, 0, 0) == lib.LLMC_ERR_RANGE
    assert lib.rope_forward(buf, buf, pos, N, 1, 1, 2, 1, 4, 1e4, 0) == lib.LLMC_OK   # pos[0] only
    for bad in ([1.0, 0.0], [1.0, -1.0], [float("nan"), 1.0], [float("inf"), 1.0]):
        freq = ffi.new("double[]", bad)
        assert lib.rope_forward(buf, buf, N, freq, 1, 2, 2, 1, 4, 1e4, 0) == lib.LLMC_ERR_VALUE
        assert lib.rope_backward(buf, buf, N, freq, 1, 2, 2, 1, 4, 1e4, 0, 0) == lib.LLMC_ERR_VALUE


@pytest.mark.parametrize("B,T,NH,NKV,hs", [(2, 37, 4, 2, 16), (1, 5, 3, 1, 2)])
def test_rope_with_given_frequencies_matches_reference(rng, isa, B, T, NH, NKV, hs):
    """A scaled RoPE's frequencies (any positive ones) instead of theta's."""
    x, dout = make_inputs(rng, B, T, NH, NKV, hs)
    freq = rng.uniform(1e-4, 1.0, hs // 2)
    pos = np.array([5, 900][:B], np.int32)
    out = np.full_like(x, np.nan)
    K.rope_forward(out, x, pos, NH, NKV, 1e4, inv_freq=freq)
    dinp = np.zeros_like(x)
    K.rope_backward(dinp, dout, pos, NH, NKV, 1e4, inv_freq=freq)
    xt = t64(x, grad=True)
    ref = ref_rope(xt, t64(pos).long(), NH, NKV, inv_freq=freq)
    (ref * t64(dout)).sum().backward()
    assert_close("out", out, ref, TOL["rope"]["fwd"])
    assert_close("dinp", dinp, xt.grad, TOL["rope"]["bwd"])
    # theta's own frequencies given explicitly: bitwise the plain kernel
    plain, given = np.empty_like(x), np.empty_like(x)
    K.rope_forward(plain, x, pos, NH, NKV, 1e4)
    K.rope_forward(given, x, pos, NH, NKV, 1e4,
                   inv_freq=1e4 ** (-2.0 * np.arange(hs // 2) / hs))
    assert np.array_equal(plain, given)


def test_rope_rejects_wrong_shapes(rng):
    x, dout = make_inputs(rng, 2, 3, 2, 1, 4)
    with pytest.raises(llmc_py.ShapeError, match="out"):
        K.rope_forward(np.empty((2, 3, 20), np.float32), x, None, 2, 1)
    with pytest.raises(llmc_py.ShapeError, match="pos"):
        forward(x, np.zeros(3, np.int32), 2, 1)
    with pytest.raises(llmc_py.ShapeError, match="dinp"):
        K.rope_backward(np.zeros((2, 4, 16), np.float32), dout, None, 2, 1)
    with pytest.raises(llmc_py.ShapeError, match="dout"):
        K.rope_backward(np.zeros_like(dout), dout[:, ::-1], None, 2, 1)   # not contiguous


def test_rope_rejects_wrong_dtypes(rng):
    x, dout = make_inputs(rng, 2, 3, 2, 1, 4)
    with pytest.raises(TypeError, match="pos"):
        forward(x, np.zeros(2, np.int64), 2, 1)
    with pytest.raises(TypeError, match="inp"):
        K.rope_forward(np.empty_like(x), x.astype(np.float64), None, 2, 1)
    with pytest.raises(TypeError, match="dinp"):
        K.rope_backward(np.zeros(dout.shape, np.float64), dout, None, 2, 1)


def interleaved_rope(x, heads, hs):
    """Meta's layout on one sequence's q or k heads x [T, heads hs] (float64)."""
    T = x.shape[0]
    packed = torch.cat([x, torch.zeros(T, 2 * hs, dtype=x.dtype)], dim=1)   # + a k, a v head
    return ref_rope(packed[None], None, heads, 1, interleaved=True)[0, :, :heads * hs]


def test_interleaved_weights_permuted_give_the_same_scores(rng):
    """Scores q . k of Meta's interleaved RoPE on the original q, k weights
    equal ours (half-split) on the permuted weights (io.rope_layout)."""
    from llmc_py.io.rope_layout import half_split_to_interleaved, interleaved_to_half_split
    T, C, NH, NKV, hs = 9, 24, 2, 1, 8
    x = rng.standard_normal((T, C))
    wq, wk = rng.standard_normal((NH * hs, C)), rng.standard_normal((NKV * hs, C))
    q = interleaved_rope(t64(x @ wq.T), NH, hs).reshape(T, NH, hs)
    k = interleaved_rope(t64(x @ wk.T), NKV, hs).reshape(T, NKV, hs)
    ours_q, ours_k = interleaved_to_half_split(wq, NH, hs), interleaved_to_half_split(wk, NKV, hs)
    qkv = np.concatenate([x @ ours_q.T, x @ ours_k.T, np.zeros((T, NKV * hs))], axis=1)
    turned = ref_rope(t64(qkv[None]), None, NH, NKV)[0]
    q2 = turned[:, :NH * hs].reshape(T, NH, hs)
    k2 = turned[:, NH * hs:(NH + NKV) * hs].reshape(T, NKV, hs)
    for h in range(NH):
        scores = q[:, h] @ k[:, 0].T
        assert torch.allclose(q2[:, h] @ k2[:, 0].T, scores, rtol=1e-12, atol=1e-12)
    # without the permutation, half-split RoPE gives other scores
    plain = np.concatenate([x @ wq.T, x @ wk.T, np.zeros((T, NKV * hs))], axis=1)
    turned = ref_rope(t64(plain[None]), None, NH, NKV)[0]
    unpermuted = turned[:, :hs] @ turned[:, NH * hs:(NH + 1) * hs].T
    assert not torch.allclose(unpermuted, q[:, 0] @ k[:, 0].T, rtol=1e-3)
    assert np.array_equal(half_split_to_interleaved(ours_q, NH, hs), wq)
    # and our kernel's interleaved layout on the original weights: the same scores
    qkv = np.concatenate([x @ wq.T, x @ wk.T, np.zeros((T, NKV * hs))], axis=1)
    turned = forward(qkv[None].astype(np.float32), None, NH, NKV, interleaved=True)[0]
    for h in range(NH):
        ours = turned[:, h * hs:(h + 1) * hs] @ turned[:, NH * hs:(NH + 1) * hs].T
        assert_close(f"scores head {h}", ours, q[:, h] @ k[:, 0].T, TOL["rope"]["fwd"])


# ---- rope_table and kv_cache_write: KV-cache decoding's RoPE -----------------------

def table(P, hs, theta=10000.0, inv_freq=None):
    cos, sin = np.full((P, hs // 2), np.nan, np.float32), np.full((P, hs // 2), np.nan, np.float32)
    K.rope_table(cos, sin, theta, inv_freq)
    return cos, sin


@pytest.mark.parametrize("P,hs", [(300, 64), (1, 2), (7, 130)])
def test_rope_table_matches_reference(P, hs):
    cos, sin = table(P, hs, 500000.0)
    angles = np.arange(P)[:, None] * 500000.0 ** (-2.0 * np.arange(hs // 2) / hs)
    assert_close("cos", cos, np.cos(angles), TOL["rope"]["fwd"])
    assert_close("sin", sin, np.sin(angles), TOL["rope"]["fwd"])


def cache_write(qkv, pos, NH, NKV, slots, tables, interleaved=False):
    """kv_cache_write into fresh NaN-filled q and caches."""
    B, row = qkv.shape
    hs = row // (NH + 2 * NKV)
    q = np.full((B, NH * hs), np.nan, np.float32)
    k = np.full((B, slots, NKV * hs), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    K.kv_cache_write(q, k, v, qkv, pos, *tables, NH, NKV, interleaved=interleaved)
    return q, k, v


DECODE_SHAPES = [  # B, NH, NKV, hs, slots
    (8, 4, 2, 64, 256),    # the gpt2-vs-llama suite's Llama
    (1, 1, 1, 2, 1),       # one pair, one slot
    (3, 3, 3, 10, 5),      # multi-head, a ring smaller than the positions
    (2, 8, 1, 130, 9),     # multi-query, two angle chunks
]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("B,NH,NKV,hs,slots", DECODE_SHAPES)
def test_kv_cache_write_is_rope_forward_bitwise(rng, isa, B, NH, NKV, hs, slots, scaled,
                                                interleaved):
    """q and k turned as rope_forward turns them at the row's position (the
    same bits: decoding equals the forward), k and v in slot pos % slots, the
    other slots untouched; against the float64 reference too."""
    P = 300
    freq = rng.uniform(1e-4, 1.0, hs // 2) if scaled else None
    qkv = randn(rng, B, (NH + 2 * NKV) * hs)
    pos = rng.permutation(P)[:B].astype(np.int32)
    q, k, v = cache_write(qkv, pos, NH, NKV, slots, table(P, hs, 1e4, freq), interleaved)
    whole = np.empty_like(qkv[:, None])
    K.rope_forward(whole, qkv[:, None], pos, NH, NKV, 1e4, inv_freq=freq,
                   interleaved=interleaved)
    whole = whole[:, 0]
    q_end, k_end = NH * hs, (NH + NKV) * hs
    assert np.array_equal(q, whole[:, :q_end])
    rows, slot = np.arange(B), pos % slots
    assert np.array_equal(k[rows, slot], whole[:, q_end:k_end])
    assert np.array_equal(v[rows, slot], qkv[:, k_end:])
    others = np.ones((B, slots), bool)
    others[rows, slot] = False
    assert np.isnan(k[others]).all() and np.isnan(v[others]).all()
    ref = ref_rope(t64(qkv[:, None]), t64(pos).long(), NH, NKV, 1e4, inv_freq=freq,
                   interleaved=interleaved)[:, 0]
    assert_close("q", q, ref[:, :q_end], TOL["rope"]["fwd"])


def test_kv_cache_write_without_tables_copies(rng):
    B, NH, NKV, hs, slots = 3, 4, 2, 6, 4
    qkv = randn(rng, B, (NH + 2 * NKV) * hs)
    pos = np.array([0, 6, 3], np.int32)   # 6 wraps to slot 2
    q, k, v = cache_write(qkv, pos, NH, NKV, slots, (None, None))
    assert np.array_equal(q, qkv[:, :NH * hs])
    assert np.array_equal(k[[0, 1, 2], [0, 2, 3]], qkv[:, NH * hs:(NH + NKV) * hs])
    assert np.array_equal(v[[0, 1, 2], [0, 2, 3]], qkv[:, (NH + NKV) * hs:])


def test_rope_table_thread_invariant(set_threads):
    freq = np.linspace(0.01, 1.0, 65)
    assert_thread_invariant(set_threads, lambda: dict(zip(("cos", "sin"),
                                                          table(301, 130, 1e4, freq))))


def test_kv_cache_write_rejects_bad_arguments(rng):
    B, NH, NKV, hs, slots, P = 2, 2, 1, 4, 3, 5
    qkv = randn(rng, B, (NH + 2 * NKV) * hs)
    tables = table(P, hs)
    ok = np.array([0, 4], np.int32)
    cache_write(qkv, ok, NH, NKV, slots, tables)
    for bad in ([0, 5], [-1, 0]):   # past the table, negative
        with pytest.raises(llmc_py.RangeError):
            cache_write(qkv, np.array(bad, np.int32), NH, NKV, slots, tables)
    with pytest.raises(llmc_py.RangeError):
        cache_write(qkv, np.array([0, -1], np.int32), NH, NKV, slots, (None, None))
    with pytest.raises(llmc_py.NullPointerError):
        cache_write(qkv, ok, NH, NKV, slots, (tables[0], None))
    with pytest.raises(llmc_py.ShapeError, match="sin_table"):
        cache_write(qkv, ok, NH, NKV, slots, (tables[0], tables[1][:4]))
    with pytest.raises(llmc_py.ShapeError, match="cos_table"):
        cache_write(qkv, ok, NH, NKV, slots, table(P, 2 * hs))
    with pytest.raises(llmc_py.ShapeError, match="qkv"):
        cache_write(qkv[:, :-2], ok, NH, NKV, slots, tables)
    with pytest.raises(llmc_py.ShapeError, match="pos"):
        cache_write(qkv, ok[:1], NH, NKV, slots, tables)


def test_rope_table_rejects_bad_arguments():
    cos = np.empty((3, 2), np.float32)
    with pytest.raises(llmc_py.InvalidValueError, match="theta"):
        K.rope_table(cos, np.empty_like(cos), 0.0)
    with pytest.raises(llmc_py.InvalidValueError):
        K.rope_table(cos, np.empty_like(cos), 1e4, np.array([1.0, -1.0]))
    with pytest.raises(llmc_py.ShapeError, match="sin_table"):
        K.rope_table(cos, np.empty((3, 3), np.float32))
    with pytest.raises(llmc_py.ShapeError, match="inv_freq"):
        K.rope_table(cos, np.empty_like(cos), 1e4, np.ones(3))
