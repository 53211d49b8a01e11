"""Train a GPT-2 or a Llama-style model: ``python -m llmc_py.train`` (``--help``
for every flag; ``--arch llama`` and its choices for the Llama family).

With no arguments it prepares the Shakespeare dataset if it is missing and
trains a small GPT-2 from scratch (DEFAULT_MODEL), printing progress,
evaluating, sampling and checkpointing into ``out/`` (train.run_folder).
Flags follow llm.c's train_gpt2 where one exists (-i -j -e -o -b -t -x -l -u
-q -k -c -v -m -s -g -n -y -a -d), with long names too. This module reads the
command line and sequences the run; the step itself is train.loop.Trainer.
"""
import argparse
import hashlib
import math
import os
import signal
import sys
import time
import types
from pathlib import Path

import numpy as np

from .._native.lib import set_num_threads
from ..config import MODEL_FLAGS
from ..errors import CheckpointError, LlmcError, UsageError, WriteError
from ..io.files import atomic_write
from ..io.tokens import fingerprint
from ..flags import FRACTION, NON_NEGATIVE, POSITIVE, SEED, Range, check_flags
from ..generate import stream
from ..model import PRECISIONS, load_model
from ..model.presets import GPT2_VOCAB, config_from_depth, describe, preset_for
from ..model.dropout import RATES as DROPOUT_SITES, Dropout
from ..model.transformer import INIT_SCHEMES, INIT_STD
from ..model.memory import return_freed_scratch
from ..monitors import Monitor
from . import distributed
from .distributed import RankRows, ShardedAdamW, Solo, raise_injected_fault
from .loop import Trainer, evaluate, perplexity
from .optimizer import DECAY_ON, AdamW
from .resume import resume_changes, usable_checkpoint
from .run_folder import RunFolder
from .signals import StopSignals, Stopped
from .schedule import SCHEDULES, LRSchedule

DEFAULT_MODEL = "d4"            # 4 layers, 256 channels, 4 heads: 16.3M parameters
DEFAULT_DATASET = "shakespeare"


# ---- configuration -----------------------------------------------------------

def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m llmc_py.train",
        description="Train a GPT-2 or a Llama-style model on token files (llm.c's format) "
                    "with the C kernels.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("-i", "--train-data", default=None,
      help="glob of training token files (default: the Shakespeare set, prepared if missing)")
    a("-j", "--val-data", default=None, help="glob of validation token files")
    a("-e", "--init", default=DEFAULT_MODEL,
      help="an llm.c model file or a Hugging Face model folder (GPT-2, Llama, Qwen3) to start "
           "from (fine-tune), or a depth like d6 for a fresh model (d12 is GPT-2 124M's shape)")
    a("--tokenizer", default=None,
      help="a tokenizer.json, or a folder holding one, for the default dataset and samples "
           "(default: -e's when it is a Hugging Face folder with one, else GPT-2's); give "
           "it (or the same -e) again when resuming")
    a("--export-hf", metavar="DIR", default=None,
      help="at the end, also write the model as a Hugging Face folder (config.json, "
           "model.safetensors and -e's tokenizer files)")
    a("-o", "--output-dir", default="out", help="folder for the log and checkpoints")
    a("-b", "--batch-size", type=int, default=8, help="B: sequences per micro-batch")
    a("-t", "--seq-len", type=int, default=128, help="T: tokens per sequence")
    a("-d", "--total-batch-tokens", type=int, default=0,
      help="tokens per optimizer step; a multiple of B*T > B*T accumulates gradients "
           "(0: B*T)")
    a("-x", "--max-steps", type=int, default=500, help="optimizer steps to train in all")
    a("-l", "--learning-rate", type=float, default=1e-3, help="peak learning rate")
    a("-u", "--warmup-steps", type=int, default=25, help="steps of linear warmup")
    a("-q", "--final-lr-fraction", type=float, default=0.1,
      help="learning rate at the end, as a fraction of the peak")
    a("-k", "--schedule", choices=SCHEDULES, default="cosine",
      help="learning-rate decay after warmup")
    a("-c", "--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    a("--decay-on", choices=DECAY_ON, default="matrices",
      help="matrices: decay the weight matrices only (wte, wpe, qkvw, attprojw, fcw, fcprojw, "
           "lm_head), not biases or norm weights; all: every parameter (llm.c's "
           "train_gpt2.c)")
    a("--beta1", type=float, default=0.9, help="AdamW beta1")
    a("--beta2", type=float, default=0.95,
      help="AdamW beta2 (nanoGPT's and llm.c's GPU trainer's choice; train_gpt2.c uses 0.999)")
    a("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    a("--grad-clip", type=float, default=1.0,
      help="clip the global gradient norm to this (0: no clipping)")
    a("-v", "--val-every", type=int, default=50, help="evaluate every N steps (0: never)")
    a("-m", "--val-batches", type=int, default=10, help="batches per evaluation")
    a("-s", "--sample-every", type=int, default=100, help="print a sample every N steps (0: never)")
    a("-g", "--gen-tokens", type=int, default=64, help="tokens per sample")
    a("-n", "--checkpoint-every", type=int, default=100,
      help="write a checkpoint every N steps (0: only at the end)")
    a("-nk", "--keep-checkpoints", type=int, default=0,
      help="keep only the last N checkpoints (0: keep all)")
    a("--keep-best", type=int, choices=(0, 1), default=0,
      help="1: also keep the model with the lowest validation loss so far as "
           "OUT/model_best.bin (its step and loss in OUT/best.json), which -nk never removes")
    a("-y", "--resume", type=int, choices=(0, 1), default=0,
      help="1: resume from the newest complete checkpoint in the output folder")
    a("--overwrite", action="store_true",
      help="start a new run in an output folder that holds another run's checkpoints, "
           "removing them (without it such a folder is refused)")
    a("-a", "--overfit-single-batch", type=int, choices=(0, 1), default=0,
      help="1: train on one batch over and over (a sanity check)")
    a("--shuffle", type=int, choices=(0, 1), default=0,
      help="1: visit training windows in a seeded random order")
    a("--seed", type=int, default=1337, help="seed for initialisation, shuffling and sampling")
    a("--precision", choices=PRECISIONS, default="fp32",
      help="bf16: mixed precision (bf16 matmuls on a bf16 copy of the weights; float32 "
           "master weights, gradients, optimizer state and statistics)")
    a("--dropout", type=float, default=0.0,
      help="dropout probability in training at every site: the embedding's output, the "
           "attention probabilities and each residual branch's output (0: none; evaluation "
           "and sampling never drop)")
    for site, what in zip(DROPOUT_SITES, ("the embedding's output",
                                          "the attention probabilities",
                                          "each residual branch's output")):
        a(f"--dropout-{site}", type=float, default=None,
          help=f"dropout probability on {what} (default: --dropout's)")
    a("--recompute", type=int, choices=(0, 1), default=0,
      help="1: keep the norm outputs and the MLP activation for one layer only and "
           "recompute them in backward (less memory, the same results, a little slower)")
    a("--threads", type=int, default=0, help="kernel threads (0: OpenMP's default)")
    a("--init-scheme", choices=INIT_SCHEMES, default="gpt2",
      help="a fresh model's weight matrices: gpt2 (normal, --init-std, residual projections "
           "/ sqrt(2L)), xavier_normal or xavier_uniform")
    a("--init-std", type=float, default=INIT_STD, help="gpt2 scheme: the std")
    a("--zero", type=int, choices=(0, 1), default=0,
      help="under mpiexec: 1 keeps each rank's shard of AdamW's moments only (ZeRO-1)")
    a("--monitor-every", type=int, default=0,
      help="every N steps, measure attention entropy, representation collapse, per-layer "
           "gradient norms and update ratios on a fixed validation batch and append them "
           "to OUT/metrics.jsonl (0: never; needs validation data)")
    a("--monitor-entropy-min", type=float, default=0.1,
      help="with --monitor-every: warn when a head's mean attention entropy (nats) falls "
           "below this (0: never)")
    a("--monitor-cosine-max", type=float, default=0.99,
      help="with --monitor-every: warn when a layer's mean cosine between token vectors "
           "rises above this (1: never)")
    a("--data-dir", default="data", help="where the default dataset is prepared")
    llama = p.add_argument_group(
        "model family", "for a fresh model (-e dN); a model file carries its own choices")
    llama.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                       help="gpt2: llm.c's GPT-2; llama: the decoder with the choices below")
    for field in MODEL_FLAGS.values():
        llama.add_argument(field.flag.name, **field.flag_options())
    return p


def dropout_from_args(args):
    """The run's Dropout: --dropout at every site unless a site's own flag
    says otherwise; its masks come from --seed."""
    rates = {site: getattr(args, f"dropout_{site}") for site in DROPOUT_SITES}
    try:
        return Dropout(**{site: args.dropout if p is None else p for site, p in rates.items()},
                       seed=args.seed)
    except ValueError as e:   # a probability that rounds to 1 in float32
        raise UsageError(f"--dropout: {e}") from None


def describe_dropout(dropout):
    """"dropout P", or each site's when they differ."""
    rates = [getattr(dropout, site) for site in DROPOUT_SITES]
    if len(set(rates)) == 1:
        return f"dropout {rates[0]:g}"
    return "dropout " + ", ".join(f"{site} {p:g}" for site, p in zip(DROPOUT_SITES, rates))


def schedule_from_args(args):
    return LRSchedule(peak=args.learning_rate, total_steps=args.max_steps,
                      warmup_steps=args.warmup_steps, kind=args.schedule,
                      final_fraction=args.final_lr_fraction)


def lr_at(step, args):
    """The learning rate for optimizer step ``step`` (1-based)."""
    return schedule_from_args(args)(step)


BELOW_ONE = Range(lo=0, hi=1, hi_open=True, text="in [0, 1)")
# every numeric flag's allowed values
FLAG_RANGES = {
    "batch_size": POSITIVE, "seq_len": POSITIVE, "total_batch_tokens": NON_NEGATIVE,
    "max_steps": POSITIVE, "learning_rate": POSITIVE, "warmup_steps": NON_NEGATIVE,
    "final_lr_fraction": FRACTION, "weight_decay": NON_NEGATIVE,
    "beta1": BELOW_ONE, "beta2": BELOW_ONE, "adam_eps": POSITIVE,
    "grad_clip": NON_NEGATIVE, "val_every": NON_NEGATIVE, "val_batches": POSITIVE,
    "sample_every": NON_NEGATIVE, "gen_tokens": POSITIVE, "checkpoint_every": NON_NEGATIVE,
    "keep_checkpoints": NON_NEGATIVE, "seed": SEED, "threads": NON_NEGATIVE,
    **{dest: f.flag.range for dest, f in MODEL_FLAGS.items() if f.flag.range},
    "init_std": POSITIVE,
    "monitor_every": NON_NEGATIVE, "monitor_entropy_min": NON_NEGATIVE,
    "monitor_cosine_max": Range(lo=-1, hi=1, text="in [-1, 1]"),
    "dropout": BELOW_ONE, **{f"dropout_{site}": BELOW_ONE for site in DROPOUT_SITES},
}


def check_args(args):
    """Raises UsageError naming the first flag outside its range."""
    check_flags(args, FLAG_RANGES)


def grad_accum_of(args, ranks=1):
    """Micro-batches per optimizer step, from -d (0: one), the tokens of a
    step over all ``ranks`` processes (llm.c's convention: -b is per process)."""
    bt = args.batch_size * args.seq_len * ranks
    total = args.total_batch_tokens or bt
    if total % bt:
        raise UsageError(f"-d {total} is not a multiple of B*T*processes = {args.batch_size}*"
                         f"{args.seq_len}*{ranks} = {bt}")
    return total // bt


# ---- the run -------------------------------------------------------------------

class Progress:
    """A live line per step on a terminal; plain parseable lines otherwise."""

    def __init__(self, stream=None):
        self.stream = sys.stdout if stream is None else stream
        self.live = self.stream.isatty()
        self.open_line = False

    def step(self, step, total, loss, norm, lr, ms, tokens_per_s, eta_s):
        if self.live:
            self.stream.write(f"\rstep {step:5d}/{total} | loss {loss:.4f} | "
                              f"ppl {perplexity(loss):.2f} | norm {norm:.3f} | "
                              f"lr {lr:.2e} | {ms:6.0f} ms | {tokens_per_s:7.0f} tok/s | "
                              f"eta {format_seconds(eta_s)}  ")
            self.open_line = True
        else:
            self.stream.write(f"step {step}/{total}: train loss {loss:.6f} "
                              f"ppl {perplexity(loss):.4f} norm {norm:.4f} "
                              f"lr {lr:.3e} (took {ms:.1f} ms, {tokens_per_s:.0f} tok/s, "
                              f"eta {eta_s:.0f} s)\n")
        self.stream.flush()

    def say(self, text):
        if self.open_line:
            self.stream.write("\n")
            self.open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()


def format_seconds(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def build_model(args):
    """A fresh model of the -e depth, or the -e model file's."""
    config = config_from_depth(args.init, family=vars(args))
    if config is not None:
        model = preset_for(config)(config, seed=args.seed, precision=args.precision)
        if (args.init_scheme, args.init_std) != ("gpt2", INIT_STD):
            model.initialize(args.seed, args.init_scheme, args.init_std)
        return model
    if not Path(args.init).exists():
        raise UsageError(f"-e {args.init}: no such model file, and not a depth like d6")
    return load_model(args.init, precision=args.precision)


def tokenizer_source(args):
    """Where the run's tokenizer comes from: --tokenizer, else -e when it is
    a folder (a Hugging Face model's); None for GPT-2's."""
    if args.tokenizer:
        return args.tokenizer
    return args.init if Path(args.init).is_dir() else None


def check_model_fits(args, config, encoding=None):
    """Everything the flags ask of the model, checked before step 1; the
    tokenizer ``encoding`` (None: GPT-2's) must fit its vocabulary."""
    if encoding is None and config.vocab_size != GPT2_VOCAB:
        raise UsageError(f"the model's vocab_size is {config.vocab_size}; the GPT-2 tokenizer "
                         f"needs {GPT2_VOCAB} (give the model's tokenizer with --tokenizer)")
    if encoding is not None and encoding.n_vocab > config.vocab_size:
        raise UsageError(f"the model's vocab_size is {config.vocab_size}, fewer than the "
                         f"{encoding.n_vocab} tokens of {tokenizer_source(args)}")
    if config.learned_positions:
        if args.seq_len > config.max_seq_len:
            raise UsageError(f"-t {args.seq_len} is longer than the model's max_seq_len "
                             f"{config.max_seq_len}")
        if args.sample_every and args.gen_tokens > config.max_seq_len:
            raise UsageError(f"-g {args.gen_tokens}: a sample of that many tokens does not fit "
                             f"the model's max_seq_len {config.max_seq_len}")


def explicit_flags(argv):
    """The dests of the flags given on the command line ``argv``."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def run(args, out=None, argv=None, world=None):
    """The run the command line asks for; returns the exit code. ``args`` (the
    parser's namespace) is read, never changed; ``argv`` says which flags
    were given; ``world`` is train.distributed's (default: one process)."""
    progress = Progress(out)
    with StopSignals() as signals:
        try:
            return _run(args, progress, signals, explicit_flags(argv or []),
                        Solo() if world is None else world)
        except KeyboardInterrupt as stop:   # Stopped, or Ctrl-C before the handlers were in
            signum = getattr(stop, "signum", signal.SIGINT)
            if not getattr(stop, "handled", False):
                progress.say(f"stopped by {signal_name(signum)} before training started; "
                             f"nothing saved")
            return 128 + signum


def signal_name(signum):
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _run(args, progress, signals, explicit, world):
    from ..data import DataLoader, prepare_dataset   # noqa: deferred, pulls tiktoken
    from ..tokenizer import get_encoding, load_tokenizer

    check_args(args)
    grad_accum = grad_accum_of(args, world.size)
    if args.threads:
        set_num_threads(args.threads)
    folder = RunFolder(args.output_dir)
    if not world.is_root:   # the output folder is rank 0's alone
        return _train(args, progress, signals, explicit, folder, grad_accum, DataLoader,
                      prepare_dataset, get_encoding, load_tokenizer, world)
    folder.create()
    folder.lock()
    try:
        stale = folder.remove_stale_temporaries()
        if stale:
            progress.say(f"removed {stale} temporary file(s) of an interrupted save in "
                         f"{folder.path}")
        if not args.resume and folder.run_files():
            if not args.overwrite:
                raise UsageError(f"{folder.path} holds another run's checkpoints or log: "
                                 f"resume it with -y 1, remove it with --overwrite, or give "
                                 f"another -o")
            folder.clear()
            progress.say(f"removed the earlier run in {folder.path} (--overwrite)")
        return _train(args, progress, signals, explicit, folder, grad_accum, DataLoader,
                      prepare_dataset, get_encoding, load_tokenizer, world)
    finally:
        folder.unlock()


def _train(args, progress, signals, explicit, folder, grad_accum, DataLoader, prepare_dataset,
           get_encoding, load_tokenizer, world):
    root, ranks = world.is_root, world.size
    dropout = dropout_from_args(args)
    # data, in the tokens of the model's tokenizer (GPT-2's unless a
    # Hugging Face folder or --tokenizer gives another)
    source = tokenizer_source(args)
    encoding = load_tokenizer(source) if source else None
    train_data, val_data = args.train_data, args.val_data
    if train_data is None:
        from ..data.prepare import dataset_name
        for preparing in (True, False):   # rank 0 first; the others then find it ready
            if preparing == root:
                train_path, val_path = prepare_dataset(
                    DEFAULT_DATASET, args.data_dir, encoding=encoding,
                    folder=dataset_name(DEFAULT_DATASET, encoding), quiet=not root)
            world.barrier()
        train_data = str(train_path)
        if val_data is None:
            val_data = str(val_path)

    # model, optimizer, schedule
    resume_step, m, v, extra = 0, None, None, None
    if args.resume:
        if root:
            resume_step, model, m, v, extra = usable_checkpoint(folder, progress, args.precision)
            if args.max_steps < resume_step:
                raise UsageError(f"-x {args.max_steps} is below the checkpoint's step "
                                 f"{resume_step} in {folder.path}")
        # the other ranks get the checkpoint from rank 0 (they need no access to -o)
        resume_step, config, extra = world.broadcast_object(
            (resume_step, model.config, extra) if root else None)
        if not root:
            model = preset_for(config)(config, precision=args.precision)
    else:
        model = build_model(args)
        if ranks > 1:
            world.same_on_every_rank("model (-e and its file)", model_digest(model))
    if ranks > 1:   # every rank starts from rank 0's parameters
        world.broadcast(model.params.memory)
        if model.params_bf16 is not None:
            model.refresh_bf16()
    c = model.config
    check_model_fits(args, c, encoding)
    B, T = args.batch_size, args.seq_len
    model.recompute = bool(args.recompute)
    sharded = bool(args.zero) and ranks > 1
    shard = distributed.shard_bounds(model.num_parameters, ranks)[world.rank]
    # fails now if a step cannot fit in memory
    model.reserve(B, T, training=True, moment_params=shard[1] - shard[0] if sharded else None)
    adamw = dict(beta1=args.beta1, beta2=args.beta2, eps=args.adam_eps,
                 weight_decay=args.weight_decay, decay_on=args.decay_on)
    optimizer = ShardedAdamW(model, world, **adamw) if sharded else AdamW(model, **adamw)
    # each rank reads its B rows of every batch of ranks * B
    train_loader = RankRows(DataLoader(train_data, B * ranks, T, shuffle=bool(args.shuffle),
                                       seed=args.seed, vocab_size=c.vocab_size), world)
    val_loader = None
    val_batches = args.val_batches
    if val_data and args.val_every:
        val_loader = RankRows(DataLoader(val_data, B * ranks, T, vocab_size=c.vocab_size),
                              world)
        val_batches = min(val_batches, val_loader.num_batches)
    world.same_on_every_rank("training data (-i)", fingerprint(train_loader.files))
    if args.keep_best and val_loader is None:
        raise UsageError("--keep-best 1 keeps the model with the best validation loss: it "
                         "needs validation data (-j) and evaluations (-v > 0)")
    probe = None
    if args.monitor_every:
        if not val_data:
            raise UsageError("--monitor-every measures on a validation batch: give -j (the "
                             "default dataset has one)")
        if sharded:
            raise UsageError("--monitor-every reads every gradient, which --zero 1 leaves "
                             "reduced on their own rank only: use one or the other")
        probe = DataLoader(val_data, B, T, vocab_size=c.vocab_size).next_batch()
    if encoding is None and args.sample_every:
        encoding = get_encoding()
    EOT = encoding.eot_token if encoding is not None else None
    sample_rng = np.random.default_rng(args.seed)
    # what a resumed run must share with this one, saved in every state file
    settings = dict(vars(args), train_data=train_data, val_data=val_data,
                    total_batch_tokens=grad_accum * B * T * ranks, grad_accum=grad_accum,
                    world_size=ranks,
                    val_batches=val_batches, train_fingerprint=fingerprint(train_loader.files),
                    val_fingerprint=fingerprint(val_loader.files) if val_loader else None)

    if resume_step:
        state_path = folder.checkpoint_paths(resume_step)[1]
        saved = extra.get("args") if isinstance(extra.get("args"), dict) else {}
        changes = resume_changes(saved, settings, explicit)
        try:
            train_loader.load_state_dict(extra["train_loader"],
                                         other_batch=saved.get("world_size", 1) != ranks)
            sample_rng.bit_generator.state = extra["sample_rng"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{state_path}: the data loader or RNG state is not "
                                  f"usable ({type(e).__name__}: {e})") from None
        if ranks > 1 and not sharded:   # every rank holds all of m and v
            if not root:
                m, v = np.empty(model.num_parameters, np.float32), \
                    np.empty(model.num_parameters, np.float32)
            world.broadcast(m)
            world.broadcast(v)
        optimizer.load_moments(m, v)
        if root:
            folder.truncate_log(resume_step)
            folder.truncate_metrics(resume_step)
        progress.say(f"resumed from step {resume_step} in {folder.path}")
        if changes:
            progress.say("changed on resume: " + ", ".join(changes))

    progress.say(f"model: {describe(c)}, {model.num_parameters / 1e6:.1f}M parameters, "
                 f"{model.precision}"
                 + (f", {describe_dropout(dropout)}" if dropout.active else "")
                 + f"; batch {B}x{T}"
                 + (f" on each of {ranks} processes" + (" (ZeRO-1)" if sharded else "")
                    if ranks > 1 else "")
                 + f", {grad_accum} micro-batch(es) per step; {args.max_steps} steps")
    log = folder.open_log(append=bool(resume_step)) if root else open(os.devnull, "w")
    metrics = folder.open_metrics(append=bool(resume_step)) \
        if probe is not None and root else None

    def state_extra():
        return {"args": settings,
                "train_loader": train_loader.state_dict(),
                "sample_rng": sample_rng.bit_generator.state}

    # --keep-best: the validation loss to beat, and what it was measured on
    best_loss = math.inf
    measured_on = {"val_data": settings["val_fingerprint"], "val_batches": val_batches}
    best = folder.read_best() if args.keep_best and resume_step and root else None
    if best is not None:
        if best.get("measured_on") == measured_on:
            best_loss = best["val_loss"]
            progress.say(f"best so far: step {best.get('step')}, val loss {best_loss:.6f} "
                         f"({folder.best_path})")
        else:
            progress.say(f"{folder.best_path} (step {best.get('step')}) was measured on other "
                         f"validation data or batches: the next evaluation replaces it")

    # the last step whose update finished, and the state that goes with it
    finished = {"step": resume_step, "extra": state_extra()}
    last_good = resume_step

    def step_finished(trainer, result):
        finished["step"], finished["extra"] = result.step, state_extra()

    def save(step):
        """Rank 0 writes the checkpoint, whole: ZeRO's moment shards are gathered
        first (every rank takes part in that)."""
        try:
            with signals.deferred():
                state = optimizer
                if sharded:
                    state = types.SimpleNamespace(m=None, v=None)
                    state.m, state.v = optimizer.gathered_moments()
                if root:
                    folder.save(step, model, state, finished["extra"], args.keep_checkpoints)
        except WriteError as e:
            intact = (f"the checkpoint of step {last_good} is intact" if last_good
                      else "no checkpoint was written before")
            raise UsageError(f"saving the checkpoint of step {step} failed: {e}; {intact} in "
                             f"{folder.path}; free space and resume with -y 1") from None

    def warn(what, step, e):
        progress.say(f"step {step}: warning: {what} failed ({type(e).__name__}: {e}); "
                     f"training goes on")

    if args.overfit_single_batch:
        fixed_batch = train_loader.next_batch()
        next_batch = lambda: fixed_batch   # noqa: E731
    else:
        next_batch = train_loader.next_batch
    trainer = Trainer(model, optimizer, schedule_from_args(args), next_batch,
                      grad_accum=grad_accum, grad_clip=args.grad_clip,
                      update_guard=signals.deferred, world=world, dropout=dropout)
    if ranks > 1:   # first of all: the gradients averaged over the ranks
        reduce = world.reduce_scatter_mean if sharded else world.average
        trainer.after_backward.append(lambda trainer, step: reduce(model.grads.memory))
    trainer.after_step.append(step_finished)
    if probe is not None and root:
        monitor = Monitor(model, *probe, args.monitor_every, metrics,
                          entropy_min=args.monitor_entropy_min or None,
                          cosine_max=args.monitor_cosine_max if args.monitor_cosine_max < 1
                          else None, say=progress.say)
        trainer.after_backward.append(monitor.after_backward)
        trainer.after_step.append(monitor.after_step)
    started = time.perf_counter()
    losses = []
    val_loss = None
    try:
        for step in range(resume_step + 1, args.max_steps + 1):
            r = trainer.train_step(step)
            if not r.finite:
                progress.say(f"step {step}: the loss ({r.loss}) or gradient norm ({r.norm}) is "
                             f"not finite; stopping. The last good checkpoint is step {last_good}"
                             + ("" if last_good else " (none written)") + f" in {folder.path}")
                return 1
            losses.append(r.loss)
            log.write(f"s:{step} trl:{r.loss:.6f} lr:{r.lr:.6e} norm:{r.norm:.6f}\n")
            log.flush()
            elapsed = time.perf_counter() - started
            eta = elapsed / (step - resume_step) * (args.max_steps - step)
            progress.step(step, args.max_steps, r.loss, r.norm, r.lr, r.ms,
                          grad_accum * B * T * ranks / (r.ms / 1000), eta)
            raise_injected_fault(world.rank, step)

            last = step == args.max_steps
            if val_loader is not None and (step % args.val_every == 0 or last):
                try:
                    val_loss = world.mean(evaluate(model, val_loader, val_batches))
                    log.write(f"s:{step} tel:{val_loss:.6f}\n")
                    log.flush()
                    progress.say(f"step {step}: val loss {val_loss:.6f} "
                                 f"(perplexity {perplexity(val_loss):.4f})")
                except (LlmcError, ValueError) as e:
                    warn("evaluation", step, e)
                else:
                    if args.keep_best and root and val_loss < best_loss:
                        try:
                            with signals.deferred():
                                folder.save_best(step, model, val_loss, measured_on)
                        except WriteError as e:
                            warn("saving the best model", step, e)
                        else:
                            best_loss = val_loss
                            best = {"step": step}
                            progress.say(f"step {step}: new best val loss {val_loss:.6f}, "
                                         f"saved as {folder.best_path}")
            if args.sample_every and (step % args.sample_every == 0 or last) and root:
                try:
                    ids = [int(new[0]) for new in stream(model, [[EOT]], args.gen_tokens,
                                                         temperature=1.0, rng=sample_rng)]
                    progress.say(f"step {step}: sample:\n---\n{encoding.decode(ids)}\n---")
                except (LlmcError, ValueError) as e:
                    warn("sampling", step, e)
                finished["extra"] = state_extra()   # the sampler's RNG moved on
            if (args.checkpoint_every and step % args.checkpoint_every == 0) or last:
                save(step)
                last_good = step
    except KeyboardInterrupt as stop:
        # parameters, moments and finished["extra"] all describe the last
        # step whose update finished; further signals only wait for the save
        signals.hold()
        signum = getattr(stop, "signum", signal.SIGINT)
        if finished["step"] > last_good:
            save(finished["step"])
        if finished["step"]:
            progress.say(f"stopped by {signal_name(signum)}: checkpoint of step "
                         f"{finished['step']} in {folder.path}; resume with -y 1")
        else:
            progress.say(f"stopped by {signal_name(signum)} before the first step finished; "
                         f"nothing saved")
        raise Stopped(signum, handled=True) from None
    finally:
        log.close()
        if metrics is not None:
            metrics.close()

    elapsed = time.perf_counter() - started
    steps_run = args.max_steps - resume_step
    summary = f"done: {steps_run} steps in {format_seconds(elapsed)}"
    if losses:
        summary += (f", train loss {losses[0]:.4f} -> {losses[-1]:.4f} (perplexity "
                    f"{perplexity(losses[0]):.2f} -> {perplexity(losses[-1]):.2f})")
    if val_loss is not None:
        summary += f", val loss {val_loss:.4f} (perplexity {perplexity(val_loss):.2f})"
    if args.keep_best and best is not None and best_loss < math.inf:
        summary += f", best val loss {best_loss:.4f} at step {best['step']} ({folder.best_path})"
    progress.say(summary + f"; checkpoint {folder.checkpoint_paths(args.max_steps)[0]}")
    if ranks > 1 and steps_run:   # rank 0's share of the exchanges
        progress.say(f"communication (rank 0): {world.seconds / steps_run * 1000:.1f} ms and "
                     f"{world.bytes_sent / steps_run / 2**20:.1f} MiB sent per step "
                     f"({100 * world.seconds / elapsed:.1f}% of the time)")
    if args.export_hf and root:
        export_hf(model, args.export_hf, source)
        progress.say(f"exported as a Hugging Face folder: {args.export_hf}")
    return 0


# a Hugging Face folder's tokenizer files, copied beside an export
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")


def export_hf(model, folder, tokenizer_from=None):
    """The model as a Hugging Face folder, with the tokenizer files and the
    bos/eos/pad ids of the folder ``tokenizer_from`` (a model's, or a
    tokenizer.json's) when given."""
    from ..io.hf import token_ids
    if tokenizer_from is None:
        model.save_pretrained(folder)
        return
    source = Path(tokenizer_from)
    source = source if source.is_dir() else source.parent
    model.save_pretrained(folder, token_ids=token_ids(source))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            atomic_write(Path(folder) / name, [(source / name).read_bytes()])


def model_digest(model):
    """A hash of a model's config and parameters, to compare across ranks."""
    digest = hashlib.sha256(repr(model.config).encode())
    digest.update(model.params.memory.tobytes())
    return digest.hexdigest()[:16]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    return_freed_scratch()
    try:
        world = distributed.world()
        if world.size == 1:
            return run(args, argv=argv)
    except (UsageError, LlmcError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return run_ranks(args, argv, world)


def run_ranks(args, argv, world):
    """One rank of a run under mpiexec: rank 0 prints and writes; the others
    are silent. Any exception on any rank ends the whole job at once: one
    line naming the rank, then MPI_Abort (no rank is left waiting for it)."""
    quiet = None if world.is_root else open(os.devnull, "w")
    try:
        code = run(args, out=quiet, argv=argv, world=world)
    except BaseException as e:   # noqa: B036 (anything, even a bug, must end the job)
        print(f"error: rank {world.rank} of {world.size}: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        time.sleep(1.0)   # the launcher forwards the line before the abort tears it down
        world.abort(1)
        return 1
    if code != 0 and code < 128:
        world.abort(code)
    world.barrier()
    return code

