"""Requests that cannot fit in memory fail up front with OutOfMemoryError (a
MemoryError) saying how much they needed and what for."""
import numpy as np
import pytest

from llmc_py import GPT2, GPT2Config, OutOfMemoryError
from llmc_py.model import memory
from llmc_py import train as train_mod
from llmc_py.data import write_tokens
from llmc_py.model.layout import ACT_SPECS, GRAD_ACT_SPECS, aligned_empty, specs_bytes

GIB = 1 << 30
# a long context and a wide padded vocabulary: the logits and probs (B, T, Vp)
# are 128 GiB per sequence, so B=80 needs about 10 TiB for the activations alone
# (attention keeps only (B, NH, T, 2) statistics, so T alone no longer does it)
LONG = GPT2Config(max_seq_len=65536, vocab_size=50, padded_vocab_size=1 << 18, num_layers=1,
                  num_heads=8, channels=8)


def write_meminfo(folder, available_kb, swap_free_kb=0):
    path = folder / "meminfo"
    path.write_text(f"MemTotal:       99999999 kB\nMemFree:         1000 kB\n"
                    f"MemAvailable:   {available_kb} kB\nSwapTotal:       0 kB\n"
                    f"SwapFree:       {swap_free_kb} kB\n")
    return path


def test_available_bytes_reads_meminfo_and_cgroup(tmp_path):
    meminfo = write_meminfo(tmp_path, 4 * 1024 * 1024, swap_free_kb=1024 * 1024)
    no_cgroup = tmp_path / "no-cgroup"
    assert memory.available_bytes(meminfo, no_cgroup) == 5 * GIB   # available + free swap
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text(f"{GIB}\n")
    assert memory.available_bytes(meminfo, cgroup) == 5 * GIB      # no limit
    (cgroup / "memory.max").write_text(f"{3 * GIB}\n")
    assert memory.available_bytes(meminfo, cgroup) == 2 * GIB      # limit - current


def test_available_bytes_of_this_machine_is_plausible():
    avail = memory.available_bytes()
    assert avail is not None and 64 << 20 < avail < 1 << 50


def test_require_names_the_need_in_gib():
    memory.require(GIB, "a thing", available=2 * GIB)
    with pytest.raises(OutOfMemoryError) as info:
        memory.require(3 * GIB + GIB // 2, "activations for B=4, T=8", available=2 * GIB)
    assert isinstance(info.value, MemoryError)
    assert str(info.value).startswith("activations for B=4, T=8 need 3.50 GiB of memory, "
                                      "but only 2.00 GiB is available")


def test_aligned_empty_checks_before_allocating():
    with pytest.raises(OutOfMemoryError, match=r"the moments need 3\.64 TiB \(3725\.3 GiB\)"):
        aligned_empty(10**12, np.float32, what="the moments")
    assert aligned_empty(10).size == 10


def test_model_forward_needing_10_tib_fails_before_allocating():
    model = GPT2(LONG)
    B, T = 80, 65536
    needed = specs_bytes(ACT_SPECS, LONG, B, T) + specs_bytes(GRAD_ACT_SPECS, LONG, B, T)
    assert needed > 10 * 1024 * GIB
    tokens = np.zeros((B, T), np.int32)
    with pytest.raises(OutOfMemoryError) as info:
        model.forward(tokens, tokens)
    text = str(info.value)
    assert text.startswith(f"activations and their gradients for B={B}, T={T} need "
                           f"{needed / (1024 * GIB):.2f} TiB ({needed / GIB:.1f} GiB)")
    assert model.acts is None and model.B is None   # nothing allocated, nothing changed
    # inference needs no gradients, and says so
    with pytest.raises(OutOfMemoryError, match=rf"^activations for B={B}, T={T} need"):
        model.reserve(B, T)
    # and the model still works at a size that fits
    assert np.isfinite(model.forward(tokens[:1, :16], tokens[:1, :16]))


def test_a_model_too_large_for_memory():
    huge = GPT2Config(max_seq_len=1024, vocab_size=50257, padded_vocab_size=50304,
                      num_layers=2000, num_heads=16, channels=8192)
    with pytest.raises(OutOfMemoryError, match=r"^the tensors wte, wpe, ln1w, \.\.\. need "
                                               r"\d+\.\d\d TiB"):
        GPT2(huge)


def test_train_cli_fails_up_front_with_one_line(tmp_path, capsys):
    write_tokens(tmp_path / "train.bin", np.arange(100) % 50)
    code = train_mod.main(["-i", str(tmp_path / "train.bin"), "-e", "d1", "-b", "200000",
                           "-t", "1024", "-x", "1", "-v", "0", "-s", "0",
                           "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert "activations and their gradients for B=200000, T=1024 need" in err and "GiB" in err
