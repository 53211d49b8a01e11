"""A frozen bf16 base (load_model(..., precision="bf16", frozen=True)): its
matrices in bf16 alone, no float32 master, read from a bf16 Hugging Face
folder saved by transformers (test_hf's tiny models) tensor by tensor; the
same bits as a bf16 model (float32 master + bf16 copy) of the same bf16
weights in logits, generation and LoRA gradients; refusals of what needs
the float32 weights; memory_plan's count of it."""
import numpy as np
import pytest
import torch

import llmc_py
from llmc_py import load_model
from llmc_py.io.files import to_bf16
from llmc_py.model.layout import num_parameters
from llmc_py.model.transformer import FROZEN_BF16
from test_hf import V, batch, make_hf

MODELS = ["gpt2", "llama-gqa-untied", "qwen3-qknorm-tied"]


@pytest.fixture(scope="module", params=MODELS)
def bf16_folder(request, tmp_path_factory):
    """A transformers model saved in bf16 (as hub checkpoints are)."""
    folder = tmp_path_factory.mktemp(request.param)
    make_hf(request.param).to(torch.bfloat16).save_pretrained(folder)
    return folder


def both(folder):
    return (load_model(folder, precision="bf16", frozen=True),
            load_model(folder, precision="bf16"))


def test_no_float32_copy_of_the_matrices_exists(bf16_folder):
    frozen, mixed = both(bf16_folder)
    names = set(frozen.params_bf16.names)
    assert names == {n for n, _ in frozen.param_specs if n in FROZEN_BF16}
    assert not names & set(frozen.params.names)
    assert frozen.params_bf16.memory.dtype == np.uint16
    small = frozen.params.size
    assert small + frozen.params_bf16.size == num_parameters(frozen.config)
    assert small < 0.05 * frozen.num_parameters   # norms, biases, wpe only
    for name in names:   # the same bf16 bits as the mixed model's copy
        np.testing.assert_array_equal(frozen.params_bf16[name], mixed.params_bf16[name])
    for name in frozen.params.names:
        np.testing.assert_array_equal(frozen.params[name], mixed.params[name])


def test_logits_and_generation_are_the_bf16_models_bits(bf16_folder):
    frozen, mixed = both(bf16_folder)
    x, y = batch(seed=3)
    assert frozen.forward(x, y) == mixed.forward(x, y)
    np.testing.assert_array_equal(frozen.logits, mixed.logits)
    prompts = [[1, 2, 3], [4, 5]]
    assert (frozen.generate(prompts, 6, temperature=0) ==
            mixed.generate(prompts, 6, temperature=0))
    assert (frozen.generate(prompts, 6, temperature=1.0, seed=5) ==
            mixed.generate(prompts, 6, temperature=1.0, seed=5))


@pytest.mark.parametrize("recompute", [False, True])
def test_lora_training_is_the_bf16_models_bits(bf16_folder, recompute):
    x, y = batch(seed=4)
    results = []
    for model in both(bf16_folder):
        model.recompute = recompute
        model.add_lora(4, 8, seed=1)
        model.lora.params.memory[...] = np.random.default_rng(0).standard_normal(
            model.lora.params.size).astype(np.float32) * np.float32(0.05)
        losses = []
        for t in range(1, 3):
            model.zero_grad()
            losses.append(model.forward_backward(x, y))
            model.update(1e-3, t=t)
        results.append((losses, model.lora.grads.memory.copy(),
                        model.lora.params.memory.copy()))
    (l1, g1, p1), (l2, g2, p2) = results
    assert l1 == l2
    np.testing.assert_array_equal(g1, g2)
    np.testing.assert_array_equal(p1, p2)
    assert np.abs(g1).max() > 0


def test_a_float32_folder_is_rounded_as_the_bf16_copy_is(tmp_path):
    folder = tmp_path / "fp32"
    make_hf("llama-gqa-untied").save_pretrained(folder)
    frozen, mixed = both(folder)
    for name in frozen.params_bf16.names:
        np.testing.assert_array_equal(frozen.params_bf16[name], mixed.params_bf16[name])


def test_frozen_from_a_model_file(tmp_path):
    model = llmc_py.Llama(llmc_py.LlamaConfig(num_layers=2, channels=32, num_heads=4,
                                              num_kv_heads=2, vocab_size=V, max_seq_len=16))
    path = tmp_path / "m.bin"
    model.save_checkpoint(path, dtype="bf16")
    frozen, mixed = both(path)
    x, _ = batch(seed=1)
    frozen.forward(x)
    mixed.forward(x)
    np.testing.assert_array_equal(frozen.logits, mixed.logits)


def test_what_needs_float32_weights_is_refused(bf16_folder, tmp_path):
    model = load_model(bf16_folder, precision="bf16", frozen=True)
    x, y = batch()
    for call in (lambda: model.update(1e-3), lambda: model.zero_grad(),
                 lambda: model.forward_backward(x, y), lambda: model.grads,
                 lambda: model.save_pretrained(tmp_path / "out"),
                 lambda: model.save_checkpoint(tmp_path / "m.bin"),
                 lambda: model.refresh_bf16(), lambda: model.initialize()):
        with pytest.raises(RuntimeError, match="frozen bf16 base"):
            call()
    with pytest.raises(RuntimeError, match=r"save_pretrained\(dtype='fp32'\): this model is "
                                           r"a frozen bf16 base"):
        model.save_pretrained(tmp_path / "out", dtype="fp32")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="precision must be 'bf16'"):
        load_model(bf16_folder, precision="fp32", frozen=True)


def test_merge_lora_rounds_each_merged_weight_once_to_bf16(bf16_folder, tmp_path):
    """The adapters fold into the bf16 weights as into the float32 master
    (W + scale B A in float32), rounded once; save_pretrained(dtype="bf16")
    then writes the file a bf16 model so merged writes."""
    models = both(bf16_folder)
    for model in models:
        model.add_lora(4, 8, seed=1)
        model.lora.params.memory[...] = np.random.default_rng(0).standard_normal(
            model.lora.params.size).astype(np.float32) * np.float32(0.05)
    frozen, mixed = models
    before = frozen.params_bf16.memory.copy()
    for model in models:
        model.merge_lora()
    assert frozen.lora is None and frozen.frozen
    for name in frozen.params_bf16.names:
        np.testing.assert_array_equal(frozen.params_bf16[name], to_bf16(mixed.params[name]))
    assert not np.array_equal(frozen.params_bf16.memory, before)
    frozen.save_pretrained(tmp_path / "frozen", dtype="bf16")
    mixed.save_pretrained(tmp_path / "mixed", dtype="bf16")
    for name in ("model.safetensors", "config.json"):
        assert ((tmp_path / "frozen" / name).read_bytes()
                == (tmp_path / "mixed" / name).read_bytes())


def test_memory_plan_counts_bf16_alone(bf16_folder):
    frozen, mixed = both(bf16_folder)
    n = frozen.num_parameters
    plan = frozen.memory_plan(2, 8, training=False)
    assert plan["parameters (bf16)"] == 2 * frozen.params_bf16.size
    assert plan["parameters"] == 4 * frozen.params.size
    assert plan["parameters"] + plan["parameters (bf16)"] < mixed.memory_plan(
        2, 8, training=False)["parameters"] + 2 * n
    frozen.add_lora(4, 8)
    plan = frozen.memory_plan(2, 19)
    size = frozen.lora.params.size
    assert plan["parameter gradients"] == 4 * size
    assert plan["AdamW moments"] == 8 * size
    frozen.forward_backward(*batch())   # fits its plan: allocated buffers as planned
    assert frozen.acts.buffer.nbytes == plan["activations"]
    assert frozen.grads_acts.buffer.nbytes == plan["activation gradients"]


@pytest.mark.parametrize("cli", ["eval", "sample"])
def test_sample_and_eval_load_a_frozen_bf16_base(cli, tmp_path, monkeypatch):
    """--precision bf16: they never train the base, so it is held in bf16 alone."""
    import importlib
    module = importlib.import_module(f"llmc_py.{cli}")
    seen = []

    def spy(path, **options):
        seen.append(options)
        raise RuntimeError("stop here")   # only how the model is loaded matters

    monkeypatch.setattr(module if cli == "sample" else llmc_py.model, "load_model", spy)
    args = ["-e", "m.bin"] if cli == "sample" else ["m.bin", "tokens.bin", "--lengths", "8"]
    for extra in (["--precision", "bf16"], []):
        with pytest.raises(RuntimeError, match="stop here"):
            module.main(args + extra)
    assert seen == [dict(precision="bf16", weights=None, frozen=True, head_weights=None),
                    dict(precision="fp32", weights=None, frozen=False, head_weights=None)]


def test_quantized_weights_and_a_frozen_base_are_one_choice():
    """weights= (llama.cpp's blocks) and frozen=True (bf16 alone) both say how
    the weights are held: asking for both is refused before any file is read."""
    with pytest.raises(llmc_py.UsageError, match="weights='q8_0' and frozen=True"):
        llmc_py.load_model("no-such-model.bin", precision="bf16", weights="q8_0", frozen=True)
