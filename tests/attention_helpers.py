"""What the attention kernels' tests share: the shapes, the calls (outputs
start as NaN: a (written) array must never be read) and the check against
the float64 reference."""
import numpy as np

from llmc_py import kernels as K
from helpers import TOL, assert_close, randn, t64
from reference import attention_gqa as ref_attention_gqa
from reference import attention_gqa_stats as ref_attention_gqa_stats

GQA_SHAPES = [  # B, T, NH, NKV, hs, slopes
    (2, 256, 12, 4, 64, None),      # a Llama-like layer: 3 query heads per kv head
    (2, 256, 12, 4, 64, "alibi"),
    (1, 1, 4, 2, 8, "alibi"),       # a single position: att == 1 whatever the bias
    (2, 13, 6, 3, 15, None),        # hs = 15: not a multiple of any vector width
    (3, 13, 8, 1, 16, "alibi"),     # multi-query: one kv head for all query heads
    (2, 17, 4, 4, 32, None),        # NKV == NH: plain multi-head
    (2, 20, 6, 2, 16, "alibi"),     # NH = 6: ALiBi slopes for a non-power of two
    (2, 40, 4, 2, 16, "steep"),     # slopes up to 4: far keys' weights underflow to 0
]


def make_gqa_inputs(rng, B, T, NH, NKV, hs, slopes=None):
    qkv, dout = randn(rng, B, T, (NH + 2 * NKV) * hs), randn(rng, B, T, NH * hs)
    if slopes == "alibi":
        slopes = K.alibi_slopes(NH)
    elif slopes == "steep":
        slopes = rng.uniform(0.5, 4.0, NH).astype(np.float32)
    return qkv, dout, slopes


def gqa_forward(qkv, slopes, NH, NKV):
    B, T, width = qkv.shape
    hs = width // (NH + 2 * NKV)
    out = np.full((B, T, NH * hs), np.nan, np.float32)   # (written): must not be read
    stats = np.full((B, NH, T, 2), np.nan, np.float32)
    K.attention_gqa_forward(out, stats, qkv, slopes, NH, NKV)
    return out, stats


def gqa_backward(dout, qkv, stats, slopes, NH, NKV, calls=1):
    dinp = np.zeros_like(qkv)
    for _ in range(calls):
        K.attention_gqa_backward(dinp, dout, qkv, stats, slopes, NH, NKV)
    return dinp


TILE_SHAPES = [  # B, T, NH, NKV, hs, slopes. The kernels tile 8 query rows, 4 keys,
                 # 32 keys of scores and 64 channels, and the backward recomputes
                 # blocks of 64 query rows; these shapes hit each remainder
    (1, 1, 6, 2, 24, "alibi"),      # T = 1: one row, one key
    (1, 35, 6, 1, 24, "alibi"),     # T = 4 tiles of 8 rows + 3; multi-query
    (2, 33, 6, 2, 15, None),        # hs = 15: one partial vector
    (1, 70, 2, 1, 80, "steep"),     # hs = 80: a 64-channel chunk, then 16; blocks 64 + 6
    (1, 47, 3, 3, 100, None),       # hs = 100: 64, then 36 (a partial vector)
    (3, 9, 2, 2, 1, "alibi"),       # hs = 1
    (1, 130, 4, 2, 32, "steep"),    # blocks of 64, 64 and 2 rows
]


def probs(qkv, stats, slopes, NH, NKV):
    """The forward's probabilities, recomputed from its statistics."""
    B, _, T, _ = stats.shape
    att = np.full((B, NH, T, T), np.nan, np.float32)   # (written): must not be read
    K.attention_gqa_probs(att, qkv, stats, slopes, NH, NKV)
    return att


def tiled(qkv, slopes, NH, NKV):
    """The tiled forward: out, what its backward reads (stats), and att."""
    out, stats = gqa_forward(qkv, slopes, NH, NKV)
    return out, stats, probs(qkv, stats, slopes, NH, NKV)


def naive_forward(qkv, slopes, NH, NKV):
    B, T, width = qkv.shape
    hs = width // (NH + 2 * NKV)
    out = np.full((B, T, NH * hs), np.nan, np.float32)
    att = np.full((B, NH, T, T), np.nan, np.float32)
    K.attention_forward_naive(out, att, qkv, slopes, NH, NKV)
    return out, att


def naive_backward(dout, qkv, att, slopes, NH, NKV, calls=1):
    # the plain backward reads att, so it needs no slopes
    dinp = np.zeros_like(qkv)
    for _ in range(calls):
        K.attention_backward_naive(dinp, dout, qkv, att, NH, NKV)
    return dinp


def naive(qkv, slopes, NH, NKV):
    """The plain forward: out, what its backward reads (att), and att."""
    out, att = naive_forward(qkv, slopes, NH, NKV)
    return out, att, att


def check_gqa_against_reference(rng, forward, backward, B, T, NH, NKV, hs, slopes):
    qkv, dout, slopes = make_gqa_inputs(rng, B, T, NH, NKV, hs, slopes)
    out, saved, att = forward(qkv, slopes, NH, NKV)
    dinp = backward(dout, qkv, saved, slopes, NH, NKV)

    qkv_t = t64(qkv, grad=True)
    slopes_t = None if slopes is None else t64(slopes)
    ref_out, ref_att = ref_attention_gqa(qkv_t, NH, NKV, slopes_t)
    (ref_out * t64(dout)).sum().backward()

    tol = TOL["attention_gqa"]
    assert_close("out", out, ref_out, tol["fwd"])
    assert_close("att", att, ref_att, tol["fwd"])
    assert not np.triu(att, k=1).any(), "att is not exactly 0 above the diagonal"
    assert_close("dinp", dinp, qkv_t.grad, tol["bwd"])
    if forward is tiled:
        ref_stats = ref_attention_gqa_stats(t64(qkv), NH, NKV, slopes_t)
        assert_close("stats max", saved[..., 0], ref_stats[..., 0], tol["fwd"])
        assert_close("stats inv", saved[..., 1], ref_stats[..., 1], tol["fwd"])


def windowed(qkv, slopes, NH, NKV, window):
    """The tiled forward with a window: out, stats, and att from probs."""
    B, T, width = qkv.shape
    hs = width // (NH + 2 * NKV)
    out = np.full((B, T, NH * hs), np.nan, np.float32)
    stats = np.full((B, NH, T, 2), np.nan, np.float32)
    K.attention_gqa_forward(out, stats, qkv, slopes, NH, NKV, window)
    att = np.full((B, NH, T, T), np.nan, np.float32)
    K.attention_gqa_probs(att, qkv, stats, slopes, NH, NKV, window)
    return out, stats, att


def entropy(qkv, stats, slopes, NH, NKV):
    """Each query row's entropy, from the forward's statistics."""
    B, _, T, _ = stats.shape
    out = np.full((B, NH, T), np.nan, np.float32)   # (written): must not be read
    K.attention_gqa_entropy(out, qkv, stats, slopes, NH, NKV)
    return out
