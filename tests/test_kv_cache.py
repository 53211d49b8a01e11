"""KV-cache generation (kv_cache.py) against full recomputation: the same
logits at every step, for GPT-2, RoPE, ALiBi, GQA, MQA and Qwen3-style
(qk_norm, head size apart from C / NH) models and models with experts (each
decoded row routed as in the full forward), batched prompts of unequal
lengths included; greedy decoding equals the argmax chain of full
forwards; seeds reproduce.

No tolerance: the cached logits of a position equal those of a full forward
over the whole sequence bitwise, on every instruction set of the matmul (the
two paths run the same arithmetic per element)."""
import dataclasses

import numpy as np
import pytest

from helpers import FP32_ISAS
from llmc_py import GPT2, GPT2Config, Llama, LlamaConfig
from llmc_py.errors import ShapeError
from llmc_py.model.kv_cache import Decoder, KVCache, generate
from llmc_py.model.sampling import sample_next

GPT2_SMALL = GPT2Config(max_seq_len=48, vocab_size=67, padded_vocab_size=128, num_layers=2,
                        num_heads=4, channels=60)
LLAMA = LlamaConfig(max_seq_len=24, vocab_size=67, padded_vocab_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, channels=64)
MODELS = {
    "gpt2": lambda: GPT2(GPT2_SMALL, seed=1),
    "llama-rope-gqa": lambda: Llama(LLAMA, seed=2),
    "rope-mqa-untied": lambda: Llama(dataclasses.replace(LLAMA, num_kv_heads=1,
                                                         tied_embeddings=False), seed=3),
    "alibi-gqa": lambda: Llama(dataclasses.replace(LLAMA, position="alibi", norm="layernorm",
                                                   mlp="gelu", bias=True, num_heads=6,
                                                   num_kv_heads=2, channels=90), seed=4),
    "learned-mha": lambda: Llama(dataclasses.replace(LLAMA, position="learned",
                                                     num_kv_heads=4, max_seq_len=48), seed=5),
    # Qwen3-style: q and k heads RMS-normed before RoPE, NH hs = 96 != C
    "qwen3-qknorm": lambda: Llama(dataclasses.replace(LLAMA, qk_norm=True, head_dim=24,
                                                      rope_theta=1e6), seed=6),
    # Llama 3.1's scaled RoPE (rotated at each position with its own frequencies)
    "rope-llama3": lambda: Llama(dataclasses.replace(
        LLAMA, rope_scaling="llama3", rope_factor=8.0, rope_original_max=8), seed=7),
    # the other MLPs
    "geglu": lambda: Llama(dataclasses.replace(LLAMA, mlp="geglu"), seed=7),
    "reglu-alibi": lambda: Llama(dataclasses.replace(LLAMA, mlp="reglu", position="alibi"),
                                 seed=8),
    "relu-learned": lambda: Llama(dataclasses.replace(LLAMA, mlp="relu", position="learned",
                                                      max_seq_len=48), seed=9),
    "gelu_erf": lambda: Llama(dataclasses.replace(LLAMA, mlp="gelu_erf"), seed=10),
    # the norms' places
    "post-norm": lambda: Llama(dataclasses.replace(LLAMA, block="post"), seed=11),
    "parallel-layernorm": lambda: Llama(dataclasses.replace(LLAMA, block="parallel",
                                                            norm="layernorm", bias=True),
                                        seed=12),
    "sinusoidal": lambda: Llama(dataclasses.replace(LLAMA, position="sinusoidal"), seed=13),
    "rope-interleaved": lambda: Llama(dataclasses.replace(LLAMA, rope_interleaved=True),
                                      seed=17),
    # a sliding window: a rolling cache of W slots (prompts of 7 and 12 overflow 5)
    "sliding-window": lambda: Llama(dataclasses.replace(LLAMA, sliding_window=5), seed=14),
    "sliding-window-alibi-mqa": lambda: Llama(dataclasses.replace(
        LLAMA, sliding_window=8, position="alibi", num_kv_heads=1), seed=15),
    # experts: every layer's MLP, and every second one's in a post-norm block
    "moe-e8-k2": lambda: Llama(dataclasses.replace(LLAMA, num_experts=8, experts_per_token=2,
                                                   expert_hidden=24), seed=18),
    "moe-every2-post-top1": lambda: Llama(dataclasses.replace(
        LLAMA, block="post", num_experts=3, experts_per_token=1, expert_hidden=16, moe_every=2,
        norm_topk_prob=False), seed=19),
}


def full_logits(model, tokens):
    """Logits (T, V) of every position of one sequence, by a full forward."""
    model.forward(np.array([tokens]))
    return model.logits[0, :, :model.config.vocab_size].copy()


def assert_logits_equal(ours, ref, what):
    """Bitwise: a decoded position runs the same arithmetic as that position
    of a full forward (the skinny matmul sums each element in the GEMM's
    order, attention_decode uses the forward's row code, and the rest is
    row by row)."""
    err = float(np.abs(ours - ref).max())
    assert np.array_equal(ours, ref), f"{what}: max difference {err:.3g}"


@pytest.mark.parametrize("isa", FP32_ISAS)
@pytest.mark.parametrize("name", MODELS)
def test_cached_logits_equal_full_recompute_bitwise_at_every_step(use_isa, name, isa):
    use_isa(isa)
    model = MODELS[name]()
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    lengths = [7, 1, 12]                      # unequal prompts in one batch
    sequences = [list(rng.integers(0, V, size=n + 30)) for n in lengths]   # prompt + 30
    decoder = Decoder(model, len(lengths), max(lengths) + 30)
    logits = decoder.prefill([seq[:n] for seq, n in zip(sequences, lengths)]).copy()
    references = [full_logits(model, seq) for seq in sequences]
    for b, n in enumerate(lengths):
        assert_logits_equal(logits[b], references[b][n - 1], f"{name} prefill row {b}")
    for step in range(30):
        tokens = [seq[n + step] for seq, n in zip(sequences, lengths)]
        logits = decoder.step(np.array(tokens))
        for b, n in enumerate(lengths):
            assert_logits_equal(logits[b], references[b][n + step], f"{name} step {step} row {b}")
    assert decoder.cache.lengths.tolist() == [n + 30 for n in lengths]
    # steps after the first replayed its kernel calls, but for experts (routed in numpy)
    assert (decoder.calls is None) == bool(model.config.num_experts)


def test_steps_after_the_first_replay_its_kernel_calls(monkeypatch):
    """The layers' and the head's kernels are called again as the first step
    called them, without the model's Python; the token, its position and
    each row's length still change (the embedding runs every step)."""
    model = MODELS["qwen3-qknorm"]()
    prompts = [[5, 6, 7], [8]]
    want = Decoder(model, 2, 10)
    got = Decoder(model, 2, 10)
    steps = [np.array([1, 2]), np.array([3, 4]), np.array([9, 9])]
    expected = [want.prefill(prompts).copy()]
    for tokens in steps:
        want.calls = None   # each step through the model's Python
        expected.append(want.step(tokens).copy())
    logits = [got.prefill(prompts).copy(), got.step(steps[0]).copy()]
    assert got.calls   # recorded
    monkeypatch.setattr(model, "block_forward", None)
    monkeypatch.setattr(model, "head_forward", None)
    logits += [got.step(tokens).copy() for tokens in steps[1:]]
    for i, (ours, ref) in enumerate(zip(logits, expected)):
        assert_logits_equal(ours, ref, f"step {i}")
    assert got.cache.lengths.tolist() == [6, 4]


def test_replay_raises_a_failed_calls_error_by_its_kernel_name():
    """replay checks each status as the wrappers do (only a failure reaches
    check): a NULL pointer is the NullPointerError naming the kernel."""
    from llmc_py._native.lib import ffi, lib, replay
    from llmc_py.errors import NullPointerError
    x = np.ones(4, np.float32)
    good = (lib.residual_forward, (ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", x),
                                   ffi.from_buffer("float[]", x), 4))
    replay([good])
    assert x.tolist() == [2.0] * 4
    with pytest.raises(NullPointerError, match="residual_forward"):
        replay([good, (lib.residual_forward, (ffi.NULL, ffi.NULL, ffi.NULL, 4))])
    assert x.tolist() == [4.0] * 4   # the calls before it ran


@pytest.mark.parametrize("name", ["gpt2", "llama-rope-gqa", "alibi-gqa"])
def test_greedy_is_the_argmax_chain_of_full_forwards(name):
    model = MODELS[name]()
    prompt = [3, 1, 4, 1, 5]
    tokens = model.generate(prompt, 20, temperature=0)
    context = list(prompt)
    for token in tokens:
        assert token == int(np.argmax(full_logits(model, context)[-1]))
        context.append(token)
    assert len(tokens) == 20


def test_batched_generation_matches_one_prompt_at_a_time():
    model = MODELS["llama-rope-gqa"]()
    prompts = [[1, 2, 3], [9], [4, 4, 4, 4, 4, 4]]
    batch = model.generate(prompts, 10, temperature=0)
    assert batch == [model.generate(p, 10, temperature=0) for p in prompts]


def test_same_seed_same_tokens():
    model = MODELS["llama-rope-gqa"]()
    settings = dict(temperature=1.0, top_k=20, top_p=0.9)
    a = model.generate([1, 2], 15, seed=7, **settings)
    b = model.generate([1, 2], 15, seed=7, **settings)
    c = model.generate([1, 2], 15, seed=8, **settings)
    assert a == b and a != c


def test_stop_token_ends_a_row():
    model = MODELS["gpt2"]()
    greedy = model.generate([5, 6], 12, temperature=0)
    stop = greedy[3]
    first = greedy.index(stop)
    out = model.generate([[5, 6], [5, 6]], 12, temperature=0, stop_token=stop)
    assert out == [greedy[:first + 1]] * 2


def test_learned_positions_refuse_to_go_past_max_seq_len():
    model = MODELS["gpt2"]()            # max_seq_len 48
    assert len(model.generate([1] * 40, 9, temperature=0)) == 9   # 40 + 9 - 1 = 48 positions
    with pytest.raises(ShapeError, match="exceeds the model's max_seq_len=48"):
        model.generate([1] * 40, 10, temperature=0)


@pytest.mark.parametrize("name", ["llama-rope-gqa", "alibi-gqa", "sinusoidal", "sliding-window"])
def test_rope_alibi_and_sinusoidal_generate_past_max_seq_len(name):
    model = MODELS[name]()
    prompt = [2, 7, 1, 8]
    max_seq_len = model.config.max_seq_len
    tokens = model.generate(prompt, 2 * max_seq_len, temperature=0)
    sequence = prompt + tokens
    ref = full_logits(model, sequence[:-1])     # a full forward past max_seq_len too
    for i, token in enumerate(tokens):
        assert token == int(np.argmax(ref[len(prompt) - 1 + i]))


def test_cache_is_sized_from_its_shape():
    config = LLAMA   # 2 layers, 2 kv heads of 16
    cache = KVCache(config, batch_size=3, max_len=50)
    assert cache.k.shape == cache.v.shape == (2, 3, 50, 32)
    assert cache.nbytes == 2 * 2 * 3 * 50 * 32 * 4
    assert np.shares_memory(cache.k, cache.memory) and np.shares_memory(cache.v, cache.memory)
    assert KVCache(GPT2_SMALL, 2, 10).k.shape == (2, 2, 10, 60)   # GPT-2: every head cached


def test_sliding_window_cache_holds_the_window_only():
    """A window of W positions needs W slots, whatever the length generated:
    position p is written to slot p % W over the oldest."""
    config = dataclasses.replace(LLAMA, sliding_window=6)
    assert KVCache(config, 2, 100).k.shape == (2, 2, 6, 32)
    assert KVCache(config, 2, 4).k.shape == (2, 2, 4, 32)   # shorter than the window
    model = Llama(config, seed=16)
    decoder = Decoder(model, 1, 100)
    decoder.prefill([list(range(1, 10))])    # 9 positions: 3 .. 8 kept, in slots 3, 4, 5, 0, 1, 2
    model.forward(np.array([list(range(1, 10))]))
    qkv = model.acts.qkvr[:, 0]
    C, kv = config.attn_channels, config.kv_dim
    for p in range(3, 9):
        assert np.array_equal(decoder.cache.k[:, 0, p % 6], qkv[:, p, C:C + kv])
    assert decoder.att.shape == (1, 4, 6)


def test_decoder_rejects_bad_prompts_and_a_full_cache():
    model = MODELS["llama-rope-gqa"]()
    decoder = Decoder(model, 2, 5)
    with pytest.raises(ShapeError, match="1 prompts for a decoder of batch 2"):
        Decoder(model, 2, 5).prefill([[1]])
    with pytest.raises(ShapeError, match=r"prompt lengths must be in \[1, 5\]"):
        decoder.prefill([[1], []])
    decoder.prefill([[1, 2, 3, 4], [1]])
    decoder.step(np.array([1, 1]))
    with pytest.raises(ShapeError, match="full"):
        decoder.step(np.array([1, 1]))
    with pytest.raises(ShapeError, match="at least one token"):
        generate(model, [[]], 3)


def test_repetition_penalty_lowers_seen_tokens():
    rng = np.random.default_rng(0)
    positive = np.array([1.0, 0.9, 0.1])
    assert sample_next(positive, rng, 0) == 0
    assert sample_next(positive, rng, 0, repetition_penalty=1.2, seen=[0]) == 1   # 1/1.2 < 0.9
    negative = np.array([-1.0, -1.1, -5.0])
    assert sample_next(negative, rng, 0, repetition_penalty=1.2, seen=[0, 0]) == 1   # -1.2
    assert sample_next(negative, rng, 0, repetition_penalty=1.0, seen=[0]) == 0
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        sample_next(negative, rng, 1.0, repetition_penalty=-1.0, seen=[0])
