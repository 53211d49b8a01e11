"""train -e MODEL --lora-rank R --base-weights q8_0|q4_0: the base loaded,
then quantized (model.quantize), the adapters trained on it (QLoRA)."""
import numpy as np
import pytest

from llmc_py import train as train_mod
from llmc_py.data import DataLoader
from llmc_py.model.presets import config_from_depth, preset_for
from llmc_py.train.cli import parse


def argv(shards, out_dir, *extra):
    train_glob, val_glob = shards
    return ["-i", train_glob, "-j", val_glob, "-o", str(out_dir), "-e", "d1", "-b", "2",
            "-t", "16", "-x", "1", "-v", "0", "-s", "0", "-l", "3e-2", "-u", "0",
            "--lora-rank", "2", *extra]


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_train_base_weights_is_lora_on_the_quantized_base(shards, tmp_path, qtype):
    pytest.importorskip("safetensors")
    out = tmp_path / "out"
    args = argv(shards, out, "--base-weights", qtype, "--recompute", "1")
    assert train_mod.main(args) == 0
    spec = parse(args)
    config = config_from_depth("d1")
    expected = preset_for(config)(config, seed=spec.seed)
    expected.quantize(qtype)
    expected.recompute = True
    expected.add_lora(rank=2, alpha=4, seed=spec.seed)
    x, y = DataLoader(shards[0], 2, 16).next_batch()
    expected.zero_grad()
    expected.forward_backward(x, y)
    expected.clip_grad_norm(spec.grad_clip)
    expected.update(spec.lr_schedule()(1), beta1=spec.beta1, beta2=spec.beta2,
                    eps=spec.adam_eps, weight_decay=spec.weight_decay, t=1)
    trained = preset_for(config)(config, seed=spec.seed)
    trained.quantize(qtype)
    trained.load_lora(out / "lora_00000001")
    assert np.array_equal(trained.lora.params.memory, expected.lora.params.memory)
    assert np.any(trained.lora.params.memory != 0)


@pytest.mark.parametrize("argv, message", [
    (["--base-weights", "q8_0"], "--base-weights needs --lora-rank"),
    (["--lora-rank", "2", "--base-weights", "q8_0", "--precision", "bf16"],
     "--precision bf16 with --base-weights q8_0: a quantized base"),
    (["--lora-rank", "2", "--base-weights", "q4_0", "--export-hf", "hf"],
     "--export-hf with --base-weights q4_0: a quantized base has no float weights"),
])
def test_bad_base_weights_flags_are_refused_before_step_1(shards, tmp_path, capsys, argv,
                                                          message):
    train_glob, val_glob = shards
    out = tmp_path / "out"
    code = train_mod.main(["-i", train_glob, "-j", val_glob, "-o", str(out), "-e", "d1",
                           "-b", "2", "-t", "16", "-x", "2", "-s", "0", *argv])
    assert code != 0
    err = capsys.readouterr().err
    assert message in err, err
    assert not (out / "main.log").exists()
