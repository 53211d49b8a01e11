"""Look at a model's attention on a prompt:
``python -m llmc_py.inspect MODEL --prompt "..." [--layer L]``.

Runs the model (a model file: llm.c's GPT-2 or ours) on the prompt's GPT-2
tokens, prints every head's attention entropy (its mean over the prompt's
positions, in nats, and normalised by ln(t + 1): 1 is uniform over the
keys, 0 one key), and draws the attention maps of every head of one layer as
a grid of heatmaps, the tokens as tick labels (rows: queries, columns:
keys), into a PNG beside the model file (or -o). Needs matplotlib
(``pip install "llmc_py[plot]"``).
"""
import argparse
import math
import sys
from pathlib import Path

import numpy as np

from ._native import kernels as K
from .cli import command
from .errors import UsageError
from .monitors import attention_entropy_rows
from .monitors.attention import mean_entropy
from .monitors.probe import run_forward
from .plot import pyplot

# the most tick labels an axis gets; longer prompts label every k-th token
MAX_LABELS = 48


def attention_maps(model, layer):
    """float32 (NH, T, T): layer ``layer``'s attention probabilities for the
    first sequence of the model's last forward, rebuilt from its statistics
    by attention_gqa_probs (rows: queries, columns: keys; 0 above the
    diagonal and before a sliding window)."""
    c, a = model.config, model.acts
    att = np.empty((model.B, c.NH, model.T, model.T), np.float32)
    K.attention_gqa_probs(att, model._attention_input(a, layer), a.att_stats[layer],
                          model.slopes, c.NH, c.NKV, c.sliding_window)
    return att[0]


def token_labels(encoding, ids):
    """Each token's text, with whitespace made visible."""
    labels = []
    for i in ids:
        text = encoding.decode_bytes([i]).decode("utf-8", errors="replace")
        labels.append(text.replace(" ", "\u00b7").replace("\n", "\\n").replace("\t", "\\t"))
    return labels


def entropy_table(entropy, normalized, layer):
    """Text: one line per layer of each head's entropy (normalised in brackets)."""
    L, NH = entropy.shape
    lines = ["attention entropy per head, nats (normalised by ln(t+1)); * the drawn layer"]
    for l in range(L):
        heads = "  ".join(f"{entropy[l, h]:5.2f} ({normalized[l, h]:.2f})" for h in range(NH))
        lines.append(f"{'*' if l == layer else ' '}layer {l:2d}: {heads}")
    return "\n".join(lines)


def draw(plt, maps, labels, entropy_row, title):
    """The figure: one heatmap per head in a near-square grid, and a colour bar."""
    NH, T, _ = maps.shape
    cols = math.ceil(math.sqrt(NH))
    rows = math.ceil(NH / cols)
    size = min(max(3.0, 0.22 * T + 1.5), 9.0)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * size, rows * size), squeeze=False,
                             layout="constrained")     # leaves room for the colour bar
    every = max(1, math.ceil(T / MAX_LABELS))
    ticks = list(range(0, T, every))
    font = 8 if T <= 24 else 6
    for h, ax in enumerate(axes.ravel()):
        if h >= NH:
            ax.axis("off")
            continue
        image = ax.imshow(maps[h], cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(f"head {h}: entropy {entropy_row[h]:.2f}", fontsize=10)
        ax.set_xticks(ticks)
        ax.set_xticklabels([labels[t] for t in ticks], rotation=90, fontsize=font)
        ax.set_yticks(ticks)
        ax.set_yticklabels([labels[t] for t in ticks], fontsize=font)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    fig.suptitle(title)
    # every head shares the 0..1 scale, so one bar serves them all
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention probability")
    return fig


def build_parser():
    p = argparse.ArgumentParser(prog="python -m llmc_py.inspect",
                                description=__doc__.split("\n")[0])
    p.add_argument("model", help="a model file (llm.c's GPT-2, or ours)")
    p.add_argument("--prompt", required=True, help="the text to run the model on")
    p.add_argument("--layer", type=int, default=0, help="the layer whose heads are drawn")
    p.add_argument("-o", "--output", default=None,
                   help="image path (default attention_layer{L}.png beside MODEL)")
    return p


def attention_on_prompt(args):
    """The model's attention on --prompt: the tokens' labels, the (L, NH)
    entropies (in nats, and normalised) and --layer's (NH, T, T) maps."""
    from .model import load_model
    from .tokenizer import get_encoding
    model = load_model(args.model)
    c = model.config
    if not 0 <= args.layer < c.L:
        raise UsageError(f"--layer {args.layer}: the model has layers 0 to {c.L - 1}")
    encoding = get_encoding()
    ids = encoding.encode(args.prompt, allowed_special="all")
    if not ids:
        raise UsageError("--prompt is empty")
    if max(ids) >= c.vocab_size:
        raise UsageError(f"the prompt has token {max(ids)}; the model's vocabulary has "
                         f"{c.vocab_size}")
    if c.learned_positions and len(ids) > c.max_seq_len:
        raise UsageError(f"the prompt has {len(ids)} tokens; the model's positions end at "
                         f"{c.max_seq_len}")
    run_forward(model, np.array([ids]))
    rows = attention_entropy_rows(model)
    entropy = mean_entropy(rows)
    normalized = mean_entropy(rows, normalized=True, window=c.sliding_window)
    return token_labels(encoding, ids), entropy, normalized, attention_maps(model, args.layer)


def default_output(model, layer):
    """attention_layer{layer}.png in the model file's folder."""
    return Path(model).with_name(f"attention_layer{layer}.png")


def show(args, labels, entropy, normalized, maps):
    """Prints the entropy table and draws --layer's maps into --output."""
    L, NH = entropy.shape
    print(f"{len(labels)} tokens, {L} layers x {NH} heads")
    print(entropy_table(entropy, normalized, args.layer))
    plt = pyplot("drawing")
    output = args.output or default_output(args.model, args.layer)
    fig = draw(plt, maps, labels, entropy[args.layer], f"{args.model}: layer {args.layer}")
    fig.savefig(output, dpi=100, bbox_inches="tight")
    print(f"wrote {output}")


@command
def main(argv=None):
    args = build_parser().parse_args(argv)
    show(args, *attention_on_prompt(args))


if __name__ == "__main__":
    sys.exit(main())
