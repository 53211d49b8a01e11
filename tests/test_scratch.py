"""csrc/scratch.c: the matmul kernels' scratch arena, kept between calls.

A call's results never depend on what the arena held before it: calls of
other sizes in between, a release, the thread count, or another Python
thread calling kernels at the same time (they take turns on the arena)."""
import threading

import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from helpers import assert_thread_invariant

ISAS = llmc_py.supported_isas()

SHAPES = [  # B, T, C, OC: small, large (the arena grows), odd, one row (skinny forward)
    (2, 17, 67, 45), (2, 64, 768, 300), (1, 37, 37, 29), (1, 1, 40, 70), (1, 129, 100, 50)]


def layer(rng, B, T, C, OC):
    x = rng.standard_normal((B, T, C), dtype=np.float32)
    w = (rng.standard_normal((OC, C), dtype=np.float32) * 0.1)
    w16 = np.empty(w.shape, np.uint16)
    K.float_to_bf16(w16, w)
    dout = rng.standard_normal((B, T, OC), dtype=np.float32)
    bias = rng.standard_normal(OC, dtype=np.float32)
    return x, w, w16, dout, bias


def products(case, precision):
    """The three products of a linear layer (and dbias), fresh outputs."""
    x, w, w16, dout, bias = case
    weight = w16 if precision == "bf16" else w
    forward = K.matmul_forward_bf16 if precision == "bf16" else K.matmul_forward
    backward = K.matmul_backward_bf16 if precision == "bf16" else K.matmul_backward
    out = np.empty(dout.shape, np.float32)
    forward(out, x, weight, bias)
    dinp, dw, db = np.ones_like(x), np.ones_like(w), np.ones_like(bias)   # (+=) onto ones
    backward(dinp, dw, db, dout, x, weight)
    return {"out": out, "dinp": dinp, "dweight": dw, "dbias": db}


def assert_same(expected, got, where):
    for name in expected:
        assert np.array_equal(expected[name], got[name]), f"{where}: {name} differs"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("isa", ISAS)
def test_reused_arena_gives_the_bits_of_a_fresh_one(rng, use_isa, isa, precision):
    """Each shape alone on a just-released arena, then all of them in turn,
    largest first and smallest first, twice: bitwise the same every time."""
    use_isa(isa)
    cases = [layer(rng, *shape) for shape in SHAPES]
    fresh = []
    for case in cases:
        llmc_py.release_scratch()
        fresh.append(products(case, precision))
    for order in (range(len(cases)), reversed(range(len(cases)))):
        for _ in range(2):
            for i in order:
                assert_same(fresh[i], products(cases[i], precision), f"{isa} {SHAPES[i]}")


def test_release_frees_and_the_next_call_grows_it_again(rng, use_isa):
    x, w, w16, dout, bias = layer(rng, 2, 64, 768, 300)
    out = np.empty(dout.shape, np.float32)
    K.matmul_forward(out, x, w, bias)
    assert llmc_py.scratch_bytes() > 0
    llmc_py.release_scratch()
    assert llmc_py.scratch_bytes() == 0
    llmc_py.release_scratch()   # releasing an empty arena is fine
    again = np.empty_like(out)
    K.matmul_forward(again, x, w, bias)
    assert llmc_py.scratch_bytes() > 0 and np.array_equal(out, again)


def test_the_arena_stops_growing_once_it_fits(rng):
    """Repeated calls of one shape allocate nothing more; a smaller call
    keeps the larger buffer."""
    big, small = layer(rng, 2, 64, 768, 300), layer(rng, 1, 37, 37, 29)
    for precision in ("fp32", "bf16"):
        products(big, precision)
    held = llmc_py.scratch_bytes()
    for precision in ("fp32", "bf16", "fp32", "bf16"):
        products(big, precision)
        products(small, precision)
        assert llmc_py.scratch_bytes() == held


@pytest.mark.parametrize("isa", ISAS)
def test_thread_counts_share_one_arena_bitwise(rng, set_threads, use_isa, isa):
    """1, 2 and 3 threads, each on the arena the previous count left (a
    different slice per thread), give the same bits."""
    use_isa(isa)
    cases = [layer(rng, *shape) for shape in SHAPES[:3]]
    assert_thread_invariant(set_threads, lambda: {
        f"{precision} {i} {name}": value
        for precision in ("fp32", "bf16") for i, case in enumerate(cases)
        for name, value in products(case, precision).items()})


def test_two_python_threads_take_turns(rng):
    """Two Python threads (cffi releases the GIL around each kernel) calling
    the matmuls of different shapes at once, with releases in between: every
    result is bitwise what the calls give one at a time."""
    cases = [layer(rng, *shape) for shape in SHAPES]
    expected = [{p: products(case, p) for p in ("fp32", "bf16")} for case in cases]
    failures = []

    def work(offset):
        try:
            for step in range(12):
                i = (step + offset) % len(cases)
                for precision in ("fp32", "bf16"):
                    assert_same(expected[i][precision], products(cases[i], precision),
                                f"thread {offset}, {SHAPES[i]}, {precision}")
                if step % 5 == offset:
                    llmc_py.release_scratch()
        except AssertionError as e:
            failures.append(e)

    threads = [threading.Thread(target=work, args=(offset,)) for offset in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]


@pytest.mark.parametrize("isa", ISAS)
def test_the_memory_plan_counts_the_arena(use_isa, isa):
    """After bf16 training steps the arena holds no more than memory_plan's
    scratch, on every instruction set: the widened paths keep their float32
    copies in it too, largest at a GPT-2-sized head (its weight's copy
    alone is 12 MiB here)."""
    use_isa(isa)
    config = llmc_py.GPT2Config(max_seq_len=64, vocab_size=50257, padded_vocab_size=50304,
                                num_layers=1, num_heads=4, channels=64)
    model = llmc_py.GPT2(config, seed=0, precision="bf16")
    tokens = np.random.default_rng(0).integers(0, 50257, size=(3, 65))
    llmc_py.release_scratch()
    for _ in range(2):
        model.zero_grad()
        model.forward_backward(tokens[:, :-1], tokens[:, 1:])
    held = llmc_py.scratch_bytes()
    assert 0 < held <= model.memory_plan(3, 64, training=True)["scratch"]
