"""Parameters and memory of a model, from its config alone (nothing is
allocated, so any size works, Qwen3-8B or GPT-2 XL included):

    python -m llmc_py.summary MODEL_OR_CONFIG [-b B] [-t T] [--precision fp32|bf16]
                              [--recompute [LEVEL]] [--lora-rank R [--lora-targets q,k,...]]
                              [--base-weights q8_0|q4_0]
    python -m llmc_py.summary MODEL_OR_CONFIG --tensors [--precision fp32|bf16]

MODEL_OR_CONFIG is a model file (only its header is read), a Hugging Face
folder or its config.json, or a depth like d12 (GPT-2's shapes, as train's
-e). The parameters are counted per component from the layout the model
allocates (model.layout.param_specs); the memory is the model's own plan
(model.transformer.memory_plan) for a training step and for a forward that
keeps its logits and one layer's activations (no backward follows it: as
sample and eval run it), and the KV cache is model.kv_cache's. With
--precision bf16 the forward is a frozen bf16 base's (the matrices in bf16
alone, as sample and eval load it); with --lora-rank the training step is a LoRA
step's: the frozen base (bf16 alone with --precision bf16), the adapters,
their gradients and moments, and the activations it keeps. --base-weights
plans the base quantized (model.quantize: the linear layers in those
blocks, the embedding and head too), for the LoRA step (QLoRA) and the
forward. --tensors shows
instead llm.c's table of the parameter tensors, one row per tensor of that
layout (GPT-2's are llm.c's 16), per-layer ones with L first.

A model with experts (Mixtral, Qwen3-MoE) shows beside each component's
parameters those active per token: every parameter but the experts a
token is not routed to, so the embeddings (the whole table, as the
published 12.9B of Mixtral 8x7B and 3.3B of Qwen3-30B-A3B count it),
attention, norms, routers, dense MLPs and head, and k of the E experts of
each MoE layer; and both as bytes (the memory holds every expert).
"""
import argparse
import math
import sys
import textwrap
from pathlib import Path

from .cli import command
from .errors import UsageError
from .model.kv_cache import kv_cache_floats
from .model.layout import param_specs
from .model.lora import adapter_parameters, adapter_width
from .model.memory import format_bytes
from .model.planning import RECOMPUTE_LEVELS
from .model.presets import config_from_depth, describe
from .model.transformer import PRECISIONS, memory_plan

# the parameter tensors of each component
COMPONENTS = (
    ("embeddings", ("wte", "wpe")),
    ("attention", ("qkvw", "qkvb", "qnormw", "knormw", "attprojw", "attprojb")),
    ("MLP", ("fcw", "fcb", "fcprojw", "fcprojb")),
    ("router", ("routerw",)),
    ("experts", ("expertfcw", "expertprojw")),
    ("norms", ("ln1w", "ln1b", "ln2w", "ln2b", "lnfw", "lnfb")),
    ("head", ("lm_head",)),
)
# the components only a model with experts has
MOE_COMPONENTS = ("router", "experts")
# what "active per token" counts, said in the output and in --help
ACTIVE_MEANS = ("active per token: every parameter but the experts a token is not routed "
                "to: the embeddings (the whole table, as published figures count it), "
                "attention, norms, routers, dense MLPs and head, and k of the E experts "
                "of each MoE layer")


def load_config(source):
    """The config of ``source``: a depth like d12, a Hugging Face folder or
    config.json, or a model file (its header only)."""
    config = config_from_depth(str(source))
    if config is not None:
        return config
    path = Path(source)
    if not (path.is_dir() or path.suffix == ".json" or path.is_file()):
        raise UsageError(f"{source}: no such model file, Hugging Face folder or config.json, "
                         f"and not a depth like d12")
    from .io.load import read_config
    return read_config(path)


def parameter_counts(config):
    """{component: parameters} over COMPONENTS, in the order the model lays
    them out; they add up to the model's num_parameters."""
    sizes = {name: math.prod(fn(config)) for name, fn in param_specs(config)}
    counts = {part: sum(sizes.pop(name, 0) for name in names) for part, names in COMPONENTS}
    if sizes:   # a tensor no component claims would go uncounted
        raise AssertionError(f"summary.COMPONENTS misses {sorted(sizes)}")
    return counts


def active_parameter_counts(config):
    """{component: parameters} a token's forward multiplies by (ACTIVE_MEANS):
    parameter_counts with the experts' scaled to k of E."""
    counts = parameter_counts(config)
    if config.num_experts:
        counts["experts"] = counts["experts"] * config.experts_per_token // config.num_experts
    return counts


# bytes of a parameter as the matmuls read it, per --precision
PARAM_BYTES = {"fp32": 4, "bf16": 2}


def tensor_table(config):
    """(name, shape, parameters) per parameter tensor, in the model's (and
    llm.c's checkpoint) order; per-layer shapes have L first."""
    return [(name, tuple(fn(config)), math.prod(fn(config))) for name, fn in param_specs(config)]


def format_tensors(config, precision="fp32", source=None):
    """The tensor table as text, with a total row: the model's parameters."""
    c, size = config, PARAM_BYTES[precision]
    rows = tensor_table(c)
    total = sum(n for _, _, n in rows)
    lines = [f"{source + ': ' if source else ''}{describe(c)}", "",
             f"{'tensor':<14}{'shape':<24}{'parameters':>16}{f'bytes ({precision})':>18}"]
    for name, shape, n in rows:
        lines.append(f"  {name:<12}{str(shape):<24}{n:>16,}{n * size:>18,}")
    lines.append(f"  {'total':<36}{total:>16,}{total * size:>18,}")
    lines += parameter_notes(c)
    if precision == "bf16":
        lines.append("  (bf16: the copy the matmuls read; the float32 master weights take "
                     "twice these bytes)")
    return "\n".join(lines)


def parameter_notes(c):
    """The lines under a parameter table: wte's padding rows, a tied head."""
    notes = []
    if c.Vp > c.V:
        notes.append(f"wte has {c.Vp - c.V} padding rows (Vp {c.Vp} - V {c.V}): "
                     f"{(c.Vp - c.V) * c.C:,} of the embeddings' parameters")
    if c.tied_embeddings:
        notes.append("the head is tied to wte: it adds no parameters")
    return [f"  ({note})" for note in notes]


def memory_table(config, B, T, precision="fp32", recompute=False, lora_rank=0,
                 lora_targets=None, base_weights=None):
    """({part: bytes} of a training step, {part: bytes} of a forward that
    keeps its (B, T, Vp) logits and one layer's activations), as the model
    plans them: with
    ``lora_rank`` a LoRA step on ``lora_targets`` (default all); a bf16
    forward, and a bf16 LoRA step, on a frozen bf16 base; with
    ``base_weights`` ("q8_0", "q4_0") both on a quantized base (a LoRA step
    is then the only training step there is)."""
    frozen = precision == "bf16" and base_weights is None
    base = dict(precision=precision, recompute=recompute, frozen=frozen,
                base_weights=base_weights)
    if lora_rank:
        train = memory_plan(config, B, T, training=True, **base,
                            adapter_params=adapter_parameters(config, lora_rank, lora_targets),
                            adapter_width=adapter_width(config, lora_rank, lora_targets),
                            adapter_rank=lora_rank)
    elif base_weights is None:
        train = memory_plan(config, B, T, training=True, precision=precision,
                            recompute=recompute)
    else:
        train = {}
    forward = memory_plan(config, B, T, training=False, keep_logits=True, **base)
    return train, forward


def kv_cache_bytes(config, B=1, T=1):
    """Bytes of a KV cache for B rows of T positions (float32)."""
    return 4 * kv_cache_floats(config, B, T)


def format_summary(config, B, T, precision="fp32", source=None, recompute=False, lora_rank=0,
                   lora_targets=None, base_weights=None):
    """The tables as text."""
    c = config
    counts = parameter_counts(c)
    total = sum(counts.values())
    lines = [f"{source + ': ' if source else ''}{describe(c)}; vocab {c.vocab_size} "
             f"(padded {c.Vp}), max_seq_len {c.max_seq_len}", ""]
    if c.num_experts:
        lines += moe_parameter_lines(c)
    else:
        lines.append(f"{'parameters':<14}{'count':>18}{'share':>9}")
        for part, n in counts.items():
            if part not in MOE_COMPONENTS:   # 0 without experts
                lines.append(f"  {part:<12}{n:>18,}{100 * n / total:>8.1f}%")
        lines.append(f"  {'total':<12}{total:>18,}{100.0:>8.1f}%")
    lines += parameter_notes(c)
    train, forward = memory_table(c, B, T, precision, recompute, lora_rank, lora_targets,
                                  base_weights)
    step = f"LoRA step, r={lora_rank}" if lora_rank else "training step"
    kind = f"{base_weights} base" if base_weights else precision
    lines += ["", f"{f'memory at B={B}, T={T}, {kind}':<30}{step:>20}"
                  f"{'forward':>20}"]
    for part in {**train, **forward}:   # a part of either, in order
        lines.append(f"  {part:<28}{_bytes(train.get(part, 0)):>20}"
                     f"{_bytes(forward.get(part, 0)):>20}")
    lines.append(f"  {'total':<28}{_bytes(sum(train.values())) if train else '-':>20}"
                 f"{_bytes(sum(forward.values())):>20}")
    lines += ["  (training: forward_backward's logits, a block of rows at a time; "
              "forward: all B*T rows",
              "  of them kept, and one layer's activations, as sample and eval run it; "
              "scratch:",
              "  estimated for this machine's threads)",
              "", f"KV cache (float32): {kv_cache_bytes(c):,} bytes per token "
                  f"(2 x {c.L} layers x {c.NKV} kv heads x {c.head_size}); "
                  f"{_bytes(kv_cache_bytes(c, B, T))} for {B} x {T} tokens"
                  + (f" (a rolling cache of the sliding window's {c.sliding_window} "
                     f"positions per row)" if c.sliding_window else "")]
    return "\n".join(lines)


def moe_parameter_lines(config):
    """The parameter table of a model with experts: each component's total
    and active per token (ACTIVE_MEANS), and both as bytes."""
    c = config
    counts, active = parameter_counts(c), active_parameter_counts(c)
    total, used = sum(counts.values()), sum(active.values())
    lines = [f"{'parameters':<14}{'count':>18}{'share':>9}{'active per token':>20}"]
    for part, n in counts.items():
        lines.append(f"  {part:<12}{n:>18,}{100 * n / total:>8.1f}%{active[part]:>20,}")
    lines.append(f"  {'total':<12}{total:>18,}{100.0:>8.1f}%{used:>20,}")
    per_layer = len(c.moe_layers)
    return lines + [
        "", f"{total / 1e9:.2f}B parameters in total, {used / 1e9:.2f}B active per token "
            f"({c.experts_per_token} of {c.num_experts} experts in {per_layer} of "
            f"{c.num_layers} layers)",
        f"  total: {_bytes(4 * total)} fp32, {_bytes(2 * total)} bf16 (the memory holds "
        f"every expert)",
        f"  active per token: {_bytes(4 * used)} fp32, {_bytes(2 * used)} bf16",
        *textwrap.wrap(f"({ACTIVE_MEANS})", 96, initial_indent="  ", subsequent_indent="   ")]


def _bytes(n):
    return format_bytes(n) if n else "-"


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m llmc_py.summary",
        description="Parameters per component and memory per part of a model, or its "
                    "parameter tensors (--tensors), from its config alone (nothing is "
                    "allocated). A model with experts (Mixtral, Qwen3-MoE) shows its total "
                    "parameters and those active per token; " + ACTIVE_MEANS + ".")
    p.add_argument("model", metavar="MODEL_OR_CONFIG",
                   help="a model file, a Hugging Face folder or its config.json, or a depth "
                        "like d12")
    p.add_argument("-b", "--batch-size", type=int, default=1, help="B: sequences")
    p.add_argument("-t", "--seq-len", type=int, default=0,
                   help="T: tokens per sequence (0: the model's max_seq_len)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="bf16 adds the bf16 copy of the weights (mixed precision); with "
                        "--tensors, the bytes are the bf16 copy's")
    p.add_argument("--recompute", type=int, nargs="?", const=1, default=0,
                   choices=RECOMPUTE_LEVELS, metavar="LEVEL",
                   help="plan with recompute at LEVEL (train's --recompute; 1 when no LEVEL "
                        "is given)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="R > 0: the training step is a LoRA step of rank R on a frozen base")
    p.add_argument("--lora-targets", default=None,
                   help="the adapted modules, comma-separated Hugging Face names (q_proj, "
                        "...; default all the model has)")
    p.add_argument("--base-weights", choices=("q8_0", "q4_0"), default=None,
                   help="plan the base quantized, as train --base-weights and sample --weights "
                        "hold it: the linear layers, the embedding and the head in these "
                        "blocks (the training step: a LoRA step with --lora-rank)")
    p.add_argument("--tensors", action="store_true",
                   help="instead: llm.c's table of the parameter tensors (name, shape, "
                        "parameters, bytes), per-layer ones with L first")
    return p


@command
def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.lora_rank < 0:
        raise UsageError(f"--lora-rank {args.lora_rank}: must be >= 0")
    if args.batch_size < 1 or args.seq_len < 0:
        raise UsageError(f"-b {args.batch_size} -t {args.seq_len}: B must be >= 1 and T >= 0")
    config = load_config(args.model)
    if args.lora_rank and config.num_experts:
        raise UsageError(f"--lora-rank {args.lora_rank}: {args.model} has experts, and LoRA "
                         f"on a mixture of experts is not planned yet")
    T = args.seq_len or config.max_seq_len
    if args.tensors:
        print(format_tensors(config, args.precision, args.model))
    else:
        targets = args.lora_targets.split(",") if args.lora_targets else None
        try:
            text = format_summary(config, args.batch_size, T, args.precision, args.model,
                                  args.recompute, args.lora_rank, targets, args.base_weights)
        except ValueError as e:   # a target the model lacks, a rank it cannot have
            raise UsageError(f"--lora-rank {args.lora_rank} --lora-targets "
                             f"{args.lora_targets}: {e}") from None
        print(text)


if __name__ == "__main__":
    sys.exit(main())
