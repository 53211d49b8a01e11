"""Benchmarks: ``python -m llmc_py.bench`` (``--help`` for options).

1. matmul: each product of a linear layer at GPT-2 124M's shapes, on each
   instruction set of the kernel (--isa), verified against the naive kernel,
   then timed beside numpy's sgemm and torch's matmul for the same product;
   GFLOP/s. With --precision bf16, the bf16 products beside torch's bf16
   matmul as well.
2. attention (forward, backward) at GPT-2 124M's heads, on each instruction
   set, verified against the plain twin (attention_*_naive), then timed
   beside that twin.
3. the memory-bound kernels (GELU, residual, AdamW): GB/s beside a numpy copy
   of the same bytes.
4. the training step of GPT-2 124M (random init): forward + backward + AdamW,
   ms/step and tokens/s, in --precision (fp32, or bf16 mixed precision),
   beside PyTorch eager on the same model when torch is installed (in bf16:
   also under torch.autocast; with --compile: torch.compile'd too), and on 1
   thread with --scaling.
5. with --generate: greedy generation with GPT-2 124M after a prompt, batch 1
   and 4: tokens/s with the KV cache, without it (a full forward per token),
   and PyTorch with a KV cache of its own; the cache's size beside the model's.
   With --precision bf16: our bf16 decoding beside our fp32 and torch's bf16.
6. with --quality: the default training run (python -m llmc_py.train: d4 on
   Shakespeare, 500 steps) in fp32 and in bf16, each in a process of its
   own; the validation losses side by side.
Every time is the median of several repeats (min and max shown too). Every
PyTorch measurement runs in a process of its own (bench_torch.py).
"""
import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from ._native import kernels as K
from ._native.lib import get_isa, get_num_threads, set_isa, set_num_threads, supported_isas
from .config import GPT2Config
from .errors import UsageError
from .flags import NON_NEGATIVE, POSITIVE, check_flags
from .model import GPT2, PRECISIONS


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


def torch_job(kind, **job):
    """The result of one PyTorch measurement (bench_torch.py) run in a fresh
    interpreter on this process's thread count; None when torch is not
    installed. A failing job raises RuntimeError with its last error line."""
    job = dict(job, kind=kind, threads=get_num_threads())
    done = subprocess.run([sys.executable, "-m", "llmc_py.bench_torch", json.dumps(job)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        raise RuntimeError(f"PyTorch {kind} job failed: {lines[-1]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return None if result.get("missing") else result


def bench_matmul(BT, C, OC, repeats, rng, isas, torch_gflops=None, precision="fp32"):
    """GFLOP/s of each product of a linear layer at one (BT, C, OC): the
    forward (out = inp . weight^T), dinp (+= dout . weight) and dW (+= dout^T
    . inp), ours on each instruction set in ``isas`` (each verified against
    the naive kernel first), beside numpy's sgemm for the same product and
    ``torch_gflops`` ({product: GFLOP/s}, measured by torch_job). With
    ``precision="bf16"`` the weight is bf16 and ours are the bf16 kernels."""
    x = rng.standard_normal((1, BT, C), dtype=np.float32)
    w = rng.standard_normal((OC, C), dtype=np.float32) * 0.02
    dout = rng.standard_normal((1, BT, OC), dtype=np.float32)
    out, dinp, dw = np.empty((1, BT, OC), np.float32), np.zeros_like(x), np.zeros_like(w)
    ref = {"fwd": np.empty_like(out), "dinp": np.zeros_like(x), "dW": np.zeros_like(w)}
    if precision == "bf16":
        weight = np.empty(w.shape, np.uint16)
        K.float_to_bf16(weight, w)
        forward, backward = K.matmul_forward_bf16, K.matmul_backward_bf16
        tol = 1e-4   # the dot-product path sums pairs of k, the naive loop one k at a time
    else:
        weight, forward, backward, tol = w, K.matmul_forward, K.matmul_backward, 1e-5
    forward(ref["fwd"], x, weight, variant="naive")
    backward(ref["dinp"], ref["dW"], None, dout, x, weight, variant="naive")
    cases = [  # name, ours, numpy's, our result
        ("fwd", lambda: forward(out, x, weight), lambda: np.matmul(x[0], w.T, out=out[0]), out),
        ("dinp", lambda: backward(dinp, None, None, dout, x, weight),
         lambda: np.matmul(dout[0], w, out=dinp[0]), dinp),
        ("dW", lambda: backward(None, dw, None, dout, x, weight),
         lambda: np.matmul(dout[0].T, x[0], out=dw), dw),
    ]
    flop = 2.0 * BT * C * OC
    before = get_isa()
    rows = []
    try:
        for name, ours, numpys, result in cases:
            # a few untimed calls first: page faults, thread wake-up and clock ramp
            t_np = timed(numpys, repeats, warmup=3)
            for isa in isas:
                set_isa(isa)
                result[...] = 0.0   # verify before timing
                ours()
                err = float(np.abs(result - ref[name]).max() / np.abs(ref[name]).max())
                if err > tol:
                    raise AssertionError(f"matmul {name} ({isa}, {precision}) disagrees with "
                                         f"naive at {BT}x{C}x{OC}: {err:.2e}")
                t_ours = timed(ours, repeats, warmup=3)
                rows.append({"kernel": f"matmul {name}" + (" bf16" if precision == "bf16"
                                                           else ""),
                             "shape": f"{BT}x{C}x{OC}", "isa": isa,
                             "ms": t_ours["median"] * 1e3,
                             "gflops": flop / t_ours["median"] / 1e9,
                             "numpy_gflops": flop / t_np["median"] / 1e9,
                             "torch_gflops": torch_gflops[name] if torch_gflops else None})
    finally:
        set_isa(before)
    return rows


def bench_attention(B, T, NH, hs, repeats, rng, isas, window=0):
    """ms of attention's forward and backward (GPT-2's layout, NKV = NH;
    with ``window`` a sliding window of that many keys) on each instruction
    set in ``isas``, each verified against the plain twin first, beside
    that twin's ms. The forward keeps only row statistics, so its
    probabilities are checked as attention_gqa_probs recomputes them."""
    qkv = rng.standard_normal((B, T, 3 * NH * hs), dtype=np.float32)
    dout = rng.standard_normal((B, T, NH * hs), dtype=np.float32)
    out, stats = np.empty((B, T, NH * hs), np.float32), np.empty((B, NH, T, 2), np.float32)
    probs = np.empty((B, NH, T, T), np.float32)
    dinp = np.zeros_like(qkv)
    ref_out, ref_att, ref_dinp = np.empty_like(out), np.empty_like(probs), np.zeros_like(qkv)
    forward = lambda: K.attention_gqa_forward(out, stats, qkv, None, NH, NH, window)

    def recomputed_probs():
        K.attention_gqa_probs(probs, qkv, stats, None, NH, NH, window)
        return probs

    # name, ours, the naive twin, {what: (our result, the naive result)}; the
    # naive backward reads the naive forward's att, so "fwd" runs first
    cases = [
        ("fwd", forward,
         lambda: K.attention_forward_naive(ref_out, ref_att, qkv, None, NH, NH, window),
         {"out": (lambda: out, ref_out), "probs": (recomputed_probs, ref_att)}),
        ("bwd", lambda: K.attention_gqa_backward(dinp, dout, qkv, stats, None, NH, NH, window),
         lambda: K.attention_backward_naive(ref_dinp, dout, qkv, ref_att, NH, NH, window),
         {"dinp": (lambda: dinp, ref_dinp)}),
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
                forward()         # the backward reads this instruction set's stats
                naive()
                ours()
                for what, (result, ref) in results.items():
                    err = float(np.abs(result() - ref).max() / np.abs(ref).max())
                    if err > 1e-5:
                        raise AssertionError(f"attention {name} ({isa}): {what} disagrees "
                                             f"with naive at B={B} T={T} NH={NH} hs={hs}: "
                                             f"{err:.2e}")
                t_ours = timed(ours, repeats)
                kernel = f"attention {name}" + (f" w{window}" if window else "")
                rows.append({"kernel": kernel, "shape": f"{B}x{T}x{NH}x{hs}",
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


def bench_step(config, B, T, repeats, rng, precision="fp32", recompute=False):
    """Times forward_backward + AdamW of a fresh GPT-2; with the model's
    memory plan of the step in MiB ("planned_mib")."""
    model = GPT2(config, seed=0, precision=precision)
    model.recompute = recompute
    planned = sum(model.memory_plan(B, T, training=True).values()) / 2**20
    tokens = rng.integers(0, config.vocab_size, size=(B, T + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    state = {"t": 0}

    def step():
        state["t"] += 1
        model.zero_grad()
        model.forward_backward(x, y)
        model.update(1e-4, 0.9, 0.999, 1e-8, 0.0, state["t"])
    return dict(timed(step, repeats), planned_mib=planned)


def own_step_job(layers, B, T, repeats, precision="fp32", recompute=False, threads=None,
                 config=None):
    """bench_step in a fresh interpreter (bench_step.py), on this process's
    instruction set and thread count unless ``threads`` is given: its
    timing, peak RSS and memory plan. ``config``: GPT2Config fields other
    than num_layers (default: GPT-2 124M's)."""
    job = dict(layers=layers, B=B, T=T, repeats=repeats, precision=precision,
               recompute=recompute, isa=get_isa(),
               threads=get_num_threads() if threads is None else threads, config=config or {})
    done = subprocess.run([sys.executable, "-m", "llmc_py.bench_step", json.dumps(job)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        raise RuntimeError(f"llmc_py step job failed: {lines[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_generate(config, B, prompt_len, new_tokens, repeats, rng, with_torch,
                   precision="fp32"):
    """Tokens/s of greedy generation, B rows of ``new_tokens`` after a prompt,
    in ``precision``; in bf16 our fp32 model too."""
    from .generate import KVCache
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


def bench_quality(steps, extra=(), out_dir="bench_quality"):
    """The default training run for ``steps`` steps in each precision (each
    `python -m llmc_py.train` in a process of its own, writing to
    out_dir/<precision>); {precision: (final val loss, wall seconds)}."""
    import re
    results = {}
    for precision in PRECISIONS:
        folder = os.path.join(out_dir, precision)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "llmc_py.train", "-o", folder, "--overwrite",
                        "-x", str(steps), "-v", str(steps), "-s", "0", "-n", "0",
                        "--precision", precision, *extra], check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(folder, "main.log")) as f:
            val = re.findall(r"tel:(\S+)", f.read())
        results[precision] = (float(val[-1]), time.perf_counter() - start)
    return results


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
    p.add_argument("--attention-window", type=int, default=0, metavar="W",
                   help="also time attention with a sliding window of W keys (on the "
                        "fastest instruction set), beside full causal attention")
    p.add_argument("--isa", nargs="+", default=None, metavar="ISA",
                   help="the matmul kernel's instruction sets to time (avx512bf16, avx512, "
                        "avx2, portable); default: every one this CPU runs. The training "
                        "step runs on the first one.")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="bf16: also the bf16 matmul products beside torch's bf16 matmul; the "
                        "step in bf16 mixed precision beside torch under autocast(bf16); with "
                        "--generate, bf16 decoding beside fp32's and torch's bf16")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--compile", action="store_true",
                   help="also time the step under torch.compile (its first step compiles, "
                        "which takes minutes; untimed)")
    p.add_argument("--recompute", action="store_true",
                   help="also time the step with recompute on (model.recompute)")
    p.add_argument("--scaling", action="store_true",
                   help="also time the step on 1 thread, for the 1 -> N scaling")
    p.add_argument("--generate", action="store_true",
                   help="benchmark generation (KV cache) instead of training")
    p.add_argument("--gen", type=int, nargs=2, default=(64, 256), metavar=("PROMPT", "NEW"),
                   help="--generate: prompt tokens and new tokens")
    p.add_argument("--quality", type=int, default=0, metavar="STEPS",
                   help="instead: the default training run for STEPS steps (500 is the "
                        "default run) in fp32 and in bf16; their validation losses")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    args = p.parse_args(argv)
    try:
        check_flags(args, {"repeats": POSITIVE, "threads": NON_NEGATIVE, "batch": POSITIVE,
                           "layers": POSITIVE, "gen": POSITIVE,
                           "attention_window": NON_NEGATIVE})
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
    if args.quality:
        results = bench_quality(args.quality)
        fp32, bf16 = results["fp32"][0], results["bf16"][0]
        for precision, (val, seconds) in results.items():
            print(f"{precision}: val loss {val:.4f} after {args.quality} steps ({seconds:.0f} s)")
        print(f"bf16 - fp32: {bf16 - fp32:+.4f} ({(bf16 - fp32) / fp32 * 100:+.2f}%)")
        return 0
    if args.generate:
        return main_generate(args, rng)
    B, T = args.batch
    bf16 = args.precision == "bf16"
    results = {"threads": get_num_threads(), "isa": get_isa(), "precision": args.precision,
               "matmul": [], "step": {}}
    if not args.skip_matmul:
        shapes = [(B * T, C, OC) for C, OC in
                  ((768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50304))]
        for precision in ("fp32", "bf16") if bf16 else ("fp32",):
            theirs = None if args.skip_torch else torch_job(
                "matmul", shapes=shapes, repeats=args.repeats, dtype=precision)
            for shape in shapes:
                key = "x".join(map(str, shape))
                results["matmul"] += bench_matmul(*shape, args.repeats, rng, isas,
                                                  theirs["gflops"][key] if theirs else None,
                                                  precision)
        results["attention"] = bench_attention(B, T, 12, 64, args.repeats, rng, isas)
        if args.attention_window:
            results["attention"] += bench_attention(B, T, 12, 64, args.repeats, rng, isas[:1],
                                                    window=args.attention_window)
        results["memory_bound"] = bench_memory_bound(B * T * 3072 * 4, args.repeats, rng)
    step = results["step"]
    own_step = functools.partial(own_step_job, args.layers, B, T, args.repeats)
    step["llmc_py"] = own_step(args.precision)
    if args.recompute:
        step["llmc_py_recompute"] = own_step(args.precision, recompute=True)
    if bf16:
        step["llmc_py_fp32"] = own_step()
        if args.recompute:
            step["llmc_py_fp32_recompute"] = own_step(recompute=True)
    if not args.skip_torch:
        torch_step = functools.partial(torch_job, "step", layers=args.layers, B=B, T=T,
                                       repeats=args.repeats)
        step["torch_eager"] = torch_step()
        if bf16:
            step["torch_eager_autocast_bf16"] = torch_step(autocast=True)
        if args.compile:
            step["torch_compile"] = torch_step(compile=True)
            if bf16:
                step["torch_compile_autocast_bf16"] = torch_step(compile=True, autocast=True)
    if args.scaling:
        step["llmc_py_1_thread"] = own_step(args.precision, threads=1)
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"threads: {results['threads']}; kernels for the step: {results['isa']}, "
          f"{results['precision']}")
    if results["matmul"]:
        print("GFLOP/s; ratio = ours / numpy's sgemm; vs torch = ours / torch's matmul in the "
              "same dtype (bf16 rows: torch's bf16 matmul); all measured in this run")
        print(f"{'kernel':<16}{'B*T x C x OC':>16}{'isa':>11}{'ms':>9}{'GFLOP/s':>9}"
              f"{'numpy':>8}{'torch':>8}{'ratio':>7}{'vs torch':>9}")
        for r in results["matmul"]:
            theirs = r["torch_gflops"]
            torch_cols = (f"{theirs:8.1f}" if theirs else f"{'-':>8}")
            print(f"{r['kernel']:<16}{r['shape']:>16}{r['isa']:>11}{r['ms']:9.2f}"
                  f"{r['gflops']:9.1f}{r['numpy_gflops']:8.1f}{torch_cols}"
                  f"{r['gflops'] / r['numpy_gflops']:7.2f}"
                  + (f"{r['gflops'] / theirs:9.2f}" if theirs else f"{'-':>9}"))
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
    print(f"\ntraining step, GPT-2 {args.layers} layers, B={B} T={T} (median, min-max; "
          f"peak RSS of each one's own process; ours: also the model's memory plan):")
    for name, t in results["step"].items():
        if t is None:
            print(f"  {name:<28} not installed")
            continue
        rss = f"  {t['peak_rss_mib']:6.0f} MiB" if "peak_rss_mib" in t else ""
        rss += f" (plan {t['planned_mib']:.0f})" if "planned_mib" in t else ""
        print(f"  {name:<28} {t['median'] * 1e3:9.1f} ms  ({t['min'] * 1e3:.1f}-"
              f"{t['max'] * 1e3:.1f})  {B * T / t['median']:8.0f} tok/s{rss}")
    ours = results["step"]["llmc_py"]
    for name, t in results["step"].items():
        if t and name != "llmc_py" and not name.startswith("llmc_py_1"):
            memory = (f", {ours['peak_rss_mib'] / t['peak_rss_mib']:.2f}x the memory"
                      if "peak_rss_mib" in t else "")
            print(f"  llmc_py ({results['precision']}) over {name}: "
                  f"{t['median'] / ours['median']:.2f}x the speed{memory}")
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
                                                args.repeats, rng, not args.skip_torch,
                                                args.precision)
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"threads: {results['threads']}; greedy generation, GPT-2 {args.layers} layers, "
          f"{args.precision}, {new_tokens} new tokens after {prompt_len} (median, min-max; "
          f"no-cache: 1 run)")
    for B, rows in results["generate"].items():
        print(f"batch {B}:")
        for name in ("cached", "cached_fp32", "no_cache", "torch_kv_cache"):
            t = rows.get(name)
            if t is None:
                continue
            print(f"  {name:<16} {t['median']:8.2f} s  ({t['min']:.2f}-{t['max']:.2f})  "
                  f"{B * new_tokens / t['median']:8.1f} tok/s")
        for name in ("cached_fp32", "torch_kv_cache"):
            if rows.get(name):
                print(f"  speed-up over {name}: "
                      f"{rows[name]['median'] / rows['cached']['median']:.2f}x")
        if not rows["no_cache_agrees"]:
            print("  (the no-cache greedy tokens diverged from the cached ones: a near-tie)")
        if rows.get("torch_agrees") is False:
            print("  (torch's greedy tokens diverged from ours: a near-tie, or bf16 rounding)")
        print(f"  KV cache {rows['cache_mib']:.1f} MiB for the model's {rows['model_mib']:.1f} "
              f"MiB of parameters")
    print(f"peak memory (max RSS of this process): {results['peak_rss_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
