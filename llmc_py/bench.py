"""Benchmarks: ``python -m llmc_py.bench`` (``--help`` for options).

1. matmul: each product of a linear layer at GPT-2 124M's shapes, on each
   instruction set of the kernel (--isa), verified against the naive kernel,
   then timed beside numpy's sgemm for the same product; GFLOP/s.
2. attention (forward, backward) at GPT-2 124M's heads, on each instruction
   set, verified against the plain twin (attention_*_naive), then timed
   beside that twin.
3. the memory-bound kernels (GELU, residual, AdamW): GB/s beside a numpy copy
   of the same bytes.
4. the training step of GPT-2 124M (random init): forward + backward + AdamW,
   ms/step and tokens/s, beside PyTorch eager on the same model when torch is
   installed (and on 1 thread with --scaling).
5. with --generate: greedy generation with GPT-2 124M after a prompt, batch 1
   and 4: tokens/s with the KV cache, without it (a full forward per token),
   and PyTorch with a KV cache of its own; the cache's size beside the model's.
Every time is the median of several repeats (min and max shown too).
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy as np

from ._native import kernels as K
from ._native.lib import get_isa, get_num_threads, set_isa, set_num_threads, supported_isas
from .config import GPT2Config
from .errors import UsageError
from .flags import NON_NEGATIVE, POSITIVE, check_flags
from .model import GPT2


# the environment variables that set numpy's (OpenBLAS's) and OpenMP's threads
BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def timed(fn, repeats, warmup=1):
    # let other libraries' spinning worker threads (numpy's BLAS, torch's
    # OpenMP) go idle first
    time.sleep(0.2)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def _torch():
    """torch, on this process's thread count, or None when not installed."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(get_num_threads())
    return torch


def bench_matmul(BT, C, OC, repeats, rng, isas, with_torch=True):
    """GFLOP/s of each product of a linear layer at one (BT, C, OC): the
    forward (out = inp . weight^T), dinp (+= dout . weight) and dW (+= dout^T
    . inp), ours on each instruction set in ``isas`` (each verified against
    the naive kernel first), beside numpy's sgemm and torch's (when
    installed) for the same product."""
    x = rng.standard_normal((1, BT, C), dtype=np.float32)
    w = rng.standard_normal((OC, C), dtype=np.float32) * 0.02
    dout = rng.standard_normal((1, BT, OC), dtype=np.float32)
    out, dinp, dw = np.empty((1, BT, OC), np.float32), np.zeros_like(x), np.zeros_like(w)
    ref = {"fwd": np.empty_like(out), "dinp": np.zeros_like(x), "dW": np.zeros_like(w)}
    K.matmul_forward(ref["fwd"], x, w, variant="naive")
    K.matmul_backward(ref["dinp"], ref["dW"], None, dout, x, w, variant="naive")
    torch = _torch() if with_torch else None
    if torch is not None:
        tx, tw, tdout = (torch.from_numpy(a) for a in (x[0], w, dout[0]))
        tout, tdinp, tdw = (torch.from_numpy(a) for a in (out[0], dinp[0], dw))
    cases = [  # name, ours, numpy's, torch's, our result
        ("fwd", lambda: K.matmul_forward(out, x, w),
         lambda: np.matmul(x[0], w.T, out=out[0]),
         lambda: torch.matmul(tx, tw.T, out=tout), out),
        ("dinp", lambda: K.matmul_backward(dinp, None, None, dout, x, w),
         lambda: np.matmul(dout[0], w, out=dinp[0]),
         lambda: torch.matmul(tdout, tw, out=tdinp), dinp),
        ("dW", lambda: K.matmul_backward(None, dw, None, dout, x, w),
         lambda: np.matmul(dout[0].T, x[0], out=dw),
         lambda: torch.matmul(tdout.T, tx, out=tdw), dw),
    ]
    flop = 2.0 * BT * C * OC
    before = get_isa()
    rows = []
    try:
        for name, ours, numpys, torchs, result in cases:
            # a few untimed calls first: page faults, thread wake-up and clock ramp
            t_np = timed(numpys, repeats, warmup=3)
            t_torch = timed(torchs, repeats, warmup=3) if torch is not None else None
            for isa in isas:
                set_isa(isa)
                result[...] = 0.0   # verify before timing
                ours()
                err = float(np.abs(result - ref[name]).max() / np.abs(ref[name]).max())
                if err > 1e-5:
                    raise AssertionError(f"matmul {name} ({isa}) disagrees with naive "
                                         f"at {BT}x{C}x{OC}: {err:.2e}")
                t_ours = timed(ours, repeats, warmup=3)
                rows.append({"kernel": f"matmul {name}", "shape": f"{BT}x{C}x{OC}",
                             "isa": isa, "ms": t_ours["median"] * 1e3,
                             "gflops": flop / t_ours["median"] / 1e9,
                             "numpy_gflops": flop / t_np["median"] / 1e9,
                             "torch_gflops": (flop / t_torch["median"] / 1e9
                                              if t_torch is not None else None)})
    finally:
        set_isa(before)
    return rows


def bench_attention(B, T, NH, hs, repeats, rng, isas):
    """ms of attention's forward and backward (GPT-2's layout, NKV = NH) on
    each instruction set in ``isas``, each verified against the plain twin
    first, beside that twin's ms."""
    qkv = rng.standard_normal((B, T, 3 * NH * hs), dtype=np.float32)
    dout = rng.standard_normal((B, T, NH * hs), dtype=np.float32)
    out, att = np.empty((B, T, NH * hs), np.float32), np.empty((B, NH, T, T), np.float32)
    dinp = np.zeros_like(qkv)
    ref_out, ref_att, ref_dinp = np.empty_like(out), np.empty_like(att), np.zeros_like(qkv)
    K.attention_forward_naive(ref_out, ref_att, qkv, None, NH, NH)
    K.attention_backward_naive(ref_dinp, dout, qkv, ref_att, NH, NH)
    cases = [  # name, ours, the naive twin, {our result: the naive result}
        ("fwd", lambda: K.attention_gqa_forward(out, att, qkv, None, NH, NH),
         lambda: K.attention_forward_naive(ref_out, ref_att, qkv, None, NH, NH),
         {"out": (out, ref_out), "att": (att, ref_att)}),
        ("bwd", lambda: K.attention_gqa_backward(dinp, dout, qkv, ref_att, NH, NH),
         lambda: K.attention_backward_naive(ref_dinp, dout, qkv, ref_att, NH, NH),
         {"dinp": (dinp, ref_dinp)}),
    ]
    before = get_isa()
    rows = []
    try:
        for name, ours, naive, results in cases:
            t_naive = timed(naive, repeats)
            for isa in isas:
                set_isa(isa)
                dinp[...] = 0.0   # verify before timing
                ref_dinp[...] = 0.0
                naive()
                ours()
                for what, (result, ref) in results.items():
                    err = float(np.abs(result - ref).max() / np.abs(ref).max())
                    if err > 1e-5:
                        raise AssertionError(f"attention {name} ({isa}): {what} disagrees "
                                             f"with naive at B={B} T={T} NH={NH} hs={hs}: "
                                             f"{err:.2e}")
                t_ours = timed(ours, repeats)
                rows.append({"kernel": f"attention {name}", "shape": f"{B}x{T}x{NH}x{hs}",
                             "isa": isa, "ms": t_ours["median"] * 1e3,
                             "naive_ms": t_naive["median"] * 1e3})
    finally:
        set_isa(before)
    return rows


def bench_memory_bound(N, repeats, rng, C=768):
    """GB/s of the element-wise kernels, layernorm, dbias and AdamW beside a
    numpy copy of the same number of bytes (read + written); N elements,
    seen as rows of C for layernorm and of 4C for dbias."""
    x = rng.standard_normal(N, dtype=np.float32)
    y = rng.standard_normal(N, dtype=np.float32)
    out = np.empty_like(x)
    m, v = np.zeros_like(x), np.zeros_like(x)
    step = {"t": 0}
    rows_ = N // C
    x3, y3, out3 = (a[:rows_ * C].reshape(1, rows_, C) for a in (x, y, out))
    weight, bias = np.ones(C, np.float32), np.zeros(C, np.float32)
    dweight, dbias = np.zeros(C, np.float32), np.zeros(C, np.float32)
    mean, rstd = np.empty((1, rows_), np.float32), np.empty((1, rows_), np.float32)
    K.layernorm_forward(out3, mean, rstd, x3, weight, bias)
    wide = x[:N // (4 * C) * 4 * C].reshape(1, -1, 4 * C)
    # dbias alone: matmul_backward reads neither inp nor weight (shapes only)
    inp_1, weight_1 = np.empty(wide.shape[:2] + (1,), np.float32), np.empty((4 * C, 1), np.float32)
    db_wide = np.zeros(4 * C, np.float32)

    def adamw():
        step["t"] += 1
        K.adamw_update(out, m, v, x, 1e-4, 0.9, 0.999, 1e-8, 0.0, step["t"])
    cases = [  # name, fn, bytes moved per call (reads + writes)
        ("gelu_forward", lambda: K.gelu_forward(out, x), 8 * N),
        ("gelu_backward", lambda: K.gelu_backward(out, y, x), 16 * N),
        ("residual_forward", lambda: K.residual_forward(out, x, y), 12 * N),
        ("layernorm_forward", lambda: K.layernorm_forward(out3, mean, rstd, x3, weight, bias),
         8 * x3.size),
        ("layernorm_backward", lambda: K.layernorm_backward(
            out3, dweight, dbias, y3, x3, weight, mean, rstd), 16 * x3.size),
        ("matmul dbias", lambda: K.matmul_backward(
            None, None, db_wide, wide, inp_1, weight_1), 4 * wide.size),
        ("adamw_update", adamw, 28 * N),
    ]
    rows = []
    for name, fn, nbytes in cases:
        t = timed(fn, repeats, warmup=2)
        # written first: pages never written all map the kernel's one zero
        # page, which would make the copy's reads free
        copy_src = np.ones(nbytes // 8, np.float32)
        copy_dst = np.zeros_like(copy_src)
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


def bench_torch_step(config, B, T, repeats, rng, compile=False):
    """PyTorch on the same model and batch: eager, or torch.compile'd (the
    forward and its backward; the first, untimed, step compiles)."""
    torch = _torch()
    if torch is None:
        return None
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

    loss_fn = torch.compile(forward) if compile else forward

    def step():
        opt.zero_grad(set_to_none=False)
        loss_fn().backward()
        opt.step()
    return timed(step, repeats)


def bench_generate(config, B, prompt_len, new_tokens, repeats, rng, with_torch):
    """Tokens/s of greedy generation, B rows of ``new_tokens`` after a prompt."""
    from .generate.kv_cache import KVCache
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
    torch = _torch()
    if torch is None:
        return None
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
    p.add_argument("--threads", type=int, default=0,
                   help="0: OpenMP's default. numpy's BLAS and torch get the same count "
                        "(from the command line the benchmark restarts itself with "
                        "OMP_NUM_THREADS and OPENBLAS_NUM_THREADS set, which numpy reads "
                        "only at import)")
    p.add_argument("--batch", type=int, nargs=2, default=(4, 64), metavar=("B", "T"))
    p.add_argument("--layers", type=int, default=12, help="GPT-2 124M has 12")
    p.add_argument("--skip-matmul", action="store_true")
    p.add_argument("--isa", nargs="+", default=None, metavar="ISA",
                   help="the matmul kernel's instruction sets to time (avx512, avx2, "
                        "portable); default: every one this CPU runs. The training step "
                        "runs on the first one.")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--compile", action="store_true",
                   help="also time the step under torch.compile (its first step compiles, "
                        "which takes minutes; untimed)")
    p.add_argument("--scaling", action="store_true",
                   help="also time the step on 1 thread, for the 1 -> N scaling")
    p.add_argument("--generate", action="store_true",
                   help="benchmark generation (KV cache) instead of training")
    p.add_argument("--gen", type=int, nargs=2, default=(64, 256), metavar=("PROMPT", "NEW"),
                   help="--generate: prompt tokens and new tokens")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    args = p.parse_args(argv)
    try:
        check_flags(args, {"repeats": POSITIVE, "threads": NON_NEGATIVE, "batch": POSITIVE,
                           "layers": POSITIVE, "gen": POSITIVE})
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.threads:
        wanted = str(args.threads)
        if argv is None and any(os.environ.get(name) != wanted for name in BLAS_THREAD_VARS):
            env = dict(os.environ, **{name: wanted for name in BLAS_THREAD_VARS})
            os.execve(sys.executable, [sys.executable, "-m", "llmc_py.bench", *sys.argv[1:]],
                      env)
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
            results["matmul"] += bench_matmul(B * T, C, OC, args.repeats, rng, isas,
                                              with_torch=not args.skip_torch)
        results["attention"] = bench_attention(B, T, 12, 64, args.repeats, rng, isas)
        results["memory_bound"] = bench_memory_bound(B * T * 3072 * 4, args.repeats, rng)
    config = GPT2Config(num_layers=args.layers)
    results["step"]["llmc_py"] = bench_step(config, B, T, args.repeats, rng)
    if not args.skip_torch:
        results["step"]["torch_eager"] = bench_torch_step(config, B, T, args.repeats, rng)
        if args.compile:
            results["step"]["torch_compile"] = bench_torch_step(config, B, T, args.repeats,
                                                                rng, compile=True)
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
        print("GFLOP/s; ratio = ours / numpy's sgemm, measured in this run")
        print(f"{'kernel':<14}{'B*T x C x OC':>16}{'isa':>9}{'ms':>9}{'GFLOP/s':>9}"
              f"{'numpy':>8}{'torch':>8}{'ratio':>7}")
        for r in results["matmul"]:
            torch_col = f"{r['torch_gflops']:8.1f}" if r["torch_gflops"] else f"{'-':>8}"
            print(f"{r['kernel']:<14}{r['shape']:>16}{r['isa']:>9}{r['ms']:9.2f}"
                  f"{r['gflops']:9.1f}{r['numpy_gflops']:8.1f}{torch_col}"
                  f"{r['gflops'] / r['numpy_gflops']:7.2f}")
    if results.get("attention"):
        print(f"\n{'kernel':<16}{'B x T x NH x hs':>16}{'isa':>9}{'ms':>9}{'naive ms':>10}"
              f"{'ratio':>7}")
        for r in results["attention"]:
            print(f"{r['kernel']:<16}{r['shape']:>16}{r['isa']:>9}{r['ms']:9.2f}"
                  f"{r['naive_ms']:10.2f}{r['naive_ms'] / r['ms']:7.2f}")
    if results.get("memory_bound"):
        print(f"\n{'kernel':<20}{'elements':>12}{'ms':>9}{'GB/s':>8}{'copy':>8}{'ratio':>7}")
        for r in results["memory_bound"]:
            print(f"{r['kernel']:<20}{r['elements']:>12}{r['ms']:9.2f}{r['gbps']:8.1f}"
                  f"{r['copy_gbps']:8.1f}{r['gbps'] / r['copy_gbps']:7.2f}")
    print(f"\ntraining step, GPT-2 {args.layers} layers, B={B} T={T} (median, min-max):")
    for name, t in results["step"].items():
        if t is None:
            print(f"  {name:<18} not installed")
            continue
        print(f"  {name:<18} {t['median'] * 1e3:9.1f} ms  ({t['min'] * 1e3:.1f}-"
              f"{t['max'] * 1e3:.1f})  {B * T / t['median']:8.0f} tok/s")
    ours = results["step"]["llmc_py"]
    for name in ("torch_eager", "torch_compile"):
        if results["step"].get(name):
            print(f"  speed-up over {name.replace('_', ' ')}: "
                  f"{results['step'][name]['median'] / ours['median']:.2f}x")
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
