"""The whole GPT-2 against the PyTorch reference in model_reference.py:
logits, loss, every parameter gradient, then AdamW steps, at a small odd
config and at GPT-2 124M width. The pytest form of llm.c's test_gpt2.c, with
tolerances that fail the run when they are missed.

Tolerances (our fp32 against a float64 reference):
  loss       relative error <= 1e-5
  logits     max |error| <= 1e-4 * max |logit| (and an absolute floor of 1e-5)
  gradients  max |error| <= 1e-4 * max |gradient| of each tensor (the issue asks 1e-3)
  AdamW      the loss after each of 10 steps, relative error <= 1e-5
"""
import numpy as np
import pytest
import torch

import model_reference as ref
from helpers import FP32_ISAS
import llmc_py
from llmc_py import GPT2, GPT2Config
from llmc_py.io import read_debug_state, write_debug_state
from llmc_py.model.layout import PARAM_SPECS

LOSS_RTOL = 1e-5
LOGITS_TOL = 1e-4
GRAD_TOL = 1e-4

SMALL = GPT2Config(max_seq_len=32, vocab_size=67, padded_vocab_size=128,
                   num_layers=2, num_heads=4, channels=60)          # hs = 15
WIDE = GPT2Config(max_seq_len=1024, vocab_size=50257, padded_vocab_size=50304,
                  num_layers=2, num_heads=12, channels=768)          # GPT-2 124M width

ADAMW = dict(learning_rate=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def make_model(config, seed):
    """A GPT-2-initialised model whose biases and norm parameters are also
    randomised, so that every parameter shapes the result."""
    model = GPT2(config, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for name in ("ln1w", "ln2w", "lnfw"):
        model.params[name][...] += 0.1 * rng.standard_normal(model.params[name].shape)
    for name in ("ln1b", "qkvb", "attprojb", "ln2b", "fcb", "fcprojb", "lnfb"):
        model.params[name][...] = 0.02 * rng.standard_normal(model.params[name].shape)
    return model


def make_batch(config, B, T, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, size=(B, T + 1), dtype=np.int32)
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


def max_rel_error(ours, theirs):
    """max |ours - theirs| over max |theirs|: an error relative to the tensor's scale."""
    theirs = np.asarray(theirs, dtype=np.float64)
    scale = max(float(np.abs(theirs).max()), 1e-30)
    return float(np.abs(np.asarray(ours, dtype=np.float64) - theirs).max()) / scale


def check_against_reference(model, x, y, dropout=None):
    """Compares loss, logits and every parameter's gradient with the
    reference model; returns the errors seen and the reference's parameters.
    With ``dropout`` (model.dropout.Dropout) both drop, with our masks."""
    c = model.config
    p = ref.torch_params(model.params.memory, c)
    masks = None if dropout is None else ref.dropout_masks(dropout, c, *x.shape)
    logits, loss = ref.forward(p, c, x, y, masks=masks)
    loss.backward()

    model.zero_grad()
    ours = model.forward(x, y, dropout=dropout)
    logits_ours = model.logits[..., :c.vocab_size].copy()   # backward overwrites them
    model.backward()

    errors = {"loss": abs(ours - loss.item()) / abs(loss.item())}
    assert errors["loss"] <= LOSS_RTOL, f"loss {ours} vs {loss.item()}"
    logits_ref = logits.detach().numpy()[..., :c.vocab_size]
    errors["logits"] = float(np.abs(logits_ours - logits_ref).max())
    assert errors["logits"] <= LOGITS_TOL * max(float(np.abs(logits_ref).max()), 0.1), \
        f"logits: max abs error {errors['logits']:.3g}"
    for name in model.params.names:
        err = max_rel_error(model.grads[name], p[name].grad.numpy())
        errors[name] = err
        assert err <= GRAD_TOL, f"gradient {name}: error {err:.3g} of its max magnitude"
    return errors, p


def check_adamw_steps(model, p, x, y, steps):
    """Runs ``steps`` AdamW steps on one batch in both; compares every loss."""
    c = model.config
    opt = ref.AdamW(p, ADAMW["learning_rate"], ADAMW["beta1"], ADAMW["beta2"],
                    ADAMW["eps"], ADAMW["weight_decay"])
    for t in range(1, steps + 1):
        for tensor in p.values():
            tensor.grad = None
        _, loss = ref.forward(p, c, x, y)
        loss.backward()
        opt.step(t)

        model.zero_grad()
        ours = model.forward(x, y)
        model.backward()
        model.update(t=t, **ADAMW)
        assert abs(ours - loss.item()) <= LOSS_RTOL * abs(loss.item()), \
            f"step {t}: loss {ours} vs reference {loss.item()}"
    # and the losses after the last update
    _, loss = ref.forward(p, c, x, y)
    ours = model.forward(x, y)
    assert abs(ours - loss.item()) <= LOSS_RTOL * abs(loss.item())


@pytest.mark.parametrize("B,T", [(4, 13), (1, 1), (2, 32)])
def test_small_model_matches_torch(B, T):
    model = make_model(SMALL, seed=B * 100 + T)
    x, y = make_batch(SMALL, B, T, seed=T)
    _, p = check_against_reference(model, x, y)
    check_adamw_steps(model, p, x, y, steps=10)


@pytest.mark.slow
def test_gpt2_124M_width_matches_torch():
    model = make_model(WIDE, seed=124)
    x, y = make_batch(WIDE, 4, 64, seed=7)
    errors, p = check_against_reference(model, x, y)
    print("max errors at 124M width:", {k: f"{v:.2e}" for k, v in errors.items()})
    check_adamw_steps(model, p, x, y, steps=10)


def test_checkpoint_round_trip_is_exact(tmp_path):
    model = make_model(SMALL, seed=3)
    first = tmp_path / "a.bin"
    model.save_checkpoint(first)
    loaded = GPT2.from_checkpoint(first)
    assert loaded.config == SMALL
    assert np.array_equal(loaded.params.memory, model.params.memory)
    second = tmp_path / "b.bin"
    loaded.save_checkpoint(second)
    assert first.read_bytes() == second.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin"]   # no temp files


def test_debug_state_from_reference_checks_the_model(tmp_path):
    """The debug-state file written from the PyTorch reference, read back,
    agrees with the model: llm.c's test_gpt2.c flow."""
    model = make_model(SMALL, seed=5)
    x, y = make_batch(SMALL, 3, 9, seed=5)
    p = ref.torch_params(model.params.memory, SMALL)
    logits, loss = ref.forward(p, SMALL, x, y)
    loss.backward()
    path = tmp_path / "debug_state.bin"
    write_debug_state(path, SMALL, x, y, logits.detach().numpy().astype(np.float32),
                      loss.item(), ref.flat_grads(p).astype(np.float32))

    state = read_debug_state(path, SMALL)
    assert np.array_equal(state["x"], x) and np.array_equal(state["y"], y)
    assert path.stat().st_size == 1024 + 4 * (2 * 27 + 27 * 67 + 1 + model.num_parameters)
    ours = model.forward(state["x"], state["y"])
    assert max_rel_error(model.logits[..., :SMALL.vocab_size], state["logits"]) <= LOGITS_TOL
    model.backward()
    assert abs(ours - state["loss"]) <= LOSS_RTOL * abs(state["loss"])
    assert max_rel_error(model.grads.memory, state["grads"]) <= GRAD_TOL


def test_results_do_not_depend_on_thread_count():
    model = make_model(SMALL, seed=11)
    x, y = make_batch(SMALL, 4, 29, seed=11)
    results = []
    before = llmc_py.get_num_threads()
    try:
        for threads in (1, 2, 3):
            llmc_py.set_num_threads(threads)
            model.zero_grad()
            loss = model.forward(x, y)
            logits = model.logits.copy()
            model.backward()
            results.append((loss, logits, model.grads.memory.copy()))
    finally:
        llmc_py.set_num_threads(before)
    for loss, logits, grads in results[1:]:
        assert loss == results[0][0]
        assert np.array_equal(logits, results[0][1])
        assert np.array_equal(grads, results[0][2])


def test_every_isa_gives_the_same_step(use_isa):
    """Forward and backward of the whole model on each instruction set this
    CPU runs: the matmul kernels differ at most by FMA rounding (none at all
    when the build's flags give the portable kernel FMA too), so loss, logits
    and every gradient agree far inside the reference tolerances (a baseline
    x86-64 build, portable without FMA vs AVX2: seen 5.6e-9 loss, 2.8e-7
    logits, 4.6e-7 gradients)."""
    model = make_model(SMALL, seed=19)
    x, y = make_batch(SMALL, 3, 17, seed=19)
    results = {}
    for isa in FP32_ISAS:
        use_isa(isa)
        model.zero_grad()
        loss = model.forward(x, y)
        logits = model.logits.copy()
        model.backward()
        results[isa] = (loss, logits,
                        {name: model.grads[name].copy() for name in model.grads.names})
    first, (loss0, logits0, grads0) = next(iter(results.items()))
    for isa, (loss, logits, grads) in results.items():
        assert abs(loss - loss0) <= 1e-6 * abs(loss0), f"{isa} vs {first}: loss"
        assert max_rel_error(logits, logits0) <= 1e-5, f"{isa} vs {first}: logits"
        for name, grad in grads.items():
            err = max_rel_error(grad, grads0[name])
            assert err <= 1e-5, f"{isa} vs {first}: gradient {name}, error {err:.3g}"


def test_new_batch_shape_replans_activations():
    model = make_model(SMALL, seed=13)
    fresh = make_model(SMALL, seed=13)
    big, small = make_batch(SMALL, 4, 20, seed=1), make_batch(SMALL, 2, 7, seed=2)
    model.forward(*big)
    loss_small = model.forward(*small)
    assert model.logits.shape == (2, 7, SMALL.padded_vocab_size)
    assert loss_small == fresh.forward(*small)
    assert model.forward(*big) == fresh.forward(*big)


def test_gradients_accumulate_until_zero_grad():
    model = make_model(SMALL, seed=17)
    x, y = make_batch(SMALL, 2, 5, seed=17)
    model.zero_grad()
    model.forward(x, y)
    model.backward()
    once = model.grads.memory.copy()
    model.forward(x, y)
    model.backward()
    assert max_rel_error(model.grads.memory, 2 * once) <= 1e-6   # fp32 rounding only
    model.zero_grad()
    assert not model.grads.memory.any()


def test_forward_without_targets_gives_logits_only():
    model = make_model(SMALL, seed=19)
    x, y = make_batch(SMALL, 2, 6, seed=19)
    assert model.forward(x) is None
    logits = model.logits.copy()
    with pytest.raises(RuntimeError, match="targets"):
        model.backward()
    model.forward(x, y)
    assert np.array_equal(model.logits, logits)


def test_fresh_model_has_gpt2_initialisation():
    config = GPT2Config(max_seq_len=64, vocab_size=500, padded_vocab_size=512,
                        num_layers=4, num_heads=4, channels=64)
    model = GPT2(config, seed=0)
    p = model.params
    assert model.num_parameters == p.memory.size == sum(
        np.prod(fn(config)) for _, fn in PARAM_SPECS)
    assert abs(p.wte[:500].std() - 0.02) < 0.001 and not p.wte[500:].any()
    assert abs(p.fcw.std() - 0.02) < 0.001
    assert abs(p.attprojw.std() - 0.02 / np.sqrt(8)) < 0.0005
    assert abs(p.fcprojw.std() - 0.02 / np.sqrt(8)) < 0.0005
    assert (p.ln1w == 1).all() and (p.lnfw == 1).all() and not p.qkvb.any()
    assert np.array_equal(GPT2(config, seed=0).params.memory, p.memory)
    assert not np.array_equal(GPT2(config, seed=1).params.memory, p.memory)


def test_bad_model_inputs_raise_clear_errors():
    model = make_model(SMALL, seed=23)
    with pytest.raises(llmc_py.ShapeError, match="max_seq_len"):
        model.forward(np.zeros((1, SMALL.max_seq_len + 1), np.int32))
    with pytest.raises(llmc_py.RangeError, match=r"inputs\[1, 2\] = 67"):
        bad = np.zeros((2, 4), np.int32)
        bad[1, 2] = 67
        model.forward(bad)
    with pytest.raises(llmc_py.RangeError, match=r"targets\[0, 0\] = -2 .* or -1 \(ignored\)"):
        model.forward(np.zeros((1, 3), np.int32), np.full((1, 3), -2))
    with pytest.raises(llmc_py.RangeError, match=r"inputs\[0, 1\] = -1 is not a token id"):
        model.forward(np.array([[0, -1, 2]]), np.zeros((1, 3), np.int32))   # targets only
    with pytest.raises(llmc_py.ShapeError):
        model.forward(np.zeros((1, 3), np.int32), np.zeros((1, 4), np.int32))
    with pytest.raises(llmc_py.ShapeError):
        model.forward(np.zeros(5, np.int32))
    with pytest.raises(TypeError):
        model.forward(np.zeros((1, 3), np.float32))
