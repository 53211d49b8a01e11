"""A forward that no backward follows (forward(..., keep_activations=False),
evaluation, sampling, a KV cache's prefill, and by default a model that
cannot be trained): one layer's activations, reused layer after layer, the
ordinary forward's results to the bit; memory_plan's count of it; a
backward after it refused; and, slow, the resident memory of such a
forward of a bf16 model loaded from a folder against its plan."""
import dataclasses

import numpy as np
import pytest

from llmc_py import GPT2, GPT2Config, Llama
from llmc_py.model.kv_cache import Decoder
from llmc_py.monitors.probe import last_forward_acts
from llmc_py.train.loop import validation_loss
from test_llama_step import BASE, CONFIGS
from test_moe_config import moe_config

SMALL_GPT2 = GPT2Config(max_seq_len=32, vocab_size=67, padded_vocab_size=128, num_layers=3,
                        num_heads=2, channels=34)   # odd C: bf16 tensors of odd sizes
MODELS = {"gpt2": (GPT2, SMALL_GPT2),
          **{name: (Llama, dataclasses.replace(BASE, num_layers=3, **choices))
             for name, choices in CONFIGS.items()},
          "moe": (Llama, moe_config(moe_every=2))}


def batch(config, B=2, T=13, seed=0):
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, config.vocab_size, (2, B, T))
    y[0, :3] = -1   # some ignored targets
    return x, y


def randomised(cls, config, precision, seed=1):
    """A model whose norm weights and biases are off their initial values."""
    model = cls(config, seed=seed)
    p = model.params
    p.memory[...] += np.random.default_rng(seed).standard_normal(p.size).astype(
        np.float32) * np.float32(0.05)
    return cls(config, params=p.memory, precision=precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS)
def test_results_are_the_ordinary_forwards_bits(name, precision):
    cls, config = MODELS[name]
    model = randomised(cls, config, precision)
    x, y = batch(config)
    loss = model.forward(x, y)
    logits, aux = model.logits.copy(), model.aux_losses
    lean = model.forward(x, y, keep_logits=False)
    assert model.kept_activations
    assert model.forward(x, y, keep_activations=False) == loss
    assert not model.kept_activations
    assert np.array_equal(model.logits, logits) and model.aux_losses == aux
    assert model.forward(x, y, keep_logits=False, keep_activations=False) == lean
    # held: one layer's, as planned (less than every layer's)
    plan = model.memory_plan(*x.shape, training=False, keep_activations=False)["activations"]
    assert model.acts.memory.nbytes == plan
    assert plan < model.memory_plan(*x.shape, training=False)["activations"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["gpt2", "qwen3", "post-layernorm-learned", "moe"])
def test_a_training_step_after_one_is_a_fresh_models(name, precision):
    """forward_backward after forward-only passes (of another shape too)
    re-plans the activations and gives a fresh model's gradients."""
    cls, config = MODELS[name]
    x, y = batch(config)
    fresh, model = (randomised(cls, config, precision) for _ in range(2))
    model.forward(x[:1, :5], keep_activations=False)
    model.forward(x, y, keep_activations=False)
    assert model.forward_backward(x, y) == fresh.forward_backward(x, y)
    assert np.array_equal(model.grads.memory, fresh.grads.memory)
    model.zero_grad()
    model.forward(x, y)   # kept again: backward reads them
    model.backward()
    assert np.array_equal(model.grads.memory, fresh.grads.memory)


def test_backward_after_a_forward_only_pass_is_refused():
    model = GPT2(SMALL_GPT2)
    x, y = batch(SMALL_GPT2)
    model.forward(x, y, keep_activations=False)
    with pytest.raises(RuntimeError, match="the last forward kept one layer's activations"):
        model.backward()
    assert not model.grads.memory.any()   # nothing was added
    with pytest.raises(RuntimeError, match=r"keep_activations=False"):
        last_forward_acts(model, None)


def test_a_frozen_base_forwards_with_one_layer_unless_it_has_adapters():
    """A frozen bf16 or quantized base cannot be trained: its forward keeps
    one layer's activations, and its plan says so; with adapters it keeps
    every layer's for their backward."""
    config = dataclasses.replace(BASE, num_layers=3)
    x, y = batch(config)
    mixed = randomised(Llama, config, "bf16")
    frozen = Llama(config, params=randomised(Llama, config, "fp32").params.memory,
                   precision="bf16", frozen=True)
    quantized = randomised(Llama, config, "fp32")
    quantized.quantize("q8_0")
    assert mixed.trainable and not frozen.trainable and not quantized.trainable
    for model in (frozen, quantized):
        loss = model.forward(x, y)
        assert not model.kept_activations
        assert model.forward(x, y, keep_activations=True) == loss
        assert model.kept_activations
        full = model.memory_plan(2, 13, training=False, keep_activations=True)
        assert model.memory_plan(2, 13, training=False)["activations"] < full["activations"]
        model.add_lora(2, 4)
        assert model.trainable
        model.forward(x, y)
        assert model.kept_activations
        model.backward()


@pytest.mark.parametrize("name", ["gpt2", "qwen3", "post-layernorm-learned",
                                  "sliding-window"])
def test_the_kv_cache_prefill_keeps_each_layers_keys(name):
    """The prefill runs forward-only and copies each layer's keys and values
    as its attention read them: those of an ordinary forward."""
    cls, config = MODELS[name]
    model = randomised(cls, config, "fp32")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]]
    decoder = Decoder(model, 2, 12)
    logits = decoder.prefill(prompts).copy()
    assert not model.kept_activations
    model.forward(np.array([prompts[0], prompts[1] + [0] * 4]))
    a = model.acts
    qkv = a.qkvr if "qkvr" in a else a.qkv
    C, kv, slots = config.attn_channels, config.kv_dim, decoder.cache.slots
    for b, n in enumerate((7, 3)):
        kept = np.arange(max(0, n - slots), n)
        assert np.array_equal(decoder.cache.k[:, b, kept % slots], qkv[:, b, kept, C:C + kv])
        assert np.array_equal(decoder.cache.v[:, b, kept % slots], qkv[:, b, kept, C + kv:])
    assert np.array_equal(logits, model.logits[[0, 1], [6, 2], :config.vocab_size])


def test_evaluation_and_sampling_keep_one_layer():
    from llmc_py.model.sampling import generate
    model = GPT2(SMALL_GPT2)
    x, y = batch(SMALL_GPT2)
    loss, counted = validation_loss(model, [(x, y)])
    assert not model.kept_activations and counted == model.counted
    assert loss == model.forward(x, y, keep_logits=False)
    tokens = list(generate(model, [1, 2, 3], 4, temperature=0))
    assert not model.kept_activations
    assert tokens == model.generate([1, 2, 3], 4, temperature=0)


_RSS_SCRIPT = r"""
import os, sys
import numpy as np
from llmc_py.model import load_model
from llmc_py.model.memory import return_freed_scratch

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

return_freed_scratch()
x = np.random.default_rng(0).integers(0, 32000, (1, 512))
warm = load_model(sys.argv[2], precision="bf16", frozen=True)
warm.forward(x[:, :64] % 64)
del warm
before = resident()
model = load_model(sys.argv[1], precision="bf16", frozen=True)
with open("/proc/self/clear_refs", "w") as f:   # the peak from here on: the forward's
    f.write("5")
model.forward(x)
plan = model.memory_plan(1, 512, training=False, keep_logits=True)
print(peak() - before, sum(plan.values()), plan["activations"])
"""


@pytest.mark.slow
def test_the_plan_against_peak_memory_of_a_bf16_forward(tmp_path):
    """The peak resident memory of a forward (B=1, T=512, logits kept) of a
    frozen bf16 base loaded from a Hugging Face folder, a 166M-parameter
    Qwen3-like shape of random weights (333 MB in bf16), is its plan (one
    layer's activations) within 5% plus 8 MiB: the interpreter's own heap
    moves by a few MiB between runs (test_qlora measured up to 6)."""
    import os
    import subprocess
    import sys
    pytest.importorskip("safetensors")
    config = dataclasses.replace(
        BASE, max_seq_len=512, vocab_size=32000, padded_vocab_size=32000, num_layers=8,
        num_heads=16, num_kv_heads=8, head_dim=64, channels=1024, ffn_hidden=3072,
        tied_embeddings=False, qk_norm=True)
    Llama(config, seed=0).save_pretrained(tmp_path / "model", dtype="bf16")
    Llama(dataclasses.replace(config, num_layers=1, channels=64, num_heads=4, num_kv_heads=2,
                              head_dim=16, ffn_hidden=96, vocab_size=64, padded_vocab_size=64),
          seed=0).save_pretrained(tmp_path / "warm", dtype="bf16")
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "model"),
                          str(tmp_path / "warm")], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    measured, planned, activations = map(int, out.stdout.split())
    print(f"peak {measured / 2**20:.1f} MiB, plan {planned / 2**20:.1f} MiB "
          f"(activations {activations / 2**20:.1f} MiB)")
    assert abs(measured - planned) < 0.05 * planned + 8 * 2**20, (measured, planned)
