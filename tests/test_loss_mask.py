"""Loss masking through the whole model: targets equal to IGNORE_INDEX (-1)
add no loss and no gradient and are not counted in the mean; a batch with
none counted has loss 0 and zero gradients. Against the PyTorch reference
(whose mean is checked against cross_entropy(ignore_index=-1)), the lean
ways bitwise equal to the plain one, and gradient accumulation's mean
(each micro-batch's mean, then their average, as llm.c's)."""
import dataclasses

import numpy as np
import pytest
import torch

import model_reference as ref
import llmc_py
from llmc_py import IGNORE_INDEX
from llmc_py.model import transformer
from llmc_py.train.loop import Trainer
from test_gpt2_step import SMALL, check_against_reference, make_batch, max_rel_error
from test_gpt2_step import make_model as make_gpt2
from test_llama_step import BASE, CONFIGS
from test_llama_step import make_model as make_llama

MODELS = {
    "gpt2": lambda: make_gpt2(SMALL, seed=31),
    "qwen3": lambda: make_llama(dataclasses.replace(BASE, **CONFIGS["qwen3"]), seed=31),
    "alibi-layernorm-gelu": lambda: make_llama(
        dataclasses.replace(BASE, **CONFIGS["alibi-layernorm-gelu"]), seed=31),
}


def masked_batch(config, B, T, seed, fraction):
    """make_batch's (inputs, targets) with about ``fraction`` of the targets
    ignored (at least one kept, one ignored)."""
    x, y = make_batch(config, B, T, seed)
    rng = np.random.default_rng(seed + 7)
    y[rng.random(y.shape) < fraction] = IGNORE_INDEX
    y.flat[0], y.flat[-1] = IGNORE_INDEX, 1
    return x, y


@pytest.mark.parametrize("B,T,fraction", [(3, 13, 0.4), (2, 32, 0.9), (1, 2, 0.5)])
@pytest.mark.parametrize("name", MODELS)
def test_masked_loss_and_gradients_match_torch(name, B, T, fraction):
    model = MODELS[name]()
    x, y = masked_batch(model.config, B, T, seed=B + T, fraction=fraction)
    check_against_reference(model, x, y)   # loss, logits, every gradient
    assert model.counted == int((y != IGNORE_INDEX).sum())
    # the reference's mean is PyTorch's cross_entropy with ignore_index
    c = model.config
    p = ref.torch_params(model.params.memory, c)
    logits, loss = ref.forward(p, c, x, y)
    torch_loss = torch.nn.functional.cross_entropy(
        logits[..., :c.vocab_size].reshape(-1, c.vocab_size),
        torch.as_tensor(y, dtype=torch.long).reshape(-1), ignore_index=IGNORE_INDEX)
    assert abs(loss.item() - torch_loss.item()) <= 1e-12 * abs(torch_loss.item())


def test_masked_mean_is_over_the_counted_targets():
    """The losses of the kept rows are the unmasked run's, and the mean
    divides their sum by how many there are, not by B*T."""
    model = MODELS["gpt2"]()
    x, y = masked_batch(SMALL, 4, 9, seed=3, fraction=0.5)
    kept = y != IGNORE_INDEX
    full = np.where(kept, y, 0)
    model.forward(x, full)
    losses = model.acts.losses.copy()
    loss = model.forward(x, y)
    assert np.array_equal(model.acts.losses[kept], losses[kept])
    assert not model.acts.losses[~kept].any()
    assert abs(loss - losses[kept].astype(np.float64).mean()) <= 1e-12 * loss
    assert abs(loss - losses.astype(np.float64).mean()) > 1e-3 * loss   # not over B*T


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS)
def test_masked_forward_backward_equals_forward_then_backward(monkeypatch, name, precision):
    # blocks of 16 rows over 51: a block whose rows are all ignored among them
    monkeypatch.setattr(transformer, "HEAD_ROWS", 16)
    base = MODELS[name]()
    x, y = masked_batch(base.config, 3, 17, seed=4, fraction=0.5)
    y.reshape(-1)[16:32] = IGNORE_INDEX
    plain = type(base)(base.config, params=base.params.memory, precision=precision)
    plain.zero_grad()
    loss = plain.forward(x, y)
    plain.backward(loss_scale=0.5)
    lean = type(base)(base.config, params=base.params.memory, precision=precision)
    lean.zero_grad()
    assert lean.forward_backward(x, y, loss_scale=0.5) == loss
    assert lean.forward(x, y, keep_logits=False) == loss
    assert np.array_equal(lean.grads.memory, plain.grads.memory)


@pytest.mark.parametrize("name", MODELS)
def test_a_batch_with_every_target_ignored_has_loss_0_and_no_gradient(name):
    model = MODELS[name]()
    x, _ = make_batch(model.config, 2, 5, seed=9)
    y = np.full((2, 5), IGNORE_INDEX, np.int32)
    model.zero_grad()
    assert model.forward(x, y) == 0.0 and model.counted == 0
    model.backward()
    assert not model.grads.memory.any()
    assert model.forward_backward(x, y) == 0.0
    assert not model.grads.memory.any()
    assert model.forward(x, y, keep_logits=False) == 0.0


def test_only_targets_may_be_ignored():
    model = MODELS["gpt2"]()
    x, y = make_batch(SMALL, 2, 4, seed=1)
    x[1, 2] = IGNORE_INDEX
    with pytest.raises(llmc_py.RangeError, match=r"inputs\[1, 2\] = -1 is not a token id"):
        model.forward_backward(x, y)
    with pytest.raises(llmc_py.RangeError, match=r"\[0, 1\] = -1 is not a token id"):
        model.generate([[0, IGNORE_INDEX]], 1)
    x[1, 2] = 0
    y[0, 3] = -3
    with pytest.raises(llmc_py.RangeError, match=r"targets\[0, 3\] = -3 .*or -1 \(ignored\)"):
        model.forward(x, y)


class _Optimizer:
    """Records nothing, changes nothing: the test reads the gradients."""
    def step(self, lr, step):
        pass


def test_gradient_accumulation_averages_the_micro_batch_means():
    """With grad_accum micro-batches, a step's loss is the mean of the
    micro-batches' masked means, and its gradient the mean of theirs (llm.c's
    1/n per micro-batch, whatever each one counts): a micro-batch with one
    counted target weighs as much as a full one."""
    model = MODELS["gpt2"]()
    full = make_batch(SMALL, 2, 6, seed=11)
    sparse = masked_batch(SMALL, 2, 6, seed=12, fraction=1.0)   # one target counted
    assert (sparse[1] != IGNORE_INDEX).sum() == 1
    expected_loss, expected_grads = 0.0, np.zeros_like(model.grads.memory)
    for x, y in (full, sparse):
        model.zero_grad()
        loss = model.forward_backward(x, y)
        expected_loss += loss / 2
        expected_grads += model.grads.memory / 2
    batches = iter([full, sparse])
    trainer = Trainer(model, _Optimizer(), lambda step: 1e-3, lambda: next(batches),
                      grad_accum=2, grad_clip=0.0)
    result = trainer.train_step(1)
    assert result.loss == expected_loss
    # float32 sums in another order: within 1e-5 of the largest gradient
    assert max_rel_error(model.grads.memory, expected_grads) <= 1e-5
