"""Loss and perplexity of a model at several context lengths:

    python -m llmc_py.eval MODEL DATA --lengths 256 512 1024 [--stride S]

MODEL is a model file or a Hugging Face folder; DATA a glob of llm.c token
files, read as one long text (the files in sorted order, one after another).
A token file with a loss mask beside it (NAME.mask, from `llmc_py.data
--jsonl`) is scored only where the mask trains, as training scores it.

At each length L the text is cut into windows of L tokens that start every
S tokens (S = L by default: windows side by side). Every next-token target
of the text is scored exactly once: a window scores the targets that no
earlier window scored (the others are masked, IGNORE_INDEX), so with S < L
each target after the first window has at least L - S tokens of context
(sliding-window evaluation). The last window ends at the text's end. The loss
is the mean over all targets scored (train.loop.validation_loss, as
training's validation loss); the perplexity its exp.

--weights fp32 bf16 q8_0 q4_0 evaluates the model with each of these weights
in turn (float32, a frozen bf16 base, llama.cpp's 8-bit or 4-bit blocks),
each perplexity beside its change from the first's: what each costs. A model with a
learned position table cannot go past its max_seq_len: asking is a clear
error, not a crash; RoPE, ALiBi and other position schemes can.
"""
import argparse
import glob
import os
import sys

import numpy as np

from ._native.kernels import QUANT_TYPES
from .cli import command
from .errors import DataError, UsageError
from .io.tokens import IGNORE_INDEX, mask_path, read_mask, read_tokens
from .train.loop import perplexity, validation_loss


def windows(n_tokens, length, stride):
    """(begin, first) per window over a text of ``n_tokens`` tokens: the
    window's inputs are tokens[begin:begin + length], its targets the next
    token of each, and it scores its targets from offset ``first`` on (the
    ones before were scored by an earlier window). Every target position
    1 .. n_tokens - 1 is scored once."""
    if length < 1 or stride < 1 or stride > length:
        raise UsageError(f"length {length}, stride {stride}: need 1 <= stride <= length")
    if n_tokens < length + 1:
        raise DataError(f"the text has {n_tokens} tokens; a window of {length} needs "
                        f"{length + 1}")
    out, scored_to = [], 0   # targets (by input offset) up to scored_to are done
    begin = 0
    while True:
        begin = min(begin, n_tokens - 1 - length)   # the last window ends at the text's end
        out.append((begin, scored_to - begin if scored_to > begin else 0))
        scored_to = begin + length
        if scored_to >= n_tokens - 1:
            return out
        begin += stride


def evaluate_length(model, tokens, length, stride=None, batch_size=1, trained=None):
    """(mean loss, targets scored, windows) of ``model`` on the 1-D
    ``tokens`` at context ``length`` with windows every ``stride`` tokens
    (default: ``length``), ``batch_size`` windows per forward; ``trained``
    (0 or 1 per token, as read_text gives) leaves the 0s' targets unscored."""
    c = model.config
    if c.learned_positions and length > c.max_seq_len:
        raise UsageError(f"length {length} is past the model's learned position table "
                         f"(max_seq_len {c.max_seq_len}): a learned-position model cannot be "
                         f"evaluated there; RoPE or ALiBi models can")
    spans = windows(len(tokens), length, stride or length)
    loss, counted = validation_loss(model, window_batches(tokens, length, spans, batch_size,
                                                          trained))
    return loss, counted, len(spans)


def window_batches(tokens, length, spans, batch_size, trained=None):
    """(inputs, targets) of ``batch_size`` windows at a time of ``spans``
    (windows()), the targets before each window's ``first`` IGNORE_INDEX, and
    those whose ``trained`` entry is 0."""
    for b0 in range(0, len(spans), batch_size):
        batch = spans[b0:b0 + batch_size]
        x = np.stack([tokens[begin:begin + length] for begin, _ in batch]).astype(np.int32)
        y = np.stack([tokens[begin + 1:begin + length + 1] for begin, _ in batch]).astype(
            np.int32)
        for row, (begin, first) in enumerate(batch):
            y[row, :first] = IGNORE_INDEX
            if trained is not None:
                y[row, trained[begin + 1:begin + length + 1] == 0] = IGNORE_INDEX
        yield x, y


def read_text(pattern, vocab_size, max_tokens=0):
    """The tokens of the files matching ``pattern``, in sorted order, one
    after another (the first ``max_tokens`` of them if > 0), as int32, and
    their loss mask (uint8, 1: scored), or None when no file has one."""
    files = sorted(glob.glob(os.path.expanduser(pattern)))
    if not files:
        raise DataError(f"no token files match {pattern!r}")
    parts, masks, have = [], [], 0
    for path in files:
        part = np.asarray(read_tokens(path))
        mask = mask_path(path)
        mask = read_mask(mask) if mask.exists() else np.ones(part.size, np.uint8)
        if mask.size != part.size:
            raise DataError(f"{mask_path(path)}: masks {mask.size} tokens, but {path} holds "
                            f"{part.size}")
        parts.append(part)
        masks.append(mask)
        have += part.size
        if max_tokens and have >= max_tokens:
            break
    tokens, trained = np.concatenate(parts), np.concatenate(masks)
    if max_tokens:
        tokens, trained = tokens[:max_tokens], trained[:max_tokens]
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise DataError(f"{pattern}: token id {int(tokens.max())} is outside the model's "
                        f"vocabulary of {vocab_size}")
    return tokens.astype(np.int32), (None if trained.all() else trained)


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m llmc_py.eval",
        description="Loss and perplexity of a model at several context lengths, with "
                    "sliding windows over long texts.")
    p.add_argument("model", help="a model file or a Hugging Face model folder")
    p.add_argument("data", help="glob of token files (llm.c's format), read as one text")
    p.add_argument("--lengths", type=int, nargs="+", required=True,
                   help="context lengths to evaluate at")
    p.add_argument("--stride", type=int, default=0,
                   help="tokens between window starts (0, or more than a length: the length, "
                        "windows side by side); a smaller stride gives each scored token "
                        "more context")
    p.add_argument("-b", "--batch-size", type=int, default=1, help="windows per forward")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="evaluate on the first N tokens only (0: all)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: the matmuls on the weights in bf16 alone (a frozen bf16 "
                        "base, no float32 copy)")
    p.add_argument("--weights", nargs="+", choices=WEIGHTS, default=None,
                   help="evaluate with each of these weights in turn (instead of "
                        "--precision): fp32, bf16 (as --precision bf16), or llama.cpp's "
                        "8-bit or 4-bit blocks of the linear layers' weights (q8_0, q4_0; "
                        "the embedding and head too, unless --head-weights); with several, a "
                        "last column gives each perplexity's change from the first's (e.g. "
                        "--weights fp32 bf16 q8_0 q4_0: the cost of each)")
    p.add_argument("--head-weights", choices=tuple(QUANT_TYPES), default=None,
                   help="the quantized --weights' embedding and head in these blocks instead "
                        "(e.g. --weights q4_0 --head-weights q8_0)")
    return p


# what --weights takes: a precision, or a quantisation type
WEIGHTS = ("fp32", "bf16") + tuple(QUANT_TYPES)


def parse(argv):
    args = build_parser().parse_args(argv)
    if args.batch_size < 1 or args.stride < 0 or args.max_tokens < 0 or min(args.lengths) < 1:
        raise UsageError("--lengths and -b must be >= 1, --stride and --max-tokens >= 0")
    if args.weights is None:
        args.weights = [args.precision]
    elif args.precision != "fp32":
        raise UsageError(f"--precision {args.precision} and --weights: give one (--weights "
                         f"takes bf16 too)")
    if args.head_weights and not set(args.weights) & set(QUANT_TYPES):
        raise UsageError(f"--head-weights {args.head_weights}: the head of quantized --weights "
                         f"({', '.join(QUANT_TYPES)}); none is given")
    return args


def load_with_weights(path, weights, head_weights=None):
    """The model at ``path`` with ``weights`` (WEIGHTS): in float32, a frozen
    bf16 base (the matmuls on bf16 alone), or quantized (its embedding and
    head in ``head_weights``, default the same)."""
    from .model import load_model
    quantized = weights in QUANT_TYPES
    return load_model(path, precision="fp32" if quantized else weights,
                      weights=weights if quantized else None, frozen=weights == "bf16",
                      head_weights=head_weights if quantized else None)


def evaluate(args):
    """The number of tokens read, and a row (weights, length, stride,
    windows, targets, loss) per --weights and --lengths, each evaluated as
    it is taken (so that a table shows each as soon as it is known)."""
    model = load_with_weights(args.model, args.weights[0], args.head_weights)
    c = model.config
    too_long = [L for L in args.lengths if c.learned_positions and L > c.max_seq_len]
    if too_long:
        raise UsageError(f"--lengths {' '.join(map(str, too_long))}: past the model's "
                         f"learned position table (max_seq_len {c.max_seq_len}); a "
                         f"learned-position model cannot be evaluated there (RoPE or "
                         f"ALiBi models can)")
    tokens, trained = read_text(args.data, c.vocab_size, args.max_tokens)

    def rows(model):
        for weights in args.weights:
            model = model or load_with_weights(args.model, weights, args.head_weights)
            for L in args.lengths:
                stride = min(args.stride or L, L)
                loss, counted, n = evaluate_length(model, tokens, L, stride, args.batch_size,
                                                   trained)
                yield weights, L, stride, n, counted, loss
            model = None   # let go before the next one is loaded
    return len(tokens), rows(model)


def print_table(args, n_tokens, rows):
    """One row per length; with several --weights, a weights column first
    and each perplexity's change from the first weights' at that length."""
    several = len(args.weights) > 1
    print(f"{args.model} on {n_tokens} tokens of {args.data}")
    print(("weights  " if several else "") + f"{'length':>8} {'stride':>8} {'windows':>8} "
          f"{'targets':>9} {'loss':>9} {'perplexity':>11}"
          + (f" vs {args.weights[0]}" if several else ""))
    first = {}   # length: the first weights' perplexity
    for weights, L, stride, n, counted, loss in rows:
        ppl = perplexity(loss)
        line = f"{L:>8} {stride:>8} {n:>8} {counted:>9} {loss:>9.4f} {ppl:>11.3f}"
        if several:
            base = first.setdefault(L, ppl)
            line = f"{weights:<8} {line} {(ppl / base - 1) * 100:+7.2f}%"
        print(line)


@command
def main(argv=None):
    args = parse(argv)
    n_tokens, rows = evaluate(args)
    print_table(args, n_tokens, rows)


if __name__ == "__main__":
    sys.exit(main())
