"""llmc_py/bench.py: the matmul and attention tables cover every instruction
set asked for, verify each before timing it, and leave the chosen one in place."""
import numpy as np
import pytest

import llmc_py
from llmc_py import bench
from llmc_py.config import GPT2Config


def test_bench_matmul_times_each_isa(use_isa):
    isas = llmc_py.supported_isas()
    use_isa(isas[0])
    rows = bench.bench_matmul(7, 67, 45, 1, np.random.default_rng(0), isas)
    assert [(r["kernel"], r["isa"]) for r in rows] == [
        (f"matmul {product}", isa) for product in ("fwd", "dinp", "dW") for isa in isas]
    assert all(r["gflops"] > 0 and r["numpy_gflops"] > 0 and r["torch_gflops"] > 0
               for r in rows)
    assert llmc_py.get_isa() == isas[0]


def test_bench_attention_verifies_and_times_each_isa(use_isa):
    isas = llmc_py.supported_isas()
    use_isa(isas[0])
    rows = bench.bench_attention(2, 19, 3, 16, 1, np.random.default_rng(0), isas)
    assert [(r["kernel"], r["isa"]) for r in rows] == [
        (f"attention {name}", isa) for name in ("fwd", "bwd") for isa in isas]
    assert all(r["ms"] > 0 and r["naive_ms"] > 0 for r in rows)
    assert llmc_py.get_isa() == isas[0]


def test_bench_memory_bound_reports_each_kernel_beside_a_copy():
    rows = bench.bench_memory_bound(4 * 3072 * 2, 1, np.random.default_rng(0), C=48)
    assert [r["kernel"] for r in rows] == [
        "gelu_forward", "gelu_backward", "residual_forward", "layernorm_forward",
        "layernorm_backward", "matmul dbias", "adamw_update"]
    assert all(r["gbps"] > 0 and r["copy_gbps"] > 0 for r in rows)


@pytest.mark.slow
def test_bench_torch_step_eager_and_compiled():
    """Both PyTorch columns of the step table run (torch.compile included:
    its first, untimed step compiles a one-layer model, ~20 s)."""
    config = GPT2Config(max_seq_len=16, vocab_size=64, padded_vocab_size=64, num_layers=1,
                        num_heads=2, channels=32)
    for compile in (False, True):
        t = bench.bench_torch_step(config, 2, 8, 2, np.random.default_rng(0), compile=compile)
        assert 0 < t["min"] <= t["median"] <= t["max"]
