"""Requests that cannot fit in memory fail up front with OutOfMemoryError (a
MemoryError) saying how much they needed and what for."""
import numpy as np
import pytest

from llmc_py import GPT2, GPT2Config, OutOfMemoryError
from llmc_py.model import memory
from llmc_py import train as train_mod
from llmc_py.data import write_tokens
from llmc_py.model.layout import aligned_empty
from llmc_py.model.transformer import HEAD_ROWS

GIB = 1 << 30
# a long context and GPT-2's vocabulary: 196 KiB of logits per position
WIDE_VOCAB = GPT2Config(max_seq_len=65536, vocab_size=50257, padded_vocab_size=50304,
                        num_layers=1, num_heads=2, channels=8)


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


def test_model_forward_that_cannot_fit_fails_before_allocating():
    model = GPT2(WIDE_VOCAB)
    B, T = 4, 65536   # 262144 rows of 50304 logits: 49 GiB of them alone
    tokens = np.zeros((B, T), np.int32)
    plan = model.memory_plan(B, T, training=False, keep_logits=True)
    missing = {part: n for part, n in plan.items() if n and not part.startswith("parameters")}
    assert list(missing) == ["activations", "logits", "scratch"]
    with pytest.raises(OutOfMemoryError) as info:
        model.forward(tokens, tokens)
    needed = sum(missing.values())
    text = str(info.value)
    assert text.startswith(f"a forward at B={B}, T={T} (activations "), text
    assert f"logits {memory.format_bytes(plan['logits'])}" in text
    assert f") need {memory.format_bytes(needed)} of memory, but only " in text
    assert model.acts is None and model.B is None   # nothing allocated, nothing changed
    # training runs the classifier a block of rows at a time, so this fits
    # its logits; 128 times the rows do not fit, and the message says what
    # needs what, gradients and AdamW's moments too
    assert model.memory_plan(B, T, training=True)["logits"] < 100 << 20
    with pytest.raises(OutOfMemoryError, match=rf"^training at B={128 * B}, T={T} \(parameter "
                                               rf"gradients .*AdamW moments .*activation "
                                               rf"gradients .*\) need"):
        model.reserve(128 * B, T, training=True)
    assert model.acts is None and model.m_memory is None and model._grads is None
    # and the model still works at a size that fits
    assert np.isfinite(model.forward(tokens[:1, :16], tokens[:1, :16]))


def test_activation_memory_grows_linearly_in_t():
    """No (T, T) buffer: at fixed B, every T-dependent part of a training
    step's plan (activations, their gradients, the scratch) grows by the same
    bytes for each doubling step of 256 positions; the parameters' parts stay."""
    model = GPT2(GPT2Config())
    B = 8
    plans = {T: model.memory_plan(B, T, training=True) for T in (256, 512, 1024, 2048)}
    for part in ("activations", "activation gradients", "scratch"):
        sizes = [plans[T][part] for T in (256, 512, 1024, 2048)]
        per_256 = sizes[1] - sizes[0]
        assert per_256 > 0
        assert sizes[2] - sizes[1] == 2 * per_256 and sizes[3] - sizes[2] == 4 * per_256, part
    for part in ("parameters", "parameter gradients", "AdamW moments", "logits"):
        assert len({plans[T][part] for T in plans}) == 1, part   # logits: HEAD_ROWS rows
    # per position and layer: the attention's output and two numbers per head,
    # where its probabilities once took T floats per head (T=1024: 4.8 GB)
    assert plans[1024]["activations"] < 4 * B * 1024 * 12 * 17 * 768
    assert plans[256]["logits"] == 4 * HEAD_ROWS * 50304


def test_recompute_plans_less_and_changes_nothing_else():
    model = GPT2(GPT2Config())
    full = model.memory_plan(8, 256, training=True)
    model.recompute = True
    lean = model.memory_plan(8, 256, training=True)
    C, L, BT = 768, 12, 8 * 256
    # ln1, ln2 (C each) and the GELU output (4 C) held for 1 layer, not 12
    assert full["activations"] - lean["activations"] == 4 * BT * 6 * C * (L - 1)
    assert {k: v for k, v in full.items() if k != "activations"} == \
        {k: v for k, v in lean.items() if k != "activations"}
    model.recompute = 2
    leaner = model.memory_plan(8, 256, training=True)
    # and the MLP's input projection (4 C) held for 1 layer
    assert lean["activations"] - leaner["activations"] == 4 * BT * 4 * C * (L - 1)


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
    assert "training at B=200000, T=1024 (" in err and ") need" in err and "GiB" in err


def test_return_freed_scratch_applies_under_glibc():
    import platform
    applied = memory.return_freed_scratch()
    assert applied == (platform.libc_ver()[0] == "glibc")


def test_bf16_models_plan_their_matmul_inputs_in_half_the_bytes():
    """A bf16 model keeps ln1, ln2 and the GELU output in bf16: 2 bytes, not
    4, per element of their 6 C per position and layer (one layer's with
    recompute); post-norm and a quantized base keep them float32. The plan is
    the bytes the model allocates."""
    from llmc_py.model.planning import memory_plan
    C, L, B, T = 768, 12, 8, 256
    for recompute, layers in ((False, L), (True, 1)):
        fp32 = memory_plan(GPT2Config(), B, T, recompute=recompute)
        bf16 = memory_plan(GPT2Config(), B, T, precision="bf16", recompute=recompute)
        assert fp32["activations"] - bf16["activations"] == 2 * B * T * 6 * C * layers
    from llmc_py import LlamaConfig
    post = LlamaConfig(block="post", num_layers=2, channels=64, num_heads=4)
    assert memory_plan(post, B, T, precision="bf16")["activations"] \
        == memory_plan(post, B, T)["activations"]
    assert memory_plan(GPT2Config(), B, T, precision="bf16", base_weights="q8_0")["activations"] \
        == memory_plan(GPT2Config(), B, T, base_weights="q8_0")["activations"]
    small = GPT2Config(max_seq_len=64, vocab_size=100, padded_vocab_size=128, num_layers=2,
                       num_heads=2, channels=34)   # odd bf16 tensors: 3 * 5 * 34 * 4 / 2
    for precision in ("fp32", "bf16"):
        model = GPT2(small, precision=precision)
        model.forward(np.zeros((3, 5), np.int32))
        assert model.acts.buffer.nbytes == model.memory_plan(3, 5)["activations"]
        assert (model.acts.ln1.dtype == np.uint16) == (precision == "bf16")
