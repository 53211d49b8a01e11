"""Text generation from a model: next-token sampling (temperature, top-k,
top-p, repetition penalty) and a plain generation loop that recomputes the
whole context for each token (kv_cache.py has the fast one).

Sampling is reproducible: a seeded numpy Generator draws one uniform number
per token, and the token is read off the cumulative distribution.
"""
import numpy as np

from ..errors import ShapeError


def sample_next(logits, rng, temperature=1.0, top_k=None, top_p=None, *,
                repetition_penalty=None, seen=()):
    """One token id from a row of logits over the real vocabulary.

    temperature 0 is greedy (argmax); top_k keeps the k likeliest tokens;
    top_p keeps the smallest set of likeliest tokens whose probability
    reaches p; repetition_penalty > 1 makes the tokens in ``seen`` less
    likely (CTRL's rule: a positive logit is divided by it, a negative one
    multiplied). ``rng`` is a numpy Generator and is used once per call, also
    when greedy, so a run's random stream does not depend on the settings.
    """
    u = rng.random()
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    z = np.asarray(logits, dtype=np.float64)
    if repetition_penalty is not None and repetition_penalty != 1.0 and len(seen):
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
        ids = np.unique(np.asarray(seen, dtype=np.int64))
        z = z.copy()
        z[ids] = np.where(z[ids] > 0, z[ids] / repetition_penalty, z[ids] * repetition_penalty)
    if temperature == 0:
        return int(np.argmax(z))
    z = z / temperature
    if top_k is not None and 0 < top_k < z.size:
        kth = np.partition(z, z.size - top_k)[z.size - top_k]
        z = np.where(z >= kth, z, -np.inf)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p is not None and 0 < top_p < 1:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        cut = int(np.searchsorted(cumulative, top_p)) + 1   # tokens kept
        kept = np.zeros_like(probs)
        kept[order[:cut]] = probs[order[:cut]]
        probs = kept / kept.sum()
    index = int(np.searchsorted(np.cumsum(probs), u * probs.sum(), side="right"))
    return min(index, probs.size - 1)


def generate(model, prompt, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None,
             rng=None, seed=None, eot=None):
    """Yields up to ``max_new_tokens`` new token ids after ``prompt`` (a list
    of ids), stopping after ``eot`` if given. Each step runs the model on the
    last max_seq_len tokens of the context."""
    if len(prompt) == 0:
        raise ShapeError("generation needs a prompt of at least one token")
    if rng is None:
        rng = np.random.default_rng(seed)
    c = model.config
    context = [int(t) for t in prompt]
    model.reserve(1, min(len(context) + max_new_tokens, c.max_seq_len), keep_activations=False)
    for _ in range(max_new_tokens):
        window = np.array([context[-c.max_seq_len:]], dtype=np.int32)
        model.forward(window, keep_activations=False)
        token = sample_next(model.logits[0, -1, :c.vocab_size], rng, temperature, top_k, top_p)
        context.append(token)
        yield token
        if eot is not None and token == eot:
            return
