import zlib

import numpy as np
import pytest

import llmc_py
from helpers import FP32_ISAS
from llmc_py.data import write_tokens


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's id: reproducible, and different
    for each parametrization."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def set_threads():
    """llmc_py.set_num_threads, with the thread count restored afterwards."""
    before = llmc_py.get_num_threads()
    try:
        yield llmc_py.set_num_threads
    finally:
        llmc_py.set_num_threads(before)


@pytest.fixture
def use_isa():
    """llmc_py.set_isa, with the instruction set restored afterwards."""
    before = llmc_py.get_isa()
    try:
        yield llmc_py.set_isa
    finally:
        llmc_py.set_isa(before)


@pytest.fixture
def shards(tmp_path):
    """Two training shards and one validation shard of random GPT-2 ids."""
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    for name, n in (("train_000.bin", 300), ("train_001.bin", 250), ("val.bin", 200)):
        tokens = rng.integers(0, 50257, size=n)
        tokens[::37] = 50256
        write_tokens(data / name, tokens)
    return str(data / "train_*.bin"), str(data / "val.bin")


@pytest.fixture(params=FP32_ISAS)
def isa(request, use_isa):
    """Runs the test once on each instruction set of the float32 kernels this
    CPU and build support (helpers.FP32_ISAS), slowest first (llmc_py.set_isa switches every kernel family), restoring
    the instruction set afterwards."""
    use_isa(request.param)
    assert llmc_py.get_isa() == request.param
    return request.param
