"""The benchmark's printed tables, one function per mode (--json prints the
results themselves instead)."""
import math
import statistics



def print_training(args, results):
    """The kernel tables (matmul, attention, memory-bound) when measured,
    then the training step's: each configuration and ours over it."""
    B, T = args.batch
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


def print_generation(args, results):
    """Per batch: each way of generating, the speed-ups, the cache's size."""
    prompt_len, new_tokens = results["prompt"], results["new_tokens"]
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


def print_weights(args, results):
    """Per model and batch: tokens/s of each weight type beside its
    bandwidth limit, and the ratio to bf16 with the issue's floors: the
    median of the per-repeat ratios (the types alternate repeat by repeat);
    a llama.cpp row's, its median over our bf16 median."""
    print(f"threads: {results['threads']}; greedy decoding, {results['new_tokens']} new tokens "
          f"after {results['prompt']} (tokens/s: median, min-max of {args.repeats}); streaming "
          f"read {results['bandwidth_gbps']:.1f} GB/s; limit = that over a step's bytes "
          f"(weights + KV cache); the weight types alternate repeat by repeat, vs bf16 = "
          f"median of the per-repeat ratios (llama.cpp: over our bf16 median)")
    print(f"{'model':<20} {'batch':>5} {'weights':>8} {'tok/s':>9} {'min-max':>19} "
          f"{'step MiB':>9} {'limit':>9} {'of limit':>8} {'vs bf16':>7} {'floor':>6}")
    rows = results["weights"]
    bf16 = {(r["model"], r["batch"]): r["median"] for r in rows
            if r["weights"] == "bf16" and "peer" not in r}
    for r in rows:
        name = r["weights"] if "peer" not in r else f"{r['peer']} {r['weights']}"
        spread = f"{r['min']:.1f}-{r['max']:.1f}"
        line = f"{r['model']:<20} {r['batch']:>5} {name:>8} {r['median']:9.1f} {spread:>19}"
        if "peer" in r:
            line += f" {'':>9} {'':>9} {'':>8}"
        else:
            line += (f" {r['step_mib']:9.1f} {r['limit']:9.1f} "
                     f"{r['median'] / r['limit']:8.2f}")
        base = bf16.get((r["model"], r["batch"]))
        ratio = r.get("vs_bf16", r["median"] / base if base and "peer" in r else None)
        line += f" {ratio:7.2f}" if ratio else f" {'-':>7}"
        floor = DECODE_FLOORS.get(r["weights"]) if r["batch"] == 1 and "peer" not in r else None
        if floor and ratio:
            line += f" {'>=' + str(floor):>6}" + ("" if ratio >= floor else " MISSED")
        print(line)
    print(f"peak memory (max RSS of this process): {results['peak_rss_mib']:.0f} MiB")


# issue 31's floors: batch-1 tokens/s over bf16's
DECODE_FLOORS = {"q8_0": 1.7, "q4_0": 2.6}


def print_quality(args, results):
    """Each precision's validation loss, then bf16's difference."""
    fp32, bf16 = results["fp32"][0], results["bf16"][0]
    for precision, (val, seconds) in results.items():
        print(f"{precision}: val loss {val:.4f} after {args.quality} steps ({seconds:.0f} s)")
    print(f"bf16 - fp32: {bf16 - fp32:+.4f} ({(bf16 - fp32) / fp32 * 100:+.2f}%)")


def _step_row(name, t, tokens, width):
    """One training step's line: ms (median, min-max) and tokens/s."""
    return (f"  {name:<{width}} {t['median'] * 1e3:9.1f} ms  ({t['min'] * 1e3:.1f}-"
            f"{t['max'] * 1e3:.1f})  {tokens / t['median']:7.0f} tok/s")


def print_lora(args, results):
    """The three steps (ours with LoRA, ours fully fine-tuned, peft's), then
    LoRA's speed over each and peak memory beside peft's, against the floors."""
    from .lora import ALPHA, FLOORS, RANK, TARGETS
    B, T = args.batch
    steps = results["step"]
    print(f"threads: {results['threads']}; kernels: {results['isa']}")
    print(f"training step, Qwen3-0.6B shapes, {args.layers} layers, random weights, B={B} "
          f"T={T}; LoRA r={RANK} alpha={ALPHA} on {','.join(TARGETS)} (median, min-max; peak "
          f"RSS of each one's own process; ours: also the model's memory plan):")
    for name, t in steps.items():
        if t is None:
            print(f"  {name:<20} not installed")
            continue
        plan = f" (plan {t['planned_mib']:.0f})" if "planned_mib" in t else ""
        print(f"{_step_row(name, t, B * T, 20)}  {t['peak_rss_mib']:6.0f} MiB{plan}")
    ours = steps["llmc_py_lora"]
    rounds = ours.get("rounds_over", {})
    for name, floor in FLOORS.items():
        if steps.get(name):
            per_round = rounds.get(name, [steps[name]["median"] / ours["median"]])
            ratio = statistics.median(per_round)
            spread = (f", the median of {len(per_round)} rounds' "
                      f"{', '.join(f'{r:.2f}' for r in per_round)}" if len(per_round) > 1 else "")
            print(f"  llmc_py_lora over {name}: {ratio:.2f}x the speed{spread} (floor {floor}x: "
                  f"{'met' if ratio >= floor else 'NOT met'})")
    if steps.get("peft_bf16"):
        theirs = steps["peft_bf16"]["peak_rss_mib"]
        print(f"  peak RSS: llmc_py_lora {ours['peak_rss_mib']:.0f} MiB, peft_bf16 "
              f"{theirs:.0f} MiB (floor: at most peft's: "
              f"{'met' if ours['peak_rss_mib'] <= theirs else 'NOT met'})")
    print(f"peak memory (max RSS of this process): {results['peak_rss_mib']:.0f} MiB")


def print_lora_quality(args, results):
    """The base's loss on each half, then each fine-tuning's on the held-out one."""
    from .quality import LORA_BASE_MODEL, LORA_RANK
    base_steps, steps = args.lora_quality
    plays = results["plays"]
    print(f"{LORA_BASE_MODEL} trained {base_steps} steps on {plays['base']} plays, fine-tuned "
          f"{steps} steps on the other {plays['tune']}; val loss on the held-out plays' "
          f"validation split:")
    print("| model | val loss (held-out plays) | perplexity | fine-tuning s |")
    print("|---|---|---|---|")
    print(f"| base, before fine-tuning | {results['before']:.4f} | "
          f"{math.exp(results['before']):.2f} | - |")
    for name, label in (("lora", f"LoRA r={LORA_RANK}, {steps} steps"),
                        ("full", f"full fine-tuning, {steps} steps")):
        loss, seconds = results[name]
        print(f"| {label} | {loss:.4f} | {math.exp(loss):.2f} | {seconds:.0f} |")
    print(f"(the base on its own plays' validation split: {results['base']:.4f})")


def print_moe(args, results):
    """The steps (ours MoE and dense in fp32 and bf16, transformers'), the
    ratios against the floors, then decoding at batch 1 and 8."""
    from .moe import DENSE_CEILING, DENSE_MLP, FLOORS, MOE_MLP
    B, T = args.batch
    steps = results["step"]
    print(f"threads: {results['threads']}; kernels: {results['isa']}")
    print(f"training step (forward_backward + AdamW), Llama-style, {args.layers} layers, "
          f"B={B} T={T}: {MOE_MLP['num_experts']} experts of {MOE_MLP['expert_hidden']} "
          f"top-{MOE_MLP['experts_per_token']} against a dense SwiGLU of "
          f"{DENSE_MLP['ffn_hidden']} (median, min-max):")
    for name, t in steps.items():
        print(f"  {name:<32} not installed" if t is None else _step_row(name, t, B * T, 32))
    for precision, theirs in (("fp32", "fp32"), ("bf16", "autocast_bf16")):
        ours = steps[f"llmc_py_moe_{precision}"]["median"]
        ratio = ours / steps[f"llmc_py_dense_{precision}"]["median"]
        print(f"  {precision}: our MoE / our dense: {ratio:.2f}x the time (ceiling "
              f"{DENSE_CEILING}x: {'met' if ratio <= DENSE_CEILING else 'NOT met'})")
        if steps.get(f"transformers_moe_{theirs}"):
            moe = steps[f"transformers_moe_{theirs}"]["median"]
            ratio = moe / ours
            print(f"  {precision}: transformers MoE ({theirs}) / our MoE: {ratio:.2f}x the "
                  f"time (floor {FLOORS[precision]}x: "
                  f"{'met' if ratio >= FLOORS[precision] else 'NOT met'}); its MoE / its "
                  f"dense: {moe / steps[f'transformers_dense_{theirs}']['median']:.2f}x")
    prompt_len, new_tokens = args.gen
    print(f"greedy decoding, fp32, KV cache, {new_tokens} new tokens after {prompt_len} "
          f"(median, min-max):")
    for batch, rows in results["decode"].items():
        for name, t in rows.items():
            print(f"  batch {batch:<3} {name:<16} {t['median']:8.2f} s  ({t['min']:.2f}-"
                  f"{t['max']:.2f})  {int(batch) * new_tokens / t['median']:8.1f} tok/s")
    print(f"peak memory (max RSS of this process): {results['peak_rss_mib']:.0f} MiB")


def print_profile(args, results):
    """The profiled step's rows by phase (each with its rate beside the
    peak), the time between the kernels, then every GEMM call of the step
    replayed alone and the step over their sum."""
    from .profile import ZERO_GRAD
    p = results
    peaks = p["peaks"]
    plain = p["unprofiled_ms"]
    print(f"threads: {p['threads']}; kernels: {p['isa']}, {p['precision']}; training step "
          f"(zero_grad, forward_backward, AdamW), {p.get('model', 'GPT-2')} {p['layers']} layers, "
          f"B={p['B']} T={p['T']}; {p['repeats']} profiled steps, medians")
    print(f"peaks in this run: our GEMM {peaks['gemm_n']}^3 ({peaks['gemm']}) "
          f"{peaks['gemm_gflops']:.1f} GFLOP/s; streaming (residual add, {peaks['copy_mib']} "
          f"MiB arrays) {peaks['copy_gbps']:.1f} GB/s (bytes read + written)")
    print(f"step: {p['step_ms']:.1f} ms profiled, {plain['median']:.1f} ms unprofiled "
          f"({plain['min']:.1f}-{plain['max']:.1f}); the kernels {p['kernels_ms']:.1f} ms "
          f"({p['kernels_ms'] / p['step_ms']:.1%})")
    print(f"{'phase':<9}{'row':<30}{'B*T x C x OC':>18}{'calls':>6}{'ms/step':>10}{'share':>8}"
          f"{'rate':>18}{'of peak':>8}")
    zero_grad = None
    for r in p["rows"]:
        if r["row"] == ZERO_GRAD:
            zero_grad = r
            continue
        print(f"{r['phase']:<9}{r['row']:<30}{r['shape']:>18}{r['calls']:6d}{r['ms']:10.2f}"
              f"{r['share']:8.1%}{r['rate']:10.1f} {r['unit']:<7}{r['of_peak']:8.2f}")
    print(f"{'':<9}{'between the kernels':<54}{p['between_ms']:10.2f}"
          f"{p['between_ms'] / p['step_ms']:8.1%}")
    if zero_grad:
        r = zero_grad
        print(f"{'':<9}{'  of which ' + ZERO_GRAD:<54}{r['ms']:10.2f}{r['share']:8.1%}")
    print("  rates: a GEMM's 2*M*N*K FLOP per product (a backward's dinp, dW and dbias timed "
          "as calls of their own); attention's 2*hs FLOP per causal (query, key) pair and "
          "product, 2 forward, 5 backward (the scores again, dP, dq, dk, dv); GB/s: each "
          "array argument's bytes, twice for an output added into or updated")
    print("  between the kernels: the step less its kernel calls: Python, the numpy zeroing "
          "left (activation gradients that no kernel writes first, d.qkvr[...] = 0.0, ...), "
          "the loss's sum, allocation, and the profiler's timing of each call (profiled - "
          "unprofiled is its cost); zero_grad's fill of the gradients that no weight-gradient "
          "product writes first is the update's fill_zero")
    alone = p["matmuls_alone"]
    print(f"\nmatmuls alone: each GEMM call of a step replayed on fresh arrays of its shapes "
          f"and dtypes (median of {p['repeats']}), beside its time in the profiled step")
    print(f"{'row':<20}{'kernel':<22}{'B*T x C x OC':>18}{'calls':>6}{'ms alone':>10}"
          f"{'ms in step':>11}")
    for r in alone["rows"]:
        print(f"{r['row']:<20}{r['kernel']:<22}{r['shape']:>18}{r['calls']:6d}"
              f"{r['alone_step_ms']:10.2f}{r['in_step_ms']:11.2f}")
    ratio = alone["step_over_matmuls"]
    print(f"step {plain['median']:.1f} ms (unprofiled) over its matmuls alone "
          f"{alone['total_ms']:.1f} ms: {ratio:.2f}x (issue 32's floor: within 1.12x: "
          f"{'met' if ratio <= 1.12 else 'NOT met'})")
    print(f"peak RSS of the step's process (after the steps): {p['step_peak_rss_mib']:.0f} MiB "
          f"(plan {p['planned_mib']:.0f})")
