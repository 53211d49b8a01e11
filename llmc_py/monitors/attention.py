"""Attention entropy per layer and head, from the attention kernel itself."""
import numpy as np

from .._native import kernels as K
from .probe import last_forward_acts


def attention_entropy_rows(model, tokens=None, targets=None):
    """float32 (L, B, NH, T): the entropy -sum_t2 p ln p (natural log) of every
    query row of every head's causal attention, by attention_gqa_entropy from
    the forward's packed q, k, v (after RoPE) and its saved row statistics."""
    a = last_forward_acts(model, tokens, targets)
    c = model.config
    B, T = model.B, model.T
    rows = np.empty((c.L, B, c.NH, T), np.float32)
    for l in range(c.L):
        # the model's own choice of what attention read (e.g. qkv after RoPE)
        K.attention_gqa_entropy(rows[l], model._attention_input(a, l), a.att_stats[l],
                                model.slopes, c.NH, c.NKV, c.sliding_window)
    return rows


def mean_entropy(rows, normalized=False, window=0):
    """(L, NH) float64 means over batch rows and query positions of
    attention_entropy_rows' ``rows``. ``normalized`` divides each row's
    entropy by its largest possible, the log of its number of keys (t + 1,
    at most a sliding ``window``), first (1: uniform over the row's keys, 0:
    one key), leaving out row 0 (one key; NaN when T = 1)."""
    if not normalized:
        return rows.mean(axis=(1, 3), dtype=np.float64)
    T = rows.shape[-1]
    if T < 2 or window == 1:
        return np.full(rows.shape[:1] + rows.shape[2:3], np.nan)
    keys = np.arange(2, T + 1, dtype=np.float64)
    if window:
        keys = np.minimum(keys, window)
    scaled = rows[..., 1:] / np.log(keys)
    return scaled.mean(axis=(1, 3))


def attention_entropy(model, tokens=None, targets=None, *, normalized=False):
    """float64 (L, NH): for each layer and head, the mean over batch rows and
    query positions of the entropy of its causal attention probabilities
    (natural log). ``normalized``: each row's entropy divided by ln(t + 1)
    first (see mean_entropy). Runs the forward on ``tokens`` (B, T) first,
    or reads the model's last forward's when tokens is None."""
    return mean_entropy(attention_entropy_rows(model, tokens, targets), normalized,
                        model.config.sliding_window)
