"""Generation with a KV cache, for GPT2 and the Llama family.

A prefill runs the prompts (of any lengths, right-padded into one batch)
through the ordinary forward, keeping one layer's activations at a time
(model.prefill), and copies each layer's keys and values into the cache as
its attention has read them; then each new token runs the block on one position per row,
writes its key and value into the cache slot at that row's position
(kv_cache_write, which also turns q and k by RoPE, reading the cos and sin
of its position from a table made once per decoder: rope_table), and
attends over the row's cached positions (attention_decode). Nothing is
allocated per token: the cache, the RoPE table and the one-position
activations are made once per generation.

The cache is one contiguous float32 buffer, ``k`` then ``v``, each
[L, B, slots, NKV * hs]: a grouped-query model caches only its NKV heads.
Keys are cached as attention reads them: after qk_norm and RoPE (rotated at
their own position). The slots are a ring: position p lives in slot
p % slots. A model with a sliding window of W positions needs only the last
W, so its cache has min(max_len, W) slots and rolls over the oldest (memory
O(W), not O(max_len)); for other models slots = max_len and nothing rolls.
"""
import numpy as np

from .._native import kernels as K
from .._native.lib import record_calls, replay
from ..errors import ShapeError
from .layout import aligned_zeros, forward_only_acts
from .sampling import sample_next


def cache_slots(config, max_len):
    """The positions a cache for up to ``max_len`` positions holds at once:
    max_len, or a sliding window's W if that is fewer."""
    window = config.sliding_window
    return min(max_len, window) if window else max_len


def kv_cache_floats(config, batch_size, max_len):
    """Floats a KV cache for up to ``max_len`` positions holds: per slot of
    each row (cache_slots), every layer's key and value (2 * L * NKV * hs)."""
    return 2 * config.num_layers * batch_size * cache_slots(config, max_len) * config.kv_dim


class KVCache:
    """Keys and values of every layer for ``batch_size`` rows of up to
    ``max_len`` positions, in ``slots`` slots per row (a ring, see the
    module); ``lengths[b]`` positions of row b have been written."""

    def __init__(self, config, batch_size, max_len):
        L, kv_dim = config.num_layers, config.kv_dim
        if batch_size < 1 or max_len < 1:
            raise ShapeError(f"a KV cache needs batch_size, max_len >= 1, got {batch_size}, "
                             f"{max_len}")
        self.slots = cache_slots(config, max_len)
        shape = (L, batch_size, self.slots, kv_dim)
        count = kv_cache_floats(config, batch_size, max_len) // 2
        self.memory = aligned_zeros(2 * count, what=f"a KV cache for batch {batch_size} of "
                                                    f"{self.slots} positions")
        self.k = self.memory[:count].reshape(shape)
        self.v = self.memory[count:].reshape(shape)
        self.lengths = np.zeros(batch_size, dtype=np.int32)
        self.batch_size, self.max_len = batch_size, max_len

    @property
    def nbytes(self):
        return self.memory.nbytes


class Decoder:
    """Incremental decoding for one model: ``prefill(prompts)`` then
    ``step(tokens)`` per position; both return the (B, V) logits of each
    row's newest position. What it uses of the model is its decoding
    interface (model.transformer.Transformer): config, params, embed, slopes,
    rope_inv_freq, token_ids, normed_qkv, block_forward and head_forward, and
    prefill."""

    def __init__(self, model, batch_size, max_len):
        c = model.config
        if c.learned_positions and max_len > c.max_seq_len:
            raise ShapeError(f"generating up to {max_len} positions exceeds the model's "
                             f"max_seq_len={c.max_seq_len} (its learned position table has "
                             f"{c.max_seq_len} rows); RoPE, ALiBi and sinusoidal models can go "
                             f"further")
        self.model = model
        self.cache = KVCache(c, batch_size, max_len)
        # one position per row, of one layer at a time
        self.acts = forward_only_acts(c, batch_size, 1, dtypes=model.act_dtypes)
        self.q = aligned_zeros(batch_size * c.attn_channels).reshape(batch_size,
                                                                      c.attn_channels)
        slots = self.cache.slots
        self.att = aligned_zeros(batch_size * c.num_heads * slots).reshape(
            batch_size, c.num_heads, slots)   # attention_decode's scores
        self.rows = np.arange(batch_size)
        # a step's positions and lengths per row, in place: the layers' calls read them
        self.pos = np.zeros(batch_size, np.int32)
        self.lengths = np.zeros(batch_size, np.int32)
        # the layers' and the head's kernel calls, recorded at the first step
        # and replayed after (_layers); None: not yet recorded, or a model
        # whose step is more than kernel calls on fixed memory: adapters
        # (numpy temporaries), MoE layers (the routing's grouping in numpy)
        self.calls = None
        # RoPE's cos and sin at every position the cache can hold, made once
        # (rope_forward's floats): a step reads its positions' rows
        self.rope_cos = self.rope_sin = None
        if c.position == "rope":
            self.rope_cos = np.empty((max_len, c.head_size // 2), np.float32)
            self.rope_sin = np.empty_like(self.rope_cos)
            K.rope_table(self.rope_cos, self.rope_sin, c.rope_theta, model.rope_inv_freq)

    def prefill(self, prompts):
        """Fills the cache from ``prompts`` (B lists of token ids, lengths
        1..max_len); returns the logits after each prompt's last token."""
        c, cache = self.model.config, self.cache
        lengths = np.array([len(p) for p in prompts], dtype=np.int32)
        if len(prompts) != cache.batch_size:
            raise ShapeError(f"{len(prompts)} prompts for a decoder of batch "
                             f"{cache.batch_size}")
        if lengths.min() < 1 or lengths.max() > cache.max_len:
            raise ShapeError(f"prompt lengths must be in [1, {cache.max_len}], got "
                             f"{lengths.tolist()}")
        tokens = np.zeros((len(prompts), lengths.max()), dtype=np.int64)
        for b, prompt in enumerate(prompts):
            tokens[b, :lengths[b]] = prompt   # right padding: causal rows never see it
        C, kv = c.attn_channels, c.kv_dim

        def keep(l, qkv):   # keys after qk_norm and RoPE
            for b, n in enumerate(lengths):
                kept = np.arange(max(0, n - cache.slots), n)   # the positions the ring holds
                cache.k[l, b, kept % cache.slots] = qkv[b, kept, C:C + kv]
                cache.v[l, b, kept % cache.slots] = qkv[b, kept, C + kv:]

        model = self.model
        model.prefill(tokens, keep)
        cache.lengths[:] = lengths
        return model.logits[self.rows, lengths - 1, :c.vocab_size]

    def step(self, tokens):
        """Runs one new token per row (int array (B,)) at each row's next
        position; returns the (B, V) logits (a view, valid until the next step).
        After the first step, the layers' and the head's kernels are called
        again as that step called them (the wrappers' Python and checks
        skipped: _layers), so the weights are the model's at the first step."""
        with self.model.exclusive("generate"):
            return self._step(tokens)

    def _step(self, tokens):
        model, cache, a = self.model, self.cache, self.acts
        c = model.config
        pos = self.pos   # the new token's position in each row
        if cache.lengths.max() >= cache.max_len:
            raise ShapeError(f"the KV cache holds {cache.max_len} positions and is full")
        tokens = model.token_ids(np.asarray(tokens).reshape(-1, 1))[:, 0]
        pos[:] = cache.lengths
        self.lengths[:] = pos + 1

        model.embed(a.encoded, tokens[:, None], pos)
        if c.position == "sinusoidal":
            K.sinusoidal_forward(a.encoded, a.encoded, pos)
        if self.calls is not None:
            replay(self.calls)
        elif model.lora is None and not c.num_experts:
            with record_calls() as self.calls:
                self._layers()
        else:
            self._layers()
        cache.lengths[:] = self.lengths
        return a.logits[:, 0, :c.vocab_size]

    def _layers(self):
        """Every layer and the head on the embedded a.encoded, one position
        per row (self.pos): kernel calls on memory made once per decoder,
        with the same arguments at every step, which is what lets a step
        replay the first's (_step)."""
        model, cache, a = self.model, self.cache, self.acts
        c = model.config

        def attend(l):
            # q, and k, v into slot pos % slots (over the oldest position a
            # sliding window has left), each rotated at its position by RoPE
            K.kv_cache_write(self.q, cache.k[l], cache.v[l], model.normed_qkv(a, l)[:, 0],
                             self.pos, self.rope_cos, self.rope_sin, c.NH, c.NKV,
                             c.rope_interleaved)
            K.attention_decode(a.atty[l][:, 0], self.att, self.q, cache.k[l], cache.v[l],
                               self.lengths, model.slopes, c.NH, c.NKV, c.sliding_window)

        residual = a.encoded
        for l in range(c.num_layers):
            residual = model.block_forward(a, l, residual, attend)
        model.head_forward(a, residual)


def stream(model, prompts, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None,
           repetition_penalty=None, seed=None, rng=None, stop_token=None):
    """Yields, per generated position, an int array (B,) of the new token of
    each prompt's row, -1 for rows already stopped (at ``stop_token``, which
    is yielded once). ``prompts`` are B lists of token ids of any lengths."""
    prompts = [[int(t) for t in prompt] for prompt in prompts]
    if not prompts or min(len(prompt) for prompt in prompts) == 0:
        raise ShapeError("generation needs at least one prompt, each of at least one token")
    if max_new_tokens < 1:
        return
    if rng is None:
        rng = np.random.default_rng(seed)
    B = len(prompts)
    longest = max(len(prompt) for prompt in prompts)
    decoder = Decoder(model, B, longest + max_new_tokens - 1)
    logits = decoder.prefill(prompts)
    seen = [list(prompt) for prompt in prompts]   # for the repetition penalty
    running = np.ones(B, dtype=bool)
    for i in range(max_new_tokens):
        new = np.full(B, -1, dtype=np.int64)
        for b in np.flatnonzero(running):
            new[b] = sample_next(logits[b], rng, temperature, top_k, top_p,
                                 repetition_penalty=repetition_penalty, seen=seen[b])
            seen[b].append(int(new[b]))
        yield new
        if stop_token is not None:
            running &= new != stop_token
        if not running.any() or i == max_new_tokens - 1:
            return
        # stopped rows run on with a dummy token (their outputs are dropped)
        logits = decoder.step(np.where(running, new, 0))


def generate(model, prompt_tokens, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None,
             repetition_penalty=None, seed=None, stop_token=None):
    """The new token ids after ``prompt_tokens``: a list of ids gives a list;
    a list of lists (a batch, lengths may differ) gives a list of lists. Each
    row stops after ``stop_token`` (kept) or ``max_new_tokens``."""
    batched = len(prompt_tokens) > 0 and not np.isscalar(prompt_tokens[0])
    prompts = prompt_tokens if batched else [prompt_tokens]
    out = [[] for _ in prompts]
    for new in stream(model, prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                      top_p=top_p, repetition_penalty=repetition_penalty, seed=seed,
                      stop_token=stop_token):
        for b, token in enumerate(new):
            if token >= 0:
                out[b].append(int(token))
    return out if batched else out[0]
