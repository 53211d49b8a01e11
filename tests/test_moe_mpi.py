"""Mixture-of-experts training over MPI (train.distributed), as test_mpi.py
runs it: real `mpiexec -n 2` processes of one thread each.

What 2 ranks compute: the cross-entropy and the router z-loss are means
over tokens, and the load-balancing loss is that of both ranks' rows
together (their per-expert counts and router probabilities are added inside
each MoE layer's forward), so 2 ranks of B rows are one process of 2 B rows:
the same losses, each auxiliary term apart, and parameters."""
import shutil
import subprocess
import sys

import numpy as np
import pytest

from llmc_py import load_model
from test_mpi import (SMALL, assert_same_checkpoint, env, files_of, log_lines, mpirun, shards,
                      solo)

T = 32
EXPERTS = ["--arch", "llama", "--experts", "4", "--experts-per-token", "2", "--expert-hidden",
           "32", "--router-z-loss", "0.001"]
BALANCE = ["--router-aux-loss", "0.01"]

__all__ = ["shards"]   # the module fixture


def assert_same_losses(two, one, kinds, steps=8):
    for kind in kinds:
        a, b = log_lines(two, kind), log_lines(one, kind)
        assert len(a) == len(b) == (steps if kind != "tel" else 2), kind
        np.testing.assert_allclose(a, b, rtol=1e-5, err_msg=kind)


def assert_close_parameters(two, one, step):
    a, b = (load_model(out / f"model_{step:08d}.bin") for out in (two, one))
    for name in a.params:
        np.testing.assert_allclose(a.params[name], b.params[name], rtol=0, atol=1e-5,
                                   err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--zero", "1"], ["-d", str(2 * 2 * 2 * T)]],
                         ids=["allreduce", "zero1", "accumulation"])
def test_two_ranks_are_one_process_of_twice_the_batch(shards, tmp_path, extra):
    args = [*shards, *SMALL, *EXPERTS, *BALANCE, "-x", "8", "-n", "8", "--keep-best", "0"]
    ran = mpirun(tmp_path / "two", *args, "-b", "2", *extra)
    assert ran.returncode == 0, ran.stderr
    assert solo(tmp_path / "one", *args, "-b", "4",
                *[a for a in extra if a not in ("--zero", "1")]) == 0
    assert_same_losses(tmp_path / "two", tmp_path / "one", ("trl", "ce", "balance", "z", "tel"))
    assert_close_parameters(tmp_path / "two", tmp_path / "one", 8)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--zero", "1"]], ids=["allreduce", "zero1"])
def test_expert_runs_resume_bitwise(shards, tmp_path, extra):
    args = [*shards, *SMALL, *EXPERTS, *BALANCE, "-b", "2", "-n", "4", "-nk", "2", "-k",
            "constant", "--keep-best", "0", *extra]
    assert mpirun(tmp_path / "a", *args, "-x", "8").returncode == 0
    assert mpirun(tmp_path / "c", *args, "-x", "4").returncode == 0
    ran = mpirun(tmp_path / "c", *args, "-x", "8", "-y", "1")
    assert ran.returncode == 0, ran.stderr
    a, c = tmp_path / "a", tmp_path / "c"
    assert files_of(a) == files_of(c)
    assert_same_checkpoint(a, c, 8)
    assert (c / "main.log").read_bytes() == (a / "main.log").read_bytes()


COUNTS_ON_RANKS = """
import numpy as np
from types import SimpleNamespace
from llmc_py.monitors.experts import ExpertCollapse
from llmc_py.train import distributed
world = distributed.world()
config = SimpleNamespace(moe_layers=range(1, 2), num_experts=3)
collapse = ExpertCollapse(config)
collapse.first_step = 1
collapse.counts[0] = [5, 0, 0] if world.rank == 0 else [2, 0, 4]   # expert 2: rank 1's rows
collapse.gather(world)
if world.is_root:   # one printer: the ranks' lines would interleave
    print(collapse.counts.tolist(), collapse.warnings(2))
elif collapse.counts.any():
    raise SystemExit("rank 1's counts did not start over")
"""


def test_collapse_counts_every_ranks_rows():
    """Each rank counts its own rows' experts; rank 0 warns of the sum: an
    expert that only rank 1's tokens reached has not collapsed."""
    ran = subprocess.run([shutil.which("mpiexec"), "-n", "2", sys.executable, "-c",
                          COUNTS_ON_RANKS], env=env(), capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        "[[7, 0, 4]] ['layer 1 expert 1 received no tokens in steps 1-2 (collapse)']"]


@pytest.mark.slow
def test_monitors_of_experts_on_two_ranks_with_zero1(shards, tmp_path):
    """The runner's count over both ranks and the monitor on rank 0 together:
    the records are those of the run without ZeRO (as test_mpi checks for a
    dense model), with the experts' fields."""
    from llmc_py.monitors import read_metrics
    records = {}
    for name, extra in (("plain", []), ("zero", ["--zero", "1"])):
        ran = mpirun(tmp_path / name, *shards, *SMALL, *EXPERTS, *BALANCE, "-b", "2", "-x", "4",
                     "--monitor-every", "2", *extra)
        assert ran.returncode == 0, ran.stderr
        records[name] = read_metrics(tmp_path / name / "metrics.jsonl")
    for z, p in zip(records["zero"], records["plain"]):
        assert z["step"] == p["step"] and z["moe_layers"] == [0]
        for field in ("expert_fraction", "router_entropy", "aux_balance", "aux_z",
                      "grad_norm_layer"):
            np.testing.assert_allclose(z[field], p[field], rtol=1e-6, err_msg=field)
    assert [r["step"] for r in records["zero"]] == [2, 4]
