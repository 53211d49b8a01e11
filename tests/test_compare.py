"""python -m llmc_py.compare end to end at a tiny size: every variant of a
suite trains in its own process, and the table and the plot are written."""
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from llmc_py import compare
from llmc_py.data import write_tokens

REPO = Path(__file__).resolve().parent.parent


def tiny_data(tmp_path, monkeypatch, seed):
    """-i and -j flags of random train and val tokens; the runs' processes
    import this tree."""
    rng = np.random.default_rng(seed)
    write_tokens(tmp_path / "train.bin", rng.integers(0, 50257, 3000))
    write_tokens(tmp_path / "val.bin", rng.integers(0, 50257, 1000))
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return ["-i", str(tmp_path / "train.bin"), "-j", str(tmp_path / "val.bin")]


def test_compare_runs_a_suite_end_to_end(tmp_path, monkeypatch):
    tiny = ["-e", "d4", "-b", "2", "-t", "16", "-x", "3", "-v", "3", "-m", "1",
            *tiny_data(tmp_path, monkeypatch, 0)]
    assert compare.main(["heads", "--out", str(tmp_path / "out"), "--", *tiny]) == 0
    text = (tmp_path / "out" / "heads.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| m") or
            line.startswith("| g")]
    assert [r.split("|")[1].strip() for r in rows] == ["mha", "gqa", "mqa"]
    for row in rows:
        cells = [float(c) for c in row.split("|")[2:-1]]
        assert all(math.isfinite(c) and c > 0 for c in cells), row
        assert abs(cells[1] - math.exp(cells[0])) < 1e-3 * cells[1]   # perplexity
    header = [c.strip() for c in text.splitlines()[2].split("|")[1:-1]]
    column = {name: [float(r.split("|")[1:-1][header.index(name)]) for r in rows]
              for name in ("parameters (M)", "KV cache MiB", "decode tokens/s")}
    params, cache = column["parameters (M)"], column["KV cache MiB"]
    assert params[0] > params[1] > params[2]   # fewer kv heads, fewer parameters
    assert cache[0] == 2 * cache[1] == 4 * cache[2]   # 4, 2 and 1 kv heads
    assert (tmp_path / "out" / "heads.png").stat().st_size > 0


def test_compare_refuses_an_unknown_suite(capsys):
    assert compare.main(["nope"]) == 1
    assert "unknown suite" in capsys.readouterr().err
    assert sys.modules["llmc_py.compare"] is compare


def test_compare_evaluates_at_longer_lengths(tmp_path, monkeypatch):
    """A suite with lengths: each trained model's loss at 1x and 2x its T,
    a RoPE one also with its RoPE scaled by the multiple."""
    rope = ["--arch", "llama", "--kv-heads", "1", "--position", "rope"]
    monkeypatch.setitem(compare.SUITES, "tiny", {
        "about": "a test", "lengths": (1, 2),
        "variants": {"rope": rope, "rope scaled": {"flags": rope, "scale_rope": "linear"}}})
    tiny = ["-e", "d1", "-b", "2", "-t", "16", "-x", "2", "-v", "2", "-m", "1",
            *tiny_data(tmp_path, monkeypatch, 1)]
    assert compare.main(["tiny", "--out", str(tmp_path / "out"), "--", *tiny]) == 0
    lines = (tmp_path / "out" / "tiny.md").read_text().splitlines()
    assert "loss @ 1x T | loss @ 2x T |" in lines[2]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in lines[4:] if line.startswith("| rope")}
    plain, scaled = rows["rope"], rows["rope scaled"]
    assert all(np.isfinite(float(c)) for c in plain[-2:] + scaled[-2:])
    # the same training (same seed, flags): the same losses at 1x; at 2x the scaling differs
    results = [json.loads((tmp_path / "out" / "tiny" / name / "peak.json").read_text())
               for name in ("rope", "rope-scaled")]
    assert plain[:2] == scaled[:2]
    assert results[0]["lengths"]["1"] == results[1]["lengths"]["1"]
    assert results[0]["lengths"]["2"] != results[1]["lengths"]["2"]


def test_compare_moe_shows_each_experts_load(tmp_path, monkeypatch):
    """The moe suite at a tiny size: every variant trains; the MoE rows show
    each MoE layer's max/min tokens per expert (from the final model's
    routing), their active parameters below their total, the dense rows
    their active parameters equal to their total."""
    tiny = ["-e", "d2", "-b", "2", "-t", "16", "-x", "2", "-v", "2", "-m", "1",
            *tiny_data(tmp_path, monkeypatch, 2)]
    assert compare.main(["moe", "--out", str(tmp_path / "out"), "--", *tiny]) == 0
    lines = (tmp_path / "out" / "moe.md").read_text().splitlines()
    header = [c.strip() for c in lines[2].split("|")[1:-1]]
    rows = {line.split("|")[1].strip(): dict(zip(header, (c.strip() for c in
                                                           line.split("|")[1:-1])))
            for line in lines[4:] if line.startswith("| ")}
    assert list(rows) == list(compare.SUITES["moe"]["variants"])
    for name, row in rows.items():
        total, active = float(row["parameters (M)"]), float(row["active parameters (M)"])
        if name.startswith("dense"):
            assert row["expert load max/min"] == "n/a" and abs(active - total) < 0.1
            continue
        loads = row["expert load max/min"].split()
        assert len(loads) == 2, row   # d2: two MoE layers
        assert all(load == "inf" or float(load) >= 1 for load in loads)
        assert active < total
    # top-1 sends a token through half the experts' parameters top-2 does
    assert float(rows["moe 8x384 top-1"]["active parameters (M)"]) < \
        float(rows["moe 8x384 top-2"]["active parameters (M)"])


def test_compare_runs_moe_only_when_asked():
    assert "moe" in compare.SUITES and "moe" not in compare.DEFAULT_SUITES
