"""Train a GPT-2 or a Llama-style model: ``python -m llmc_py.train`` (``--help``
for every flag; ``--arch llama`` and its choices for the Llama family).

With no arguments it prepares the Shakespeare dataset if it is missing and
trains a small GPT-2 from scratch (train.spec.DEFAULT_MODEL), printing progress,
evaluating, sampling and checkpointing into ``out/`` (train.run_folder).
Flags follow llm.c's train_gpt2 where one exists (-i -j -e -o -b -t -x -l -u
-q -k -c -v -m -s -g -n -y -a -d), with long names too. This module parses
the command line into a train.spec.RunSpec and runs it (train.runner), which
says its progress as it goes; under mpiexec, once per rank.
"""
import argparse
import os
import sys
import time

from ..cli import DefaultsHelpFormatter, command
from ..config import MODEL_FLAGS
from ..model import PRECISIONS, RECOMPUTE_LEVELS
from ..model.dropout import RATES as DROPOUT_SITES
from ..model.memory import return_freed_scratch
from ..model.transformer import INIT_SCHEMES
from . import distributed
from .optimizer import DECAY_ON
from .runner import run
from .schedule import SCHEDULES
from .spec import RunSpec, family_defaults


# ---- parse ---------------------------------------------------------------------

def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m llmc_py.train",
        description="Train a GPT-2 or a Llama-style model on token files (llm.c's format) "
                    "with the C kernels.",
        formatter_class=DefaultsHelpFormatter)
    a = p.add_argument
    a("-i", "--train-data", default=RunSpec.train_data,
      help="glob of training token files (default: the Shakespeare set, prepared if missing)")
    a("-j", "--val-data", default=RunSpec.val_data, help="glob of validation token files")
    a("-e", "--init", default=RunSpec.init,
      help="an llm.c model file or a Hugging Face model folder (GPT-2, Llama, Qwen3) to start "
           "from (fine-tune), or a depth like d6 for a fresh model (d12 is GPT-2 124M's shape)")
    a("--tokenizer", default=RunSpec.tokenizer,
      help="a tokenizer.json, or a folder holding one, for the default dataset and samples "
           "(default: -e's when it is a Hugging Face folder with one, else GPT-2's)")
    a("--export-hf", metavar="DIR", default=RunSpec.export_hf,
      help="at the end, also write the model as a Hugging Face folder (config.json, "
           "model.safetensors and -e's tokenizer files), its weights in float32; with "
           "--lora-rank, the base with the adapters merged into it, in bf16 with --precision "
           "bf16 (each merged weight rounded once)")
    a("-o", "--output-dir", default=RunSpec.output_dir, help="folder for the log and checkpoints")
    a("-b", "--batch-size", type=int, default=RunSpec.batch_size,
      help="B: sequences per micro-batch")
    a("-t", "--seq-len", type=int, default=RunSpec.seq_len, help="T: tokens per sequence")
    a("-d", "--total-batch-tokens", type=int, default=RunSpec.total_batch_tokens,
      help="tokens per optimizer step; a multiple of B*T > B*T accumulates gradients "
           "(0: B*T)")
    a("-x", "--max-steps", type=int, default=RunSpec.max_steps,
      help="optimizer steps to train in all")
    a("-l", "--learning-rate", type=float, default=RunSpec.learning_rate,
      help="peak learning rate")
    a("-u", "--warmup-steps", type=int, default=RunSpec.warmup_steps,
      help="steps of linear warmup")
    a("-q", "--final-lr-fraction", type=float, default=RunSpec.final_lr_fraction,
      help="learning rate at the end, as a fraction of the peak")
    a("-k", "--schedule", choices=SCHEDULES, default=RunSpec.schedule,
      help="learning-rate decay after warmup")
    a("-c", "--weight-decay", type=float, default=RunSpec.weight_decay, help="AdamW weight decay")
    a("--decay-on", choices=DECAY_ON, default=RunSpec.decay_on,
      help="matrices: decay the weight matrices only (wte, wpe, qkvw, attprojw, fcw, fcprojw, "
           "lm_head), not biases or norm weights; all: every parameter (llm.c's "
           "train_gpt2.c)")
    a("--beta1", type=float, default=RunSpec.beta1, help="AdamW beta1")
    a("--beta2", type=float, default=RunSpec.beta2,
      help="AdamW beta2 (nanoGPT's and llm.c's GPU trainer's choice; train_gpt2.c uses 0.999)")
    a("--adam-eps", type=float, default=RunSpec.adam_eps, help="AdamW epsilon")
    a("--grad-clip", type=float, default=RunSpec.grad_clip,
      help="clip the global gradient norm to this (0: no clipping)")
    a("-v", "--val-every", type=int, default=RunSpec.val_every,
      help="evaluate every N steps (0: never)")
    a("-m", "--val-batches", type=int, default=RunSpec.val_batches,
      help="batches per evaluation; the val loss is the mean over their counted targets")
    a("-s", "--sample-every", type=int, default=RunSpec.sample_every,
      help="print a sample every N steps (0: never)")
    a("-g", "--gen-tokens", type=int, default=RunSpec.gen_tokens, help="tokens per sample")
    a("--sample-top-k", type=int, default=RunSpec.sample_top_k,
      help="samples draw from the k likeliest tokens (0: from the whole vocabulary), at "
           "temperature 1, after an end-of-text token")
    a("-n", "--checkpoint-every", type=int, default=RunSpec.checkpoint_every,
      help="write a checkpoint every N steps (0: only at the end)")
    a("-nk", "--keep-checkpoints", type=int, default=RunSpec.keep_checkpoints,
      help="keep only the last N checkpoints (0: keep all)")
    a("--keep-best", type=int, choices=(0, 1), default=RunSpec.keep_best,
      help="1: also keep the model with the lowest validation loss so far as "
           "OUT/model_best.bin (OUT/lora_best/ with --lora-rank; its step and loss in "
           "OUT/best.json), which -nk never removes; "
           "by default only when there is validation data (-nk 0 --keep-best 0: llm.c's "
           "behaviour, every checkpoint and no best)")
    a("-y", "--resume", type=int, choices=(0, 1), default=RunSpec.resume,
      help="1: resume from the newest complete checkpoint in the output folder that loads "
           "(one truncated or failing its checksum is passed over, with a line), taking "
           "every flag not given (but -o, --threads, --data-dir) from the run; with none "
           "there yet, start a fresh run (so one command serves every restart)")
    a("--overwrite", action="store_true",
      help="start a new run in an output folder that holds another run's checkpoints, "
           "removing them (without it such a folder is refused)")
    a("-a", "--overfit-single-batch", type=int, choices=(0, 1),
      default=RunSpec.overfit_single_batch,
      help="1: train on one batch over and over (a sanity check)")
    a("--shuffle", type=int, choices=(0, 1), default=RunSpec.shuffle,
      help="1: visit training windows in a seeded random order")
    a("--seed", type=int, default=RunSpec.seed,
      help="seed for initialisation, shuffling and sampling")
    a("--precision", choices=PRECISIONS, default=RunSpec.precision,
      help="bf16: mixed precision (bf16 matmuls on a bf16 copy of the weights; float32 "
           "master weights, gradients, optimizer state and statistics); with --lora-rank, "
           "the base is held in bf16 alone, with no float32 master (the adapters are float32, "
           "their products bf16 as the base's)")
    a("--dropout", type=float, default=RunSpec.dropout,
      help="dropout probability in training at every site: the embedding's output, the "
           "attention probabilities and each residual branch's output (0: none; evaluation "
           "and sampling never drop)")
    for site, what in zip(DROPOUT_SITES, ("the embedding's output",
                                          "the attention probabilities",
                                          "each residual branch's output")):
        a(f"--dropout-{site}", type=float, default=getattr(RunSpec, f"dropout_{site}"),
          help=f"dropout probability on {what} (default: --dropout's)")
    a("--recompute", type=int, choices=RECOMPUTE_LEVELS, default=RunSpec.recompute,
      help="1: keep the norm outputs and the MLP activation for one layer only and "
           "recompute them in backward; 2: also the MLP's input projection, whose matmul "
           "then runs again in backward (less memory, the same results, a little slower)")
    a("--threads", type=int, default=RunSpec.threads, help="kernel threads (0: OpenMP's default)")
    a("--init-scheme", choices=INIT_SCHEMES, default=RunSpec.init_scheme,
      help="a fresh model's weight matrices: gpt2 (normal, --init-std, residual projections "
           "/ sqrt(2L)), xavier_normal or xavier_uniform")
    a("--init-std", type=float, default=RunSpec.init_std, help="gpt2 scheme: the std")
    a("--zero", type=int, choices=(0, 1), default=RunSpec.zero,
      help="under mpiexec: 1 keeps each rank's shard of AdamW's moments only (ZeRO-1; "
           "with --monitor-every, rank 0 gathers the gradients on measured steps)")
    a("--monitor-every", type=int, default=RunSpec.monitor_every,
      help="every N steps, measure attention entropy, representation collapse, per-layer "
           "gradient norms and update ratios (with experts: each expert's share of the "
           "tokens, the router's entropy, the auxiliary losses) on a fixed validation "
           "batch and append them to OUT/metrics.jsonl, and warn of an expert that got no "
           "token in the N steps (0: never; needs validation data)")
    a("--monitor-entropy-min", type=float, default=RunSpec.monitor_entropy_min,
      help="with --monitor-every: warn when a head's mean attention entropy (nats) falls "
           "below this (0: never)")
    a("--monitor-cosine-max", type=float, default=RunSpec.monitor_cosine_max,
      help="with --monitor-every: warn when a layer's mean cosine between token vectors "
           "rises above this (1: never)")
    a("--data-dir", default=RunSpec.data_dir, help="where the default dataset is prepared")
    lora = p.add_argument_group(
        "LoRA", "train low-rank adapters on a frozen base (-e) instead of every parameter")
    lora.add_argument("--lora-rank", type=int, default=RunSpec.lora_rank,
                      help="R: adapters of rank R (0: full fine-tuning); each checkpoint is "
                           "then OUT/lora_%%08d/, a PEFT folder, and the adapters' moments; "
                           "-y 1 resumes onto the same -e")
    lora.add_argument("--lora-alpha", type=float, default=RunSpec.lora_alpha,
                      help="the adapters' scale is alpha / R (default: 2R, a scale of 2)")
    lora.add_argument("--lora-targets", default=RunSpec.lora_targets,
                      help="comma-separated modules to adapt: q,k,v,o,gate,up,down (short for "
                           "q_proj, ...) or Hugging Face's names (GPT-2's c_attn, c_proj, c_fc, "
                           "mlp.c_proj) (default: every one the model has)")
    lora.add_argument("--lora-dropout", type=float, default=RunSpec.lora_dropout,
                      help="dropout probability on the adapters' input in training")
    lora.add_argument("--lora-rslora", type=int, choices=(0, 1), default=RunSpec.lora_rslora,
                      help="1: scale by alpha / sqrt(R) (rsLoRA)")
    lora.add_argument("--base-weights", choices=("q8_0", "q4_0"), default=RunSpec.base_weights,
                      help="hold the frozen base quantized (QLoRA): its linear layers in "
                           "llama.cpp's Q8_0 or Q4_0 blocks, the embedding and head too, "
                           "as sample --weights does; needs --lora-rank")
    llama = p.add_argument_group(
        "model family", "for a fresh model (-e dN); a model file carries its own choices")
    llama.add_argument("--arch", choices=("gpt2", "llama"), default=family_defaults()["arch"],
                       help="gpt2: llm.c's GPT-2; llama: the decoder with the choices below")
    for field in MODEL_FLAGS.values():
        llama.add_argument(field.flag.name, **field.flag_options())
    return p


def spec_of(args, explicit=None, names=None):
    """The RunSpec of the parser's namespace ``args``; ``explicit``: the
    flags given (None: those not at their defaults); ``names``: how the
    command line names each flag (option_names)."""
    flags = dict(vars(args))
    family = {dest: flags.pop(dest) for dest in family_defaults()}
    return RunSpec(**flags, family=family,
                   explicit=None if explicit is None else frozenset(explicit),
                   flag_names=names or {})


def parse(argv):
    """The RunSpec of the command line ``argv``."""
    parser = build_parser()
    return spec_of(parser.parse_args(argv), explicit_flags(argv), option_names(parser))


def option_names(parser):
    """{dest: "-b/--batch-size"}: every flag of ``parser`` by its options."""
    return {action.dest: "/".join(action.option_strings) for action in parser._actions
            if action.option_strings}


def lr_at(step, args):
    """The learning rate for optimizer step ``step`` (1-based) of the
    parser's namespace ``args``."""
    return spec_of(args).lr_schedule()(step)


def explicit_flags(argv):
    """The dests of the flags given on the command line ``argv``."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


@command
def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    spec = parse(argv)
    return_freed_scratch()
    world = distributed.world()
    if world.size == 1:
        return run(spec)
    return run_ranks(spec, world)


def run_ranks(spec, world):
    """One rank of a run under mpiexec: rank 0 prints and writes; the others
    are silent. Any exception on any rank ends the whole job at once: one
    line naming the rank, then MPI_Abort (no rank is left waiting for it)."""
    quiet = None if world.is_root else open(os.devnull, "w")
    try:
        code = run(spec, out=quiet, world=world)
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

