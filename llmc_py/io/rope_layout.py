"""RoPE's two pair layouts, and the permutation between them.

Meta's original Llama code (and llama2.c) rotates interleaved pairs: channel
2i of a head with channel 2i + 1, by the angle p * theta^(-2i/hs). Hugging
Face's Llama, and our kernels, rotate half-split pairs: channel i with
channel i + hs/2, by the same angle. The two are one model once the rows of
each q and k head's projection are reordered: row 2i of a head becomes row
i and row 2i + 1 becomes row i + hs/2. Attention only sees q . k, and
permuting q and k alike leaves every dot product unchanged, so the logits
are identical. This is what Hugging Face's Llama converter does to Meta's
checkpoints; v heads, and everything else, stay as they are.
"""
import numpy as np


def half_split_order(hs):
    """Row i of a half-split head is row half_split_order(hs)[i] of the
    interleaved one: 0, 2, 4, ..., then 1, 3, 5, ..."""
    if hs % 2:
        raise ValueError(f"RoPE needs an even head size, got {hs}")
    return np.concatenate([np.arange(0, hs, 2), np.arange(1, hs, 2)])


def interleaved_to_half_split(rows, heads, hs):
    """The rows (a weight [heads * hs, in] or a bias [heads * hs]) of q or k
    heads of an interleaved-RoPE model, reordered for half-split RoPE."""
    rows = np.asarray(rows)
    per_head = rows.reshape((heads, hs) + rows.shape[1:])
    return per_head[:, half_split_order(hs)].reshape(rows.shape)


def half_split_to_interleaved(rows, heads, hs):
    """The inverse of interleaved_to_half_split."""
    rows = np.asarray(rows)
    per_head = rows.reshape((heads, hs) + rows.shape[1:])
    return per_head[:, np.argsort(half_split_order(hs))].reshape(rows.shape)
