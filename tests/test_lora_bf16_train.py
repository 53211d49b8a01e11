"""A LoRA run in bf16 (train --lora-rank R --precision bf16) on a frozen bf16
base: -e is held in bf16 alone (load_model's frozen=True), with no float32
master, weight gradients or moments of the base; the run's results are the
bits of the same run on a float32 master with its bf16 copy. Checkpoints,
Ctrl-C and resume, --export-hf, sample --lora and two MPI ranks on it; and
a float32 LoRA run, whose base keeps its float32 parameters alone."""
import dataclasses
import io
import os
import signal
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from llmc_py import GPT2, Llama, LlamaConfig, load_model, sample
from llmc_py import train as train_mod
from llmc_py.io import read_state
from llmc_py.io.files import to_bf16
from llmc_py.model.layout import frozen_bf16_parameters
from llmc_py.model.presets import config_from_depth
from llmc_py.tokenizer import get_encoding
from llmc_py.train import RunFolder, RunSpec
from llmc_py.train.runner import Run
from test_lora_train import fresh_d1, lora_run, spec
from test_mpi import SMALL as MPI_SMALL, mpirun
from test_reliability import ROOT, _CHILD, finish, wait_for

# a Qwen3-shaped model (qk_norm, head_dim != C / NH, GQA, untied head) of
# GPT-2's vocabulary, so that the runs need no tokenizer of their own
QWEN3 = LlamaConfig(vocab_size=50257, num_layers=2, channels=64, num_heads=4, num_kv_heads=2,
                    head_dim=24, qk_norm=True, ffn_hidden=96, tied_embeddings=False,
                    max_seq_len=64)


def saved_in_bf16(tmp_path_factory, model):
    """``model`` as a Hugging Face folder in bf16, as hub checkpoints are."""
    pytest.importorskip("safetensors")
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder, dtype="bf16")
    return folder


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    return saved_in_bf16(tmp_path_factory, Llama(QWEN3, seed=3))


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """GPT-2's layout: a learned position table (float32 in a frozen base)
    and Conv1D weights, transposed on the way in and out."""
    return saved_in_bf16(tmp_path_factory, GPT2(config_from_depth("d1", max_seq_len=64), seed=3))


def bf16_run(shards, out, init, *extra):
    train_glob, val_glob = shards
    return train_mod.main(["-i", train_glob, "-j", val_glob, "-o", str(out), "-e", str(init),
                           "-b", "2", "-t", "16", "-x", "3", "-v", "1", "-m", "1", "-s", "0",
                           "-l", "3e-2", "-u", "0", "--lora-rank", "2", "--precision", "bf16",
                           *extra])


def assert_no_float32_base(model):
    """The base's matrices in bf16 alone; no gradients or moments of it."""
    assert model.frozen and model.lora is not None
    assert model.params_bf16.size == frozen_bf16_parameters(model.config)
    assert model.params.size + model.params_bf16.size == model.num_parameters
    assert model.params.size < 0.05 * model.num_parameters   # norms, biases, wpe alone
    assert model._grads is None and model.m_memory is None and model.v_memory is None
    assert model.lora.m.size == model.lora.params.size == model.lora.grads.memory.size


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_a_bf16_lora_run_is_the_float32_masters_run_on_bf16_alone(shards, tmp_path, monkeypatch,
                                                                 request, family):
    """The same log and adapters, to the bit, as the run that holds a
    float32 master and its bf16 copy (the way before the base was frozen),
    on a bf16 folder (whose float32 master holds the same numbers)."""
    folder = request.getfixturevalue("bf16_folder" if family == "qwen3" else "gpt2_folder")
    train_glob, val_glob = shards
    fields = dict(train_data=train_glob, val_data=val_glob, batch_size=2, seq_len=16,
                  max_steps=3, val_every=1, val_batches=1, sample_every=0, learning_rate=3e-3,
                  warmup_steps=0, lora_rank=4, lora_dropout=0.1, precision="bf16",
                  init=str(folder), lora_targets="q,v,down" if family == "qwen3" else None)
    frozen = Run(RunSpec(output_dir=str(tmp_path / "frozen"), **fields))
    assert frozen.train() == 0
    assert_no_float32_base(frozen.model)
    monkeypatch.setattr(Run, "_frozen_base", lambda self: False)
    mixed = Run(RunSpec(output_dir=str(tmp_path / "mixed"), **fields))
    assert mixed.train() == 0
    assert not mixed.model.frozen and mixed.model.params.size == mixed.model.num_parameters
    assert ((tmp_path / "frozen" / "main.log").read_bytes()
            == (tmp_path / "mixed" / "main.log").read_bytes())
    np.testing.assert_array_equal(frozen.model.lora.params.memory,
                                  mixed.model.lora.params.memory)
    for name in frozen.model.params_bf16.names:   # the base unchanged, the same bits
        np.testing.assert_array_equal(frozen.model.params_bf16[name],
                                      mixed.model.params_bf16[name])
    # the same float32 values: the same base, for a resume in either precision
    assert frozen.settings["lora_base"] == mixed.settings["lora_base"]


def test_a_fresh_bf16_lora_base_is_the_fresh_model_rounded(shards, tmp_path):
    run = Run(spec(shards, tmp_path / "out", max_steps=1, lora_rank=2, precision="bf16"))
    assert run.train() == 0
    assert_no_float32_base(run.model)
    fresh = fresh_d1()
    for name in run.model.params_bf16.names:
        np.testing.assert_array_equal(run.model.params_bf16[name], to_bf16(fresh.params[name]))
    for name in run.model.params.names:
        np.testing.assert_array_equal(run.model.params[name], fresh.params[name])


def test_a_float32_lora_run_holds_the_float32_parameters_alone(shards, tmp_path):
    run = Run(spec(shards, tmp_path / "out", max_steps=2, lora_rank=2))
    assert run.train() == 0
    model = run.model
    assert not model.frozen and model.params_bf16 is None
    assert model._grads is None and model.m_memory is None and model.v_memory is None
    assert model.lora.m.size == model.lora.params.size


def test_the_base_is_never_held_in_float32(shards, tmp_path_factory, monkeypatch):
    """The whole run, loading included, peaks below the float32 weights'
    size, 4 bytes a parameter: the bf16 base (2 bytes) and the run's small
    buffers, never a float32 copy of it; the run on a float32 master (6
    bytes with its bf16 copy) peaks above. Traced: numpy's allocations,
    which hold every tensor. A model whose embedding and head are most of
    it (as a hub model's), so the run's other buffers are small beside it."""
    config = dataclasses.replace(QWEN3, channels=256, head_dim=64, ffn_hidden=512)
    folder = saved_in_bf16(tmp_path_factory, Llama(config, seed=3))
    n = load_model(folder, precision="bf16", frozen=True).num_parameters
    peaks = []
    for frozen in (True, False):
        monkeypatch.setattr(Run, "_frozen_base", lambda self, frozen=frozen: frozen)
        tracemalloc.start()
        try:
            assert bf16_run(shards, tmp_path_factory.mktemp("out"), folder, "-x", "1") == 0
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert 2 * n < peaks[0] < 4 * n < 6 * n < peaks[1]


def test_checkpoints_export_and_sample_on_a_bf16_base(shards, tmp_path, bf16_folder):
    out, export = tmp_path / "out", tmp_path / "merged"
    assert bf16_run(shards, out, bf16_folder, "--export-hf", str(export)) == 0
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "DONE_00000003", "best.json", "lora_00000003", "lora_best", "main.log",
        "state_00000003.bin"]
    base = load_model(bf16_folder, precision="bf16", frozen=True)
    base.load_lora(out / "lora_00000003")
    _, m, _, _ = read_state(out / "state_00000003.bin", base.lora.params.size)
    assert np.any(m)
    # --export-hf: the merged weights in bf16, each rounded once
    base.merge_lora()
    base.save_pretrained(tmp_path / "expected", dtype="bf16")
    for name in ("model.safetensors", "config.json"):
        assert (export / name).read_bytes() == (tmp_path / "expected" / name).read_bytes()
    merged = load_model(export, precision="bf16", frozen=True)
    np.testing.assert_array_equal(merged.params_bf16.memory, base.params_bf16.memory)
    # sample --lora on the bf16 base
    argv = ["-e", str(bf16_folder), "--precision", "bf16", "-g", "8", "--temperature", "0",
            "--stop-at-eot", "0", "--lora", str(out / "lora_00000003")]
    text = io.StringIO()
    sample.main(argv, out=text)
    adapted = load_model(bf16_folder, precision="bf16", frozen=True)
    adapted.load_lora(out / "lora_00000003")
    expected = io.StringIO()
    sample.write_sample(sample.parse(argv), adapted, get_encoding(), expected)
    assert text.getvalue() == expected.getvalue()


def test_ctrl_c_and_resume_are_bitwise_the_straight_run(shards, tmp_path, bf16_folder):
    """SIGINT to a child `train` between steps: it saves the last finished
    step's adapters and moments and exits 130; -y 1 then ends with the bytes
    of the run never stopped."""
    train_glob, val_glob = shards
    argv = ["-i", train_glob, "-j", val_glob, "-e", str(bf16_folder), "-b", "2", "-t", "16",
            "-x", "6", "-n", "100", "-v", "2", "-m", "1", "-s", "0", "-l", "3e-2", "-u", "2",
            "--lora-rank", "2", "--lora-dropout", "0.1", "--precision", "bf16"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert train_mod.main(argv + ["-o", str(straight)]) == 0
    env = dict(os.environ, PAUSE_STEP="4", PAUSE_SAVE="0", PAUSE_SECONDS="30")
    child = subprocess.Popen([sys.executable, "-c", _CHILD, *argv, "-o", str(stopped)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    wait_for(child, "paused")   # steps 1-3 done, step 4 about to run
    child.send_signal(signal.SIGINT)
    code, stdout, stderr = finish(child)
    assert code == 130, stderr
    assert "stopped by Ctrl-C: checkpoint of step 3" in stdout and "Traceback" not in stderr
    assert RunFolder(stopped).completed_steps() == [3]
    assert (stopped / "lora_00000003").is_dir() and not list(stopped.glob("model_*"))
    assert train_mod.main(["-o", str(stopped), "-y", "1"]) == 0   # every flag from the run
    assert (stopped / "main.log").read_bytes() == (straight / "main.log").read_bytes()
    assert_same_adapters(straight, stopped, 6)


def assert_same_adapters(one, other, step):
    """The adapters' PEFT folder and their moments, bitwise."""
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        path = f"lora_{step:08d}/{name}"
        assert (one / path).read_bytes() == (other / path).read_bytes(), path
    states = [read_state(folder / f"state_{step:08d}.bin", None) for folder in (one, other)]
    for i, what in ((1, "m"), (2, "v")):
        assert np.array_equal(states[0][i], states[1][i]), what
    assert states[0][3]["train_loader"] == states[1][3]["train_loader"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_ranks_of_lora_resume_bitwise(shards, tmp_path, precision):
    """Two ranks that end at step 4 (an evaluation step, -v 4) and are
    resumed (-y 1) to step 8: the bytes of the two ranks' run of 8 steps."""
    args = ["-i", shards[0], "-j", shards[1], *MPI_SMALL, "-b", "2", "-n", "4", "-k",
            "constant", "--lora-rank", "2", "-l", "1e-2", "--precision", precision]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    for out, steps in ((whole, "8"), (resumed, "4")):
        ran = mpirun(out, *args, "-x", steps)
        assert ran.returncode == 0, ran.stderr
    ran = mpirun(resumed, *args, "-x", "8", "-y", "1")
    assert ran.returncode == 0, ran.stderr
    assert "resumed from step 4" in ran.stdout
    assert (whole / "main.log").read_bytes() == (resumed / "main.log").read_bytes()
    assert_same_adapters(whole, resumed, 8)


def test_a_resume_in_bf16_of_a_float32_base_says_why_the_base_differs(shards, tmp_path, capsys):
    """A fresh d1's float32 weights are not bf16 numbers: held in bf16 alone
    they are another base, and the refusal says so."""
    out = tmp_path / "out"
    assert lora_run(shards, out, "-x", "2") == 0
    capsys.readouterr()
    assert lora_run(shards, out, "-y", "1", "-x", "4", "--precision", "bf16") != 0
    err = capsys.readouterr().err
    assert "the base model of -e/--init d1 differs from the run's" in err
    assert "with --precision bf16 the base is held in bf16 alone" in err
