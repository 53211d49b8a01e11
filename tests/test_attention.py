"""csrc/attention.c: causal multi-head attention (GPT-2) and grouped-query
attention with optional ALiBi, against the float64 reference and autograd."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from helpers import TOL, assert_close, assert_thread_invariant, randn, t64
from reference import attention_gqa as ref_attention_gqa
from reference import attention_entropy as ref_attention_entropy
from reference import attention_gqa_stats as ref_attention_gqa_stats
from attention_helpers import (
    GQA_SHAPES, make_gqa_inputs, gqa_forward, gqa_backward, TILE_SHAPES, probs, tiled,
    naive_forward, naive_backward, check_gqa_against_reference, windowed)

SHAPES = [  # B, T, C, NH
    (4, 64, 768, 12),   # GPT-2 124M: hs = 64
    (1, 1, 48, 4),      # a single position attends only to itself
    (2, 37, 60, 4),     # hs = 15: not a multiple of any vector width
    (1, 5, 67, 1),      # one head over an odd width
    (2, 9, 16, 16),     # hs = 1
]


def make_inputs(rng, B, T, C):
    return randn(rng, B, T, 3 * C), randn(rng, B, T, C)


def forward(qkv, NH):
    B, T, C3 = qkv.shape
    out = np.full((B, T, C3 // 3), np.nan, np.float32)   # (written): must not be read
    stats = np.full((B, NH, T, 2), np.nan, np.float32)
    K.attention_forward(out, stats, qkv, NH)
    return out, stats


def backward(dout, qkv, stats, NH, calls=1):
    dinp = np.zeros_like(qkv)
    for _ in range(calls):
        K.attention_backward(dinp, dout, qkv, stats, NH)
    return dinp


@pytest.mark.parametrize("B,T,C,NH", SHAPES)
def test_attention_matches_reference(rng, isa, B, T, C, NH):
    qkv, dout = make_inputs(rng, B, T, C)
    out, stats = forward(qkv, NH)
    att = probs(qkv, stats, None, NH, NH)
    dinp = backward(dout, qkv, stats, NH)

    qkv_t = t64(qkv, grad=True)
    ref_out, ref_att = ref_attention_gqa(qkv_t, NH, NH)   # NKV = NH: multi-head
    (ref_out * t64(dout)).sum().backward()

    tol = TOL["attention"]
    assert_close("out", out, ref_out, tol["fwd"])
    assert_close("att", att, ref_att, tol["fwd"])
    assert not np.triu(att, k=1).any(), "att is not exactly 0 above the diagonal"
    assert_close("dinp", dinp, qkv_t.grad, tol["bwd"])


def test_attention_backward_accumulates(rng):
    qkv, dout = make_inputs(rng, 2, 37, 60)
    _, stats = forward(qkv, 4)
    once, twice = backward(dout, qkv, stats, 4), backward(dout, qkv, stats, 4, calls=2)
    assert_close("dinp", twice, 2.0 * once, TOL["attention"]["bwd"])


def test_attention_thread_invariant(rng, isa, set_threads):
    qkv, dout = make_inputs(rng, 3, 20, 60)   # B*NH = 9 (b, h) pairs, uneven over 2 threads

    def run():
        out, stats = forward(qkv, 4)
        return {"out": out, "stats": stats, "att": probs(qkv, stats, None, 4, 4),
                "dinp": backward(dout, qkv, stats, 4)}
    assert_thread_invariant(set_threads, run)


def test_attention_rejects_heads_not_dividing_channels(rng):
    qkv, _ = make_inputs(rng, 1, 3, 10)
    with pytest.raises(llmc_py.ShapeError, match="NH=4"):
        forward(qkv, 4)


@pytest.mark.parametrize("bad", ["stats", "dout"])
def test_attention_rejects_wrong_shape(rng, bad):
    qkv, dout = make_inputs(rng, 2, 3, 8)
    _, stats = forward(qkv, 2)
    args = dict(dinp=np.zeros_like(qkv), dout=dout, inp=qkv, stats=stats, NH=2)
    args[bad] = args[bad][..., :-1].copy()
    with pytest.raises(llmc_py.ShapeError, match=bad):
        K.attention_backward(**args)


def test_attention_rejects_wrong_dtype(rng):
    qkv, _ = make_inputs(rng, 2, 3, 8)
    with pytest.raises(TypeError, match="inp"):
        forward(qkv.astype(np.float64), 2)


# ---- grouped-query attention, optionally with ALiBi -------------------------


LONG_SHAPES = [  # B, T, NH, NKV, hs, slopes: T = 1, 37, 64, 256, 1024; GPT-2
                 # (NKV = NH), GQA and ALiBi at each length
    (2, 1, 4, 4, 64, None),
    (1, 1, 4, 2, 64, "alibi"),
    (2, 37, 4, 4, 64, None),
    (2, 37, 4, 2, 64, "alibi"),
    (1, 64, 4, 4, 64, None),        # one whole block of the backward
    (1, 64, 6, 2, 64, "alibi"),
    (1, 256, 4, 4, 64, None),
    (1, 256, 4, 1, 64, "alibi"),
    (1, 1024, 2, 2, 64, None),
    (1, 1024, 2, 1, 64, "alibi"),
    (1, 1024, 4, 2, 64, "steep"),
]


@pytest.mark.parametrize("B,T,NH,NKV,hs,slopes", GQA_SHAPES + TILE_SHAPES)
def test_attention_gqa_matches_reference(rng, isa, B, T, NH, NKV, hs, slopes):
    check_gqa_against_reference(rng, tiled, gqa_backward, B, T, NH, NKV, hs, slopes)


@pytest.mark.parametrize("B,T,NH,NKV,hs,slopes", LONG_SHAPES)
def test_attention_gqa_long_sequences_match_reference(rng, isa, B, T, NH, NKV, hs, slopes):
    check_gqa_against_reference(rng, tiled, gqa_backward, B, T, NH, NKV, hs, slopes)


def test_attention_gqa_backward_accumulates(rng):
    qkv, dout, slopes = make_gqa_inputs(rng, 2, 13, 6, 2, 15, "alibi")
    _, stats = gqa_forward(qkv, slopes, 6, 2)
    once = gqa_backward(dout, qkv, stats, slopes, 6, 2)
    twice = gqa_backward(dout, qkv, stats, slopes, 6, 2, calls=2)
    assert_close("dinp", twice, 2.0 * once, TOL["attention_gqa"]["bwd"])


def test_attention_gqa_thread_invariant(rng, isa, set_threads):
    # 5 (b, kv head) pairs in the backward: uneven over 2 and over 3 threads
    qkv, dout, slopes = make_gqa_inputs(rng, 1, 21, 10, 5, 16, "alibi")

    def run():
        out, stats, att = tiled(qkv, slopes, 10, 5)
        return {"out": out, "stats": stats, "att": att,
                "dinp": gqa_backward(dout, qkv, stats, slopes, 10, 5)}
    assert_thread_invariant(set_threads, run, counts=(1, 2, 3))


def test_attention_gqa_without_groups_or_slopes_is_gpt2_attention(rng):
    # the same core runs both, so the results are bitwise equal
    qkv, dout = make_inputs(rng, 2, 37, 60)
    out, stats = forward(qkv, 4)
    gqa_out, gqa_stats = gqa_forward(qkv, None, 4, 4)
    assert np.array_equal(gqa_out, out) and np.array_equal(gqa_stats, stats)
    assert np.array_equal(gqa_backward(dout, qkv, stats, None, 4, 4),
                          backward(dout, qkv, stats, 4))


def test_attention_gqa_zero_slopes_are_no_bias(rng):
    qkv, dout, _ = make_gqa_inputs(rng, 2, 19, 6, 2, 16)
    zeros = np.zeros(6, np.float32)
    plain, zero = tiled(qkv, None, 6, 2), tiled(qkv, zeros, 6, 2)
    for name, a, b in zip(("out", "stats", "att"), plain, zero):
        assert np.array_equal(a, b), name
    assert np.array_equal(gqa_backward(dout, qkv, plain[1], None, 6, 2),
                          gqa_backward(dout, qkv, plain[1], zeros, 6, 2)), "dinp"


def test_attention_gqa_rejects_heads_not_dividing(rng):
    qkv, _, _ = make_gqa_inputs(rng, 1, 3, 6, 4, 8)   # 6 query heads, 4 kv heads
    with pytest.raises(llmc_py.ShapeError, match="NH=6 is not a multiple of NKV=4"):
        gqa_forward(qkv, None, 6, 4)


def test_attention_gqa_c_rejects_heads_not_dividing():
    # the C prologue checks it too, for callers that skip the wrapper
    from llmc_py._native.lib import ffi, lib
    buf = ffi.new("float[]", 1024)
    assert lib.attention_gqa_forward(buf, buf, buf, ffi.NULL, 1, 2, 6, 4, 2, 0, 0.0, 0) \
        == lib.LLMC_ERR_SHAPE
    assert lib.attention_gqa_backward(buf, buf, buf, buf, ffi.NULL, 1, 2, 6, 4, 2, 0, 0.0, 0, 0) \
        == lib.LLMC_ERR_SHAPE
    assert lib.attention_gqa_probs(buf, buf, buf, ffi.NULL, 1, 2, 6, 4, 2, 0) \
        == lib.LLMC_ERR_SHAPE
    # and a negative sliding window
    assert lib.attention_gqa_forward(buf, buf, buf, ffi.NULL, 1, 2, 2, 1, 2, -1, 0.0, 0) \
        == lib.LLMC_ERR_SHAPE


@pytest.mark.parametrize("NH,NKV", [(0, 1), (4, 0), (4, -2)])
def test_attention_gqa_rejects_non_positive_heads(rng, NH, NKV):
    qkv = randn(rng, 1, 3, 24)
    with pytest.raises(llmc_py.ShapeError, match="must be a positive int"):
        K.attention_gqa_forward(np.zeros((1, 3, 8), np.float32),
                                np.zeros((1, 4, 3, 2), np.float32), qkv, None, NH, NKV)


def test_attention_gqa_rejects_inp_width_not_a_whole_number_of_heads(rng):
    qkv = randn(rng, 1, 3, 8 * 8 + 1)   # NH=4, NKV=2: 8 heads of hs channels, plus one
    with pytest.raises(llmc_py.ShapeError, match="inp has 65 channels"):
        gqa_forward(qkv, None, 4, 2)


@pytest.mark.parametrize("bad", ["out", "stats", "slopes"])
def test_attention_gqa_forward_rejects_wrong_shape(rng, bad):
    qkv, _, slopes = make_gqa_inputs(rng, 2, 3, 4, 2, 8, "alibi")
    args = dict(out=np.zeros((2, 3, 32), np.float32), stats=np.zeros((2, 4, 3, 2), np.float32),
                inp=qkv, slopes=slopes, NH=4, NKV=2)
    args[bad] = args[bad][..., :-1].copy()
    with pytest.raises(llmc_py.ShapeError, match=bad):
        K.attention_gqa_forward(**args)


@pytest.mark.parametrize("bad", ["dinp", "dout", "stats", "slopes"])
def test_attention_gqa_backward_rejects_wrong_shape(rng, bad):
    qkv, dout, slopes = make_gqa_inputs(rng, 2, 3, 4, 2, 8, "alibi")
    _, stats = gqa_forward(qkv, slopes, 4, 2)
    args = dict(dinp=np.zeros_like(qkv), dout=dout, inp=qkv, stats=stats, slopes=slopes, NH=4,
                NKV=2)
    args[bad] = args[bad][..., :-1].copy()
    with pytest.raises(llmc_py.ShapeError, match=bad):
        K.attention_gqa_backward(**args)


def test_attention_gqa_rejects_wrong_slopes_dtype(rng):
    qkv, _, _ = make_gqa_inputs(rng, 1, 3, 4, 2, 8)
    with pytest.raises(TypeError, match="slopes"):
        gqa_forward(qkv, K.alibi_slopes(4).astype(np.float64), 4, 2)


# ---- dropout on the probabilities -------------------------------------------


DROPOUT_SHAPES = [  # B, T, NH, NKV, hs, slopes, p
    (2, 13, 6, 3, 15, None, 0.1),
    (3, 35, 4, 1, 24, "alibi", 0.3),
    (1, 70, 2, 1, 80, "steep", 0.5),    # blocks of 64 and 6 rows in the backward
    (2, 9, 2, 2, 1, "alibi", 0.2),      # hs = 1
    (1, 1, 4, 2, 8, None, 0.6),         # one key: it survives or out is 0
]


def attention_mask(p, seed, B, NH, T):
    """The attention's dropout mask [B, NH, T, T] (0 or 1 / (1 - p)): by the
    contract, dropout_forward's on [B, NH T, T]."""
    ones = np.ones((B, NH * T, T), np.float32)
    K.dropout_forward(ones, ones, p, seed)
    return ones.reshape(B, NH, T, T)


def dropout_run(qkv, dout, slopes, NH, NKV, p, seed, naive_kernels=False):
    B, T, width = qkv.shape
    hs = width // (NH + 2 * NKV)
    out = np.full((B, T, NH * hs), np.nan, np.float32)
    saved = np.full((B, NH, T, T) if naive_kernels else (B, NH, T, 2), np.nan, np.float32)
    dinp = np.zeros_like(qkv)
    if naive_kernels:
        K.attention_forward_naive(out, saved, qkv, slopes, NH, NKV, dropout=p, seed=seed)
        K.attention_backward_naive(dinp, dout, qkv, saved, NH, NKV, dropout=p, seed=seed)
    else:
        K.attention_gqa_forward(out, saved, qkv, slopes, NH, NKV, dropout=p, seed=seed)
        K.attention_gqa_backward(dinp, dout, qkv, saved, slopes, NH, NKV, dropout=p, seed=seed)
    return {"out": out, "saved": saved, "dinp": dinp}


@pytest.mark.parametrize("B,T,NH,NKV,hs,slopes,p", DROPOUT_SHAPES)
def test_attention_dropout_matches_reference_with_its_mask(rng, isa, B, T, NH, NKV, hs, slopes,
                                                           p):
    qkv, dout, slopes = make_gqa_inputs(rng, B, T, NH, NKV, hs, slopes)
    seed = 2**63 + 12345
    ours = dropout_run(qkv, dout, slopes, NH, NKV, p, seed)
    naive_ours = dropout_run(qkv, dout, slopes, NH, NKV, p, seed, naive_kernels=True)

    qkv_t = t64(qkv, grad=True)
    ref_out, _ = ref_attention_gqa(qkv_t, NH, NKV, None if slopes is None else t64(slopes),
                                   mask=t64(attention_mask(p, seed, B, NH, T)))
    (ref_out * t64(dout)).sum().backward()
    tol = TOL["attention_gqa"]
    for name, run in (("tiled", ours), ("naive", naive_ours)):
        assert_close(f"{name} out", run["out"], ref_out, tol["fwd"])
        assert_close(f"{name} dinp", run["dinp"], qkv_t.grad, tol["bwd"])
    # the statistics (and so the probabilities) are those without dropout
    assert np.array_equal(ours["saved"], gqa_forward(qkv, slopes, NH, NKV)[1])
    assert np.array_equal(naive_ours["saved"], naive_forward(qkv, slopes, NH, NKV)[1])


@pytest.mark.parametrize("naive_kernels", [False, True])
def test_attention_dropout_0_is_no_dropout_bitwise(rng, naive_kernels):
    qkv, dout, slopes = make_gqa_inputs(rng, 2, 37, 6, 2, 24, "alibi")
    plain = dropout_run(qkv, dout, slopes, 6, 2, 0.0, 0, naive_kernels)
    with_seed = dropout_run(qkv, dout, slopes, 6, 2, 0.0, 987, naive_kernels)
    if naive_kernels:
        out, att = naive_forward(qkv, slopes, 6, 2)
        before = {"out": out, "saved": att, "dinp": naive_backward(dout, qkv, att, None, 6, 2)}
    else:
        out, stats = gqa_forward(qkv, slopes, 6, 2)
        before = {"out": out, "saved": stats,
                  "dinp": gqa_backward(dout, qkv, stats, slopes, 6, 2)}
    for name in before:
        assert np.array_equal(plain[name], before[name]), name
        assert np.array_equal(with_seed[name], before[name]), name


def test_attention_dropout_thread_invariant_and_seeded(rng, isa, set_threads):
    qkv, dout, slopes = make_gqa_inputs(rng, 1, 21, 10, 5, 16, "alibi")   # 5 kv heads
    run = lambda: dropout_run(qkv, dout, slopes, 10, 5, 0.25, 42)   # noqa: E731
    assert_thread_invariant(set_threads, run)
    assert not np.array_equal(run()["out"], dropout_run(qkv, dout, slopes, 10, 5, 0.25, 43)["out"])


def test_attention_dropout_rows_of_a_larger_batch_take_its_masks(rng):
    # batch rows b0.. under seed + b0 * DROPOUT_ROW_STEP are those rows of the
    # whole batch: another rank's or micro-batch's rows drop the same
    qkv, dout, slopes = make_gqa_inputs(rng, 4, 19, 4, 2, 16, None)
    whole = dropout_run(qkv, dout, slopes, 4, 2, 0.3, 5)
    step = K.DROPOUT_ROW_STEP
    part = dropout_run(qkv[2:].copy(), dout[2:].copy(), slopes, 4, 2, 0.3, (5 + 2 * step) % 2**64)
    for name in whole:
        assert np.array_equal(part[name], whole[name][2:]), name


@pytest.mark.parametrize("p", [1.0, -0.5, float("nan")])
def test_attention_dropout_rejects_a_probability_outside_0_1(rng, p):
    qkv, dout, slopes = make_gqa_inputs(rng, 1, 3, 2, 1, 8)
    for naive_kernels in (False, True):
        with pytest.raises(llmc_py.InvalidValueError):
            dropout_run(qkv, dout, slopes, 2, 1, p, 0, naive_kernels)


_ASAN = "asan" in os.environ.get("LD_PRELOAD", "")


# Runs in a child process: the attention of one head at T = 16384, whose
# T x T probabilities would be 1 GiB, with the address space capped at what
# the process already maps plus 256 MiB (unless LLMC_TEST_NO_CAP is set: then
# it checks the results alone).
_LONG_CONTEXT = """
import os
import resource
import numpy as np
from llmc_py import kernels as K

B, T, NH, hs = 1, 16384, 1, 16
rng = np.random.default_rng(0)
qkv = rng.standard_normal((B, T, 3 * NH * hs), dtype=np.float32)
dout = rng.standard_normal((B, T, NH * hs), dtype=np.float32)
out, stats = np.empty((B, T, NH * hs), np.float32), np.empty((B, NH, T, 2), np.float32)
dinp = np.zeros_like(qkv)
# start the threads and touch every page before the cap
small = qkv[:, :8].copy()
K.attention_gqa_forward(out[:, :8].copy(), stats[:, :, :8].copy(), small, None, NH, NH)
out[...], stats[...] = 0, 0
if not os.environ.get("LLMC_TEST_NO_CAP"):
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (256 << 20), resource.RLIM_INFINITY))
    try:
        np.ones((T, T), np.float32)
        raise SystemExit("the cap does not hold: a T x T array was allocated")
    except MemoryError:
        pass
K.attention_gqa_forward(out, stats, qkv, None, NH, NH)
K.attention_gqa_backward(dinp, dout, qkv, stats, None, NH, NH)
# the last query row attends to every key: check it in float64
q, k, v = (qkv[0, :, i * hs:(i + 1) * hs].astype(np.float64) for i in range(3))
s = k @ q[-1] / np.sqrt(hs)
p = np.exp(s - s.max())
ref = p @ v / p.sum()
# a weighted sum of 16384 values in float32: rounding grows with the terms
# (about sqrt(T) ulps; seen 3.0e-6 on the sanitizers' -O1 build)
err = np.abs(out[0, -1] - ref).max() / np.abs(ref).max()
assert err <= 2e-5, f"out: {err:.3g}"
assert abs(stats[0, 0, -1, 0] - s.max()) <= 3e-6 * abs(s.max()), "stats max"
assert np.isfinite(dinp).all() and np.abs(dinp).max() > 0, "dinp"
# the row entropies need no T x T either
ent = np.empty((B, NH, T), np.float32)
K.attention_gqa_entropy(ent, qkv, stats, None, NH, NH)
ref_ent = np.log(p.sum()) - (p * (s - s.max())).sum() / p.sum()
assert abs(ent[0, 0, -1] - ref_ent) <= 2e-5 * ref_ent, f"entropy: {ent[0, 0, -1]} vs {ref_ent}"
print("ok")
"""


def test_attention_scratch_grows_with_T_not_T_squared():
    """Where the cap cannot hold (not Linux, whose RLIMIT_AS it uses; or
    AddressSanitizer, whose shadow memory defeats it) the child checks the
    long context's results without it."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    if _ASAN or not sys.platform.startswith("linux"):
        env["LLMC_TEST_NO_CAP"] = "1"
    result = subprocess.run([sys.executable, "-c", _LONG_CONTEXT], cwd=root, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_attention_scratch_is_the_kernels_arena_kept_between_calls(rng):
    """The tiled kernels' per-thread scratch is a slice of the kernels' arena
    (llmc_py.scratch_bytes), not an allocation per call: a call grows it from
    empty, the same calls again grow it no more, and their bits are those of
    a call on a freshly released arena (fp32 and bf16, forward and backward)."""
    qkv, dout, slopes = make_gqa_inputs(rng, 2, 300, 4, 2, 64, "alibi")

    def run():
        results = {}
        for name, forward, backward in (
                ("fp32", K.attention_gqa_forward, K.attention_gqa_backward),
                ("bf16", K.attention_gqa_forward_bf16, K.attention_gqa_backward_bf16)):
            out = np.empty((2, 300, 4 * 64), np.float32)
            stats = np.empty((2, 4, 300, 2), np.float32)
            forward(out, stats, qkv, slopes, 4, 2)
            dinp = np.zeros_like(qkv)
            backward(dinp, dout, qkv, stats, slopes, 4, 2)
            results.update({f"{name} out": out, f"{name} stats": stats, f"{name} dinp": dinp})
        return results

    llmc_py.release_scratch()
    assert llmc_py.scratch_bytes() == 0
    first = run()
    held = llmc_py.scratch_bytes()
    assert held > 0
    for again in (run(), run()):
        assert llmc_py.scratch_bytes() == held
        for name, value in first.items():
            assert np.array_equal(value, again[name]), name
    llmc_py.release_scratch()
    fresh = run()
    for name, value in first.items():
        assert np.array_equal(value, fresh[name]), name


# ---- ALiBi slopes -----------------------------------------------------------


@pytest.mark.parametrize("n,expected", [
    (1, [1 / 256]),
    (8, [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]),
    # 6 = 4 + 2: the 4-head slopes 2^-2i, then 2^-1 and 2^-3 from the 8-head ones
    (6, [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]),
    # 12 = 8 + 4: the 8-head slopes, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    (12, [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256,
          0.7071067811865476, 0.35355339059327379, 0.17677669529663689,
          0.088388347648318447]),
])
def test_alibi_slopes_match_hand_computed_values(n, expected):
    slopes = K.alibi_slopes(n)
    assert slopes.dtype == np.float32 and slopes.shape == (n,)
    np.testing.assert_array_equal(slopes, np.array(expected, np.float32))


@pytest.mark.parametrize("n", [0, -3, 2.0, True])
def test_alibi_slopes_rejects_non_positive_or_non_int(n):
    with pytest.raises(ValueError, match="n_heads"):
        K.alibi_slopes(n)


# ---- the tiled kernels' edges -----------------------------------------------


def test_attention_gqa_tiles_thread_invariant(rng, isa, set_threads):
    # T = 43: 5 tiles of 8 rows and 3 single rows; hs = 24: a partial vector;
    # 5 (b, kv head) pairs in the backward: uneven over 2 and over 3 threads
    qkv, dout, slopes = make_gqa_inputs(rng, 5, 43, 6, 1, 24, "alibi")

    def run():
        out, stats, att = tiled(qkv, slopes, 6, 1)
        return {"out": out, "stats": stats, "att": att,
                "dinp": gqa_backward(dout, qkv, stats, slopes, 6, 1)}
    assert_thread_invariant(set_threads, run, counts=(1, 2, 3))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_attention_forward_builds_panels_where_a_share_starts_inside_a_kv_group(
        rng, isa, set_threads, precision):
    """A thread keeps its previous query head's k, v panels for the next head
    of the same kv head, and builds them where its share of the (b, h) starts
    inside a group: 6 query heads over 4 threads start shares at heads 2, 4
    and 5 (3 a kv head), with another call's panels left in the arena."""
    forward = K.attention_gqa_forward_bf16 if precision == "bf16" else K.attention_gqa_forward
    other, _, slopes = make_gqa_inputs(rng, 1, 40, 6, 2, 16, "alibi")
    qkv = randn(rng, *other.shape)

    def run(x):
        out, stats = np.empty((1, 40, 6 * 16), np.float32), np.empty((1, 6, 40, 2), np.float32)
        forward(out, stats, x, slopes, 6, 2)
        return out, stats

    set_threads(1)
    expected = run(qkv)
    set_threads(4)   # without OpenMP one thread: its share is every head, the reuse across all
    run(other)
    for want, got in zip(expected, run(qkv)):
        assert np.array_equal(want, got)


# ---- sliding-window attention -----------------------------------------------


WINDOW_SHAPES = [  # B, T, NH, NKV, hs, slopes, window. The tiles start at a row's
                   # first key rounded down to 16 keys; windows that are and are
                   # not multiples of 4, 8 and 16, across the backward's 64-row blocks
    (2, 37, 4, 2, 16, None, 1),        # each query sees itself only
    (2, 37, 4, 2, 16, "alibi", 5),
    (1, 40, 6, 3, 15, None, 8),        # hs = 15
    (2, 33, 4, 1, 24, "alibi", 16),    # multi-query
    (1, 70, 2, 1, 80, "steep", 13),    # hs = 80; blocks of 64 + 6 rows
    (1, 130, 4, 2, 32, None, 37),      # blocks of 64, 64 and 2 rows
    (1, 200, 4, 4, 64, "alibi", 70),   # a window longer than a block
    (1, 130, 2, 2, 16, None, 129),     # only the last row loses a key
    (3, 9, 2, 2, 1, None, 3),          # hs = 1
]


def windowed_backward(dout, qkv, stats, slopes, NH, NKV, window):
    dinp = np.zeros_like(qkv)
    K.attention_gqa_backward(dinp, dout, qkv, stats, slopes, NH, NKV, window)
    return dinp


def outside_window(T, window):
    """[T, T] True where key t2 is not in query t's window (future or too old)."""
    t = np.arange(T)
    return (t[None, :] > t[:, None]) | (t[None, :] <= t[:, None] - window)


@pytest.mark.parametrize("B,T,NH,NKV,hs,slopes,window", WINDOW_SHAPES)
def test_attention_window_matches_reference(rng, isa, B, T, NH, NKV, hs, slopes, window):
    qkv, dout, slopes = make_gqa_inputs(rng, B, T, NH, NKV, hs, slopes)
    out, stats, att = windowed(qkv, slopes, NH, NKV, window)
    dinp = windowed_backward(dout, qkv, stats, slopes, NH, NKV, window)

    qkv_t = t64(qkv, grad=True)
    slopes_t = None if slopes is None else t64(slopes)
    ref_out, ref_att = ref_attention_gqa(qkv_t, NH, NKV, slopes_t, window)
    (ref_out * t64(dout)).sum().backward()
    ref_stats = ref_attention_gqa_stats(t64(qkv), NH, NKV, slopes_t, window)
    tol = TOL["attention_gqa"]
    assert_close("out", out, ref_out, tol["fwd"])
    assert_close("att", att, ref_att, tol["fwd"])
    assert not att[..., outside_window(T, window)].any(), "att is not 0 outside the window"
    assert_close("stats max", stats[..., 0], ref_stats[..., 0], tol["fwd"])
    assert_close("stats inv", stats[..., 1], ref_stats[..., 1], tol["fwd"])
    assert_close("dinp", dinp, qkv_t.grad, tol["bwd"])

    # the plain twin with the same window
    naive_out = np.full_like(out, np.nan)
    naive_att = np.full_like(att, np.nan)
    K.attention_forward_naive(naive_out, naive_att, qkv, slopes, NH, NKV, window)
    naive_dinp = np.zeros_like(qkv)
    K.attention_backward_naive(naive_dinp, dout, qkv, naive_att, NH, NKV, window)
    assert_close("naive out", naive_out, ref_out, tol["fwd"])
    assert_close("naive att", naive_att, ref_att, tol["fwd"])
    assert_close("naive dinp", naive_dinp, qkv_t.grad, tol["bwd"])

    # the row entropies over the window
    ent = np.full((B, NH, T), np.nan, np.float32)
    K.attention_gqa_entropy(ent, qkv, stats, slopes, NH, NKV, window)
    assert_close("entropy", ent, ref_attention_entropy(ref_att.detach()), tol["fwd"])


@pytest.mark.parametrize("T,window", [(37, 37), (37, 100), (130, 130)])
def test_attention_window_of_every_key_is_full_attention_bitwise(rng, T, window):
    # a window reaching back to key 0 for every row changes nothing, to the bit
    qkv, dout, slopes = make_gqa_inputs(rng, 2, T, 4, 2, 24, "alibi")
    out, stats, att = windowed(qkv, slopes, 4, 2, window)
    full_out, full_stats, full_att = tiled(qkv, slopes, 4, 2)
    for name, x, y in [("out", out, full_out), ("stats", stats, full_stats), ("att", att, full_att),
                       ("dinp", windowed_backward(dout, qkv, stats, slopes, 4, 2, window),
                        gqa_backward(dout, qkv, full_stats, slopes, 4, 2))]:
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), name


def test_attention_window_thread_invariant(rng, isa, set_threads):
    qkv, dout, slopes = make_gqa_inputs(rng, 5, 75, 6, 1, 24, "alibi")

    def run():
        out, stats, att = windowed(qkv, slopes, 6, 1, 11)
        return {"out": out, "stats": stats, "att": att,
                "dinp": windowed_backward(dout, qkv, stats, slopes, 6, 1, 11)}
    assert_thread_invariant(set_threads, run, counts=(1, 2, 3))


def test_attention_window_rejects_a_negative_window(rng):
    qkv, _, _ = make_gqa_inputs(rng, 1, 3, 2, 1, 8)
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        K.attention_gqa_forward(np.zeros((1, 3, 16), np.float32),
                                np.zeros((1, 2, 3, 2), np.float32), qkv, None, 2, 1, -4)


@pytest.mark.parametrize("naive_kernels", [False, True])
def test_attention_window_with_dropout_matches_reference(rng, isa, naive_kernels):
    """A sliding window and dropout together: a row's mask covers its
    window's keys, by their absolute index (the rows start past key 0)."""
    B, T, NH, NKV, hs, window, p, seed = 2, 70, 4, 2, 16, 13, 0.2, 11
    qkv, dout, slopes = make_gqa_inputs(rng, B, T, NH, NKV, hs, "alibi")
    out = np.full((B, T, NH * hs), np.nan, np.float32)
    saved = np.full((B, NH, T, T) if naive_kernels else (B, NH, T, 2), np.nan, np.float32)
    dinp = np.zeros_like(qkv)
    if naive_kernels:
        K.attention_forward_naive(out, saved, qkv, slopes, NH, NKV, window, p, seed)
        K.attention_backward_naive(dinp, dout, qkv, saved, NH, NKV, window, p, seed)
    else:
        K.attention_gqa_forward(out, saved, qkv, slopes, NH, NKV, window, p, seed)
        K.attention_gqa_backward(dinp, dout, qkv, saved, slopes, NH, NKV, window, p, seed)
    qkv_t = t64(qkv, grad=True)
    ref_out, _ = ref_attention_gqa(qkv_t, NH, NKV, t64(slopes), window,
                                   mask=t64(attention_mask(p, seed, B, NH, T)))
    (ref_out * t64(dout)).sum().backward()
    tol = TOL["attention_gqa"]
    assert_close("out", out, ref_out, tol["fwd"])
    assert_close("dinp", dinp, qkv_t.grad, tol["bwd"])
