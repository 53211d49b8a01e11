"""The mixture-of-experts MLP in the model, against the PyTorch reference in
model_reference.py: logits, the loss with both auxiliary losses, every
gradient and 10 AdamW steps (test_gpt2_step.py's tolerances; bf16 against the
bf16 reference with test_bf16_training.py's), for E = 1, 3, 8, k = 1, 2, every
block, dense and MoE layers mixed; recompute, forward_backward, dropout and
thread counts give the same bits; the train CLI runs experts and says the
loss's parts apart."""
import dataclasses
import re

import numpy as np
import pytest

from helpers import assert_thread_invariant
from llmc_py import Llama
from llmc_py import train as train_mod
from llmc_py.errors import UnsupportedError
from llmc_py.model.dropout import Dropout
from test_bf16_training import bf16_twin, check_against_bf16_reference, check_bf16_adamw_steps
from test_gpt2_step import check_adamw_steps, check_against_reference, make_batch
from test_llama_step import BASE, make_model
from test_train import interrupt_at_batch, run

MOE = dataclasses.replace(BASE, num_experts=3, experts_per_token=2, expert_hidden=24,
                          router_aux_loss=0.1, router_z_loss=0.01)

CONFIGS = {   # id: the choices, over MOE (Llama's block: pre-norm, SwiGLU)
    "e1-k1": dict(num_experts=1, experts_per_token=1),
    "e3-k2": {},
    # Switch Transformer's top-1: the one weight is its probability
    "e3-k1-no-aux": dict(experts_per_token=1, norm_topk_prob=False, router_aux_loss=0.0,
                         router_z_loss=0.0),
    "e8-k2": dict(num_experts=8, expert_hidden=16),
    "e8-k2-unnormed": dict(num_experts=8, expert_hidden=16, norm_topk_prob=False),
    # layer 0 dense (its own ffn_hidden), layer 1 experts
    "every2-dense-and-moe": dict(moe_every=2, num_layers=3, ffn_hidden=40),
    "post-gelu-layernorm": dict(block="post", mlp="gelu", norm="layernorm"),
    "parallel-geglu": dict(block="parallel", mlp="geglu", num_experts=8),
}


def moe_config(name):
    return dataclasses.replace(MOE, **CONFIGS[name])


@pytest.mark.parametrize("name", CONFIGS)
def test_moe_model_matches_torch(name):
    config = moe_config(name)
    model = make_model(config, seed=17)
    x, y = make_batch(config, 3, 13, seed=5)
    _, p = check_against_reference(model, x, y)
    check_adamw_steps(model, p, x, y, steps=10)


@pytest.mark.parametrize("name", ["e3-k2", "every2-dense-and-moe", "parallel-geglu"])
def test_moe_model_bf16_matches_the_bf16_reference(name):
    config = moe_config(name)
    model = bf16_twin(make_model(config, seed=23))
    x, y = make_batch(config, 3, 13, seed=13)
    p = check_against_bf16_reference(model, x, y)
    check_bf16_adamw_steps(model, p, x, y, steps=10)


def test_moe_dropout_matches_torch():
    config = moe_config("every2-dense-and-moe")
    model = make_model(config, seed=3)
    x, y = make_batch(config, 2, 11, seed=3)
    check_against_reference(model, x, y, Dropout(embedding=0.1, attention=0.2, residual=0.3,
                                                 seed=9))


def test_loss_is_cross_entropy_plus_the_weighted_aux_losses():
    config = moe_config("e8-k2")
    model = make_model(config, seed=2)
    x, y = make_batch(config, 2, 9, seed=2)
    loss = model.forward(x, y)
    aux = model.aux_losses
    assert set(aux) == {"balance", "z"} and aux["balance"] > 0 and aux["z"] > 0
    assert loss == (model.ce_loss + config.router_aux_loss * aux["balance"]
                    + config.router_z_loss * aux["z"])
    assert model.ce_loss == model.acts.losses.sum(dtype=np.float64) / y.size
    dense = make_model(BASE, seed=2)
    dense.forward(x, y)
    assert dense.aux_losses == {} and dense.mean_loss == dense.ce_loss


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("block", ["pre", "post", "parallel"])
def test_recompute_and_forward_backward_give_the_same_bits(block, precision):
    """With recompute (the expert activations computed again in backward)
    and in forward_backward, with dropout: the same loss and gradients."""
    config = dataclasses.replace(moe_config("every2-dense-and-moe"), block=block)
    x, y = make_batch(config, 2, 11, seed=4)
    drop = Dropout(attention=0.1, residual=0.2, seed=5)
    results = []
    for recompute, fused in ((False, False), (True, False), (True, True), (False, True)):
        model = Llama(config, params=make_model(config, seed=4).params.memory,
                      precision=precision)
        model.recompute = recompute
        model.zero_grad()
        if fused:
            loss = model.forward_backward(x, y, dropout=drop)
        else:
            loss = model.forward(x, y, dropout=drop)
            model.backward()
        results.append((loss, model.grads.memory.copy()))
    for loss, grads in results[1:]:
        assert loss == results[0][0]
        assert np.array_equal(grads, results[0][1])


def test_loss_scale_scales_the_aux_gradients_too():
    config = moe_config("e3-k2")
    model = make_model(config, seed=8)
    x, y = make_batch(config, 2, 7, seed=8)
    grads = []
    for scale in (1.0, 0.25):
        model.zero_grad()
        model.forward(x, y)
        model.backward(loss_scale=scale)
        grads.append(model.grads.routerw.copy())
    np.testing.assert_allclose(grads[1], 0.25 * grads[0], rtol=1e-5, atol=1e-9)


def test_moe_step_does_not_depend_on_thread_count(set_threads):
    config = moe_config("every2-dense-and-moe")
    params = make_model(config, seed=6).params.memory.copy()
    x, y = make_batch(config, 3, 13, seed=6)

    def run():
        model = Llama(config, params=params)
        model.zero_grad()
        loss = model.forward_backward(x, y)
        return {"loss": np.float64(loss), "grads": model.grads.memory.copy()}

    assert_thread_invariant(set_threads, run)


def test_lora_refuses_experts():
    """(Quantized experts are test_quantized_moe's.)"""
    model = make_model(moe_config("e3-k2"), seed=1)
    with pytest.raises(UnsupportedError, match="num_experts=3"):
        model.add_lora(4, 8)


def test_train_cli_runs_experts_and_logs_the_loss_parts(shards, tmp_path, capsys):
    train_glob, val_glob = shards
    code = train_mod.main(["-i", train_glob, "-j", val_glob, "-o", str(tmp_path / "out"),
                           "--arch", "llama", "-e", "d1", "--experts", "4",
                           "--experts-per-token", "2", "--expert-hidden", "32",
                           "--router-aux-loss", "0.01", "--router-z-loss", "0.001",
                           "-b", "2", "-t", "16", "-x", "2", "-v", "2", "-m", "2", "-s", "0"])
    assert code == 0
    out = capsys.readouterr().out
    assert "4 experts top-2 of 32" in out
    steps = re.findall(r"step \d/2: train loss (\S+) ce (\S+) balance (\S+) z (\S+) ppl", out)
    assert len(steps) == 2
    for loss, ce, balance, z in (map(float, s) for s in steps):
        assert abs(loss - (ce + 0.01 * balance + 0.001 * z)) < 2e-6
    log = (tmp_path / "out" / "main.log").read_text().splitlines()
    assert re.fullmatch(r"s:1 trl:\S+ ce:\S+ balance:\S+ z:\S+ lr:\S+ norm:\S+", log[0])


def test_an_interrupted_moe_run_resumes_to_the_same_bits(shards, tmp_path, monkeypatch):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ("--arch", "llama", "--experts", "3", "--experts-per-token", "2",
            "--expert-hidden", "16", "--moe-every", "1", "--router-aux-loss", "0.02",
            "--router-z-loss", "0.001", "-x", "4", "-n", "2", "-d", "64", "-v", "0")
    assert run(shards, straight, *args) == 0
    interrupt_at_batch(monkeypatch, 7)   # during step 4 (2 micro-batches a step): 2 is saved
    assert run(shards, resumed, *args) == 130
    monkeypatch.undo()
    assert train_mod.main(["-o", str(resumed), "-y", "1"]) == 0
    name = "model_00000004.bin"
    assert (resumed / name).read_bytes() == (straight / name).read_bytes()
