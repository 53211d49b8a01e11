"""bf16 mixed precision (precision="bf16") against the PyTorch reference that
applies the same roundings (model_reference.forward(..., precision="bf16")):
bf16 matmul operands, float32 (here float64) sums, float32 statistics.

Two kinds of check, because bf16 rounding is not continuous:
- Layer by layer, from our own activations ("teacher-forced"): each linear
  layer's output, input gradient and weight gradient against the reference
  linear layer fed with the very inputs ours saw. Only summation error is
  left: max |error| <= 2e-5 * max |value| (seen 1e-6 at K <= 192: bf16
  operands, whose products are exact in float32, summed in float32).
- End to end: a float32 value and the reference's float64 value that lie on
  two sides of a bf16 rounding boundary round one bf16 step (2^-8) apart,
  and the difference travels on through later layers. Bounds: loss relative
  error <= 5e-5 (seen 4e-6), logits <= 4e-3 of the largest logit (seen
  1.4e-3), gradients <= 1.5e-2 of each tensor's largest (seen 2.4e-3); the
  fp32 model is 2e-3..8e-3 away from this reference.
"""
import dataclasses

import numpy as np
import pytest
import torch

import llmc_py
import model_reference as ref
import test_llama_step as llama_tests
from llmc_py import GPT2, load_model
from llmc_py._native import kernels as K
from llmc_py.model.layout import float32_of
from test_gpt2_step import ADAMW, SMALL, make_batch, make_model, max_rel_error

LAYER_TOL = 2e-5
LOSS_RTOL = 5e-5
LOGITS_TOL = 4e-3
GRAD_TOL = 1.5e-2
ADAMW_LOSS_RTOL = 5e-4   # the loss after each of 10 AdamW steps (seen 4.3e-5)


def bf16_twin(model):
    """A bf16 model with the parameters of ``model`` (an fp32 model)."""
    return type(model)(model.config, params=model.params.memory, precision="bf16")


def test_precision_is_checked_and_reported():
    assert GPT2(SMALL).precision == "fp32" and GPT2(SMALL).params_bf16 is None
    model = GPT2(SMALL, precision="bf16")
    assert model.precision == "bf16" and model.params_bf16.memory.dtype == np.uint16
    with pytest.raises(ValueError, match="precision is 'fp16'"):
        GPT2(SMALL, precision="fp16")
    with pytest.raises(RuntimeError, match="precision is fp32"):
        GPT2(SMALL).refresh_bf16()


def test_bf16_copy_follows_the_parameters_through_updates(rng):
    model = GPT2(SMALL, seed=1, precision="bf16")
    x, y = make_batch(SMALL, 2, 9, seed=1)
    for t in (1, 2):
        model.zero_grad()
        model.forward(x, y)
        model.backward()
        model.update(t=t, **ADAMW)
        expected = np.empty_like(model.params_bf16.memory)
        K.float_to_bf16(expected, model.params.memory)
        assert np.array_equal(model.params_bf16.memory, expected)
    model.params.memory[:5] += 1.0   # by hand: refresh_bf16 catches up
    model.refresh_bf16()
    K.float_to_bf16(expected, model.params.memory)
    assert np.array_equal(model.params_bf16.memory, expected)


def check_layers_teacher_forced(model, x, y):
    """Every linear layer of every block, and the head's forward, against the
    reference bf16 linear layer fed with the very operands ours saw: each
    call of the model's bf16 matmuls is recorded (its operands and results
    copied as it returns; every block weight has one backward call a step,
    and each call's input gradient is recorded from zero, then added: post-
    norm and parallel blocks add two into one buffer)."""
    calls = {"forward": [], "backward": []}
    forward, backward = model._matmul_forward, model._matmul_backward

    # an input the model keeps in bf16 (layout.act_dtypes) is recorded widened: its values
    def recording_forward(out, inp, weight, bias):
        forward(out, inp, weight, bias)
        calls["forward"].append([a if a is None else a.copy()
                                 for a in (out, float32_of(inp), bias)] + [weight])
    def recording_backward(dinp, dweight, dbias, dout, inp, weight, written=0):
        # a written output holds no start value: its part is what the call writes
        written_w = written & K.WRITE_DWEIGHT
        before = np.zeros_like(dweight) if written_w else dweight.copy()
        own = np.zeros_like(dinp)   # this call's part of dinp
        backward(own, dweight, dbias, dout, inp, weight, written=written_w)
        if written & K.WRITE_DINP:
            dinp[...] = own
        else:
            dinp += own
        calls["backward"].append((own, dweight - before, dout.copy(), float32_of(inp).copy(),
                                  weight))
    model._matmul_forward, model._matmul_backward = recording_forward, recording_backward
    try:
        model.zero_grad()
        model.forward(x, y)
        model.backward()
    finally:
        model._matmul_forward, model._matmul_backward = forward, backward

    def float_weight(weight):
        """The fp32 master copy of a bf16 weight view (its rows are whole)."""
        for name in ("qkvw", "attprojw", "fcw", "fcprojw", "wte", "lm_head"):
            if name not in model.params_bf16:
                continue
            full = model.params_bf16[name]
            if np.shares_memory(full, weight):
                if full.ndim == 2:
                    return model.params[name]
                for l in range(full.shape[0]):
                    if np.shares_memory(full[l], weight):
                        return model.params[name][l]
        raise AssertionError("a weight not among the parameters")

    assert len(calls["forward"]) == 4 * model.config.L + 1
    assert len(calls["backward"]) == 4 * model.config.L + 1
    for out, inp, bias, weight in calls["forward"]:
        w = torch.tensor(float_weight(weight), dtype=torch.float64)
        b = None if bias is None else torch.tensor(bias, dtype=torch.float64)
        y_ref = ref.bf16_matmul(torch.tensor(inp, dtype=torch.float64), w, b)
        err = max_rel_error(out, y_ref.numpy())
        assert err <= LAYER_TOL, f"forward {out.shape}: {err:.3g}"
    for dinp, dweight, dout, inp, weight in calls["backward"]:
        x_in = torch.tensor(inp, dtype=torch.float64, requires_grad=True)
        w = torch.tensor(float_weight(weight), dtype=torch.float64, requires_grad=True)
        ref.bf16_matmul(x_in, w, None).backward(torch.tensor(dout, dtype=torch.float64))
        err = max_rel_error(dinp, x_in.grad.numpy())
        assert err <= LAYER_TOL, f"dinp {dinp.shape}: {err:.3g}"
        err = max_rel_error(dweight, w.grad.numpy())
        assert err <= LAYER_TOL, f"dweight {dweight.shape}: {err:.3g}"



def check_against_bf16_reference(model, x, y):
    """Loss, logits and every gradient against the bf16 reference; returns
    the reference's parameters."""
    c = model.config
    p = ref.torch_params(model.params.memory, c)
    logits, loss = ref.forward(p, c, x, y, precision="bf16")
    loss.backward()
    model.zero_grad()
    ours = model.forward(x, y)
    ours_logits = model.logits.copy()   # backward overwrites them
    model.backward()
    assert abs(ours - loss.item()) <= LOSS_RTOL * abs(loss.item()), f"{ours} vs {loss.item()}"
    err = max_rel_error(ours_logits[..., :c.vocab_size],
                        logits.detach().numpy()[..., :c.vocab_size])
    assert err <= LOGITS_TOL, f"logits: {err:.3g} of the largest"
    for name in model.params.names:
        err = max_rel_error(model.grads[name], p[name].grad.numpy())
        assert err <= GRAD_TOL, f"gradient {name}: {err:.3g} of its largest"
    return p


def check_bf16_adamw_steps(model, p, x, y, steps):
    opt = ref.AdamW(p, ADAMW["learning_rate"], ADAMW["beta1"], ADAMW["beta2"], ADAMW["eps"],
                    ADAMW["weight_decay"])
    for t in range(1, steps + 1):
        for tensor in p.values():
            tensor.grad = None
        _, loss = ref.forward(p, model.config, x, y, precision="bf16")
        loss.backward()
        opt.step(t)
        model.zero_grad()
        ours = model.forward(x, y)
        model.backward()
        model.update(t=t, **ADAMW)
        assert abs(ours - loss.item()) <= ADAMW_LOSS_RTOL * abs(loss.item()), \
            f"step {t}: loss {ours} vs reference {loss.item()}"


@pytest.mark.parametrize("B,T", [(4, 13), (1, 1), (2, 32)])
def test_gpt2_bf16_matches_the_bf16_reference(B, T):
    model = bf16_twin(make_model(SMALL, seed=B * 100 + T))
    x, y = make_batch(SMALL, B, T, seed=T)
    check_layers_teacher_forced(model, x, y)
    p = check_against_bf16_reference(model, x, y)
    if (B, T) == (4, 13):
        check_bf16_adamw_steps(model, p, x, y, steps=10)


@pytest.mark.parametrize("name", llama_tests.CONFIGS)
def test_llama_family_bf16_matches_the_bf16_reference(name):
    config = dataclasses.replace(llama_tests.BASE, **llama_tests.CONFIGS[name])
    model = bf16_twin(llama_tests.make_model(config, seed=313))
    x, y = make_batch(config, 3, 13, seed=13)
    check_layers_teacher_forced(model, x, y)
    p = check_against_bf16_reference(model, x, y)
    check_bf16_adamw_steps(model, p, x, y, steps=10)


def test_bf16_is_not_fp32():
    """The bf16 model really rounds: its logits differ from the fp32 model's
    by far more than fp32's own error (1e-4 of the largest at most)."""
    fp32 = make_model(SMALL, seed=5)
    bf16 = bf16_twin(fp32)
    x, y = make_batch(SMALL, 2, 16, seed=5)
    for model in (fp32, bf16):
        model.forward(x, y)
    assert max_rel_error(bf16.logits, fp32.logits) > 1e-4


@pytest.mark.parametrize("isa", llmc_py.supported_isas())
def test_bf16_results_do_not_depend_on_thread_count(use_isa, set_threads, isa):
    use_isa(isa)
    results = []
    for threads in (1, 2, 3):
        set_threads(threads)
        model = bf16_twin(make_model(SMALL, seed=9))
        x, y = make_batch(SMALL, 3, 21, seed=9)
        for t in (1, 2):
            model.zero_grad()
            loss = model.forward(x, y)
            logits = model.logits.copy()
            model.backward()
            model.update(t=t, **ADAMW)
        results.append((loss, logits, model.grads.memory.copy(),
                        model.params.memory.copy()))
    for loss, logits, grads, params in results[1:]:
        assert loss == results[0][0]
        assert np.array_equal(logits, results[0][1])
        assert np.array_equal(grads, results[0][2])
        assert np.array_equal(params, results[0][3])


def test_instruction_sets_agree_in_bf16(use_isa):
    """The dot-product path sums pairs of k, the widened paths one k at a
    time: within the end-to-end bounds of one another."""
    fp32 = make_model(SMALL, seed=11)
    x, y = make_batch(SMALL, 3, 17, seed=11)
    results = {}
    for isa in llmc_py.supported_isas():
        use_isa(isa)
        model = bf16_twin(fp32)
        loss = model.forward(x, y)
        logits = model.logits.copy()
        model.backward()
        results[isa] = (loss, logits, model.grads.memory.copy())
    loss0, logits0, grads0 = next(iter(results.values()))
    for isa, (loss, logits, grads) in results.items():
        assert abs(loss - loss0) <= LOSS_RTOL * abs(loss0), isa
        assert max_rel_error(logits, logits0) <= LOGITS_TOL, isa
        assert max_rel_error(grads, grads0) <= GRAD_TOL, isa


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_bf16_model_file_round_trips(tmp_path, kind):
    if kind == "gpt2":
        model = make_model(SMALL, seed=3)
    else:
        model = llama_tests.make_model(llama_tests.BASE, seed=3)
    path = tmp_path / "model_bf16.bin"
    model.save_checkpoint(path, dtype="bf16")
    rounded = np.empty(model.num_parameters, np.uint16)
    K.float_to_bf16(rounded, model.params.memory)
    widened = (rounded.astype(np.uint32) << 16).view(np.float32)
    header_ints = np.fromfile(path, dtype="<i4", count=2)
    assert header_ints[1] == (5 if kind == "gpt2" else 2)
    for precision in ("fp32", "bf16"):
        loaded = load_model(path, precision=precision)
        assert type(loaded) is type(model) and loaded.precision == precision
        assert np.array_equal(loaded.params.memory, widened)
    # bf16 -> fp32 file -> bf16 file: the same bytes
    again = tmp_path / "again.bin"
    load_model(path).save_checkpoint(again, dtype="bf16")
    assert again.read_bytes() == path.read_bytes()
    # the fp32 file is unchanged by all this and still loads into bf16
    fp32_path = tmp_path / "model.bin"
    model.save_checkpoint(fp32_path)
    assert np.array_equal(load_model(fp32_path, precision="bf16").params.memory,
                          model.params.memory)
    with pytest.raises(ValueError, match="dtype is 'fp16'"):
        model.save_checkpoint(tmp_path / "x.bin", dtype="fp16")
    assert not (tmp_path / "x.bin").exists()


def test_bf16_generation_is_close_to_the_full_forward():
    """KV-cache decoding in bf16 (the skinny path for a few rows) against a
    full bf16 forward over the same tokens: the sums run in another order,
    so close, not bitwise."""
    model = bf16_twin(llama_tests.make_model(llama_tests.BASE, seed=21))
    prompt = list(range(1, 8))
    tokens = model.generate(prompt, 12, temperature=0)
    full = np.array([prompt + tokens[:-1]])
    model.forward(full)
    greedy = model.logits[0, len(prompt) - 1:, :model.config.vocab_size].argmax(-1)
    assert list(greedy) == tokens


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bf16_training_resumes_bitwise_and_samples(shards, tmp_path, monkeypatch, capsys, arch):
    from test_train import interrupt_at_batch, run, train_losses
    flags = ["--precision", "bf16", "-x", "6", "-n", "3", "--arch", arch]
    straight, resumed, fp32 = tmp_path / "straight", tmp_path / "resumed", tmp_path / "fp32"
    assert run(shards, straight, *flags) == 0
    assert "bf16; batch" in capsys.readouterr().out
    interrupt_at_batch(monkeypatch, 5)
    assert run(shards, resumed, *flags) == 130
    monkeypatch.undo()
    assert run(shards, resumed, *flags, "-y", "1") == 0
    assert train_losses(resumed) == train_losses(straight)
    assert (resumed / "model_00000006.bin").read_bytes() == \
        (straight / "model_00000006.bin").read_bytes()
    # the same run in fp32 follows nearly the same path, but not bitwise
    assert run(shards, fp32, *flags[2:]) == 0
    ours = np.array([float(x) for _, x in train_losses(straight)])
    theirs = np.array([float(x) for _, x in train_losses(fp32)])
    assert not np.array_equal(ours, theirs)
    np.testing.assert_allclose(ours, theirs, rtol=2e-2)
    model = load_model(straight / "model_00000006.bin", precision="bf16")
    assert len(model.generate([50256, 464], 5, temperature=0)) == 5


# ---- bf16 storage of the activations only matmuls read -------------------------------

def float32_storage(monkeypatch):
    """Makes every model lay its activations out in float32 alone (as before
    bf16 storage), for the comparison below."""
    from llmc_py.model.transformer import Transformer
    monkeypatch.setattr(Transformer, "act_dtypes", property(lambda self: {}))


STORAGE_CONFIGS = {   # over test_llama_step's BASE, plus MoE layers
    "llama": {}, "parallel-gptj": llama_tests.CONFIGS["parallel-gptj"],
    "post-layernorm-learned": llama_tests.CONFIGS["post-layernorm-learned"],
    "relu-layernorm-bias": llama_tests.CONFIGS["relu-layernorm-bias"],
    "moe-dense-and-experts": dict(num_experts=3, experts_per_token=2, expert_hidden=24,
                                  moe_every=2, num_layers=3),
    "moe-parallel": dict(block="parallel", num_experts=3, experts_per_token=2,
                         expert_hidden=24),
}


def storage_run(model, x, y):
    """Everything a step computes, as bits: two forward + backward passes
    (recompute off, then on, with dropout) and KV-cache decoding."""
    from llmc_py.model.dropout import Dropout
    out = {}
    for recompute in (False, True):
        model.recompute = recompute
        model.zero_grad()
        drop = Dropout(attention=0.1, residual=0.1, seed=5) if recompute else None
        out[f"loss{recompute}"] = np.float64(model.forward(x, y, dropout=drop))
        out[f"logits{recompute}"] = model.logits.copy()
        model.backward()
        out[f"grads{recompute}"] = model.trained[1].memory.copy()
    out["generated"] = np.array(model.generate([[1, 2, 3]], 5, temperature=0))
    return out


@pytest.mark.parametrize("name", STORAGE_CONFIGS)
def test_bf16_activation_storage_changes_no_bit(monkeypatch, name):
    """A bf16 model keeping ln1, ln2 and fch_act in bf16 (pre-norm, parallel;
    post-norm keeps them float32) computes bitwise what it computed keeping
    them in float32: the matmuls read the bf16 values they rounded to before,
    the MoE gather widens them exactly; through recompute, dropout and
    KV-cache decoding."""
    config = dataclasses.replace(llama_tests.BASE, **STORAGE_CONFIGS[name])
    x, y = make_batch(config, 2, 9, seed=3)
    model = bf16_twin(llama_tests.make_model(config, seed=4))
    model.forward(x, y)
    kept = {n: model.acts[n].dtype for n in ("ln1", "ln2", "fch_act") if n in model.acts}
    assert kept and all((dtype == np.float32) == (config.block == "post")
                        for dtype in kept.values()), kept
    bf16 = storage_run(model, x, y)
    float32_storage(monkeypatch)
    model = bf16_twin(llama_tests.make_model(config, seed=4))
    model.forward(x, y)
    assert all(model.acts[n].dtype == np.float32 for n in kept)
    f32 = storage_run(model, x, y)
    for key, value in bf16.items():
        assert np.array_equal(value, f32[key]), key


def test_lora_on_bf16_activations_changes_no_bit(monkeypatch):
    """LoRA adapters on a frozen bf16 base read its bf16 ln1, ln2 and
    fch_act as the base matmuls do: the same bits as from float32 storage."""
    config = llama_tests.BASE
    x, y = make_batch(config, 2, 9, seed=3)

    def adapted():
        base = llama_tests.make_model(config, seed=4)
        model = type(base)(config, params=base.params.memory, precision="bf16", frozen=True)
        model.add_lora(4, 8.0, seed=1)
        model.lora.params.memory[...] = np.random.default_rng(2).standard_normal(
            model.lora.params.size).astype(np.float32) * 0.1
        model.zero_grad()
        loss = model.forward(x, y)
        logits = model.logits.copy()
        model.backward()
        return loss, logits, model.lora.grads.memory.copy()

    bf16 = adapted()
    float32_storage(monkeypatch)
    for ours, theirs in zip(bf16, adapted()):
        assert np.array_equal(ours, theirs)


def test_a_quantized_bf16_model_keeps_float32_activations():
    """A quantized base's matmuls read float32 inputs: quantizing a bf16 model
    lays its activations out in float32 again (with and without recompute),
    and it forwards, decodes and plans so."""
    config = llama_tests.BASE
    x, y = make_batch(config, 2, 9, seed=3)
    model = bf16_twin(llama_tests.make_model(config, seed=4))
    model.forward(x, y)
    assert model.acts.ln1.dtype == np.uint16
    model.quantize("q8_0")
    for recompute in (False, True):
        model.recompute = recompute
        assert np.isfinite(model.forward(x, y))
        assert all(model.acts[n].dtype == np.float32 for n in ("ln1", "ln2", "fch_act"))
        assert model.acts.buffer.nbytes >= model.memory_plan(2, 9, training=False)["activations"]
    assert len(model.generate([[1, 2, 3]], 3, temperature=0)[0]) == 3
