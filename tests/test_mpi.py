"""Data-parallel training under mpiexec (train.distributed): 2 ranks of one
thread each against one process, bitwise determinism, resume, ZeRO-1,
gradient accumulation, a rank that fails, a stop signal to one rank or to
the launcher, monitors with ZeRO-1, and another number of processes on
resume. The runs are real `mpiexec -n 2 python -m llmc_py.train` processes
(the [mpi] extra's mpich, which the test extra installs).

Tolerance against one process: 1e-5 relative on every step's loss (the two
sum a step's rows in other groupings; seen: equal to the printed digits)."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llmc_py import load_model
from llmc_py import train as train_mod
from llmc_py.data import DataLoader, write_tokens
from llmc_py.errors import UsageError
from llmc_py.io import read_state
from llmc_py.train import distributed
from llmc_py.train.signals import Stopped, StopSignals

REPO = Path(__file__).resolve().parent.parent
SMALL = ["-e", "d1", "-t", "32", "-s", "0", "-v", "4", "-m", "2", "-u", "2", "-l", "1e-3"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    write_tokens(folder / "train.bin", rng.integers(0, 50257, 30000))
    write_tokens(folder / "val.bin", rng.integers(0, 50257, 4000))
    return ["-i", str(folder / "train.bin"), "-j", str(folder / "val.bin")]


def env(**extra):
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
             OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for name in distributed.LAUNCHER_SIZE_VARS:
        e.pop(name, None)
    e.update(extra)
    return e


def mpirun(out, *args, ranks=2, timeout=120, **extra_env):
    mpiexec = shutil.which("mpiexec")
    assert mpiexec, 'mpiexec is not on PATH: pip install ".[mpi]" (mpich) or a system MPI'
    return subprocess.run([mpiexec, "-n", str(ranks), sys.executable, "-m", "llmc_py.train",
                           "-o", str(out), *args], env=env(**extra_env), capture_output=True,
                          text=True, timeout=timeout)


def solo(out, *args):
    return train_mod.main(["-o", str(out), *args])


def log_lines(out, kind):
    return [float(line.split(f"{kind}:")[1].split()[0])
            for line in (Path(out) / "main.log").read_text().splitlines() if f" {kind}:" in line]


@pytest.mark.parametrize("extra", [[], ["--zero", "1"], ["-d", str(2 * 4 * 32)],
                                   ["--dropout", "0.1", "-d", str(2 * 4 * 32)]],
                         ids=["allreduce", "zero1", "accumulation", "dropout"])
def test_two_ranks_match_one_process(shards, tmp_path, extra):
    ran = mpirun(tmp_path / "two", *shards, *SMALL, "-b", "2", "-x", "8", *extra)
    assert ran.returncode == 0, ran.stderr
    assert solo(tmp_path / "one", *shards, *SMALL, "-b", "4", "-x", "8",
                *[a for a in extra if a not in ("--zero", "1")]) == 0
    for kind in ("trl", "tel"):
        two, one = log_lines(tmp_path / "two", kind), log_lines(tmp_path / "one", kind)
        assert len(two) == len(one) == (8 if kind == "trl" else 2)
        np.testing.assert_allclose(two, one, rtol=1e-5, err_msg=kind)
    assert "on each of 2 processes" in ran.stdout and ran.stdout.count("step 8/8") == 1


def test_zero1_in_bf16_matches_the_all_reduce(shards, tmp_path):
    """bf16 mixed precision: ZeRO-1 updates the fp32 shard and gathers it,
    then rounds the bf16 copy again; the same steps as without it (the
    gradient norms differ only in how their squares are summed)."""
    for name, extra in (("plain", []), ("zero", ["--zero", "1"])):
        ran = mpirun(tmp_path / name, *shards, *SMALL, "-b", "2", "-x", "6", "--precision",
                     "bf16", *extra)
        assert ran.returncode == 0, ran.stderr
    np.testing.assert_allclose(log_lines(tmp_path / "zero", "trl"),
                               log_lines(tmp_path / "plain", "trl"), rtol=1e-5)


def test_monitors_with_zero1_write_what_they_write_without(shards, tmp_path):
    """--monitor-every with --zero 1: rank 0 gathers the averaged gradient
    shards on measured steps, so the records are those of --zero 0. Step 1's
    gradients are bitwise the same in both; after it, the two trainings
    differ only in how the global norm's squares are summed (``norm``,
    1e-15 relative), which may move a clipped step's scale by an ulp: the
    rest within the records' 7 significant digits. The gather leaves
    training as it was."""
    args = [*shards, *SMALL, "-b", "2", "-x", "4", "--keep-best", "0"]
    records = {}
    for zero in ("0", "1"):
        ran = mpirun(tmp_path / zero, *args, "--monitor-every", "1", "--zero", zero)
        assert ran.returncode == 0, ran.stderr
        records[zero] = [json.loads(line)
                         for line in (tmp_path / zero / "metrics.jsonl").read_text().splitlines()]
    assert mpirun(tmp_path / "unmonitored", *args, "--zero", "1").returncode == 0
    for name in ("main.log", "model_00000004.bin"):
        assert (tmp_path / "1" / name).read_bytes() == \
            (tmp_path / "unmonitored" / name).read_bytes(), name
    plain, zero = records["0"], records["1"]
    assert [r["step"] for r in zero] == [r["step"] for r in plain] == [1, 2, 3, 4]
    for field in ("grad_norm", "grad_norm_layer"):
        assert zero[0][field] == plain[0][field], field
    for z, p in zip(zero, plain):
        assert z.keys() == p.keys()
        for field in set(p) - {"step", "monitor_ms", "warnings"}:
            np.testing.assert_allclose(flat(z[field]), flat(p[field]), rtol=1e-6,
                                       err_msg=f"step {p['step']} {field}")


def flat(value):
    """The numbers of a record's field, in order (None as NaN)."""
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in flat(value[k])]
    if isinstance(value, list):
        return [x for v in value for x in flat(v)]
    return [np.nan if value is None else value]


VALIDATION_ON_RANKS = """
import sys
from llmc_py import GPT2
from llmc_py.train import distributed
from llmc_py.train.loop import evaluate
from test_eval import Batches, masked_batches
from test_gpt2_step import SMALL
world = distributed.world()
loader = distributed.RankRows(Batches(masked_batches(SMALL, 3, 4, 8, seed=8)), world)
loss = evaluate(GPT2(SMALL, seed=8), loader, 3, world)
if world.is_root:
    print(repr(loss))
"""


def test_validation_loss_on_two_ranks_is_the_one_process_mean():
    """Masked targets, unequally counted on each rank: the ranks add their
    sums and counts, so two ranks give the one process's mean over targets
    (added in another grouping: to 1e-12), not the mean of the ranks' means."""
    from llmc_py import GPT2
    from llmc_py.train.loop import evaluate
    from test_eval import Batches, masked_batches
    from test_gpt2_step import SMALL
    ran = subprocess.run([shutil.which("mpiexec"), "-n", "2", sys.executable, "-c",
                          VALIDATION_ON_RANKS], env=env(PYTHONPATH=f"{REPO}:{REPO / 'tests'}"),
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    one = evaluate(GPT2(SMALL, seed=8), Batches(masked_batches(SMALL, 3, 4, 8, seed=8)), 3)
    assert abs(float(ran.stdout) - one) <= 1e-12 * one


def files_of(out):
    return sorted(p.name for p in Path(out).iterdir() if not p.name.startswith("."))


@pytest.mark.parametrize("extra", [[], ["--zero", "1"]], ids=["allreduce", "zero1"])
def test_runs_are_bitwise_identical_and_resume_bitwise(shards, tmp_path, extra):
    # a constant rate: a run of -x 4 is the first half of one of -x 8
    args = [*shards, *SMALL, "-b", "2", "-n", "4", "-nk", "2", "-k", "constant", "--keep-best", "0",
            *extra]
    for name in ("a", "b"):
        ran = mpirun(tmp_path / name, *args, "-x", "8")
        assert ran.returncode == 0, ran.stderr
    a, b = tmp_path / "a", tmp_path / "b"
    assert files_of(a) == ["DONE_00000004", "DONE_00000008", "main.log", "model_00000004.bin",
                           "model_00000008.bin", "state_00000004.bin", "state_00000008.bin"]
    for step in (4, 8):
        assert_same_checkpoint(a, b, step)
    assert (a / "main.log").read_bytes() == (b / "main.log").read_bytes()
    # stop at 4, resume to 8: the same bytes
    assert mpirun(tmp_path / "c", *args, "-x", "4").returncode == 0
    ran = mpirun(tmp_path / "c", *args, "-x", "8", "-y", "1")
    assert ran.returncode == 0, ran.stderr
    assert_same_checkpoint(a, tmp_path / "c", 8)
    assert (tmp_path / "c" / "main.log").read_bytes() == (a / "main.log").read_bytes()


def assert_same_checkpoint(one, other, step):
    """The model file and AdamW's moments bitwise, and the data position (the
    state files also hold each run's own -o)."""
    name = f"model_{step:08d}.bin"
    assert (one / name).read_bytes() == (other / name).read_bytes(), name
    n = load_model(one / name).num_parameters
    states = [read_state(folder / f"state_{step:08d}.bin", n) for folder in (one, other)]
    for i, what in ((1, "m"), (2, "v")):
        assert np.array_equal(states[0][i], states[1][i]), what
    assert states[0][3]["train_loader"] == states[1][3]["train_loader"]


def test_a_rank_that_raises_ends_the_job(shards, tmp_path):
    args = [*shards, *SMALL, "-b", "2", "-n", "4", "--keep-best", "0"]
    t0 = time.monotonic()
    ran = mpirun(tmp_path / "f", *args, "-x", "8", timeout=30,
                 **{distributed.FAULT_ENV: "1:6"})
    assert ran.returncode != 0 and time.monotonic() - t0 < 30
    assert "error: rank 1 of 2: RuntimeError: injected fault" in ran.stderr
    assert files_of(tmp_path / "f") == ["DONE_00000004", "main.log", "model_00000004.bin",
                                        "state_00000004.bin"]
    ran = mpirun(tmp_path / "f", *args, "-x", "8", "-y", "1")
    assert ran.returncode == 0, ran.stderr
    assert mpirun(tmp_path / "whole", *args, "-x", "8").returncode == 0
    assert (tmp_path / "f" / "model_00000008.bin").read_bytes() == \
        (tmp_path / "whole" / "model_00000008.bin").read_bytes()


def test_resume_with_another_number_of_processes(shards, tmp_path, capsys):
    args = [*shards, *SMALL, "-b", "2", "-n", "4"]
    assert mpirun(tmp_path / "r", *args, "-x", "4").returncode == 0
    assert solo(tmp_path / "r", *args, "-x", "8", "-y", "1") == 0
    said = capsys.readouterr().out
    assert "world_size 2 -> 1" in said
    # the run's tokens per step (-d, taken from it), in two micro-batches
    assert "batch 2x32, 2 micro-batch(es) per step" in said
    # -m 2 batches of B=2 rows on each process: 8 rows on two, 4 on one
    assert ("resume: the run had 2 process(es), this one 1: -m/--val-batches counts batches "
            "of B rows on each process, so an evaluation reads 4 rows (the run read 8) and "
            "its loss is not comparable with the run's; -m/--val-batches 4 reads the run's "
            "rows") in said
    assert "was measured on other validation data or batches" in said   # --keep-best's
    losses = log_lines(tmp_path / "r", "trl")
    assert len(losses) == 8 and all(np.isfinite(losses))


# ---- a stop signal ---------------------------------------------------------------

# `python -m llmc_py.train` that also says its exit code (mpiexec's is one for all ranks)
TRAIN_SAYING_EXIT = ("import sys; from llmc_py.train.cli import main; code = main(sys.argv[1:]); "
                     "sys.stderr.write(f'exit code {code}\\n'); sys.exit(code)")


def start(out, *args):
    """`mpiexec -n 2` of a training run in the background, its stdout and
    stderr in files beside ``out``."""
    with open(f"{out}.stdout", "w") as stdout, open(f"{out}.stderr", "w") as stderr:
        return subprocess.Popen([shutil.which("mpiexec"), "-n", "2", sys.executable, "-c",
                                 TRAIN_SAYING_EXIT, "-o", str(out), *args], env=env(),
                                stdout=stdout, stderr=stderr)


def wait_for_steps(job, out, steps, timeout=120):
    """Until rank 0 has logged ``steps`` steps."""
    deadline = time.monotonic() + timeout
    log = Path(out) / "main.log"
    while not (log.exists() and log.read_text().count(" trl:") >= steps):
        assert job.poll() is None, Path(f"{out}.stderr").read_text()
        assert time.monotonic() < deadline, f"{steps} steps not logged in {timeout} s"
        time.sleep(0.05)


def rank_pids(launcher):
    """{rank: pid} of the processes under ``launcher`` that an MPI launcher
    gave a rank (MPICH's PMI_RANK, Open MPI's OMPI_COMM_WORLD_RANK)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:   # "pid (command) state ppid ..."
            pid, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):   # a process that just ended
            continue
        children.setdefault(ppid, []).append(pid)
    ranks, todo = {}, [launcher]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for name in (b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK="):
                ranks.update({int(v[len(name):]): pid for v in environ if v.startswith(name)})
    return ranks


def end(job):
    """Kills what is left of a job (a test that failed)."""
    if job.poll() is None:
        for pid in rank_pids(job.pid).values():
            with contextlib.suppress(ProcessLookupError):   # ended meanwhile
                os.kill(pid, signal.SIGKILL)
        job.kill()
        job.wait()


@pytest.mark.parametrize("target, extra", [(0, []), (1, ["--zero", "1"]), ("launcher", [])],
                         ids=["rank0", "rank1-zero1", "launcher"])
def test_a_stop_signal_stops_every_rank_after_the_same_step(shards, tmp_path, target, extra):
    """SIGTERM to one rank, or to mpiexec (which forwards it to every rank):
    the ranks agree on the last finished step, save it once and exit with
    143 (so does mpiexec); the resume is bitwise the run not stopped."""
    args = [*shards, *SMALL, "-b", "2", "-n", "0", "-k", "constant", "--keep-best", "0", *extra]
    out = tmp_path / "stopped"
    job = start(out, *args, "-x", "100000")
    try:
        wait_for_steps(job, out, 3)
        pids = rank_pids(job.pid)
        assert sorted(pids) == [0, 1]
        os.kill(job.pid if target == "launcher" else pids[target], signal.SIGTERM)
        job.wait(timeout=30)   # a hang fails here
    finally:
        end(job)
    stdout, stderr = (Path(f"{out}.{name}").read_text() for name in ("stdout", "stderr"))
    assert job.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.count("exit code 143") == 2, stderr
    step = int(stdout.split("stopped by SIGTERM: checkpoint of step ")[1].split()[0])
    assert files_of(out) == [f"DONE_{step:08d}", "main.log", f"model_{step:08d}.bin",
                             f"state_{step:08d}.bin"]
    assert len(log_lines(out, "trl")) == step >= 3
    # two steps more, resumed, against a run that was not stopped
    ran = mpirun(out, *args, "-x", str(step + 2), "-y", "1")
    assert ran.returncode == 0, ran.stderr
    assert mpirun(tmp_path / "whole", *args, "-x", str(step + 2)).returncode == 0
    assert_same_checkpoint(tmp_path / "whole", out, step + 2)
    assert (out / "main.log").read_bytes() == (tmp_path / "whole" / "main.log").read_bytes()


# ---- the pieces, in one process ---------------------------------------------------

def test_shards_cover_the_buffer_in_order():
    for n, size in ((10, 3), (7, 7), (5, 8), (124_475_904, 2)):
        bounds = distributed.shard_bounds(n, size)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_held_signals_stop_where_the_ranks_agree():
    """Under mpiexec a signal is only recorded; agree() raises Stopped once
    any rank has one, this rank's or another's (the highest number)."""
    class OtherRankHasSIGTERM(distributed.Solo):
        def max(self, value):
            return max(value, signal.SIGTERM)

    with StopSignals(held=True) as signals:
        signals.agree(distributed.Solo())   # no signal anywhere: goes on
        os.kill(os.getpid(), signal.SIGINT)   # recorded, not raised
        with pytest.raises(Stopped) as stop:
            signals.agree(distributed.Solo())
        assert stop.value.signum == signal.SIGINT
        with pytest.raises(Stopped) as stop:
            signals.agree(OtherRankHasSIGTERM())
        assert stop.value.signum == signal.SIGTERM
    with StopSignals(held=True) as signals, pytest.raises(Stopped) as stop:
        signals.agree(OtherRankHasSIGTERM())
    assert stop.value.signum == signal.SIGTERM


def test_launched_without_mpi4py_is_refused(monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setitem(sys.modules, "mpi4py", None)   # as if not installed
    with pytest.raises(UsageError, match="2 processes, but mpi4py is not installed"):
        distributed.world()
    monkeypatch.setenv("PMI_SIZE", "1")
    assert isinstance(distributed.world(), distributed.Solo)


def test_a_loader_position_moves_to_another_batch(shards, tmp_path):
    """Sequential: the first window at or after the first unread token."""
    path = shards[1]
    four = DataLoader(path, 4, 32)
    for _ in range(3):
        four.next_batch()
    two = DataLoader(path, 2, 32)
    two.load_state_dict(four.state_dict(), other_batch=True)
    assert np.array_equal(two.next_batch()[0], four.next_batch()[0][:2])
    three = DataLoader(path, 3, 32)
    three.load_state_dict(four.state_dict(), other_batch=True)   # 4 windows of 4 rows read
    assert three.batch_pos == 6   # ceil(16 / 3) windows of 3 rows
    shuffled = DataLoader(path, 2, 32, shuffle=True)
    with pytest.raises(ValueError, match="B is 4"):
        shuffled.load_state_dict(DataLoader(path, 4, 32, shuffle=True).state_dict(),
                                 other_batch=True)


def test_a_zero_shard_is_what_the_memory_plan_counts():
    from llmc_py import GPT2, GPT2Config
    model = GPT2(GPT2Config(max_seq_len=16, vocab_size=100, padded_vocab_size=128,
                            num_layers=1, num_heads=2, channels=32))
    n = model.num_parameters
    bounds = distributed.shard_bounds(n, 3)[1]
    model.reserve(2, 8, training=True, moment_params=bounds[1] - bounds[0])
    assert model.m_memory is None   # the shard's optimizer makes its moments
    assert model.memory_plan(2, 8)["AdamW moments"] == 8 * (bounds[1] - bounds[0])
    full = GPT2(model.config)
    full.reserve(2, 8, training=True)
    assert full.m_memory.size == n and full.memory_plan(2, 8)["AdamW moments"] == 8 * n
