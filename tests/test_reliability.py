"""Faults a run meets on shared machines and clusters, one test each, through
the real command lines (in child processes where a signal or a second process
is the fault): stop signals, two trainers on one folder, a folder holding
another run, a bad flag found late, an interrupted dataset, one model in two
threads, changed flags on resume, a full disk, unchecked values, a corrupt
newest checkpoint."""
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import llmc_py.data.prepare as P
from llmc_py import GPT2, GPT2Config, sample
from llmc_py.bench import cli as bench
from llmc_py import train as train_mod
from llmc_py.data import DataError, DataLoader, write_tokens
from llmc_py.errors import ConcurrentUseError
from llmc_py.io import HEADER_BYTES
from llmc_py.train import RunFolder
from test_train import run, train_losses

ROOT = Path(__file__).resolve().parents[1]

# a child trainer that pauses (printing "paused") when it reaches a step's
# update or a save, so that the test can act at a known point
_CHILD = r"""
import os, sys, time
from llmc_py import train
from llmc_py.train import loop, run_folder

pause_step = int(os.environ.get("PAUSE_STEP", "0"))
pause_save = int(os.environ.get("PAUSE_SAVE", "0"))
seconds = float(os.environ.get("PAUSE_SECONDS", "30"))

real_step = loop.Trainer.train_step
def train_step(self, step):
    if step == pause_step:
        print("paused", flush=True)
        time.sleep(seconds)
    return real_step(self, step)
loop.Trainer.train_step = train_step

real_write = run_folder.write_state
def write_state(path, step, *args, **kwargs):
    if step == pause_save:
        print("saving", flush=True)
        time.sleep(seconds)
    return real_write(path, step, *args, **kwargs)
run_folder.write_state = write_state
sys.exit(train.main(sys.argv[1:]))
"""

STEPS = ["-x", "10", "-n", "100", "-v", "0", "-s", "0"]


def child(shards, out, *extra, pause_step=0, pause_save=0, seconds=30):
    train_glob, val_glob = shards
    argv = ["-i", train_glob, "-o", str(out), "-e", "d1", "-b", "2", "-t", "16", "-l", "3e-3",
            "-u", "3", *STEPS, *extra]
    env = dict(os.environ, PAUSE_STEP=str(pause_step), PAUSE_SAVE=str(pause_save),
               PAUSE_SECONDS=str(seconds))
    return subprocess.Popen([sys.executable, "-c", _CHILD, *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(proc, word):
    for line in iter(proc.stdout.readline, ""):
        if line.strip() == word:
            return
    raise AssertionError(f"the child never printed {word!r}: {proc.stderr.read()}")


def finish(proc):
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, out, err


def straight(shards, out):
    """The same run as ``child``'s, uninterrupted and in this process."""
    train_glob, _ = shards
    assert train_mod.main(["-i", train_glob, "-o", str(out), "-e", "d1", "-b", "2", "-t", "16",
                           "-l", "3e-3", "-u", "3", *STEPS]) == 0
    return train_losses(out), (out / "model_00000010.bin").read_bytes()


def resume_equals(shards, out, reference):
    train_glob, _ = shards
    assert train_mod.main(["-i", train_glob, "-o", str(out), "-e", "d1", "-b", "2", "-t", "16",
                           "-l", "3e-3", "-u", "3", *STEPS, "-y", "1"]) == 0
    assert train_losses(out) == reference[0]
    assert (out / "model_00000010.bin").read_bytes() == reference[1]


# ---- 1. SIGTERM and SIGHUP ---------------------------------------------------------

@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_stop_signal_saves_the_last_step_and_resume_is_bitwise(shards, tmp_path, signum):
    reference = straight(shards, tmp_path / "straight")
    out = tmp_path / "out"
    proc = child(shards, out, pause_step=6)   # steps 1-5 done, step 6 about to run
    wait_for(proc, "paused")
    proc.send_signal(signum)
    code, stdout, stderr = finish(proc)
    assert code == 128 + signum, stderr
    name = signal.Signals(signum).name
    assert f"stopped by {name}: checkpoint of step 5" in stdout and "resume with -y 1" in stdout
    assert "Traceback" not in stderr
    assert RunFolder(out).completed_steps() == [5]
    resume_equals(shards, out, reference)


def test_a_second_signal_during_the_save_does_not_corrupt_it(shards, tmp_path):
    reference = straight(shards, tmp_path / "straight")
    out = tmp_path / "out"
    proc = child(shards, out, pause_step=4, pause_save=3, seconds=1)
    wait_for(proc, "paused")
    proc.send_signal(signal.SIGTERM)          # stops at step 3: its save begins
    wait_for(proc, "saving")
    proc.send_signal(signal.SIGTERM)          # again, in the middle of that save
    code, stdout, stderr = finish(proc)
    assert code == 143 and "checkpoint of step 3" in stdout, stderr
    assert RunFolder(out).completed_steps() == [3]
    resume_equals(shards, out, reference)


# ---- 2. two trainers on one folder ------------------------------------------------------

def test_a_second_trainer_on_the_same_folder_is_refused(shards, tmp_path, capsys):
    reference = straight(shards, tmp_path / "straight")
    out = tmp_path / "out"
    first = child(shards, out, pause_step=4, seconds=2)
    wait_for(first, "paused")
    train_glob, _ = shards
    code = train_mod.main(["-i", train_glob, "-o", str(out), "-e", "d1", "-b", "2", "-t", "16",
                           *STEPS])
    err = capsys.readouterr().err
    assert code == 1 and f"{out} is in use by another trainer (PID {first.pid})" in err
    assert err.count("\n") == 1
    code, _, stderr = finish(first)
    assert code == 0, stderr
    assert train_losses(out) == reference[0]
    assert (out / "model_00000010.bin").read_bytes() == reference[1]


# ---- 3. a folder that holds another run -------------------------------------------------

def test_a_folder_with_another_run_needs_overwrite(shards, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(shards, out, "-x", "6", "-n", "3", "-nk", "2") == 0
    log = (out / "main.log").read_text()
    capsys.readouterr()
    assert run(shards, out, "-x", "4", "-n", "2") == 1
    err = capsys.readouterr().err
    assert "holds another run" in err and "--overwrite" in err and err.count("\n") == 1
    assert (out / "main.log").read_text() == log and RunFolder(out).completed_steps() == [3, 6]

    assert run(shards, out, "-x", "4", "-n", "2", "-nk", "2", "--overwrite") == 0
    assert RunFolder(out).completed_steps() == [2, 4]
    assert not (out / "model_00000006.bin").exists()
    assert [s for s, _ in train_losses(out)] == ["1", "2", "3", "4"]


# ---- 4. a flag that fails late; failures at sample and evaluation steps -----------------------

def test_too_long_samples_are_refused_before_step_1(shards, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(shards, out, "-x", "4", "-s", "2", "-g", "2000") == 1
    err = capsys.readouterr().err
    assert "-g 2000" in err and "max_seq_len 1024" in err
    assert not (out / "main.log").exists()


def test_a_failing_sample_is_a_warning_and_costs_no_progress(shards, tmp_path, monkeypatch,
                                                            capsys):
    def broken(*args, **kwargs):
        raise ValueError("the sampler broke")
        yield
    monkeypatch.setattr(train_mod.hooks, "stream", broken)
    out = tmp_path / "out"
    assert run(shards, out, "-x", "4", "-s", "2", "-g", "3", "-n", "2", "-nk", "2") == 0
    assert "step 2: warning: sampling failed (ValueError: the sampler broke)" in \
        capsys.readouterr().out
    assert RunFolder(out).completed_steps() == [2, 4]


# ---- 5. an interrupted dataset -------------------------------------------------------------

def test_interrupted_data_preparation_leaves_a_set_the_loader_refuses(tmp_path, monkeypatch,
                                                                     capsys):
    from data_helpers import tiny_encoding
    import llmc_py.tokenizer as tok
    monkeypatch.setattr(tok, "get_encoding", tiny_encoding)
    old, new = tmp_path / "old.txt", tmp_path / "new.txt"
    old.write_text("hello world " * 400)
    new.write_text("world hello " * 300)
    data = tmp_path / "data"
    assert P.main(["--text", str(old), "--name", "set", "--out", str(data)]) == 0
    DataLoader(str(data / "set" / "train.bin"), 2, 8)   # a whole set loads

    real = P.write_tokens

    def interrupted(path, tokens, *args):
        if Path(path).name == "train.bin":
            raise KeyboardInterrupt
        return real(path, tokens, *args)
    monkeypatch.setattr(P, "write_tokens", interrupted)
    capsys.readouterr()
    assert P.main(["--text", str(new), "--name", "set", "--out", str(data)]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and err.count("\n") == 1
    for name in ("train.bin", "val.bin"):   # new val.bin beside old train.bin: refused
        with pytest.raises(DataError, match="did not finish"):
            DataLoader(str(data / "set" / name), 2, 8)

    monkeypatch.setattr(P, "write_tokens", real)
    assert P.main(["--text", str(new), "--name", "set", "--out", str(data)]) == 0
    DataLoader(str(data / "set" / "train.bin"), 2, 8)
    # a file replaced behind a complete manifest's back is refused too
    write_tokens(data / "set" / "val.bin", np.arange(50))
    with pytest.raises(DataError, match="is not the file manifest.json lists"):
        DataLoader(str(data / "set" / "val.bin"), 2, 8)


# ---- 6. one model, two threads -----------------------------------------------------------

def test_one_model_in_two_threads_raises_instead_of_computing_wrong_results():
    config = GPT2Config(max_seq_len=32, vocab_size=67, padded_vocab_size=128, num_layers=2,
                        num_heads=2, channels=32)
    model = GPT2(config, seed=0)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 67, size=(2, 17)) for _ in range(4)]
    expected = [model.forward(b[:, :-1], b[:, 1:]) for b in batches]

    holding = threading.Event()
    release = threading.Event()

    def hold():
        with model.exclusive():
            holding.set()
            release.wait(10)
    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait(10)
    for call in (lambda: model.forward(batches[0][:, :-1]), model.zero_grad, model.backward,
                 lambda: model.generate([1, 2], 2)):
        with pytest.raises(ConcurrentUseError, match="in use by another thread"):
            call()
    release.set()
    holder.join()

    results, errors = [], []

    def work(i):
        for _ in range(5):
            b = batches[i % 4]
            try:
                results.append((i % 4, model.forward(b[:, :-1], b[:, 1:])))
            except ConcurrentUseError:
                errors.append(i)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) + len(errors) == 40
    assert all(loss == expected[k] for k, loss in results)   # never a wrong loss


# ---- 7. resuming with changed flags ------------------------------------------------------------

def test_resume_refuses_what_would_change_the_run_and_reports_the_rest(shards, tmp_path,
                                                                     capsys):
    out = tmp_path / "out"
    assert run(shards, out, "-x", "6", "-n", "3") == 0
    capsys.readouterr()
    other = tmp_path / "other"
    other.mkdir()
    rng = np.random.default_rng(7)   # other tokens, the same sizes
    for name, n in (("train_000.bin", 300), ("train_001.bin", 250)):
        write_tokens(other / name, rng.integers(0, 50257, size=n))
    _, val_glob = shards
    refused = [
        (["-i", str(other / "train_*.bin"), "-j", val_glob],
         f"the training data of -i/--train-data {other / 'train_*.bin'} differ from the run's"),
        (["--seed", "7"], "the run was made with --seed 1337, this resume gives 7"),
        (["--arch", "llama"], "the run was made with --arch gpt2, this resume gives llama"),
        (["-b", "1"], "the run was made with -b/--batch-size 2, this resume gives 1"),
    ]
    for extra, message in refused:
        args = ["-o", str(out), "-e", "d1", "-t", "16", "-v", "0", "-s", "0", "-x", "8",
                "-y", "1"]
        if "-i" not in extra:
            args = ["-i", shards[0], "-j", val_glob] + args + (["-b", "2"] if "-b" not in extra
                                                                else [])
        else:
            args += ["-b", "2"]
        assert train_mod.main(args + extra) == 1, extra
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (extra, err)

    assert run(shards, out, "-x", "4", "-y", "1") == 1
    assert "-x/--max-steps 4 is below the checkpoint's step 6" in capsys.readouterr().err

    assert run(shards, out, "-x", "8", "-n", "3", "-l", "1e-3", "-y", "1") == 0
    assert "changed on resume: max_steps 6 -> 8, learning_rate 0.003 -> 0.001" in \
        capsys.readouterr().out
    assert RunFolder(out).completed_steps() == [8]   # -nk 1: the default keeps one


# ---- 8. a full disk, a file where a folder should be ---------------------------------------

def full_disk(tmp_path, size_mb):
    """A folder on a tmpfs of ``size_mb`` (needs root), or None."""
    folder = tmp_path / "small_disk"
    folder.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs",
                             str(folder)], capture_output=True)
    return folder if result.returncode == 0 else None


def test_a_full_disk_says_what_failed_and_what_is_intact(shards, tmp_path, monkeypatch, capsys):
    # a d1 checkpoint is about 40 MB (model 13 MB, state 26 MB): 60 MB hold one
    disk = full_disk(tmp_path, 60)
    if disk is None:   # not root: the same failure, injected where the bytes are written
        disk = tmp_path / "disk"
        import llmc_py.io.files as files
        real = files.os.fsync

        def fsync(fd):
            if "state_00000004" in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(28, "No space left on device")
            return real(fd)
        monkeypatch.setattr(files.os, "fsync", fsync)
    try:
        out = disk / "out"
        assert run(shards, out, "-x", "6", "-n", "2", "-v", "0") == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert "saving the checkpoint of step 4 failed" in err and str(out) in err
        assert "No space left on device" in err
        assert "the checkpoint of step 2 is intact" in err and "resume with -y 1" in err
        assert RunFolder(out).completed_steps() == [2]
        leftovers = [p.name for p in out.iterdir()
                     if "00000004" in p.name or p.name.endswith(".tmp")]
        assert leftovers == []
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_output_folder_that_is_a_file(shards, tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    assert run(shards, tmp_path / "taken", "-x", "2") == 1
    err = capsys.readouterr().err
    assert "taken: exists and is not a folder" in err and "Errno" not in err


# ---- 9. unchecked values ----------------------------------------------------------------------

@pytest.mark.parametrize("flag,value", [
    ("--seed", "-1"), ("-l", "inf"), ("-l", "nan"), ("-c", "nan"), ("-c", "-0.1"),
    ("--grad-clip", "nan"), ("--grad-clip", "-1"), ("-m", "0"), ("-q", "2"), ("-g", "0"),
    ("--rope-theta", "0"), ("--beta2", "1"),
])
def test_every_train_flag_is_range_checked(shards, tmp_path, capsys, flag, value):
    assert run(shards, tmp_path / "out", "-x", "2", flag, value) == 1
    err = capsys.readouterr().err
    long_name = {"-l": "--learning-rate", "-c": "--weight-decay", "-m": "--val-batches",
                 "-q": "--final-lr-fraction", "-g": "--gen-tokens"}.get(flag, flag)
    assert long_name in err and value in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flag,value", [
    ("--temperature", "nan"), ("--temperature", "-1"), ("--top-k", "0"), ("--top-k", "-5"),
    ("--top-p", "0"), ("--top-p", "5"), ("--top-p", "nan"), ("-g", "0"), ("--seed", "-1"),
    ("--repetition-penalty", "0"),
])
def test_every_sample_flag_is_range_checked(tmp_path, capsys, flag, value):
    assert sample.main(["-e", str(tmp_path / "model.bin"), flag, value]) == 1
    err = capsys.readouterr().err
    long_name = {"-g": "--gen-tokens"}.get(flag, flag)
    assert long_name in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flag,value", [("--repeats", "0"), ("--layers", "0"),
                                        ("--threads", "-1")])
def test_bench_flags_are_range_checked(capsys, flag, value):
    assert bench.main([flag, value]) == 1
    assert flag in capsys.readouterr().err


def test_ctrl_c_during_start_up_is_one_line(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("llmc_py.data.prepare_dataset", interrupted)
    code = train_mod.main(["-o", str(tmp_path / "out"), "--data-dir", str(tmp_path / "data")])
    captured = capsys.readouterr()
    assert code == 130 and "Traceback" not in captured.err
    assert "before training started; nothing saved" in captured.out


# ---- 10. a corrupt newest checkpoint ----------------------------------------------------------------

def test_resume_falls_back_past_a_corrupt_checkpoint(shards, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(shards, out, "-x", "6", "-n", "3", "-nk", "2") == 0
    newest = out / "model_00000006.bin"
    newest.write_bytes(newest.read_bytes()[:5000])   # truncated
    capsys.readouterr()
    assert run(shards, out, "-x", "8", "-n", "3", "-y", "1") == 0
    said = capsys.readouterr().out
    assert re.search(r"checkpoint of step 6 is unusable \(.*truncated.*\); trying an older one",
                     said)
    assert "resumed from step 3" in said
    assert [s for s, _ in train_losses(out)] == [str(i) for i in range(1, 9)]


@pytest.mark.parametrize("victim", ["model", "state"])
def test_resume_passes_over_a_checkpoint_that_fails_its_checksum(shards, tmp_path, capsys,
                                                                 victim):
    """A byte flipped inside the newest checkpoint's data (the size and header
    still right): passed over with a line naming the file, and the run goes
    on bitwise as from the older checkpoint."""
    out, older = tmp_path / "out", tmp_path / "older"
    assert run(shards, out, "-x", "6", "-n", "3", "-nk", "2") == 0
    shutil.copytree(out, older)
    for path in reversed(RunFolder(older).checkpoint_paths(6)):
        path.unlink()
    corrupted = out / f"{victim}_00000006.bin"
    data = bytearray(corrupted.read_bytes())
    data[HEADER_BYTES + 1001] ^= 0x01
    corrupted.write_bytes(bytes(data))
    capsys.readouterr()
    assert run(shards, out, "-x", "8", "-n", "3", "-y", "1") == 0
    said = capsys.readouterr().out
    assert re.search(rf"checkpoint of step 6 is unusable \({re.escape(str(corrupted))}: checksum "
                     rf"does not match: .*\); trying an older one\n", said), said
    assert "resumed from step 3" in said
    assert run(shards, older, "-x", "8", "-n", "3", "-y", "1") == 0
    for name in ("main.log", "model_00000008.bin"):
        assert (out / name).read_bytes() == (older / name).read_bytes(), name
    num_params = GPT2.from_checkpoint(out / "model_00000008.bin").num_parameters
    (m, v, extra), (m_older, v_older, extra_older) = (
        RunFolder(folder).read_state(8, num_params) for folder in (out, older))
    assert np.array_equal(m, m_older) and np.array_equal(v, v_older)
    del extra["args"]["output_dir"], extra_older["args"]["output_dir"]   # the one difference
    assert extra == extra_older


def test_resume_refuses_when_every_checkpoint_fails_its_checksum(shards, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(shards, out, "-x", "6", "-n", "3", "-nk", "2") == 0
    for step in (3, 6):
        path = out / f"model_{step:08d}.bin"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert run(shards, out, "-x", "8", "-n", "3", "-y", "1") != 0
    captured = capsys.readouterr()
    assert captured.out.count("checksum does not match") == 2
    assert f"no checkpoint in {out} loads" in captured.err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before   # no fresh start
