"""LoRA in the training run: the --lora-* flags add adapters to the -e
model after loading; the loop, clipping and AdamW act on the adapters alone
and the base never changes."""
import io

import numpy as np
import pytest

from llmc_py import load_model, sample
from llmc_py.io import read_state
from llmc_py.tokenizer import get_encoding
from llmc_py.data import DataLoader
from llmc_py.model.presets import config_from_depth, preset_for
from llmc_py import train as train_mod
from llmc_py.train import RunSpec
from llmc_py.train.cli import parse
from llmc_py.train.runner import Run
from test_mpi import SMALL as MPI_SMALL, log_lines, mpirun, solo


def spec(shards, out_dir, **fields):
    train_glob, val_glob = shards
    return RunSpec(train_data=train_glob, val_data=val_glob, output_dir=str(out_dir),
                   init="d1", batch_size=2, seq_len=16, val_every=0, sample_every=0,
                   learning_rate=3e-3, warmup_steps=0, **fields)


def fresh_d1(seed=1337):
    config = config_from_depth("d1")
    return preset_for(config)(config, seed=seed)


def test_a_lora_step_is_add_lora_then_clip_and_adamw_on_the_adapters(shards, tmp_path):
    run = Run(spec(shards, tmp_path / "out", max_steps=1, lora_rank=4, lora_alpha=8,
                   lora_targets="c_attn,c_fc", grad_clip=1e-3))
    assert run.train() == 0
    trained = run.model
    expected = fresh_d1()
    expected.add_lora(rank=4, alpha=8, targets=("c_attn", "c_fc"), seed=1337)
    x, y = DataLoader(shards[0], 2, 16).next_batch()
    expected.zero_grad()
    expected.forward_backward(x, y)
    expected.clip_grad_norm(1e-3)
    expected.update(run.spec.lr_schedule()(1), beta1=0.9, beta2=0.95, eps=1e-8,
                    weight_decay=0.1, t=1)   # every adapter tensor decays
    assert np.array_equal(trained.lora.params.memory, expected.lora.params.memory)
    assert np.array_equal(trained.params.memory, fresh_d1().params.memory)   # the base frozen
    assert [t.name for t in trained.lora.targets] == ["c_attn", "c_fc"]


def test_lora_options_from_the_flags():
    options = parse(["--lora-rank", "8", "--lora-targets", "q,k,down",
                               "--lora-dropout", "0.05", "--lora-rslora", "1"]).lora_options()
    assert options == dict(rank=8, alpha=16, targets=("q_proj", "k_proj", "down_proj"),
                           dropout=0.05, seed=1337, rslora=True)   # alpha: 2R by default
    assert parse([]).lora_options() is None


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "-1"], "--lora-rank must be >= 0, got -1"),
    (["--lora-rank", "65"], "--lora-rank: rank 65 is outside [1, 64]"),
    (["--lora-rank", "2", "--lora-targets", "q_proj"], "--lora-targets: targets: this model "
                                                       "has no module 'q_proj'"),
    (["--lora-rank", "2", "--lora-alpha", "0"], "--lora-alpha must be positive"),
    (["--lora-rank", "2", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    (["--lora-alpha", "4"], "--lora-alpha needs --lora-rank"),
    (["--lora-rank", "2", "--monitor-every", "1"], "--monitor-every with --lora-rank"),
])
def test_bad_lora_flags_are_refused_before_step_1(shards, tmp_path, capsys, argv, message):
    train_glob, val_glob = shards
    out = tmp_path / "out"
    code = train_mod.main(["-i", train_glob, "-j", val_glob, "-o", str(out), "-e", "d1",
                           "-b", "2", "-t", "16", "-x", "2", "-s", "0", *argv])
    assert code != 0
    assert message in capsys.readouterr().err
    assert not (out / "main.log").exists()


def lora_run(shards, out_dir, *extra):
    train_glob, val_glob = shards
    return train_mod.main(["-i", train_glob, "-j", val_glob, "-o", str(out_dir), "-e", "d1",
                           "-b", "2", "-t", "16", "-x", "3", "-v", "1", "-m", "1", "-s", "0",
                           "-l", "3e-2", "-u", "0", "--lora-rank", "2", *extra])


def test_checkpoints_hold_the_adapters_and_their_moments(shards, tmp_path):
    out = tmp_path / "out"
    assert lora_run(shards, out, "-n", "1", "-nk", "2") == 0
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert names == ["DONE_00000002", "DONE_00000003", "best.json", "lora_00000002",
                     "lora_00000003", "lora_best", "main.log", "state_00000002.bin",
                     "state_00000003.bin"]   # no model file: the base is -e's
    assert sorted(p.name for p in (out / "lora_00000003").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    model = fresh_d1()
    model.load_lora(out / "lora_00000003")
    _, m, v, _ = read_state(out / "state_00000003.bin", model.lora.params.size)
    assert m.size == model.lora.params.size and np.any(v)
    assert np.any(model.lora.params["c_attn.B"])   # trained, not peft's zero init


def test_export_hf_writes_the_merged_model(shards, tmp_path):
    pytest.importorskip("safetensors")
    out, export = tmp_path / "out", tmp_path / "hf"
    assert lora_run(shards, out, "--export-hf", str(export)) == 0
    expected = fresh_d1()
    expected.load_lora(out / "lora_00000003")
    expected.merge_lora()
    assert np.array_equal(load_model(export).params.memory, expected.params.memory)
    assert not np.array_equal(expected.params.memory, fresh_d1().params.memory)


def test_a_lora_resume_is_bitwise_the_straight_run(shards, tmp_path, capsys):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    same = ["--lora-dropout", "0.1", "-k", "constant"]   # the schedule does not see -x
    assert lora_run(shards, straight, "-x", "4", *same) == 0
    assert lora_run(shards, resumed, "-x", "2", *same) == 0
    assert lora_run(shards, resumed, "-y", "1", "-x", "4") == 0   # the lora flags taken
    took = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("resume: took")]
    assert len(took) == 1 and "--lora-dropout 0.1" in took[0]
    assert (straight / "main.log").read_bytes() == (resumed / "main.log").read_bytes()
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert ((straight / "lora_00000004" / name).read_bytes()
                == (resumed / "lora_00000004" / name).read_bytes())


@pytest.mark.parametrize("extra, message", [
    (["--lora-rank", "4"], "the run was made with --lora-rank 2, this resume gives 4"),
    (["--lora-alpha", "8"], "the run was made with --lora-alpha None, this resume gives 8"),
])
def test_a_lora_resume_refuses_changed_flags(shards, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    assert lora_run(shards, out, "-x", "2") == 0
    capsys.readouterr()
    assert lora_run(shards, out, "-y", "1", "-x", "4", *extra) != 0
    assert message in capsys.readouterr().err


def test_a_lora_resume_refuses_another_base(shards, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert lora_run(shards, out, "-x", "2") == 0
    capsys.readouterr()
    real = Run._initial_model

    def other_base(self):
        model = real(self)
        model.params.memory[0] += 1.0
        return model
    monkeypatch.setattr(Run, "_initial_model", other_base)
    assert lora_run(shards, out, "-y", "1", "-x", "4") != 0
    assert "the base model of -e/--init d1 differs from the run's" in capsys.readouterr().err


def test_sample_loads_an_adapter_onto_the_base(shards, tmp_path):
    out, base = tmp_path / "out", tmp_path / "base.bin"
    assert lora_run(shards, out) == 0
    fresh_d1().save_checkpoint(base)
    argv = ["-e", str(base), "-g", "16", "--temperature", "0", "--stop-at-eot", "0"]
    texts = []
    for extra in ([], ["--lora", str(out / "lora_00000003")]):
        text = io.StringIO()
        sample.main(argv + extra, out=text)
        texts.append(text.getvalue())
    adapted = fresh_d1()
    adapted.load_lora(out / "lora_00000003")
    expected = io.StringIO()
    sample.write_sample(sample.parse(argv), adapted, get_encoding(), expected)
    assert texts[1] == expected.getvalue() != texts[0]


def adapter_tensors(folder):
    from safetensors.numpy import load_file
    return load_file(str(folder / "adapter_model.safetensors"))


def test_two_ranks_of_lora_match_one_process(shards, tmp_path):
    """Only the adapters' gradients are averaged over the ranks (the base's
    would raise: it has none); as test_mpi's tolerance."""
    mpi_shards = ["-i", shards[0], "-j", shards[1]]
    lora = ["--lora-rank", "2", "-l", "1e-2"]
    ran = mpirun(tmp_path / "two", *mpi_shards, *MPI_SMALL, "-b", "2", "-x", "6", *lora)
    assert ran.returncode == 0, ran.stderr
    assert solo(tmp_path / "one", *mpi_shards, *MPI_SMALL, "-b", "4", "-x", "6", *lora) == 0
    for kind in ("trl", "tel"):
        np.testing.assert_allclose(log_lines(tmp_path / "two", kind),
                                   log_lines(tmp_path / "one", kind), rtol=1e-5, err_msg=kind)
    two, one = (adapter_tensors(tmp_path / name / "lora_00000006") for name in ("two", "one"))
    assert two.keys() == one.keys()
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-4, atol=1e-6, err_msg=name)
    refused = mpirun(tmp_path / "zero", *mpi_shards, *MPI_SMALL, "-b", "2", "-x", "2",
                     "--zero", "1", *lora)
    assert refused.returncode != 0 and "--zero 1 with --lora-rank" in refused.stderr


def test_a_hugging_face_llama_with_short_target_names(shards, tmp_path):
    transformers = pytest.importorskip("transformers")
    base = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)).save_pretrained(base)
    out, export = tmp_path / "out", tmp_path / "merged"
    train_glob, val_glob = shards
    assert train_mod.main(["-i", train_glob, "-j", val_glob, "-o", str(out), "-e", str(base),
                           "-b", "2", "-t", "16", "-x", "2", "-s", "0", "-v", "0", "-l", "1e-2",
                           "--lora-rank", "2", "--lora-targets", "q,v,down",
                           "--export-hf", str(export)]) == 0
    names = adapter_tensors(out / "lora_00000002").keys()
    assert sorted({name.split(".")[-3] for name in names}) == ["down_proj", "q_proj", "v_proj"]
    expected = load_model(base)
    expected.load_lora(out / "lora_00000002")
    expected.merge_lora()
    assert np.array_equal(load_model(export).params.memory, expected.params.memory)
