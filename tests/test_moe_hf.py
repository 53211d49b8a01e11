"""Mixtral and Qwen3-MoE against transformers itself: tiny random models
saved by save_pretrained, loaded with load_model, compared on logits, the
cross-entropy, every gradient of it and greedy generation; our export loaded
by transformers; and the total loss with the load-balancing term
(output_router_logits) equal to transformers'. Tolerances are test_hf.py's.
The routers' weights are scaled up so that no token's top-k choice is a near
tie that a different summation order could flip."""
import json

import numpy as np
import pytest
import torch

import transformers

from llmc_py import load_model
from llmc_py.io.files import from_bf16, to_bf16
from llmc_py.io.hf import hf_tensors
from llmc_py.model.layout import FROZEN_BF16
from test_hf import (COMMON, batch, check_export, check_greedy_generation,
                     check_logits_and_loss, rel_to_max)

MODELS = {
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig, dict(
        hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False)),
    # layers 1 and 3 MoE (decoder_sparse_step 2), 8 experts, top-k unnormalised
    "qwen3-moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig, dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        decoder_sparse_step=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=64,
        tie_word_embeddings=True)),
}
ARCHS = {"mixtral": "MixtralForCausalLM", "qwen3-moe": "Qwen3MoeForCausalLM"}


def make_hf(name, seed=0, **config):
    torch.manual_seed(seed)
    cls, config_cls, fields = MODELS[name]
    model = cls(config_cls(**COMMON, **(fields | config)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.add_((2.0 if n.endswith("mlp.gate.weight") else 0.05) * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module", params=list(MODELS))
def saved(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = make_hf(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder


def hf_grads(config, hf):
    """transformers' gradients by the names hf_tensors gives ours, the experts
    as our stacked tensors (it holds them fused in memory: gate_up_proj, gate
    rows then up, and down_proj, per layer)."""
    ref = {n: p.grad.numpy() for n, p in hf.named_parameters()}
    experts = {}
    for m, l in enumerate(config.moe_layers):
        experts["expertfcw", m] = ref.pop(f"model.layers.{l}.mlp.experts.gate_up_proj")
        experts["expertprojw", m] = ref.pop(f"model.layers.{l}.mlp.experts.down_proj")
    return ref, experts


def test_logits_loss_and_every_gradient_match_transformers(saved):
    name, hf, folder = saved
    model = load_model(folder)
    assert model.config.num_experts and model.config.router_aux_loss == 0.0
    check_logits_and_loss(model, hf)
    ref, experts = hf_grads(model.config, hf)
    # Mixtral's router is saved as block_sparse_moe.gate, held as mlp.gate
    ours = {n.replace("block_sparse_moe.", "mlp."): g
            for n, g in hf_tensors(model.config, model.grads.memory).items()
            if ".experts." not in n}
    assert set(ours) == set(ref) - ({"lm_head.weight"} if model.config.tied_embeddings else set())
    for n, grad in ours.items():
        assert rel_to_max(grad, ref[n]) < 2e-5, n
    for (tensor, m), grad in experts.items():
        assert rel_to_max(model.grads[tensor][m], grad) < 2e-5, (tensor, m)


def test_greedy_generation_matches_transformers(saved):
    name, hf, folder = saved
    check_greedy_generation(hf, folder)


def test_export_loads_in_transformers_with_the_same_logits(saved, tmp_path):
    name, _, folder = saved
    check_export(folder, ARCHS[name], tmp_path)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_total_loss_with_the_balancing_term_is_transformers(name, tmp_path):
    """One MoE layer (transformers pools the counts and probabilities of all
    layers before multiplying; ours averages each layer's product: the same
    for one layer); router_aux_loss = k * router_aux_loss_coef (config.py)."""
    one_layer = dict(num_hidden_layers=1) if name == "mixtral" else \
        dict(num_hidden_layers=2, decoder_sparse_step=2)
    hf = make_hf(name, seed=3, output_router_logits=True, router_aux_loss_coef=0.05,
                 **one_layer)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.router_aux_loss == np.float32(0.05 * 2)
    x, _ = batch(seed=3)
    targets = np.concatenate([x[:, 1:], np.full((x.shape[0], 1), -1)], axis=1)   # HF's shift
    out = hf(torch.tensor(x), labels=torch.tensor(x))
    loss = model.forward(x, targets)
    assert abs(model.ce_loss - (out.loss - 0.05 * out.aux_loss).item()) < 1e-6 * loss
    assert abs(loss - out.loss.item()) < 1e-6 * loss
    assert abs(2 * model.aux_losses["balance"] - out.aux_loss.item()) < 1e-6
    # and back: config.json's coefficient is transformers' again
    model.save_pretrained(tmp_path / "out")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["output_router_logits"] is True
    assert raw["router_aux_loss_coef"] == pytest.approx(0.05, rel=1e-7)


def test_a_frozen_bf16_base_runs_its_experts_as_the_bf16_model(saved):
    """The experts' weights held in bf16 alone read the bf16 grouped GEMM:
    the same logits as a bf16 model whose float32 matrices are those bf16
    values (its embedding gathers float32 rows)."""
    name, _, folder = saved
    x, _ = batch(seed=2)
    frozen = load_model(folder, precision="bf16", frozen=True)
    frozen.forward(x)
    model = load_model(folder, precision="bf16")
    for tensor in FROZEN_BF16:
        if tensor in model.params:
            model.params[tensor][...] = from_bf16(to_bf16(model.params[tensor]))
    model.refresh_bf16()
    model.forward(x)
    assert np.array_equal(frozen.logits, model.logits)
