"""Draw the train and val loss curves of a run: ``python -m llmc_py.plot OUTDIR``.

Reads OUTDIR/main.log (lines ``s:N trl:X ...`` and ``s:N tel:X``) and writes
OUTDIR/loss.png; when the run has OUTDIR/metrics.jsonl (--monitor-every), also
OUTDIR/monitors.png: the loss, each layer's attention entropy (mean and min
over its heads), the representation measures per layer, and each layer's
gradient norm and update-to-weight ratio, over steps, and with experts each
MoE layer's expert load, router entropy and the auxiliary losses. Needs matplotlib
(``pip install "llmc_py[plot]"``).
"""
import argparse
import math
import re
import sys
from pathlib import Path

from .cli import command
from .errors import UnsupportedError, UsageError

_LINE = re.compile(r"s:(\d+) (trl|tel):(\S+)")
METRICS_FILE = "metrics.jsonl"


def read_log(path):
    """({step: train loss}, {step: val loss}) from a main.log."""
    curves = {"trl": {}, "tel": {}}
    for line in Path(path).read_text().splitlines():
        match = _LINE.match(line)
        if match:
            curves[match.group(2)][int(match.group(1))] = float(match.group(3))
    return curves["trl"], curves["tel"]


def pyplot(purpose):
    """matplotlib's pyplot, drawing into files (the Agg backend); an
    UnsupportedError saying how to install it when it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UnsupportedError(f'{purpose} needs matplotlib: pip install "llmc_py[plot]"') \
            from None
    return plt


def read_curves(out_dir):
    """OUTDIR/main.log's ({step: train loss}, {step: val loss}); a
    UsageError when it cannot be read or has no loss lines."""
    log = Path(out_dir) / "main.log"
    try:
        train, val = read_log(log)
    except OSError as e:
        raise UsageError(f"cannot read {log}: {e.strerror or e}") from None
    if not train and not val:
        raise UsageError(f"{log} has no loss lines")
    return train, val


def draw(args, train, val):
    """Writes the loss curves and, when the run has metrics.jsonl, the
    monitors figure; says where."""
    plt = pyplot("plotting")
    output = Path(args.output) if args.output else Path(args.out_dir) / "loss.png"
    plot_loss(plt, train, val, args.out_dir).savefig(output, dpi=100, bbox_inches="tight")
    print(f"wrote {output}")
    metrics = Path(args.out_dir) / METRICS_FILE
    if metrics.exists():
        from .monitors import read_metrics
        records = read_metrics(metrics)
        if records:
            output = output.with_name("monitors.png")
            plot_monitors(plt, records, train, f"monitors: {args.out_dir}").savefig(
                output, dpi=100, bbox_inches="tight")
            print(f"wrote {output}")


def plot_loss(plt, train, val, out_dir):
    """The loss figure of main.log's {step: loss} curves."""
    fig, ax = plt.subplots(figsize=(8, 5))
    if train:
        ax.plot(list(train), list(train.values()), label="train", linewidth=1)
    if val:
        ax.plot(list(val), list(val.values()), "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    integer_steps(ax)
    ax.set_title(f"train and val loss: {out_dir}")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def integer_steps(ax):
    """Step ticks at whole steps only (a short run would get 1.5, 2.5, ...)."""
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def build_parser():
    p = argparse.ArgumentParser(prog="python -m llmc_py.plot", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", help="a training output folder (with main.log)")
    p.add_argument("-o", "--output", default=None, help="image path (default OUTDIR/loss.png)")
    return p


@command
def main(argv=None):
    args = build_parser().parse_args(argv)
    train, val = read_curves(args.out_dir)
    draw(args, train, val)


def _series(records, field, reduce=None):
    """(steps, values (steps, layers)) of a per-layer field of the records;
    ``reduce`` turns a layer's list (e.g. its heads) into one number."""
    steps, rows = [], []
    for r in records:
        value = r.get(field)
        if value is None:
            continue
        steps.append(r["step"])
        rows.append([reduce(v) if reduce else v for v in value])
    values = [[float("nan") if v is None else v for v in row] for row in rows]
    return steps, values


# Series that are not layers: drawn in black or grey, which no layer's colour is.
EMBEDDING_STYLE = dict(color="black", linestyle=":")
TRAIN_STYLE = dict(color="black", linestyle="-")
PROBE_STYLE = dict(color="grey", linestyle="-", marker="o", markersize=2)


def layer_colors(L):
    """One colour per layer, the same in every panel: tab10 without its grey
    for up to 9 layers (easy to tell apart), else a sweep of turbo."""
    import matplotlib
    if L <= 9:
        tab10 = matplotlib.colormaps["tab10"].colors
        return [c for i, c in enumerate(tab10) if i != 7][:L]
    turbo = matplotlib.colormaps["turbo"]
    return [turbo(0.05 + 0.9 * l / (L - 1)) for l in range(L)]


def _layer_lines(ax, steps, values, colors, linestyle="-", suffix=""):
    """One line per layer; a stream of L + 1 values (the representation
    measures) starts with the embedding's."""
    count = len(values[0]) if values else 0
    offset = count - len(colors)                # 1 when the first value is the embedding
    for i in range(count):
        column = [row[i] for row in values]
        if i < offset:
            ax.plot(steps, column, linewidth=1, label="embedding" + suffix, **EMBEDDING_STYLE)
        else:
            l = i - offset
            ax.plot(steps, column, linestyle, color=colors[l], linewidth=1,
                    label=f"layer {l}{suffix}")


def plot_monitors(plt, records, train_loss, title):
    """The monitors figure of metrics.jsonl's ``records`` (and main.log's
    train loss {step: loss}, which is drawn at every step), with one legend
    for all its panels; a model with experts gets a third row of them
    (plot_experts)."""
    from matplotlib.lines import Line2D
    experts = any("expert_fraction" in r for r in records)
    fig, axes = plt.subplots(3 if experts else 2, 4, figsize=(20, 12.75 if experts else 8.5))
    axes = axes.ravel()
    colors = layer_colors(len(records[0]["attention_entropy"]))

    ax = axes[0]
    if train_loss:
        ax.plot(list(train_loss), list(train_loss.values()), linewidth=1, label="train loss",
                **TRAIN_STYLE)
    probe = [(r["step"], r["probe_loss"]) for r in records if r.get("probe_loss") is not None]
    if probe:
        ax.plot(*zip(*probe), linewidth=1, label="probe batch loss", **PROBE_STYLE)
    ax.set_title("loss")

    ax = axes[1]
    def finite(row):
        return [v for v in row if v is not None] or [float("nan")]
    steps, mean = _series(records, "attention_entropy", lambda heads: sum(
        finite(heads)) / len(finite(heads)))
    _layer_lines(ax, steps, mean, colors)
    steps, low = _series(records, "attention_entropy", lambda heads: min(finite(heads)))
    _layer_lines(ax, steps, low, colors, "--", suffix=", min over heads")
    ax.set_title("attention entropy (nats): mean over heads, -- min")

    panels = [
        ("attention_entropy_normalized", "normalised entropy (/ ln(t+1)): min over heads", min),
        ("mean_cosine", "mean cosine between token vectors", None),
        ("residual_ratio", "residual ratio ||X - 1 mean|| / ||X||", None),
        ("effective_rank", "effective rank of the tokens", None),
        ("grad_norm_layer", "gradient norm per layer (before clipping)", None),
        ("update_ratio_layer", "update / weight norm per layer", None),
    ]
    for ax, (field, name, reduce) in zip(axes[2:], panels):
        steps, values = _series(records, field,
                                (lambda row: min(finite(row))) if reduce else None)
        if steps:
            _layer_lines(ax, steps, values, colors)
        ax.set_title(name)
    for ax in axes[6:8]:
        ax.set_yscale("log")
    if experts:
        plot_experts(axes[8:], records, colors)
    for ax in axes:
        ax.set_xlabel("step")
        integer_steps(ax)
        ax.grid(alpha=0.3)

    # the shared legend: one entry per series, whatever panels it appears in
    key = [Line2D([], [], color=c, label=f"layer {l}") for l, c in enumerate(colors)]
    key.append(Line2D([], [], label="embedding", **EMBEDDING_STYLE))
    key.append(Line2D([], [], color="black", linestyle="--", label="min over heads"))
    if experts:
        key += axes[11].get_lines()             # the auxiliary losses
    key += axes[0].get_lines()                  # train and probe loss
    fig.suptitle(title)
    fig.tight_layout()
    fig.legend(handles=key, loc="upper left", bbox_to_anchor=(1.0, 0.95), fontsize=9,
               ncol=1 + len(key) // 30)
    return fig


def plot_experts(axes, records, colors):
    """The experts' row of the monitors figure on four ``axes``: each MoE
    layer's load (its busiest and idlest expert's fraction of the top-k
    assignments times E: 1 when balanced, 0 for an expert that got none),
    the entropy of its load over ln E, its router's mean entropy, and the
    auxiliary losses (means over the MoE layers)."""
    measured = [r for r in records if "expert_fraction" in r]
    steps = [r["step"] for r in measured]
    layers = measured[0]["moe_layers"]
    E = len(measured[0]["expert_fraction"][0])
    for i, l in enumerate(layers):
        loads = [r["expert_fraction"][i] for r in measured]
        axes[0].plot(steps, [E * max(f) for f in loads], color=colors[l], linewidth=1,
                     label=f"layer {l}")
        axes[0].plot(steps, [E * min(f) for f in loads], "--", color=colors[l], linewidth=1,
                     label=f"layer {l}, idlest expert")
        for ax, field, scale in ((axes[1], "expert_entropy", math.log(E) if E > 1 else 1.0),
                                 (axes[2], "router_entropy", 1.0)):
            ax.plot(steps, [nan_if_none(r[field][i]) / scale for r in measured],
                    color=colors[l], linewidth=1, label=f"layer {l}")
    axes[0].set_title("expert load (fraction x E): busiest, -- idlest")
    axes[1].set_title("expert load entropy / ln E (1 balanced)")
    axes[2].set_title("router entropy (nats), mean over tokens")
    axes[3].plot(steps, [nan_if_none(r["aux_balance"]) for r in measured], linewidth=1,
                 label="load-balancing loss", **TRAIN_STYLE)
    axes[3].plot(steps, [nan_if_none(r["aux_z"]) for r in measured], linewidth=1,
                 label="router z-loss", **PROBE_STYLE)
    axes[3].set_title("auxiliary losses (unweighted)")


def nan_if_none(value):
    return float("nan") if value is None else value


if __name__ == "__main__":
    sys.exit(main())
