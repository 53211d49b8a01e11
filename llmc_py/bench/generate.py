"""Greedy generation: ours with the KV cache, without it (a full forward per
token) and PyTorch with a KV cache of its own."""
import numpy as np

from .._native.lib import get_num_threads
from ..config import GPT2Config
from ..generate import KVCache
from ..model import GPT2
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
