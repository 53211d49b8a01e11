"""csrc/adamw.c: the AdamW step, the gradient norm and the in-place scale."""
import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from helpers import TOL, assert_close, assert_thread_invariant, randn, t64
from llmc_py.model.layout import TensorGroup
from reference import adamw_step as ref_adamw_step

# llm.c's defaults, with weight decay on so that its term is exercised; the
# reference gets the values the kernel sees, i.e. rounded to fp32
HYPER = dict(learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
HYPER32 = {k: float(np.float32(v)) for k, v in HYPER.items()}


@pytest.mark.parametrize("N", [1, 1000, 100_003])
def test_adamw_matches_reference_over_steps(rng, isa, N):
    params = randn(rng, N, scale=0.02)   # GPT-2's init scale
    m, v = np.zeros(N, np.float32), np.zeros(N, np.float32)
    p_ref, m_ref, v_ref = t64(params), t64(m), t64(v)
    tol = TOL["adamw"]
    for t in range(1, 6):
        # gradients across magnitudes, so eps matters for some entries
        grads = randn(rng, N) * np.float32(10.0) ** rng.integers(-6, 2, N).astype(np.float32)
        before = params.copy()
        K.adamw_update(params, m, v, grads, t=t, **HYPER)
        p_ref_before = p_ref
        p_ref, m_ref, v_ref = ref_adamw_step(p_ref, t64(grads), m_ref, v_ref, t=t, **HYPER32)
        assert_close(f"params at t={t}", params, p_ref, tol["param"])
        # the step itself (~lr) is far smaller than the parameters: check it alone
        assert_close(f"params update at t={t}", params.astype(np.float64) - before,
                     p_ref - p_ref_before, tol["update"])
        assert_close(f"m at t={t}", m, m_ref, tol["state"])
        assert_close(f"v at t={t}", v, v_ref, tol["state"])


def test_adamw_thread_invariant(rng, isa, set_threads):
    N = 100_003
    params0, grads = randn(rng, N, scale=0.02), randn(rng, N)

    def run():
        params, m, v = params0.copy(), np.zeros(N, np.float32), np.zeros(N, np.float32)
        for t in (1, 2):
            K.adamw_update(params, m, v, grads, t=t, **HYPER)
        K.scale_inplace(params, 0.5)
        return {"params": params, "m": m, "v": v}
    assert_thread_invariant(set_threads, run)


@pytest.mark.parametrize("N", [1, 17, 40_003])
def test_adamw_writes_the_bf16_copy_of_what_it_writes(rng, isa, N):
    """With params_bf16 the update is the same, and the copy is float_to_bf16
    of the new params (what a bf16 model's matmuls read)."""
    p, m, v, g = (randn(rng, N) for _ in range(4))
    m[...] = np.abs(m) * 0.1
    v[...] = np.abs(v) * 0.01
    plain = [a.copy() for a in (p, m, v)]
    K.adamw_update(*plain, g, 1e-3, 0.9, 0.999, 1e-8, 0.1, 3)
    copy = np.zeros(N, np.uint16)
    K.adamw_update(p, m, v, g, 1e-3, 0.9, 0.999, 1e-8, 0.1, 3, params_bf16=copy)
    for ours, theirs in zip((p, m, v), plain):
        assert np.array_equal(ours, theirs)
    expected = np.empty(N, np.uint16)
    K.float_to_bf16(expected, p)
    assert np.array_equal(copy, expected)
    with pytest.raises(llmc_py.ShapeError, match="params_bf16"):
        K.adamw_update(p, m, v, g, 1e-3, 0.9, 0.999, 1e-8, 0.1, 4,
                       params_bf16=np.zeros(N + 1, np.uint16))


# adamw.c's STREAM_MIN: from this many floats up, fill_zero on AVX2 and
# AVX-512 stores with streaming stores
STREAM_MIN = 1 << 22


def at_byte(a, offset):
    """A copy of ``a`` whose data starts ``offset`` bytes past a 64-byte boundary."""
    raw = np.empty(a.nbytes + 128, np.uint8)
    first = (offset - raw.ctypes.data) % 64
    out = raw[first:first + a.nbytes].view(a.dtype)
    out[...] = a
    return out


@pytest.mark.parametrize("N,at", [(1, 4), (37, 12), (STREAM_MIN + 13, 0), (STREAM_MIN + 13, 20)])
def test_fill_zero_writes_every_element_and_nothing_else(isa, set_threads, N, at):
    """Over NaN, every element +0 (streamed from STREAM_MIN floats on, from a
    start anywhere), the floats around the array untouched."""
    def run():
        around = at_byte(np.full(N + 2, np.nan, np.float32), at)
        K.fill_zero(around[1:-1])
        return {"around": around.view(np.uint32)}   # bits: NaN != NaN
    result = run()["around"].view(np.float32)
    assert np.isnan(result[[0, -1]]).all()
    assert not result[1:-1].view(np.uint32).any()
    assert_thread_invariant(set_threads, run)


def test_tensor_group_zero_fills_the_named_tensors_alone():
    """TensorGroup.zero(names): those tensors zero, the others as they were,
    in float32 (fill_zero over each run of adjacent tensors) and uint16."""
    specs = [(name, lambda n=n: (n,)) for name, n in (("a", 5), ("b", 7), ("c", 3), ("d", 4))]
    for dtype in (np.float32, np.uint16):
        group = TensorGroup(specs, dtype=dtype)
        group.memory[...] = 9
        group.zero(["d", "a", "b"])
        assert [int(group[n].sum()) for n in "abcd"] == [0, 0, 27, 0]
        group.zero()
        assert not group.memory.any()


def test_adamw_rejects_step_zero_and_mismatched_state(rng):
    params, grads = randn(rng, 8), randn(rng, 8)
    m, v = np.zeros(8, np.float32), np.zeros(8, np.float32)
    with pytest.raises(llmc_py.InvalidValueError):
        K.adamw_update(params, m, v, grads, t=0, **HYPER)
    with pytest.raises(llmc_py.ShapeError, match="grads"):
        K.adamw_update(params, m, v, grads[:7].copy(), t=1, **HYPER)
    with pytest.raises(TypeError, match="^v "):
        K.adamw_update(params, m, v.astype(np.float64), grads, t=1, **HYPER)


@pytest.mark.parametrize("N", [1, 16384, 16385, 1_000_003])   # around and across chunks
def test_global_norm_squared_matches_float64(rng, isa, N):
    x = randn(rng, N, scale=3.0)
    got = K.global_norm_squared(x)
    assert isinstance(got, float)
    expected = float(np.sum(x.astype(np.float64) ** 2))
    assert abs(got - expected) <= TOL["global_norm"]["fwd"] * expected, (got, expected)


def test_global_norm_squared_thread_invariant(rng, isa, set_threads):
    x = randn(rng, 1_000_003)   # 62 chunks
    assert_thread_invariant(set_threads, lambda: {
        "norm2": np.array([K.global_norm_squared(x)])})


@pytest.mark.parametrize("scale", [0.5, 0.3, -2.0, 0.0])
def test_scale_inplace(rng, isa, scale):
    x = randn(rng, 2479)
    expected = x * np.float32(scale)   # one fp32 rounding, so exact
    K.scale_inplace(x, scale)
    assert np.array_equal(x, expected)


def test_scale_inplace_rejects_wrong_dtype():
    with pytest.raises(TypeError, match="x"):
        K.scale_inplace(np.ones(4, np.float64), 2.0)
