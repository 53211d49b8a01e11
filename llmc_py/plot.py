"""Draw the train and val loss curves of a run: ``python -m llmc_py.plot OUTDIR``.

Reads OUTDIR/main.log (lines ``s:N trl:X ...`` and ``s:N tel:X``) and writes
OUTDIR/loss.png. Needs matplotlib (``pip install "llmc_py[plot]"``).
"""
import argparse
import re
import sys
from pathlib import Path

_LINE = re.compile(r"s:(\d+) (trl|tel):(\S+)")


def read_log(path):
    """({step: train loss}, {step: val loss}) from a main.log."""
    curves = {"trl": {}, "tel": {}}
    for line in Path(path).read_text().splitlines():
        match = _LINE.match(line)
        if match:
            curves[match.group(2)][int(match.group(1))] = float(match.group(3))
    return curves["trl"], curves["tel"]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m llmc_py.plot", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", help="a training output folder (with main.log)")
    p.add_argument("-o", "--output", default=None, help="image path (default OUTDIR/loss.png)")
    args = p.parse_args(argv)
    log = Path(args.out_dir) / "main.log"
    try:
        train, val = read_log(log)
    except OSError as e:
        print(f"error: cannot read {log}: {e.strerror or e}", file=sys.stderr)
        return 1
    if not train and not val:
        print(f"error: {log} has no loss lines", file=sys.stderr)
        return 1
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('error: plotting needs matplotlib: pip install "llmc_py[plot]"', file=sys.stderr)
        return 1
    fig, ax = plt.subplots(figsize=(8, 5))
    if train:
        ax.plot(list(train), list(train.values()), label="train", linewidth=1)
    if val:
        ax.plot(list(val), list(val.values()), "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(str(Path(args.out_dir)))
    ax.grid(alpha=0.3)
    ax.legend()
    output = Path(args.output) if args.output else Path(args.out_dir) / "loss.png"
    fig.savefig(output, dpi=100, bbox_inches="tight")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
