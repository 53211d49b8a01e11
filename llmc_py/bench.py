"""Benchmarks: ``python -m llmc_py.bench`` (``--help`` for options).

1. matmul: each product of a linear layer at GPT-2 124M's shapes, on each
   instruction set of the kernel (--isa), verified against the naive kernel,
   then timed beside numpy's sgemm for the same product; GFLOP/s.
2. the memory-bound kernels (GELU, residual, AdamW): GB/s beside a numpy copy
   of the same bytes.
3. the training step of GPT-2 124M (random init): forward + backward + AdamW,
   ms/step and tokens/s, beside PyTorch eager on the same model when torch is
   installed (and on 1 thread with --scaling).
4. with --generate: greedy generation with GPT-2 124M after a prompt, batch 1
   and 4: tokens/s with the KV cache, without it (a full forward per token),
   and PyTorch with a KV cache of its own; the cache's size beside the model's.
Every time is the median of several repeats (min and max shown too).
"""
import argparse
import json
import resource
import statistics
import sys
import time

import numpy as np

from . import kernels as K
from ._lib import get_isa, get_num_threads, set_isa, set_num_threads, supported_isas
from .config import GPT2Config
from .model import GPT2


def timed(fn, repeats, warmup=1):
    # let other libraries' spinning worker threads (numpy's BLAS) go idle first
    time.sleep(0.05)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def bench_matmul(BT, C, OC, repeats, rng, isas):
    """GFLOP/s of forward, dinp and dweight for one (BT, C, OC): ours on each
    instruction set in ``isas``, and numpy's."""
    x = rng.standard_normal((1, BT, C), dtype=np.float32)
    w = rng.standard_normal((OC, C), dtype=np.float32) * 0.02
    dout = rng.standard_normal((1, BT, OC), dtype=np.float32)
    out, ref = np.empty((1, BT, OC), np.float32), np.empty((1, BT, OC), np.float32)
    K.matmul_forward(ref, x, w, variant="naive")
    flop = 2.0 * BT * C * OC
    dinp, dw = np.zeros_like(x), np.zeros_like(w)
    rows = []
    cases = [
        ("fwd", lambda: K.matmul_forward(out, x, w), lambda: np.matmul(x[0], w.T, out=out[0])),
        ("bwd (dinp+dW)", lambda: K.matmul_backward(dinp, dw, None, dout, x, w),
         lambda: (np.matmul(dout[0], w, out=dinp[0]), np.matmul(dout[0].T, x[0], out=dw))),
    ]
    before = get_isa()
    try:
        for name, ours, theirs in cases:
            scale = 2 if name.startswith("bwd") else 1
            # a few untimed calls first: page faults, thread wake-up and clock ramp
            t_np = timed(theirs, repeats, warmup=3)
            for isa in isas:
                set_isa(isa)
                if name == "fwd":   # verify before timing
                    K.matmul_forward(out, x, w)
                    err = float(np.abs(out - ref).max() / np.abs(ref).max())
                    if err > 1e-5:
                        raise AssertionError(f"matmul_forward ({isa}) disagrees with naive "
                                             f"at {BT}x{C}x{OC}: {err:.2e}")
                t_ours = timed(ours, repeats, warmup=3)
                rows.append({"kernel": f"matmul {name}", "shape": f"{BT}x{C}x{OC}",
                             "isa": isa, "gflops": scale * flop / t_ours["median"] / 1e9,
                             "numpy_gflops": scale * flop / t_np["median"] / 1e9,
                             "ms": t_ours["median"] * 1e3})
    finally:
        set_isa(before)
    return rows


def bench_memory_bound(N, repeats, rng):
    """GB/s of the element-wise kernels and AdamW beside a numpy copy of the
    same number of bytes (read + written)."""
    x = rng.standard_normal(N, dtype=np.float32)
    y = rng.standard_normal(N, dtype=np.float32)
    out = np.empty_like(x)
    m, v = np.zeros_like(x), np.zeros_like(x)
    step = {"t": 0}

    def adamw():
        step["t"] += 1
        K.adamw_update(out, m, v, x, 1e-4, 0.9, 0.999, 1e-8, 0.0, step["t"])
    cases = [  # name, fn, bytes moved per call (reads + writes)
        ("gelu_forward", lambda: K.gelu_forward(out, x), 8 * N),
        ("gelu_backward", lambda: K.gelu_backward(out, y, x), 16 * N),
        ("residual_forward", lambda: K.residual_forward(out, x, y), 12 * N),
        ("adamw_update", adamw, 28 * N),
    ]
    rows = []
    for name, fn, nbytes in cases:
        t = timed(fn, repeats, warmup=2)
        copy_src = np.empty(nbytes // 8, np.float32)
        copy_dst = np.empty_like(copy_src)
        t_copy = timed(lambda: np.copyto(copy_dst, copy_src), repeats, warmup=2)
        rows.append({"kernel": name, "elements": N, "ms": t["median"] * 1e3,
                     "gbps": nbytes / t["median"] / 1e9,
                     "copy_gbps": nbytes / t_copy["median"] / 1e9})
    return rows


def bench_step(config, B, T, repeats, rng):
    model = GPT2(config, seed=0)
    tokens = rng.integers(0, config.vocab_size, size=(B, T + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    state = {"t": 0}

    def step():
        state["t"] += 1
        model.zero_grad()
        model.forward(x, y)
        model.backward()
        model.update(1e-4, 0.9, 0.999, 1e-8, 0.0, state["t"])
    return timed(step, repeats)


def bench_torch_step(config, B, T, repeats, rng):
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(get_num_threads())
    c = config
    # one leaf tensor per layer, as an nn.Module would hold them (slicing a
    # stacked (L, ...) leaf would make autograd build full-size gradients)
    model = GPT2(c, seed=0)
    params = {}
    for name in model.params.names:
        value = model.params[name]
        if value.ndim >= 2 and value.shape[0] == c.num_layers and name not in ("wte", "wpe"):
            params[name] = [torch.tensor(v, requires_grad=True) for v in value]
        else:
            params[name] = torch.tensor(value, requires_grad=True)
    del model
    leaves = [t for v in params.values() for t in (v if isinstance(v, list) else [v])]
    opt = torch.optim.AdamW(leaves, lr=1e-4, weight_decay=0.0, fused=True)
    tokens = torch.as_tensor(rng.integers(0, c.vocab_size, size=(B, T + 1)))
    x, y = tokens[:, :-1], tokens[:, 1:]
    F = torch.nn.functional

    def forward():
        p = params
        h = p["wte"][x] + p["wpe"][:T]
        for l in range(c.num_layers):
            a = F.layer_norm(h, (c.channels,), p["ln1w"][l], p["ln1b"][l])
            q, k, v = F.linear(a, p["qkvw"][l], p["qkvb"][l]).split(c.channels, dim=-1)
            q, k, v = (z.view(B, T, c.num_heads, -1).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + F.linear(a.transpose(1, 2).reshape(B, T, c.channels),
                             p["attprojw"][l], p["attprojb"][l])
            a = F.layer_norm(h, (c.channels,), p["ln2w"][l], p["ln2b"][l])
            a = F.gelu(F.linear(a, p["fcw"][l], p["fcb"][l]), approximate="tanh")
            h = h + F.linear(a, p["fcprojw"][l], p["fcprojb"][l])
        h = F.layer_norm(h, (c.channels,), p["lnfw"], p["lnfb"])
        logits = F.linear(h, p["wte"])[..., :c.vocab_size]
        return F.cross_entropy(logits.reshape(-1, c.vocab_size), y.reshape(-1))

    def step():
        opt.zero_grad(set_to_none=False)
        forward().backward()
        opt.step()
    return timed(step, repeats)


def bench_generate(config, B, prompt_len, new_tokens, repeats, rng, with_torch):
    """Tokens/s of greedy generation, B rows of ``new_tokens`` after a prompt."""
    from .kv_cache import KVCache
    model = GPT2(config, seed=0)
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
    # verified as well as timed (a near-tie in fp32 could legitimately flip a token)
    rows["no_cache_agrees"] = outputs["cached"] == outputs["recompute"]
    if with_torch:
        torch_tokens = {}
        rows["torch_kv_cache"] = _torch_generate(model, prompts, new_tokens, repeats,
                                                 torch_tokens)
        if rows["torch_kv_cache"] is not None and torch_tokens["out"] != outputs["cached"]:
            # fp32 ties can break differently over long greedy runs: report it
            rows["torch_agrees"] = False
    return rows


def _torch_generate(model, prompts, new_tokens, repeats, result):
    """PyTorch eager greedy generation with its own KV cache, on ``model``'s
    parameters (a simple reference implementation, float32)."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(get_num_threads())
    F = torch.nn.functional
    c = model.config
    p = {name: torch.from_numpy(model.params[name]) for name in model.params.names}
    B, T0 = prompts.shape
    C, NH = c.channels, c.num_heads
    hs = C // NH

    def run(tokens, start, k_cache, v_cache):
        t = tokens.shape[1]
        h = p["wte"][tokens] + p["wpe"][start:start + t]
        for l in range(c.num_layers):
            a = F.layer_norm(h, (C,), p["ln1w"][l], p["ln1b"][l])
            q, k, v = (z.view(B, t, NH, hs).transpose(1, 2) for z in
                       F.linear(a, p["qkvw"][l], p["qkvb"][l]).split(C, dim=-1))
            k_cache[l, :, :, start:start + t] = k
            v_cache[l, :, :, start:start + t] = v
            a = F.scaled_dot_product_attention(q, k_cache[l, :, :, :start + t],
                                               v_cache[l, :, :, :start + t], is_causal=t > 1)
            h = h + F.linear(a.transpose(1, 2).reshape(B, t, C), p["attprojw"][l],
                             p["attprojb"][l])
            a = F.layer_norm(h, (C,), p["ln2w"][l], p["ln2b"][l])
            a = F.gelu(F.linear(a, p["fcw"][l], p["fcb"][l]), approximate="tanh")
            h = h + F.linear(a, p["fcprojw"][l], p["fcprojb"][l])
        h = F.layer_norm(h[:, -1], (C,), p["lnfw"], p["lnfb"])
        return F.linear(h, p["wte"])[:, :c.vocab_size]

    @torch.no_grad()
    def generate():
        shape = (c.num_layers, B, NH, T0 + new_tokens, hs)
        k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
        tokens = torch.as_tensor(prompts)
        logits = run(tokens, 0, k_cache, v_cache)
        out = []
        for i in range(new_tokens):
            new = logits.argmax(dim=-1)
            out.append(new)
            if i < new_tokens - 1:
                logits = run(new[:, None], T0 + i, k_cache, v_cache)
        result["out"] = torch.stack(out, dim=1).tolist()
    return timed(generate, repeats, warmup=0)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m llmc_py.bench", description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="0: OpenMP's default")
    p.add_argument("--batch", type=int, nargs=2, default=(4, 64), metavar=("B", "T"))
    p.add_argument("--layers", type=int, default=12, help="GPT-2 124M has 12")
    p.add_argument("--skip-matmul", action="store_true")
    p.add_argument("--isa", nargs="+", default=None, metavar="ISA",
                   help="the matmul kernel's instruction sets to time (avx512, avx2, "
                        "portable); default: every one this CPU runs. The training step "
                        "runs on the first one.")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--scaling", action="store_true",
                   help="also time the step on 1 thread, for the 1 -> N scaling")
    p.add_argument("--generate", action="store_true",
                   help="benchmark generation (KV cache) instead of training")
    p.add_argument("--gen", type=int, nargs=2, default=(64, 256), metavar=("PROMPT", "NEW"),
                   help="--generate: prompt tokens and new tokens")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    args = p.parse_args(argv)
    if args.threads:
        set_num_threads(args.threads)
    isas = args.isa or supported_isas()[::-1]   # fastest first
    for isa in isas:
        if isa not in supported_isas():
            p.error(f"--isa {isa}: this CPU or build runs only {', '.join(supported_isas())}")
    set_isa(isas[0])
    rng = np.random.default_rng(0)
    if args.generate:
        return main_generate(args, rng)
    B, T = args.batch
    results = {"threads": get_num_threads(), "isa": get_isa(), "matmul": [], "step": {}}
    if not args.skip_matmul:
        for C, OC in ((768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50304)):
            results["matmul"] += bench_matmul(B * T, C, OC, args.repeats, rng, isas)
        results["memory_bound"] = bench_memory_bound(B * T * 3072 * 4, args.repeats, rng)
    config = GPT2Config(num_layers=args.layers)
    results["step"]["llmc_py"] = bench_step(config, B, T, args.repeats, rng)
    if not args.skip_torch:
        results["step"]["torch_eager"] = bench_torch_step(config, B, T, args.repeats, rng)
    if args.scaling:
        threads = get_num_threads()
        set_num_threads(1)
        results["step"]["llmc_py_1_thread"] = bench_step(config, B, T, args.repeats, rng)
        set_num_threads(threads)
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"threads: {results['threads']}; matmul kernel for the step: {results['isa']}")
    if results["matmul"]:
        print(f"{'kernel':<20}{'B*T x C x OC':>18}{'isa':>9}{'ms':>9}{'GFLOP/s':>10}"
              f"{'numpy':>9}{'ratio':>7}")
        for r in results["matmul"]:
            print(f"{r['kernel']:<20}{r['shape']:>18}{r['isa']:>9}{r['ms']:9.2f}"
                  f"{r['gflops']:10.1f}{r['numpy_gflops']:9.1f}"
                  f"{r['gflops'] / r['numpy_gflops']:7.2f}")
    if results.get("memory_bound"):
        print(f"\n{'kernel':<20}{'elements':>12}{'ms':>9}{'GB/s':>8}{'copy':>8}{'ratio':>7}")
        for r in results["memory_bound"]:
            print(f"{r['kernel']:<20}{r['elements']:>12}{r['ms']:9.2f}{r['gbps']:8.1f}"
                  f"{r['copy_gbps']:8.1f}{r['gbps'] / r['copy_gbps']:7.2f}")
    print(f"\ntraining step, GPT-2 {args.layers} layers, B={B} T={T} (median, min-max):")
    for name, t in results["step"].items():
        if t is None:
            print(f"  {name:<12} not installed")
            continue
        print(f"  {name:<18} {t['median'] * 1e3:9.1f} ms  ({t['min'] * 1e3:.1f}-"
              f"{t['max'] * 1e3:.1f})  {B * T / t['median']:8.0f} tok/s")
    ours, torch_t = results["step"]["llmc_py"], results["step"].get("torch_eager")
    if torch_t:
        print(f"  speed-up over torch eager: {torch_t['median'] / ours['median']:.2f}x")
    if "llmc_py_1_thread" in results["step"]:
        one = results["step"]["llmc_py_1_thread"]
        print(f"  1 -> {results['threads']} threads: {one['median'] / ours['median']:.2f}x")
    print(f"peak memory (max RSS of this process): {results['peak_rss_mib']:.0f} MiB")
    return 0


def main_generate(args, rng):
    config = GPT2Config(num_layers=args.layers)
    prompt_len, new_tokens = args.gen
    results = {"threads": get_num_threads(), "prompt": prompt_len, "new_tokens": new_tokens,
               "generate": {}}
    for B in (1, 4):
        results["generate"][B] = bench_generate(config, B, prompt_len, new_tokens,
                                                args.repeats, rng, not args.skip_torch)
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"threads: {results['threads']}; greedy generation, GPT-2 {args.layers} layers, "
          f"{new_tokens} new tokens after {prompt_len} (median, min-max; no-cache: 1 run)")
    for B, rows in results["generate"].items():
        print(f"batch {B}:")
        for name in ("cached", "no_cache", "torch_kv_cache"):
            t = rows.get(name)
            if t is None:
                continue
            print(f"  {name:<16} {t['median']:8.2f} s  ({t['min']:.2f}-{t['max']:.2f})  "
                  f"{B * new_tokens / t['median']:8.1f} tok/s")
        if rows.get("torch_kv_cache"):
            print(f"  speed-up over torch with KV cache: "
                  f"{rows['torch_kv_cache']['median'] / rows['cached']['median']:.2f}x")
        if not rows["no_cache_agrees"]:
            print("  (the no-cache greedy tokens diverged from the cached ones: an fp32 near-tie)")
        if rows.get("torch_agrees") is False:
            print("  (torch's greedy tokens diverged from ours: an fp32 near-tie)")
        print(f"  KV cache {rows['cache_mib']:.1f} MiB for the model's {rows['model_mib']:.1f} "
              f"MiB of parameters")
    print(f"peak memory (max RSS of this process): {results['peak_rss_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
