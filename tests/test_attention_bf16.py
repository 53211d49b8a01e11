"""csrc/attention_bf16.c: grouped-query attention with its products on bf16
operands (bf16 models), forward and backward, against the float64 reference
computed on the same bf16-rounded operands (reference.attention_gqa_bf16).

Bounds. Only float32 summation is left against that reference, except
where a float32 probability or dS and the reference's float64 one lie on two
sides of a bf16 rounding boundary: that one operand then rounds a bf16 step
(2^-8 relative) apart. So: max |error| <= 2e-3 of the largest (seen 4.2e-4 on
these shapes; leaving out a rounding, a term or a key gives >= 1e-2), and
all but a few elements within 1e-5 (float32 summation, seen 1e-7)."""
import dataclasses

import numpy as np
import pytest

import llmc_py
from llmc_py import Llama, LlamaConfig
from llmc_py import kernels as K
from llmc_py.errors import LlmcError
from helpers import assert_close, assert_thread_invariant, np64, t64
from reference import attention_gqa as ref_attention_gqa
from reference import attention_gqa_bf16 as ref_attention_gqa_bf16
from reference import attention_gqa_stats
from attention_helpers import make_gqa_inputs
from test_attention import attention_mask

TOL = 2e-3        # of the largest |value|: a bf16 rounding flipped by float32
SUM_TOL = 1e-5    # of the largest, for all but FLIPPED of the elements
FLIPPED = 0.005

SHAPES = [  # B, T, NH, NKV, hs, slopes, window, dropout
    (1, 1024, 4, 2, 64, None, 0, 0.0),       # GPT-2's head size at T = 1024, GQA
    (2, 256, 12, 12, 64, None, 0, 0.0),      # GPT-2 124M's layer at T = 256
    (1, 1, 4, 2, 8, "alibi", 0, 0.0),        # one position
    (2, 33, 6, 2, 15, None, 0, 0.0),         # hs = 15: odd, under a vector; T odd
    (1, 70, 2, 1, 80, "steep", 0, 0.0),      # hs = 80: 64 + 16 channels; blocks 64 + 6
    (1, 47, 3, 3, 100, None, 0, 0.0),        # hs = 100: 64 + 36
    (3, 9, 2, 2, 1, "alibi", 0, 0.0),        # hs = 1: one half of one pair
    (1, 130, 4, 1, 32, "alibi", 0, 0.0),     # multi-query; blocks 64, 64, 2
    (1, 130, 4, 2, 32, None, 20, 0.0),       # a sliding window
    (2, 97, 6, 3, 24, "alibi", 37, 0.0),     # window + ALiBi, T = 12 tiles + 1
    (2, 47, 4, 2, 64, None, 0, 0.3),         # dropout
    (1, 70, 4, 2, 16, "alibi", 9, 0.2),      # dropout + window + ALiBi
]


def bf16_run(qkv, dout, slopes, NH, NKV, window=0, p=0.0, seed=7):
    B, T, width = qkv.shape
    hs = width // (NH + 2 * NKV)
    out = np.full((B, T, NH * hs), np.nan, np.float32)   # (written): never read
    stats = np.full((B, NH, T, 2), np.nan, np.float32)
    K.attention_gqa_forward_bf16(out, stats, qkv, slopes, NH, NKV, window, p, seed)
    dinp = np.zeros_like(qkv)
    K.attention_gqa_backward_bf16(dinp, dout, qkv, stats, slopes, NH, NKV, window, p, seed)
    return {"out": out, "stats": stats, "dinp": dinp}


def reference(qkv, dout, slopes, NH, NKV, window=0, p=0.0, seed=7):
    B, T, _ = qkv.shape
    mask = t64(attention_mask(p, seed, B, NH, T)) if p else None
    qkv_t = t64(qkv, grad=True)
    out, _ = ref_attention_gqa_bf16(qkv_t, NH, NKV, None if slopes is None else t64(slopes),
                                    window, mask)
    (out * t64(dout)).sum().backward()
    return out, qkv_t.grad


def assert_bf16_close(name, ours, ref):
    assert_close(name, ours, ref, TOL)
    ref = np64(ref)
    off = np.abs(np.asarray(ours, np.float64) - ref) > SUM_TOL * np.abs(ref).max()
    assert off.mean() <= FLIPPED, f"{name}: {off.mean():.2%} of the elements off by > {SUM_TOL:g}"


@pytest.mark.parametrize("isa", llmc_py.supported_isas())
@pytest.mark.parametrize("B,T,NH,NKV,hs,slopes,window,p", SHAPES)
def test_bf16_attention_matches_the_rounded_reference(rng, use_isa, isa, B, T, NH, NKV, hs,
                                                      slopes, window, p):
    use_isa(isa)
    qkv, dout, slopes = make_gqa_inputs(rng, B, T, NH, NKV, hs, slopes)
    ours = bf16_run(qkv, dout, slopes, NH, NKV, window, p)
    ref_out, ref_dinp = reference(qkv, dout, slopes, NH, NKV, window, p)
    assert_bf16_close("out", ours["out"], ref_out)
    assert_bf16_close("dinp", ours["dinp"], ref_dinp)
    # the statistics are float32 softmax's of the bf16 scores
    stats = attention_gqa_stats(ref_round(qkv), NH, NKV,
                                None if slopes is None else t64(slopes), window)
    assert_close("stats", ours["stats"], stats, 1e-5)


def ref_round(x):
    """x rounded to bf16, as a float64 tensor."""
    rounded = np.empty(x.shape, np.uint16)
    K.float_to_bf16(rounded.reshape(-1), x.reshape(-1))
    return t64((rounded.astype(np.uint32) << 16).view(np.float32))


def test_bf16_attention_really_rounds(rng):
    """Against the float32 kernels' (unrounded) reference, the bf16 kernels are
    hundreds of times further off than their own bound on summation."""
    qkv, dout, _ = make_gqa_inputs(rng, 2, 64, 4, 2, 32)
    ours = bf16_run(qkv, dout, None, 4, 2)
    qkv_t = t64(qkv, grad=True)
    out, _ = ref_attention_gqa(qkv_t, 4, 2)
    (out * t64(dout)).sum().backward()
    for name, ref in (("out", out), ("dinp", qkv_t.grad)):
        ref = np64(ref)
        assert np.abs(ours[name] - ref).max() > 100 * SUM_TOL * np.abs(ref).max(), name


def test_bf16_attention_instruction_sets_agree(rng, use_isa):
    """The emulated pairs (avx2, avx512) add the same exact products in
    vdpbf16ps's order: bitwise equal to avx512bf16 wherever FMA is built in;
    portable (which may lack FMA in the float32 softmax) within the bound."""
    qkv, dout, slopes = make_gqa_inputs(rng, 2, 77, 6, 2, 40, "alibi")
    runs = {}
    for isa in llmc_py.supported_isas():
        use_isa(isa)
        runs[isa] = bf16_run(qkv, dout, slopes, 6, 2, window=50, p=0.1)
    base = runs[llmc_py.supported_isas()[-1]]
    for isa, run in runs.items():
        for name in run:
            if isa == "portable":
                assert_close(f"{isa} {name}", run[name], base[name], TOL)
            else:
                assert np.array_equal(run[name], base[name]), f"{isa} {name}"


@pytest.mark.parametrize("isa", llmc_py.supported_isas())
def test_bf16_attention_thread_invariant(rng, use_isa, set_threads, isa):
    use_isa(isa)
    qkv, dout, slopes = make_gqa_inputs(rng, 3, 75, 6, 3, 24, "alibi")
    assert_thread_invariant(set_threads,
                            lambda: bf16_run(qkv, dout, slopes, 6, 3, window=30, p=0.2))


def test_bf16_attention_backward_accumulates(rng):
    qkv, dout, slopes = make_gqa_inputs(rng, 2, 40, 4, 2, 16, "alibi")
    once = bf16_run(qkv, dout, slopes, 4, 2)
    dinp = np.ones_like(qkv)
    K.attention_gqa_backward_bf16(dinp, dout, qkv, once["stats"], slopes, 4, 2)
    K.attention_gqa_backward_bf16(dinp, dout, qkv, once["stats"], slopes, 4, 2)
    assert_close("dinp", dinp, 1.0 + 2.0 * np64(once["dinp"]), 1e-6)


def test_bf16_attention_rejects_bad_arguments(rng):
    qkv, dout, _ = make_gqa_inputs(rng, 1, 5, 4, 2, 8)
    out, stats = np.zeros((1, 5, 32), np.float32), np.zeros((1, 4, 5, 2), np.float32)
    with pytest.raises(LlmcError):   # C's check: a probability in [0, 1)
        K.attention_gqa_forward_bf16(out, stats, qkv, None, 4, 2, 0, 1.0, 0)
    with pytest.raises(ValueError, match="window"):
        K.attention_gqa_forward_bf16(out, stats, qkv, None, 4, 2, -1)
    with pytest.raises(LlmcError):   # 3 query heads do not share 1 kv head's row width
        K.attention_gqa_backward_bf16(np.zeros_like(qkv), dout, qkv, stats, None, 3, 1)


SMALL_LLAMA = dict(max_seq_len=40, vocab_size=67, padded_vocab_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, channels=64)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_models_attend_in_their_precision(precision):
    """A bf16 model's attention, forward and backward, is the bf16 kernels', bitwise
    (and not the float32 ones'); an fp32 model's the float32 kernels'."""
    config = dataclasses.replace(LlamaConfig(**SMALL_LLAMA), position="alibi",
                                 sliding_window=9)
    model = Llama(config, seed=3, precision=precision)
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 67, size=(2, 23)), rng.integers(0, 67, size=(2, 23))
    calls = []
    backward = model._attention_backward

    def recording_backward(dinp, dout, inp, stats, *rest, **options):
        backward(dinp, dout, inp, stats, *rest, **options)
        calls.append([v.copy() for v in (dinp, dout, inp, stats)] + [options] + list(rest))
    model._attention_backward = recording_backward
    model.forward(x, y)
    a, c = model.acts, model.config
    kernels = {"bf16": (K.attention_gqa_forward_bf16, K.attention_gqa_backward_bf16),
               "fp32": (K.attention_gqa_forward, K.attention_gqa_backward)}
    for l in range(c.L):
        for kind, (forward, _) in kernels.items():
            out = np.full_like(a.atty[l], np.nan)
            stats = np.full_like(a.att_stats[l], np.nan)
            forward(out, stats, model._attention_input(a, l), model.slopes, c.NH, c.NKV, 9)
            assert np.array_equal(out, a.atty[l]) == (kind == precision), (l, kind)
    model.backward()
    assert len(calls) == c.L
    for dinp, dout, inp, stats, options, *rest in calls:
        for kind, (_, kernel) in kernels.items():
            ours = np.zeros_like(dinp)
            kernel(ours, dout, inp, stats, *rest, **options)
            assert np.array_equal(ours, dinp) == (kind == precision), kind
