import zlib

import numpy as np
import pytest

import llmc_py


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


@pytest.fixture(params=llmc_py.supported_isas())
def isa(request, use_isa):
    """Runs the test once on each instruction set this CPU and build support,
    slowest first (llmc_py.set_isa switches every kernel family), restoring
    the instruction set afterwards."""
    use_isa(request.param)
    assert llmc_py.get_isa() == request.param
    return request.param
