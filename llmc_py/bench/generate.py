"""Greedy generation: ours with the KV cache, without it (a full forward per
token) and PyTorch with a KV cache of its own; and (--weights) our decoding
with each weight type beside the bandwidth limit."""
import dataclasses
import statistics
import time

import numpy as np

from .._native.kernels import QUANT_TYPES
from .._native.lib import get_num_threads
from ..config import GPT2Config, LlamaConfig, padded_vocab
from ..generate import Decoder, KVCache
from ..model import GPT2
from ..model.layout import aligned_zeros
from ..model.presets import preset_for
from ..model.quantized import QUANTIZED_EXPERTS
from ..model.transformer import QUANTIZED_LINEARS
from .pytorch import torch_job
from .timing import timed


def bench_generate(config, B, prompt_len, new_tokens, repeats, rng, with_torch,
                   precision="fp32"):
    """Tokens/s of greedy generation, B rows of ``new_tokens`` after a prompt,
    in ``precision``; in bf16 our fp32 model too."""
    model = GPT2(config, seed=0, precision=precision)
    prompts = rng.integers(0, config.vocab_size, size=(B, prompt_len))
    V = config.vocab_size
    outputs = {}
    rows = {"cache_mib": KVCache(config, B, prompt_len + new_tokens).nbytes / 2**20,
            "model_mib": model.params.memory.nbytes / 2**20}

    def cached():
        outputs["cached"] = model.generate(prompts.tolist(), new_tokens, temperature=0)

    def recompute():
        context = prompts
        for _ in range(new_tokens):
            model.forward(context)
            new = np.argmax(model.logits[:, -1, :V], axis=1)
            context = np.concatenate([context, new[:, None]], axis=1)
        outputs["recompute"] = context[:, prompt_len:].tolist()

    rows["cached"] = timed(cached, repeats, warmup=0)
    rows["no_cache"] = timed(recompute, 1, warmup=0)
    # verified as well as timed (a near-tie could legitimately flip a token)
    rows["no_cache_agrees"] = outputs["cached"] == outputs["recompute"]
    if precision == "bf16":
        fp32 = GPT2(config, seed=0)
        rows["cached_fp32"] = timed(lambda: fp32.generate(prompts.tolist(), new_tokens,
                                                          temperature=0), repeats, warmup=0)
    if with_torch:
        result = torch_job("generate", layers=config.num_layers, prompts=prompts.tolist(),
                           new_tokens=new_tokens, repeats=repeats, dtype=precision)
        if result is not None:
            rows["torch_kv_cache"] = result
            # ties can break differently over long greedy runs: report it
            rows["torch_agrees"] = result["tokens"] == outputs["cached"]
    return rows


def measure_generation(args, rng):
    """bench_generate at batch 1 and 4 with GPT-2 of --layers, --gen's
    prompt and new tokens."""
    config = GPT2Config(num_layers=args.layers)
    prompt_len, new_tokens = args.gen
    results = {"threads": get_num_threads(), "prompt": prompt_len, "new_tokens": new_tokens,
               "generate": {}}
    for B in (1, 4):
        results["generate"][B] = bench_generate(config, B, prompt_len, new_tokens,
                                                args.repeats, rng, not args.skip_torch,
                                                args.precision)
    return results


# ---- --generate --weights: decoding with each weight type -----------------

WEIGHT_TYPES = ("fp32", "bf16") + tuple(QUANT_TYPES)
WEIGHTS_BATCHES = (1, 8)
# Qwen3-0.6B's shape (hub config.json), random weights
QWEN3_06B = LlamaConfig(max_seq_len=40960, vocab_size=151936,
                        padded_vocab_size=padded_vocab(151936), num_layers=28, num_heads=16,
                        num_kv_heads=8, channels=1024, head_dim=128, ffn_hidden=3072,
                        qk_norm=True, tied_embeddings=True, rope_theta=1e6, norm_eps=1e-6)
# --moe: Qwen3-30B-A3B's top-8 experts, each 3/8 of the width wide (768 of
# 2048), at Qwen3-0.6B's width and attention, 32 experts, 8 layers (524M
# parameters, random weights)
QWEN3_MOE_SHAPE = dataclasses.replace(QWEN3_06B, num_layers=8, num_experts=32,
                                      experts_per_token=8, expert_hidden=384)
BANDWIDTH_BYTES = 2**30   # the streaming read's buffer: far past any cache


def decoding_models(layers):
    """{name: config} of the --weights table: GPT-2 of ``layers`` layers
    (124M at 12) and Qwen3-0.6B's shape."""
    return {f"GPT-2 {layers} layers": GPT2Config(num_layers=layers),
            "Qwen3-0.6B shape": QWEN3_06B}


def decoding_moe_models():
    """{name: config} of the --weights table with --moe."""
    return {"Qwen3-MoE shape": QWEN3_MOE_SHAPE}


def stream_bandwidth(repeats, nbytes=BANDWIDTH_BYTES):
    """GB/s of a streaming read of ``nbytes``: numpy's (OpenBLAS's, on the
    benchmark's threads) float32 matrix-vector product over them viewed as
    rows of 4096, every byte read once. Not our global_norm_squared: its
    fixed-order double sum is compute-bound (15 GB/s here against the
    product's 53, on 2 Zen 5 cores)."""
    buffer = aligned_zeros(nbytes // 4, what="the bandwidth measurement's buffer")
    rows, vector = buffer.reshape(-1, 4096), np.ones(4096, np.float32)
    t = timed(lambda: rows @ vector, repeats, warmup=1)
    return nbytes / t["median"] / 1e9


def with_weights(fp32, weights):
    """The fp32 model ``fp32`` in ``weights``: itself, a bf16 copy, or a
    quantized copy."""
    if weights == "fp32":
        return fp32
    model = preset_for(fp32.config)(fp32.config, params=fp32.params.memory,
                                    precision="bf16" if weights == "bf16" else "fp32")
    if weights in QUANT_TYPES:
        model.quantize(weights)
    return model


def linear_bytes(model):
    """Bytes of the weights every decoding step reads whole: the linear
    layers' and the head's (the embedding's gather reads B rows, the norms
    and biases are small)."""
    names = QUANTIZED_LINEARS + ("wte" if model.config.tied_embeddings else "lm_head",)
    return sum(_weight_bytes(model, name) for name in names)


def expert_bytes(model, B):
    """Bytes of the experts a decoding step of B rows reads at most: per MoE
    layer its router and min(E, B k) of its E experts (a row's k are
    distinct; rows may share them)."""
    c = model.config
    if not c.num_experts:
        return 0
    share = min(c.num_experts, B * c.experts_per_token) / c.num_experts
    return (4 * c.num_moe_layers * c.num_experts * c.C
            + share * sum(_weight_bytes(model, name) for name in QUANTIZED_EXPERTS))


def _weight_bytes(model, name):
    """Bytes of weight ``name`` as the model holds it (0 if its config has none)."""
    if name not in dict(model.param_specs):
        return 0
    weight = model._weights[name]
    return sum(w.nbytes for w in weight) if isinstance(weight, list) else weight.nbytes


def decode_once(decoder, prompts, new_tokens):
    """Seconds of one greedy decoding of ``new_tokens`` after ``prompts`` (B
    lists): the steps alone, after an untimed prefill (which a quantized
    model runs on its few-row kernel); and its tokens (B lists)."""
    V = decoder.model.config.vocab_size
    logits = decoder.prefill(prompts)
    tokens = []
    start = time.perf_counter()
    for _ in range(new_tokens):
        new = np.argmax(logits[:, :V], axis=1)
        tokens.append(new)
        logits = decoder.step(new)
    return time.perf_counter() - start, np.stack(tokens, axis=1).tolist()


def time_decoding(models, prompts, new_tokens, repeats):
    """{weights: tokens/s (median, min, max over ``repeats``), "vs_bf16"
    and the tokens of the last repeat} for each of ``models`` {weights:
    model} decoding ``prompts`` greedily (decode_once), one Decoder each.
    The types alternate repeat by repeat, after one warm-up each, so a drift
    of the machine's memory bandwidth hits them alike; "vs_bf16" is the
    median over repeats of a type's rate over that repeat's bf16 rate
    (absent without bf16)."""
    B = len(prompts)
    decoders = {kind: Decoder(model, B, len(prompts[0]) + new_tokens)
                for kind, model in models.items()}
    for decoder in decoders.values():
        decode_once(decoder, prompts, new_tokens)
    rates = {kind: [] for kind in models}
    tokens = {}
    for _ in range(repeats):
        for kind, decoder in decoders.items():
            seconds, tokens[kind] = decode_once(decoder, prompts, new_tokens)
            rates[kind].append(B * new_tokens / seconds)
    out = {}
    for kind, rate in rates.items():
        out[kind] = {"median": statistics.median(rate), "min": min(rate), "max": max(rate),
                     "tokens": tokens[kind]}
        if "bf16" in rates:
            out[kind]["vs_bf16"] = statistics.median(
                r / b for r, b in zip(rate, rates["bf16"]))
    return out


def bench_weights(name, config, weights, prompt_len, new_tokens, repeats, bandwidth, rng,
                  peer=None):
    """Rows of the --weights table for one model: per weight type and batch
    (1 and 8), tokens/s beside the bandwidth limit: bandwidth over the bytes
    of a step (linear_bytes and expert_bytes, plus the KV cache at the mean
    position, per row), and the ratio to bf16 (time_decoding: the types
    alternate). ``peer``: the optional llama.cpp row's function
    (llama_cpp_peer)."""
    fp32 = preset_for(config)(config, seed=0)
    prompts = rng.integers(0, config.vocab_size, size=(max(WEIGHTS_BATCHES), prompt_len))
    # every step reads the keys and values of prompt_len + i positions, per row
    kv_bytes = 2 * config.num_layers * config.kv_dim * 4 * (prompt_len + (new_tokens - 1) / 2)
    models = {kind: with_weights(fp32, kind) for kind in weights}
    timings = {B: time_decoding(models, prompts[:B].tolist(), new_tokens, repeats)
               for B in WEIGHTS_BATCHES}
    rows = []
    for kind, model in models.items():
        for B in WEIGHTS_BATCHES:
            step_bytes = linear_bytes(model) + expert_bytes(model, B) + B * kv_bytes
            rows.append({"model": name, "weights": kind, "batch": B,
                         "step_mib": step_bytes / 2**20,
                         "limit": B * bandwidth * 1e9 / step_bytes, **timings[B][kind]})
            if peer is not None:
                row = peer(fp32, kind, prompts[:B].tolist(), new_tokens, repeats)
                if row is not None:
                    rows.append({"model": name, "weights": kind, "batch": B,
                                 "peer": "llama.cpp", **row})
    return rows


def llama_cpp_peer():
    """The optional llama.cpp rows: bench/llama_cpp.py's decode_gguf(fp32
    model, weights, prompts, new_tokens, repeats) -> {"median", "min",
    "max"} tokens/s, or None for a weight type it does not run; None when
    that module (or llama-cpp-python) is absent."""
    try:
        from .llama_cpp import decode_gguf
    except ImportError:
        return None
    return decode_gguf


def measure_weights(args, rng, models=None, bandwidth_bytes=BANDWIDTH_BYTES):
    """The --weights table: the streaming bandwidth (a read of
    ``bandwidth_bytes``), then bench_weights for each of ``models`` {name:
    config} (default decoding_models(--layers))."""
    prompt_len, new_tokens = args.gen
    bandwidth = stream_bandwidth(args.repeats, bandwidth_bytes)
    results = {"threads": get_num_threads(), "prompt": prompt_len, "new_tokens": new_tokens,
               "bandwidth_gbps": bandwidth, "weights": []}
    peer = llama_cpp_peer()
    for name, config in (models or decoding_models(args.layers)).items():
        results["weights"] += bench_weights(name, config, args.weights, prompt_len, new_tokens,
                                            args.repeats, bandwidth, rng, peer)
    return results
