"""A newcomer's first hour (issue 33): the default run's checkpoints and
best model, samples that read, the ETA, the offline fallback lines, and
-y 1 on a fresh folder."""
import io
import re
import sys
import types

import numpy as np

from llmc_py import sample
from llmc_py import train as train_mod
from llmc_py.train import hooks
from llmc_py.train.progress import Progress
from llmc_py.train import RunFolder, RunSpec
from llmc_py.train.cli import build_parser

# the model and data of tests/test_train.py; -nk and --keep-best left at their defaults
SMALL = ["-e", "d1", "-b", "2", "-t", "16", "-v", "2", "-m", "2", "-s", "0", "-l", "3e-3",
         "-u", "3"]


def run(shards, out_dir, *extra):
    train_glob, val_glob = shards
    return train_mod.main(["-i", train_glob, "-j", val_glob, "-o", str(out_dir), *SMALL, *extra])


def test_default_run_keeps_the_last_checkpoint_and_the_best():
    assert (RunSpec.keep_checkpoints, RunSpec.keep_best) == (1, 1)
    args = build_parser().parse_args([])
    assert (args.keep_checkpoints, args.keep_best) == (1, 1)


def test_files_left_by_a_default_run_and_the_done_line(shards, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(shards, out, "-x", "8", "-n", "2") == 0
    assert RunFolder(out).completed_steps() == [8]
    names = sorted(p.name for p in out.iterdir() if p.name != ".lock")
    assert names == ["DONE_00000008", "best.json", "main.log", "model_00000008.bin",
                     "model_best.bin", "state_00000008.bin"]
    done = capsys.readouterr().out.strip().splitlines()[-1]
    best_step = re.search(r"best val loss \S+ at step (\d+) \((\S+)\)", done)
    assert done.startswith("done: ") and best_step, done
    assert best_step.group(2) == str(out / "model_best.bin")


def test_llm_c_behaviour_keeps_every_checkpoint_and_no_best(shards, tmp_path):
    out = tmp_path / "out"
    assert run(shards, out, "-x", "6", "-n", "2", "-nk", "0", "--keep-best", "0") == 0
    assert RunFolder(out).completed_steps() == [2, 4, 6]
    assert not (out / "model_best.bin").exists()


def test_no_validation_data_keeps_no_best_unless_asked_by_name(shards, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(shards, out, "-x", "2", "-v", "0") == 0   # --keep-best 1 by default: fine
    assert not (out / "model_best.bin").exists() and not (out / "best.json").exists()
    assert "best val loss" not in capsys.readouterr().out
    assert run(shards, tmp_path / "asked", "-x", "2", "-v", "0", "--keep-best", "1") == 1
    assert "--keep-best 1" in capsys.readouterr().err


class Letters:
    """A tokenizer of one letter per id, ids 0..25, and 26 as end-of-text."""
    eot_token = 26

    def encode(self, text, allowed_special=()):
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids):
        return "".join("<|endoftext|>" if i == 26 else chr(ord("a") + i) for i in ids)


def scripted_stream(monkeypatch, module, ids, calls):
    """Makes ``module``'s stream yield ``ids`` (one row), recording its arguments."""

    def stream(model, prompts, max_new_tokens, **kwargs):
        calls.append(dict(prompts=prompts, max_new_tokens=max_new_tokens, **kwargs))
        for token in ids[:max_new_tokens]:
            yield np.array([token])
            if token == kwargs.get("stop_token"):
                return
    monkeypatch.setattr(module, "stream", stream)


def test_training_samples_use_top_k_40_and_show_end_of_text_on_its_own_line(monkeypatch):
    assert RunSpec.sample_top_k == 40 and build_parser().parse_args([]).sample_top_k == 40
    calls, said = [], io.StringIO()
    said.isatty = lambda: False
    scripted_stream(monkeypatch, hooks, [7, 8, 26, 0, 1], calls)   # "hi", end of text, "ab"
    sampling = hooks.Sampling(None, Letters(), 5, 40, 10, 10, np.random.default_rng(0),
                              Progress(said), lambda: None)
    sampling(None, types.SimpleNamespace(step=10))
    assert calls[0]["top_k"] == 40 and calls[0]["prompts"] == [[26]]
    out = said.getvalue()
    assert "<|endoftext|>" not in out
    assert out.splitlines() == [
        "step 10: sample of 5 tokens after an end-of-text token, temperature 1, top-k 40:",
        "---", "hi", "--- end of text ---", "ab", "---"]
    calls.clear()
    hooks.Sampling(None, Letters(), 5, 0, 10, 10, np.random.default_rng(0), Progress(said),
                   lambda: None)(None, types.SimpleNamespace(step=10))
    assert calls[0]["top_k"] is None and "the whole vocabulary" in said.getvalue()


def test_sample_says_when_it_stopped_at_end_of_text(monkeypatch, capsys):
    calls, out = [], io.StringIO()
    scripted_stream(monkeypatch, sample, [7, 8, 26, 0], calls)
    args = sample.parse(["-e", "unused.bin", "--prompt", "ab", "-g", "10"])
    sample.write_sample(args, None, Letters(), out)
    assert out.getvalue() == "abhi\n"
    assert capsys.readouterr().err.strip() == (
        "(stopped at the end-of-text token after 3 of the -g 10 tokens; --stop-at-eot 0 "
        "goes on past it)")
    scripted_stream(monkeypatch, sample, [7, 8, 0], calls)   # all 3 of -g 3: no line
    sample.write_sample(sample.parse(["-e", "x", "-g", "3"]), None, Letters(), io.StringIO())
    assert capsys.readouterr().err == ""


def test_eta_is_hours_minutes_seconds_in_both_progress_lines():
    from llmc_py.train.progress import hours_minutes_seconds
    assert [hours_minutes_seconds(s) for s in (0, 59.6, 1257, 3600, 36000 + 61)] == \
        ["0:00:00", "0:01:00", "0:20:57", "1:00:00", "10:01:01"]
    for live in (False, True):
        shown = io.StringIO()
        shown.isatty = lambda: live
        Progress(shown).step(5, 500, 5.0, 1.0, 1e-3, 100.0, 10000.0, 1257.4)
        assert "eta 0:20:57" in shown.getvalue() and " s)" not in shown.getvalue()


def test_resume_on_a_folder_without_a_checkpoint_starts_afresh(shards, tmp_path, capsys):
    new, killed = tmp_path / "new", tmp_path / "killed"
    assert run(shards, new, "-x", "4", "-n", "2", "-y", "1") == 0   # a job's first start
    assert f"-y 1: no checkpoint in {new} yet; starting a fresh run" in capsys.readouterr().out
    assert RunFolder(new).completed_steps() == [4]
    assert run(shards, new, "-x", "6", "-n", "2", "-y", "1") == 0   # its restart resumes
    assert "resumed from step 4" in capsys.readouterr().out
    # killed before its first checkpoint: only a main.log; without -y 1 it is refused
    killed.mkdir()
    (killed / "main.log").write_text("s:1 trl:10.000000 lr:1.000000e-04 norm:1.000000\n")
    assert run(shards, killed, "-x", "2") == 1
    assert run(shards, killed, "-x", "2", "-y", "1") == 0
    assert "starting a fresh run" in capsys.readouterr().out
    log = (killed / "main.log").read_text()
    assert log.startswith("s:1 trl:") and "trl:10.000000" not in log and "s:2 trl:" in log


def test_export_hf_without_the_hf_extra_is_refused_before_step_1(shards, tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)   # as if not installed
    out = tmp_path / "out"
    assert run(shards, out, "-x", "2", "--export-hf", str(tmp_path / "hf")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--export-hf" in err and 'pip install "llmc_py[hf]"' in err
    assert not (out / "main.log").exists() and not RunFolder(out).completed_steps()
