"""How far the token representations of each layer are from collapse."""
import numpy as np

from .probe import last_forward_acts

MEASURES = ("residual_ratio", "mean_cosine", "effective_rank")


def hidden_states(model, tokens=None, targets=None):
    """The residual stream (L + 1, B, T, C) float32 views: the embedding's
    output, then each block's."""
    a = last_forward_acts(model, tokens, targets)
    return [a.encoded] + [model.layer_output(a, l) for l in range(model.config.L)]


def sequence_measures(H):
    """(residual ratio, mean pairwise cosine, effective rank), each float64
    (B,), of the token vectors of each sequence H[b] (T, C):
      residual ratio  ||X - 1 mean(X)||_F / ||X||_F: 0 when every token is
                      the same vector (rank one, Dong et al. 2021)
      mean cosine     the mean of cos(x_i, x_j) over pairs i != j (Noci et
                      al. 2022): 1 when all point one way; NaN for T = 1
      effective rank  exp of the entropy of the singular values divided by
                      their sum (Roy and Vetterli 2007): from 1 to min(T, C)
    The singular values are the square roots of the eigenvalues of the
    smaller Gram matrix, X X^T or X^T X (one batched call, far quicker than
    an SVD per sequence)."""
    X = np.asarray(H, dtype=np.float64)
    B, T, C = X.shape
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (np.linalg.norm((X - X.mean(axis=1, keepdims=True)).reshape(B, -1), axis=1)
                 / np.linalg.norm(X.reshape(B, -1), axis=1))
        lengths = np.linalg.norm(X, axis=2, keepdims=True)
        unit = np.divide(X, lengths, out=np.zeros_like(X), where=lengths > 0)
        total = unit.sum(axis=1)
        # the sum of u_i . u_j over all pairs is |sum u|^2; the diagonal adds
        # one per non-zero token
        pairs = (total * total).sum(axis=1) - np.count_nonzero(lengths[..., 0], axis=1)
        cosine = pairs / (T * (T - 1)) if T > 1 else np.full(B, np.nan)
        gram = X @ X.transpose(0, 2, 1) if T <= C else X.transpose(0, 2, 1) @ X
        s = np.sqrt(np.clip(np.linalg.eigvalsh(gram), 0.0, None))
        p = s / s.sum(axis=1, keepdims=True)
        erank = np.exp(-np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(axis=1))
    return ratio, cosine, erank


def representation_stats(model, tokens=None, targets=None):
    """{measure: float64 (L + 1,)} for measure in MEASURES, each the mean
    over the batch's sequences of sequence_measures of the residual stream
    after the embedding (index 0) and after each block (index l + 1). Runs
    the forward on ``tokens`` (B, T) first, or reads the model's last
    forward's when tokens is None."""
    layers = hidden_states(model, tokens, targets)
    out = {name: np.empty(len(layers)) for name in MEASURES}
    for i, H in enumerate(layers):
        for name, values in zip(MEASURES, sequence_measures(H)):
            out[name][i] = values.mean()
    return out
