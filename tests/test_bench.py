"""llmc_py/bench.py: the matmul table covers every instruction set asked for,
verifies each before timing it, and leaves the chosen one in place."""
import numpy as np

import llmc_py
from llmc_py import bench


def test_bench_matmul_times_each_isa(use_isa):
    isas = llmc_py.supported_isas()
    use_isa(isas[0])
    rows = bench.bench_matmul(7, 67, 45, 1, np.random.default_rng(0), isas)
    assert [(r["kernel"], r["isa"]) for r in rows] == (
        [("matmul fwd", isa) for isa in isas] + [("matmul bwd (dinp+dW)", isa) for isa in isas])
    assert all(r["gflops"] > 0 and r["numpy_gflops"] > 0 for r in rows)
    assert llmc_py.get_isa() == isas[0]
