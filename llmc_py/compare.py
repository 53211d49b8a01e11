"""Train several variants on the same data, tokens and budget, one process
each, and compare them: ``python -m llmc_py.compare [SUITE ...]``.

Each variant is a run of ``python -m llmc_py.train`` with the suite's common
flags and its own; the table (markdown, printed and written to
OUT/SUITE.md) has the final validation loss and perplexity, the median step
time, tokens/s, the process's peak memory and the parameter count, and
OUT/SUITE.png draws the loss curves (with matplotlib). A suite with
``lengths`` also evaluates each trained model on the validation text at
those multiples of the trained length (llmc_py.eval; "n/a" where a learned
position table ends); a variant with ``scale_rope`` evaluates there with
its RoPE scaled by the multiple (that rope_scaling kind). ``--`` passes
further flags to every run (e.g. ``-- -x 50`` for a quick look).
"""
import argparse
import json
import math
import re
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from .cli import command
from .errors import LlmcError, UsageError

# flags every variant shares unless a suite says otherwise: a d4-sized model
# on the default Shakespeare set, evaluated at the end
COMMON = ["-e", "d4", "-b", "8", "-t", "128", "-x", "200", "-v", "50", "-m", "10",
          "-s", "0", "-n", "0"]
LLAMA = ["--arch", "llama"]
# 8 experts of half the dense MLP's hidden size (d4's SwiGLU: 768), balanced
MOE = ["--experts", "8", "--expert-hidden", "384", "--router-aux-loss", "0.01"]
SUITES = {
    "gpt2-vs-llama": {
        "about": "GPT-2 style (learned positions, LayerNorm, GELU, multi-head) against "
                 "Llama style (RoPE, RMSNorm, SwiGLU, GQA)",
        "decode": True,
        "variants": {"gpt2": [],
                     "llama": LLAMA + ["--kv-heads", "2"]}},
    "mlp": {
        "about": "MLPs at about equal parameter count: ReLU and GELU of 4C, SwiGLU and GeGLU "
                 "of 2/3 of that (three matrices)",
        "variants": {name: LLAMA + ["--kv-heads", "4", "--mlp", name]
                     for name in ("relu", "gelu", "swiglu", "geglu")}},
    "norm-placement": {
        "about": "pre-norm, post-norm and the parallel block at a high learning rate (6e-3) "
                 "without warmup; attention entropy in each run's metrics.jsonl",
        "variants": {name: LLAMA + ["--block", name, "-l", "6e-3", "-u", "0",
                                    "--monitor-every", "25"]
                     for name in ("pre", "post", "parallel")}},
    "heads": {
        "about": "multi-head, grouped-query (2 groups of 2) and multi-query attention",
        "decode": True,
        "variants": {"mha": LLAMA + ["--kv-heads", "4"],
                     "gqa": LLAMA + ["--kv-heads", "2"],
                     "mqa": LLAMA + ["--kv-heads", "1"]}},
    "extrapolation": {
        "about": "positions trained at T = 128, evaluated at 1x, 2x and 4x that length",
        "lengths": (1, 2, 4),
        "variants": {"learned": LLAMA + ["--position", "learned"],
                     "sinusoidal": LLAMA + ["--position", "sinusoidal"],
                     "rope": LLAMA + ["--position", "rope"],
                     "rope + linear scaling": {"flags": LLAMA + ["--position", "rope"],
                                               "scale_rope": "linear"},
                     "rope + ntk scaling": {"flags": LLAMA + ["--position", "rope"],
                                            "scale_rope": "ntk"},
                     "alibi": LLAMA + ["--position", "alibi"]}},
    "moe": {
        "about": "a dense SwiGLU of 768 against 8 experts of 384: top-2 (the dense model's "
                 "active parameters), top-1, without the load-balancing loss, and a dense "
                 "model of 3072 (the experts' total parameters)",
        "routing": True,
        "variants": {"dense 768": LLAMA + ["--ffn-hidden", "768"],
                     "moe 8x384 top-2": LLAMA + MOE + ["--experts-per-token", "2"],
                     "moe 8x384 top-1": LLAMA + MOE + ["--experts-per-token", "1"],
                     "moe 8x384 top-2, no balance loss":
                         LLAMA + MOE + ["--experts-per-token", "2", "--router-aux-loss", "0"],
                     "dense 3072 (equal total)": LLAMA + ["--ffn-hidden", "3072"]}},
}
# moe is asked for by name: its table is README's own section
DEFAULT_SUITES = tuple(name for name in SUITES if name != "moe")
_STEP = re.compile(r"took ([0-9.]+) ms")
_PARAMS = re.compile(r"([0-9.]+)M parameters")


def run_variant(folder, flags, lengths=(), scale_rope=None, decode=False, routing=False,
                timeout=None):
    """Trains one variant into ``folder`` (and evaluates it at ``lengths``,
    multiples of its T, times its decoding if ``decode`` and counts its
    experts' tokens if ``routing``); returns its result row (a dict)."""
    folder.mkdir(parents=True, exist_ok=True)
    evaluation = ["--lengths", *map(str, lengths)] if lengths else []
    if scale_rope:
        evaluation += ["--scale-rope", scale_rope]
    if decode:
        evaluation += ["--decode"]
    if routing:
        evaluation += ["--routing"]
    command = [sys.executable, "-m", "llmc_py.compare", "--child", str(folder), *evaluation,
               "--", *flags, "-o", str(folder / "run"), "--overwrite"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    (folder / "stdout.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {done.returncode}: {last}"}
    steps = [float(ms) for ms in _STEP.findall(done.stdout)]
    log = (folder / "run" / "main.log").read_text().splitlines()
    val = [float(line.split("tel:")[1]) for line in log if " tel:" in line]
    tokens = _tokens_per_step(flags)
    ms = statistics.median(steps[1:] if len(steps) > 1 else steps)
    child_results = json.loads((folder / "peak.json").read_text())
    row = {"val loss": val[-1] if val else math.nan,
           "perplexity": math.exp(val[-1]) if val else math.nan,
           "ms/step": ms, "tokens/s": tokens / (ms / 1000),
           "peak MiB": child_results["peak_mib"],
           "parameters (M)": float(_PARAMS.search(done.stdout).group(1))}
    for multiple, loss in child_results.get("lengths", {}).items():
        row[f"loss @ {multiple}x T"] = loss
    row.update(child_results.get("decode", {}))
    row.update(child_results.get("routing", {}))
    row.update(monitor_columns(folder / "run" / "metrics.jsonl"))
    return row


MONITOR_COLUMNS = ("attention entropy", "mean cosine")


def monitor_columns(path):
    """From a run's monitor records (metrics.jsonl, when --monitor-every was
    given): the mean normalised attention entropy over layers and heads (1:
    uniform, 0: one key) and the last layer's mean cosine between token
    vectors, each as "first -> last" record."""
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        return {}
    first, last = records[0], records[-1]
    entropy = lambda r: statistics.fmean(v for layer in r["attention_entropy_normalized"]
                                         for v in layer)
    return {"attention entropy": f"{entropy(first):.2f} -> {entropy(last):.2f} "
                                 f"(steps {first['step']} -> {last['step']})",
            "mean cosine": f"{first['mean_cosine'][-1]:.2f} -> {last['mean_cosine'][-1]:.2f}"}


def _tokens_per_step(flags):
    """B * T (or -d) of a run's flags (the last of each wins, as argparse does)."""
    values = {}
    for flag, value in zip(flags, flags[1:]):
        values[flag] = value
    total = int(values.get("-d", 0))
    return total or int(values.get("-b", 8)) * int(values.get("-t", 128))


def curves(folder):
    """({step: train loss}, {step: val loss}) of a variant's run."""
    from .plot import read_log
    return read_log(folder / "run" / "main.log")


def table(rows):
    """A markdown table of {variant: row}."""
    columns = ["val loss", "perplexity", "ms/step", "tokens/s", "peak MiB", "parameters (M)"]
    columns += [c for c in DECODE_COLUMNS + MONITOR_COLUMNS + ROUTING_COLUMNS
                if any(c in row for row in rows.values())]
    columns += sorted({c for row in rows.values() for c in row if c.startswith("loss @")},
                      key=lambda c: int(c.split()[2][:-1]))
    lines = ["| variant | " + " | ".join(columns) + " |",
             "|---|" + "---|" * len(columns)]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | " + row["error"] + " |" + " |" * (len(columns) - 1))
            continue
        cells = [_cell(c, row.get(c)) for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(column, value):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, str):
        return value
    if column in ("val loss", "perplexity") or column.startswith("loss @"):
        return f"{value:.4f}"
    if column in ("parameters (M)", "active parameters (M)", "KV cache MiB"):
        return f"{value:.1f}"
    return f"{value:.0f}"


def draw(path, title, folders):
    """The variants' train (thin) and val (dots) loss curves, if matplotlib is there."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, folder in folders.items():
        if not (folder / "run" / "main.log").exists():
            continue
        train, val = curves(folder)
        line, = ax.plot(list(train), list(train.values()), lw=0.8, label=f"{name} train")
        if val:
            ax.plot(list(val), list(val.values()), "o-", color=line.get_color(),
                    label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def child(folder, flags, lengths=(), scale_rope=None, decode=False, routing=False):
    """--child: one variant's training in this process, its peak RSS (before
    any evaluation), the final model's validation loss at ``lengths``
    (multiples of T), with ``decode`` its decoding speed and with
    ``routing`` its experts' load."""
    from .train.cli import build_parser, main as train
    code = train(flags)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
    if sys.platform == "darwin":
        peak /= 1024   # bytes there
    results = {"peak_mib": peak}
    if code == 0 and lengths:
        args = build_parser().parse_args(flags)
        results["lengths"] = evaluate_lengths(args, lengths, scale_rope)
    if code == 0 and decode:
        results["decode"] = time_decoding(build_parser().parse_args(flags))
    if code == 0 and routing:
        results["routing"] = expert_load(build_parser().parse_args(flags))
    (Path(folder) / "peak.json").write_text(json.dumps(results))
    return code


DECODE_BATCH, DECODE_PROMPT, DECODE_TOKENS = 8, 16, 240
DECODE_COLUMNS = ("KV cache MiB", "decode tokens/s")


def time_decoding(args):
    """The final model's KV cache size and decoding speed: DECODE_BATCH rows
    of a DECODE_PROMPT-token prompt, then DECODE_TOKENS steps (median step
    time; tokens/s counts every row's token)."""
    import time
    import numpy as np
    from .generate import Decoder
    model = final_model(args)
    decoder = Decoder(model, DECODE_BATCH, DECODE_PROMPT + DECODE_TOKENS)
    rng = np.random.default_rng(0)
    decoder.prefill(rng.integers(0, model.config.vocab_size, (DECODE_BATCH, DECODE_PROMPT)))
    times = []
    for _ in range(DECODE_TOKENS):
        tokens = rng.integers(0, model.config.vocab_size, DECODE_BATCH)
        start = time.perf_counter()
        decoder.step(tokens)
        times.append(time.perf_counter() - start)
    return {"KV cache MiB": decoder.cache.nbytes / 2**20,
            "decode tokens/s": DECODE_BATCH / statistics.median(times)}


def final_model(args):
    """The last checkpoint of a finished run, loaded."""
    from .model import load_model
    from .train.run_folder import RunFolder
    folder = RunFolder(args.output_dir)
    return load_model(folder.checkpoint_paths(folder.completed_steps()[-1])[0])


ROUTING_BATCHES = 8
ROUTING_COLUMNS = ("expert load max/min", "active parameters (M)")


def expert_load(args):
    """The final model's routing on the validation text (up to
    ROUTING_BATCHES batches of the run's B x T): per MoE layer, the most
    tokens any expert received over the fewest ("inf": an expert received
    none), from the top-k choices the forward pass stores; and the
    parameters a token passes through (summary's active count). A dense
    model: its active parameters only."""
    import numpy as np
    from .eval import read_text
    from .summary import active_parameter_counts
    model = final_model(args)
    c = model.config
    row = {"active parameters (M)": sum(active_parameter_counts(c).values()) / 1e6}
    if not c.num_experts:
        return row
    tokens, _ = read_text(args.val_data or "data/shakespeare/val.bin", c.vocab_size)
    B, T = args.batch_size, args.seq_len
    batches = min(ROUTING_BATCHES, (len(tokens) - 1) // (B * T))
    counts = np.zeros((c.num_moe_layers, c.num_experts), np.int64)
    for i in range(batches):
        model.forward(tokens[i * B * T:(i + 1) * B * T].reshape(B, T), keep_activations=True)
        chosen = model.acts.topk_index.view(np.int32).reshape(c.num_moe_layers, -1)
        counts += [np.bincount(layer, minlength=c.num_experts) for layer in chosen]
    ratios = [f"{most / fewest:.2f}" if fewest else "inf"
              for most, fewest in zip(counts.max(axis=1), counts.min(axis=1))]
    row["expert load max/min"] = " ".join(ratios)
    return row


def evaluate_lengths(args, multiples, scale_rope=None):
    """{multiple: val loss} of a finished run's final model at multiple * T
    tokens of context (None where a learned table ends); with ``scale_rope``,
    each at a RoPE scaled by its multiple."""
    import dataclasses
    from .errors import UsageError
    from .eval import evaluate_length, read_text
    model = final_model(args)
    tokens, trained = read_text(args.val_data or "data/shakespeare/val.bin",
                                model.config.vocab_size)
    losses = {}
    for multiple in multiples:
        length = multiple * args.seq_len
        scaled = model
        if scale_rope and multiple > 1:
            config = dataclasses.replace(model.config, rope_scaling=scale_rope,
                                         rope_factor=float(multiple))
            scaled = type(model)(config, params=model.params.memory)
        try:
            losses[multiple] = evaluate_length(scaled, tokens, length, trained=trained)[0]
        except UsageError:
            losses[multiple] = None   # past a learned position table
    return losses


def build_parser():
    p = argparse.ArgumentParser(prog="python -m llmc_py.compare",
                                description=__doc__.split("\n")[0])
    p.add_argument("suites", nargs="*", help=f"of {', '.join(SUITES)} (default: "
                                             f"{' '.join(DEFAULT_SUITES)})")
    p.add_argument("--out", default="compare", help="folder for the runs, tables and plots")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--lengths", type=int, nargs="*", default=(), help=argparse.SUPPRESS)
    p.add_argument("--scale-rope", help=argparse.SUPPRESS)
    p.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--routing", action="store_true", help=argparse.SUPPRESS)
    return p


def parse(argv):
    """The flags, and the training flags after "--" (given to every variant)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    args = build_parser().parse_args(argv)
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        raise UsageError(f"unknown suite(s) {unknown}; known: {', '.join(SUITES)}")
    return args, extra


def run_suite(suite, out, extra):
    """Trains each variant of ``suite`` under out/suite, then prints and
    writes its table and draws its loss curves; the number of runs that failed."""
    spec = SUITES[suite]
    folders = {name: out / suite / re.sub(r"\W+", "-", name) for name in spec["variants"]}
    rows = {}
    for name, variant in spec["variants"].items():
        print(f"{suite}: training {name} ...", flush=True)
        if isinstance(variant, list):
            variant = {"flags": variant}
        rows[name] = run_variant(folders[name], COMMON + variant["flags"] + extra,
                                 spec.get("lengths", ()), variant.get("scale_rope"),
                                 spec.get("decode", False), spec.get("routing", False))
    text = f"## {suite}: {spec['about']}\n\n{table(rows)}\n"
    (out / f"{suite}.md").write_text(text)
    print(text)
    if draw(out / f"{suite}.png", spec["about"], folders):
        print(f"loss curves: {out / f'{suite}.png'}")
    return sum("error" in row for row in rows.values())


@command
def main(argv=None):
    args, extra = parse(argv)
    if args.child:
        return child(args.child, extra, args.lengths, args.scale_rope, args.decode,
                     args.routing)
    out = Path(args.out)
    failed = sum(run_suite(suite, out, extra) for suite in args.suites or DEFAULT_SUITES)
    if failed:
        raise LlmcError(f"{failed} run(s) failed; see their stdout.txt under {out}")


if __name__ == "__main__":
    sys.exit(main())
