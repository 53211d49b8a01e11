"""The memory-lean ways of running the model give the plain way's results to
the bit: forward_backward (the classifier a block of rows at a time, no
(B, T, Vp) logits held), forward(..., keep_logits=False), and recompute
(norm outputs and the MLP activation recomputed in backward; at level 2 the
MLP's input projection too), for GPT-2 and
the Llama choices, in fp32 and bf16, over several AdamW steps.

The plain way's exactness against PyTorch is tested in test_gpt2_step.py,
test_llama_step.py and test_bf16_training.py; equal bits carry it over.
"""
import dataclasses

import numpy as np
import pytest

from llmc_py.model import transformer
from test_gpt2_step import ADAMW, SMALL, make_batch
from test_gpt2_step import make_model as make_gpt2
from test_llama_step import BASE, CONFIGS
from test_llama_step import make_model as make_llama

MODELS = {
    "gpt2": lambda: make_gpt2(SMALL, seed=5),
    **{name: (lambda choices=choices: make_llama(dataclasses.replace(BASE, **choices), seed=5))
       for name, choices in CONFIGS.items()},
}


def twin(model, precision):
    return type(model)(model.config, params=model.params.memory, precision=precision)


def plain_steps(model, batches):
    """forward, backward, update per batch: (loss, logits, grads, params) of each."""
    out = []
    for t, (x, y) in enumerate(batches, start=1):
        model.zero_grad()
        loss = model.forward(x, y)
        logits = model.logits.copy()
        model.backward()
        model.update(t=t, **ADAMW)
        out.append((loss, logits, model.grads.memory.copy(), model.params.memory.copy()))
    return out


def lean_steps(model, batches):
    """forward_backward and update per batch; the logits from a separate
    forward that keeps them."""
    out = []
    for t, (x, y) in enumerate(batches, start=1):
        model.forward(x)
        logits = model.logits.copy()
        model.zero_grad()
        loss = model.forward_backward(x, y)
        model.update(t=t, **ADAMW)
        out.append((loss, logits, model.grads.memory.copy(), model.params.memory.copy()))
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("recompute", [0, 1, 2])
def test_forward_backward_equals_forward_then_backward(monkeypatch, name, precision, recompute):
    # blocks of 16 rows: B*T = 3*17 = 51 rows make three whole blocks and a partial one
    monkeypatch.setattr(transformer, "HEAD_ROWS", 16)
    base = MODELS[name]()
    batches = [make_batch(base.config, 3, 17, seed=s) for s in (1, 2, 3)]
    plain = plain_steps(twin(base, precision), batches)
    model = twin(base, precision)
    model.recompute = recompute
    lean = lean_steps(model, batches)
    for step, (ours, theirs) in enumerate(zip(lean, plain), start=1):
        for what, a, b in zip(("loss", "logits", "grads", "params"), ours, theirs):
            assert np.array_equal(a, b), f"step {step}: {what} differ"


@pytest.mark.parametrize("B,T", [(2, 9), (1, 1), (4, 32)])
def test_forward_without_logits_gives_the_same_loss(monkeypatch, B, T):
    monkeypatch.setattr(transformer, "HEAD_ROWS", 8)
    model = make_gpt2(SMALL, seed=7)
    x, y = make_batch(SMALL, B, T, seed=7)
    loss = model.forward(x, y)
    losses = model.acts.losses.copy()
    assert model.forward(x, y, keep_logits=False) == loss
    assert np.array_equal(model.acts.losses, losses)
    with pytest.raises(RuntimeError, match="did not keep them"):
        model.logits   # noqa: B018
    with pytest.raises(ValueError, match="needs targets"):
        model.forward(x, keep_logits=False)


def test_backward_replaces_the_logits_and_says_so():
    model = make_gpt2(SMALL, seed=8)
    x, y = make_batch(SMALL, 2, 5, seed=8)
    with pytest.raises(RuntimeError, match="no forward has run yet"):
        model.logits   # noqa: B018
    model.forward(x, y)
    assert model.logits.shape == (2, 5, SMALL.padded_vocab_size)
    model.backward()
    with pytest.raises(RuntimeError, match="backward replaced them by their gradient"):
        model.logits   # noqa: B018
    with pytest.raises(RuntimeError, match="backward needs a forward with targets"):
        model.backward()
    model.forward_backward(x, y)
    with pytest.raises(RuntimeError, match="forward_backward does not keep them"):
        model.logits   # noqa: B018


def test_recompute_switches_both_ways_and_replans():
    model = make_llama(BASE, seed=9)
    x, y = make_batch(BASE, 2, 11, seed=9)
    model.zero_grad()
    expected = model.forward_backward(x, y), model.grads.memory.copy()
    for recompute in (True, False, 2, 1, 0):
        model.recompute = recompute
        assert model.acts is None   # planned anew by the next forward
        model.zero_grad()
        assert model.forward_backward(x, y) == expected[0]
        assert np.array_equal(model.grads.memory, expected[1])
        assert model.recompute == recompute
        assert model.acts.ln1.shape[0] == (1 if recompute else BASE.num_layers)
        assert model.acts.fch.shape[0] == (1 if recompute == 2 else BASE.num_layers)
    for bad in (3, -1, "full"):
        with pytest.raises(ValueError, match="recompute"):
            model.recompute = bad
