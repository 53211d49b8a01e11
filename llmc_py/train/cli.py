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
import re
import sys
import time

from ..config import (BLOCKS, FFN_MULTIPLE, MLPS, NORMS, POSITIONS, ROPE_SCALINGS, GPT2Config,
                      LlamaConfig, padded_vocab)
from ..errors import LlmcError, ShapeError, UsageError
from ..model import PRECISIONS
from ..model.dropout import RATES as DROPOUT_SITES
from ..model.memory import return_freed_scratch
from ..model.transformer import INIT_SCHEMES
from . import distributed
from .optimizer import DECAY_ON
from .runner import run
from .schedule import SCHEDULES
from .spec import RunSpec, family_defaults

GPT2_VOCAB = 50257
# the sizes of GPT-2 by depth; other depths get 64 channels per layer, heads of 64
GPT2_DEPTHS = {12: (768, 12), 24: (1024, 16), 36: (1280, 20), 48: (1600, 25)}


# ---- parse ---------------------------------------------------------------------

def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m llmc_py.train",
        description="Train a GPT-2 or a Llama-style model on token files (llm.c's format) "
                    "with the C kernels.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("-i", "--train-data", default=RunSpec.train_data,
      help="glob of training token files (default: the Shakespeare set, prepared if missing)")
    a("-j", "--val-data", default=RunSpec.val_data, help="glob of validation token files")
    a("-e", "--init", default=RunSpec.init,
      help="an llm.c model file or a Hugging Face model folder (GPT-2, Llama, Qwen3) to start "
           "from (fine-tune), or a depth like d6 for a fresh model (d12 is GPT-2 124M's shape)")
    a("--tokenizer", default=RunSpec.tokenizer,
      help="a tokenizer.json, or a folder holding one, for the default dataset and samples "
           "(default: -e's when it is a Hugging Face folder with one, else GPT-2's); give "
           "it (or the same -e) again when resuming")
    a("--export-hf", metavar="DIR", default=RunSpec.export_hf,
      help="at the end, also write the model as a Hugging Face folder (config.json, "
           "model.safetensors and -e's tokenizer files)")
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
    a("-m", "--val-batches", type=int, default=RunSpec.val_batches, help="batches per evaluation")
    a("-s", "--sample-every", type=int, default=RunSpec.sample_every,
      help="print a sample every N steps (0: never)")
    a("-g", "--gen-tokens", type=int, default=RunSpec.gen_tokens, help="tokens per sample")
    a("-n", "--checkpoint-every", type=int, default=RunSpec.checkpoint_every,
      help="write a checkpoint every N steps (0: only at the end)")
    a("-nk", "--keep-checkpoints", type=int, default=RunSpec.keep_checkpoints,
      help="keep only the last N checkpoints (0: keep all)")
    a("--keep-best", type=int, choices=(0, 1), default=RunSpec.keep_best,
      help="1: also keep the model with the lowest validation loss so far as "
           "OUT/model_best.bin (its step and loss in OUT/best.json), which -nk never removes")
    a("-y", "--resume", type=int, choices=(0, 1), default=RunSpec.resume,
      help="1: resume from the newest complete checkpoint in the output folder")
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
           "master weights, gradients, optimizer state and statistics)")
    a("--dropout", type=float, default=RunSpec.dropout,
      help="dropout probability in training at every site: the embedding's output, the "
           "attention probabilities and each residual branch's output (0: none; evaluation "
           "and sampling never drop)")
    for site, what in zip(DROPOUT_SITES, ("the embedding's output",
                                          "the attention probabilities",
                                          "each residual branch's output")):
        a(f"--dropout-{site}", type=float, default=getattr(RunSpec, f"dropout_{site}"),
          help=f"dropout probability on {what} (default: --dropout's)")
    a("--recompute", type=int, choices=(0, 1), default=RunSpec.recompute,
      help="1: keep the norm outputs and the MLP activation for one layer only and "
           "recompute them in backward (less memory, the same results, a little slower)")
    a("--threads", type=int, default=RunSpec.threads, help="kernel threads (0: OpenMP's default)")
    a("--init-scheme", choices=INIT_SCHEMES, default=RunSpec.init_scheme,
      help="a fresh model's weight matrices: gpt2 (normal, --init-std, residual projections "
           "/ sqrt(2L)), xavier_normal or xavier_uniform")
    a("--init-std", type=float, default=RunSpec.init_std, help="gpt2 scheme: the std")
    a("--zero", type=int, choices=(0, 1), default=RunSpec.zero,
      help="under mpiexec: 1 keeps each rank's shard of AdamW's moments only (ZeRO-1)")
    a("--monitor-every", type=int, default=RunSpec.monitor_every,
      help="every N steps, measure attention entropy, representation collapse, per-layer "
           "gradient norms and update ratios on a fixed validation batch and append them "
           "to OUT/metrics.jsonl (0: never; needs validation data)")
    a("--monitor-entropy-min", type=float, default=RunSpec.monitor_entropy_min,
      help="with --monitor-every: warn when a head's mean attention entropy (nats) falls "
           "below this (0: never)")
    a("--monitor-cosine-max", type=float, default=RunSpec.monitor_cosine_max,
      help="with --monitor-every: warn when a layer's mean cosine between token vectors "
           "rises above this (1: never)")
    a("--data-dir", default=RunSpec.data_dir, help="where the default dataset is prepared")
    llama = p.add_argument_group(
        "model family", "for a fresh model (-e dN); a model file carries its own choices")
    b = llama.add_argument
    b("--arch", choices=("gpt2", "llama"), default="gpt2",
      help="gpt2: llm.c's GPT-2; llama: the decoder with the choices below")
    b("--norm", choices=NORMS, default="rmsnorm", help="llama: the norm")
    b("--position", choices=POSITIONS, default="rope",
      help="llama: rotary (rope), ALiBi biases (alibi), a learned table or fixed "
           "sinusoids added to the embedding (sinusoidal)")
    b("--block", choices=BLOCKS, default="pre",
      help="llama: the norms' places: pre (x + f(norm(x))), post (norm(x + f(x)), the "
           "original Transformer's) or parallel (x + attn(n) + mlp(n), n = norm(x): GPT-J)")
    b("--mlp", choices=MLPS, default="swiglu",
      help="llama: the MLP; gated (act(x W1) * x W3): swiglu, geglu, reglu; plain: gelu "
           "(tanh form), gelu_erf (exact), relu")
    b("--kv-heads", type=int, default=0,
      help="llama: key/value heads, dividing the query heads (1: multi-query; 0: as many "
           "as query heads)")
    b("--ffn-hidden", type=int, default=0,
      help="llama: MLP hidden size (0: Llama's rule for a gated MLP, 2/3 of 4C times "
           "--ffn-dim-multiplier rounded up to --ffn-multiple-of; 4C for the others)")
    b("--ffn-multiple-of", type=int, default=FFN_MULTIPLE,
      help="llama: Llama's multiple_of, the hidden-size rule's rounding")
    b("--ffn-dim-multiplier", type=float, default=1.0,
      help="llama: Llama's ffn_dim_multiplier, the hidden-size rule's factor")
    b("--bias", type=int, choices=(0, 1), default=0, help="llama: biases on the linear layers")
    b("--untied", type=int, choices=(0, 1), default=0,
      help="llama: 1 gives the output head its own matrix instead of sharing wte")
    b("--rope-theta", type=float, default=10000.0, help="llama: the RoPE base")
    b("--qk-norm", type=int, choices=(0, 1), default=0,
      help="llama: 1 RMS-normalises each q and k head before RoPE (Qwen3)")
    b("--head-dim", type=int, default=0,
      help="llama: channels per attention head (0: channels / heads; Qwen3 sets its own)")
    b("--rope-scaling", choices=ROPE_SCALINGS, default="none",
      help="llama: RoPE's frequencies for a context --rope-factor times longer: linear "
           "(position interpolation), ntk (a larger base) or llama3 (Llama 3.1's rule, "
           "with --rope-original-max)")
    b("--rope-factor", type=float, default=1.0, help="llama: --rope-scaling's factor")
    b("--rope-interleaved", type=int, choices=(0, 1), default=0,
      help="llama: 1 turns RoPE's pairs of neighbouring channels (2i, 2i+1: Meta's original "
           "layout) instead of i and i + hs/2 (Hugging Face's)")
    b("--rope-original-max", type=int, default=0,
      help="llama: --rope-scaling llama3's original context (Llama 3.1: 8192)")
    b("--sliding-window", type=int, default=0,
      help="llama: each query attends to its last W positions only (Mistral's sliding "
           "window; the KV cache keeps W); 0: to every position before it")
    return p


def config_from_depth(depth, max_seq_len=1024, vocab_size=GPT2_VOCAB, args=None):
    """A GPT2Config from a descriptor like "d6" (a LlamaConfig with the
    family's choices when ``args.arch`` is llama); None if it is not one."""
    match = re.fullmatch(r"d(\d+)", depth)
    if not match:
        return None
    L = int(match.group(1))
    if L <= 0:
        raise UsageError(f"-e {depth}: the depth must be positive")
    C, NH = GPT2_DEPTHS.get(L, (64 * L, L))
    sizes = dict(max_seq_len=max_seq_len, vocab_size=vocab_size,
                 padded_vocab_size=padded_vocab(vocab_size), num_layers=L, num_heads=NH,
                 channels=C)
    if args is None or args.arch == "gpt2":
        return GPT2Config(**sizes)
    try:
        return LlamaConfig(**sizes, num_kv_heads=args.kv_heads or NH, norm=args.norm,
                           position=args.position, mlp=args.mlp, block=args.block,
                           ffn_hidden=args.ffn_hidden,
                           ffn_multiple_of=args.ffn_multiple_of,
                           ffn_dim_multiplier=args.ffn_dim_multiplier,
                           bias=bool(args.bias), tied_embeddings=not args.untied,
                           rope_theta=args.rope_theta, qk_norm=bool(args.qk_norm),
                           head_dim=args.head_dim, sliding_window=args.sliding_window,
                           rope_scaling=args.rope_scaling, rope_factor=args.rope_factor,
                           rope_original_max=args.rope_original_max,
                           rope_interleaved=bool(args.rope_interleaved))
    except ShapeError as e:
        raise UsageError(f"-e {depth} --arch llama: {e}") from None


def describe(config):
    """One line naming the model's sizes and, for the Llama family, its choices."""
    c = config
    text = f"{c.num_layers} layers, {c.channels} channels, {c.num_heads} heads"
    if isinstance(c, LlamaConfig):
        text += (f" ({c.num_kv_heads} kv), {c.norm}, {c.position}, {c.mlp} {c.ffn_hidden}"
                 + ("" if c.block == "pre" else f", {c.block} block")
                 + (", bias" if c.bias else "") + ("" if c.tied_embeddings else ", untied")
                 + (f", qk_norm, head_dim {c.head_size}" if c.qk_norm else "")
                 + (f", window {c.sliding_window}" if c.sliding_window else "")
                 + (f", rope {c.rope_scaling} x{c.rope_factor:g}"
                    if c.rope_scaling != "none" else "")
                 + (", interleaved rope" if c.rope_interleaved else ""))
    return text


def spec_of(args, explicit=()):
    """The RunSpec of the parser's namespace ``args``; ``explicit``: the
    flags given."""
    flags = dict(vars(args))
    family = {dest: flags.pop(dest) for dest in family_defaults()}
    return RunSpec(**flags, family=family, explicit=frozenset(explicit))


def parse(argv):
    """The RunSpec of the command line ``argv``."""
    return spec_of(build_parser().parse_args(argv), explicit_flags(argv))


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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    spec = parse(argv)
    return_freed_scratch()
    try:
        world = distributed.world()
        if world.size == 1:
            return run(spec)
    except (UsageError, LlmcError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
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

