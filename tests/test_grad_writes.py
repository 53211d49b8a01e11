"""zero_grad leaves the dense linear layers', the stacks of experts' and the
head's weight gradients to backward, whose first product into each writes it
(matmul_backward's and moe_grouped_backward's `written`; an expert given no
token zeroed), and backward writes its activation gradients' first products
instead of zeroing them: the gradients stay bitwise those of a backward adding
into zeroed buffers, whatever the memory held, and model.grads read before a
backward is zero."""
import dataclasses

import numpy as np
import pytest

from llmc_py.model import transformer
from test_gpt2_step import SMALL, make_batch
from test_gpt2_step import make_model as make_gpt2
from test_llama_step import BASE, CONFIGS
from test_llama_step import make_model as make_llama
from test_moe_model import moe_config

MODELS = {
    "gpt2": lambda: make_gpt2(SMALL, seed=5),
    **{name: (lambda name=name: make_llama(dataclasses.replace(BASE, **CONFIGS[name]), seed=5))
       for name in ("llama", "mqa-untied-bias", "post-rope-qknorm", "parallel-gptj",
                    "relu-layernorm-bias", "geglu")},
    "moe-every2": lambda: make_llama(moe_config("every2-dense-and-moe"), seed=5),
    # a zero router ties every expert: the first k take every token, the rest none
    "moe-k1-one-expert": lambda: routed_to_the_first(moe_config("e3-k1-no-aux")),
    "moe-k2-idle-experts": lambda: routed_to_the_first(moe_config("e8-k2")),
}


def routed_to_the_first(config):
    model = make_llama(config, seed=5)
    model.params.routerw[...] = 0.0
    return model


def twin(model, precision):
    return type(model)(model.config, params=model.params.memory, precision=precision)


def accumulated_grads(model, batches, fused, zero):
    """The gradients of the batches' mean loss (loss_scale 1/n each) after
    ``zero(model)``: forward_backward, or forward then backward."""
    zero(model)
    for x, y in batches:
        if fused:
            model.forward_backward(x, y, loss_scale=1.0 / len(batches))
        else:
            model.forward(x, y)
            model.backward(loss_scale=1.0 / len(batches))
    return model.grads.memory.copy()


def zeroed_in_memory(model):
    """Every gradient zero in memory before the first backward: nothing left
    to backward, each product adds (the plain way)."""
    model.grads.memory[...] = 0.0


def zero_grad_over_garbage(model):
    model.grads.memory[...] = np.nan   # what zero_grad leaves to backward must not be read
    model.zero_grad()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS)
def test_zero_grad_then_backward_is_bitwise_the_plain_way(monkeypatch, name, precision, fused):
    monkeypatch.setattr(transformer, "HEAD_ROWS", 16)   # several head blocks (51 rows)
    base = MODELS[name]()
    batches = [make_batch(base.config, 3, 17, seed=s) for s in (1, 2)]
    plain = accumulated_grads(twin(base, precision), batches, fused, zeroed_in_memory)
    for recompute in (0, 2):
        model = twin(base, precision)
        model.recompute = recompute
        # twice: the second zero_grad follows an update-less step over written memory
        for _ in range(2):
            ours = accumulated_grads(model, batches, fused, zero_grad_over_garbage)
            assert np.array_equal(ours.view(np.uint32), plain.view(np.uint32)), \
                f"{name} {precision} recompute {recompute}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_grads_read_after_zero_grad_are_zero(precision):
    model = twin(MODELS["gpt2"](), precision)
    zero_grad_over_garbage(model)
    assert model._unwritten   # the weight gradients were left to backward
    assert not np.any(model.trained[1].memory)   # reading them zeroes them
    assert not model._unwritten
    zero_grad_over_garbage(model)
    assert not np.any(model.grads.memory)


def test_zero_grad_leaves_the_stacks_of_experts_to_backward():
    model = MODELS["moe-k2-idle-experts"]()
    zero_grad_over_garbage(model)
    assert {("expertfcw", 0), ("expertprojw", 0)} <= model._unwritten
    assert np.isnan(model._grad_tensors().expertfcw).all()   # not filled by zero_grad


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS)
def test_activation_gradients_over_nan_are_bitwise_the_plain_way(name, precision):
    """Every activation gradient backward reads was written first in that
    backward (the kernels' written flags: rope_backward's, head_rmsnorm_backward's,
    the products' and the activations'), so NaN left in their memory changes
    nothing."""
    base = MODELS[name]()
    batch = make_batch(base.config, 3, 17, seed=1)
    plain = accumulated_grads(twin(base, precision), [batch], True, zeroed_in_memory)
    model = twin(base, precision)
    model.forward_backward(*batch)   # plans the activation gradients
    model.grads_acts.memory[...] = np.nan
    ours = accumulated_grads(model, [batch], True, zero_grad_over_garbage)
    assert np.array_equal(ours.view(np.uint32), plain.view(np.uint32))
