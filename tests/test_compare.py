"""python -m llmc_py.compare end to end at a tiny size: every variant of a
suite trains in its own process, and the table and the plot are written."""
import math
import os
import sys
from pathlib import Path

import numpy as np

from llmc_py import compare
from llmc_py.data import write_tokens

REPO = Path(__file__).resolve().parent.parent


def test_compare_runs_a_suite_end_to_end(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    write_tokens(tmp_path / "train.bin", rng.integers(0, 50257, 3000))
    write_tokens(tmp_path / "val.bin", rng.integers(0, 50257, 1000))
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tiny = ["-e", "d4", "-b", "2", "-t", "16", "-x", "3", "-v", "3", "-m", "1",
            "-i", str(tmp_path / "train.bin"), "-j", str(tmp_path / "val.bin")]
    assert compare.main(["heads", "--out", str(tmp_path / "out"), "--", *tiny]) == 0
    text = (tmp_path / "out" / "heads.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| m") or
            line.startswith("| g")]
    assert [r.split("|")[1].strip() for r in rows] == ["mha", "gqa", "mqa"]
    for row in rows:
        cells = [float(c) for c in row.split("|")[2:-1]]
        assert all(math.isfinite(c) and c > 0 for c in cells), row
        assert abs(cells[1] - math.exp(cells[0])) < 1e-3 * cells[1]   # perplexity
    params = [float(r.split("|")[-2]) for r in rows]
    assert params[0] > params[1] > params[2]   # fewer kv heads, fewer parameters
    assert (tmp_path / "out" / "heads.png").stat().st_size > 0


def test_compare_refuses_an_unknown_suite(capsys):
    assert compare.main(["nope"]) == 1
    assert "unknown suite" in capsys.readouterr().err
    assert sys.modules["llmc_py.compare"] is compare
