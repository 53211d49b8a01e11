"""The attention backwards' `written`: dinp holds garbage (NaN) before the
call and ends bitwise as the (+=) call on a zeroed dinp, the sign of a zero
included, on every instruction set and thread count; for the tiled fp32 and
bf16 kernels, GPT-2's attention_backward and the plain reference."""
import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from helpers import assert_thread_invariant
from attention_helpers import make_gqa_inputs

SHAPES = [  # B, T, NH, NKV, hs, slopes, window, dropout
    (1, 1, 4, 2, 8, "alibi", 0, 0.0),        # one position
    (2, 37, 6, 2, 15, None, 0, 0.0),         # T odd, hs odd: partial tiles and vectors
    (1, 70, 4, 4, 80, "steep", 0, 0.0),      # multi-head; blocks of 64 + 6 rows
    (1, 130, 4, 1, 32, "alibi", 0, 0.0),     # multi-query; blocks 64, 64, 2
    (2, 97, 6, 3, 24, "alibi", 37, 0.0),     # sliding window + ALiBi
    (1, 47, 4, 2, 64, None, 20, 0.2),        # dropout + window
]

KERNELS = {
    "fp32": (K.attention_gqa_forward, K.attention_gqa_backward),
    "bf16": (K.attention_gqa_forward_bf16, K.attention_gqa_backward_bf16),
}


def inputs(rng, B, T, NH, NKV, hs, slopes):
    qkv, dout, slopes = make_gqa_inputs(rng, B, T, NH, NKV, hs, slopes)
    dout[:, -1] = -0.0   # a row of -0 gradients: 0 + (-0) is +0 in the sum into zeros
    return qkv, dout, slopes


def check_written(set_threads, backward, saved, qkv, *args):
    """backward(dinp, dout, qkv, saved, *args, written=True) over NaN is
    bitwise the (+=) call on zeros, on 1, 2 and 3 threads."""
    into_zeros = np.zeros_like(qkv)
    backward(into_zeros, *args[:1], qkv, saved, *args[1:])

    def run():
        dinp = np.full_like(qkv, np.nan)
        backward(dinp, *args[:1], qkv, saved, *args[1:], written=True)
        return {"dinp": dinp}
    assert np.array_equal(run()["dinp"].view(np.uint32), into_zeros.view(np.uint32))
    assert_thread_invariant(set_threads, run, counts=(1, 2, 3))


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("isa", llmc_py.supported_isas())
@pytest.mark.parametrize("B,T,NH,NKV,hs,slopes,window,p", SHAPES)
def test_tiled_backward_written_is_the_sum_into_zeros(rng, use_isa, set_threads, isa, kind, B,
                                                      T, NH, NKV, hs, slopes, window, p):
    use_isa(isa)
    forward, backward = KERNELS[kind]
    qkv, dout, slopes = inputs(rng, B, T, NH, NKV, hs, slopes)
    out = np.empty((B, T, NH * hs), np.float32)
    stats = np.empty((B, NH, T, 2), np.float32)
    forward(out, stats, qkv, slopes, NH, NKV, window, p, 5)
    check_written(set_threads, backward, stats, qkv, dout, slopes, NH, NKV, window, p, 5)


@pytest.mark.parametrize("B,T,NH,NKV,hs,slopes,window,p", SHAPES)
def test_naive_backward_written_is_the_sum_into_zeros(rng, set_threads, B, T, NH, NKV, hs,
                                                      slopes, window, p):
    qkv, dout, slopes = inputs(rng, B, T, NH, NKV, hs, slopes)
    out = np.empty((B, T, NH * hs), np.float32)
    att = np.empty((B, NH, T, T), np.float32)
    K.attention_forward_naive(out, att, qkv, slopes, NH, NKV, window, p, 5)
    check_written(set_threads, K.attention_backward_naive, att, qkv, dout, NH, NKV, window, p, 5)


@pytest.mark.parametrize("isa", llmc_py.supported_isas())
def test_gpt2_attention_backward_written_is_the_sum_into_zeros(rng, use_isa, set_threads, isa):
    use_isa(isa)
    qkv, dout, _ = inputs(rng, 2, 37, 4, 4, 15, None)
    out = np.empty_like(dout)
    stats = np.empty((2, 4, 37, 2), np.float32)
    K.attention_forward(out, stats, qkv, 4)
    check_written(set_threads, K.attention_backward, stats, qkv, dout, 4)

