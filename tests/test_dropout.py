"""csrc/dropout.c and dropout in training passes (model.dropout): the masks'
rate, scale and determinism; the model against the PyTorch reference with
our masks; p = 0 equal to no dropout, bitwise; the same seed bitwise the
same run; thread-count invariance; a batch split into row ranges drawing the
same masks; evaluation and decoding never dropping. (The attention kernels'
dropout is in test_attention.py, the CLI's in test_train.py.)"""
import dataclasses

import numpy as np
import pytest

import llmc_py
from llmc_py import Dropout, LlamaConfig
from llmc_py import kernels as K
from helpers import assert_thread_invariant, randn
from test_gpt2_step import check_against_reference, make_batch
from test_llama_step import make_model

SHAPES = [(4, 64, 256), (1, 1, 1), (2, 9, 17), (3, 5, 67)]   # B, T, C


def dropped(x, p, seed, backward=False):
    out = np.full_like(x, np.nan)   # (written): must not be read
    (K.dropout_backward if backward else K.dropout_forward)(out, x, p, seed)
    return out


@pytest.mark.parametrize("B,T,C", SHAPES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_1_minus_p_and_scales_them(rng, isa, B, T, C, p):
    x = randn(rng, B, T, C) + 3.0   # no zero among the inputs
    out = dropped(x, p, seed=12345)
    kept = out != 0
    # every kept element is x * (1 / (1 - p)) in float32, exactly
    scale = np.float32(1.0) / (np.float32(1.0) - np.float32(p))
    assert np.array_equal(out[kept], x[kept] * scale)
    n = x.size
    if n >= 10000:   # the kept fraction is 1 - p within 5 standard deviations
        assert abs(kept.mean() - (1 - p)) <= 5 * np.sqrt(p * (1 - p) / n)


def test_dropout_masks_are_the_same_on_every_instruction_set(rng, use_isa):
    x = randn(rng, 3, 7, 100)
    outs = {}
    for isa in llmc_py.supported_isas():
        use_isa(isa)
        outs[isa] = dropped(x, 0.3, seed=99)
    first = next(iter(outs.values()))
    assert all(np.array_equal(first, out) for out in outs.values())


def test_dropout_is_a_function_of_seed_and_indices(rng):
    x = randn(rng, 2, 8, 33)
    a, b = dropped(x, 0.5, seed=7), dropped(x, 0.5, seed=7)
    assert np.array_equal(a, b)
    assert not np.array_equal(a != 0, dropped(x, 0.5, seed=8) != 0)
    # rows and columns have masks of their own (none repeats another's)
    mask = dropped(np.ones((4, 16, 64), np.float32), 0.5, seed=7) != 0
    rows = mask.reshape(64, 64)
    assert len({row.tobytes() for row in rows}) == 64
    assert len({col.tobytes() for col in rows.T}) == 64


def test_dropout_rows_of_a_larger_batch_take_its_masks(rng):
    # batch rows b0.. under seed + b0 * DROPOUT_ROW_STEP (mod 2^64) are those
    # rows of the larger batch: how its rows are split never changes a mask
    x = randn(rng, 5, 6, 40)
    seed = 2**64 - 3   # the offset wraps around
    whole = dropped(x, 0.4, seed)
    for b0 in (1, 2, 4):
        part = dropped(x[b0:].copy(), 0.4, (seed + b0 * K.DROPOUT_ROW_STEP) % 2**64)
        assert np.array_equal(part, whole[b0:]), b0


def test_dropout_in_place_and_backward_are_the_same_masking(rng):
    x = randn(rng, 3, 11, 50)
    out = dropped(x, 0.25, seed=5)
    inplace = x.copy()
    K.dropout_forward(inplace, inplace, 0.25, 5)
    assert np.array_equal(inplace, out)
    assert np.array_equal(dropped(x, 0.25, seed=5, backward=True), out)
    K.dropout_backward(inplace, inplace, 0.25, 5)   # the mask again, in place
    assert np.array_equal(inplace, np.where(out != 0, out * np.float32(1 / 0.75), 0))


@pytest.mark.parametrize("backward", [False, True])
def test_dropout_with_p_0_is_the_identity(rng, backward):
    x = randn(rng, 2, 5, 19)
    assert np.array_equal(dropped(x, 0.0, seed=3, backward=backward), x)
    inplace = x.copy()
    (K.dropout_backward if backward else K.dropout_forward)(inplace, inplace, 0.0, 3)
    assert np.array_equal(inplace, x)


def test_dropout_thread_invariant(rng, isa, set_threads):
    x = randn(rng, 3, 17, 70)   # 51 rows, uneven over 2 and 3 threads
    assert_thread_invariant(set_threads, lambda: {"out": dropped(x, 0.3, seed=11),
                                                  "din": dropped(x, 0.3, 11, backward=True)})


@pytest.mark.parametrize("p", [1.0, -0.1, float("nan"), float("inf"), 2.0, 0.99999999])
def test_dropout_rejects_a_probability_outside_0_1(p):
    x = np.ones((1, 2, 3), np.float32)
    with pytest.raises(llmc_py.InvalidValueError, match="dropout_forward"):
        K.dropout_forward(x, x, p, 0)
    with pytest.raises(ValueError, match="probability in"):
        Dropout(attention=p)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5])
def test_dropout_rejects_a_seed_outside_64_bits(seed):
    x = np.ones((1, 2, 3), np.float32)
    with pytest.raises(ValueError, match="seed"):
        K.dropout_forward(x, x, 0.1, seed)
    with pytest.raises(ValueError, match="seed"):
        Dropout(residual=0.1, seed=seed)


def test_dropout_rejects_wrong_shape():
    x = np.ones((2, 3, 4), np.float32)
    with pytest.raises(llmc_py.ShapeError, match="out"):
        K.dropout_forward(np.ones((2, 3, 5), np.float32), x, 0.1, 0)
    with pytest.raises(llmc_py.ShapeError, match="dout"):
        K.dropout_backward(x, np.ones((2, 3), np.float32), 0.1, 0)


# ---- dropout in the model -----------------------------------------------------

BASE = LlamaConfig(max_seq_len=32, vocab_size=67, padded_vocab_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, channels=64)
CONFIGS = {   # the blocks, positions and buffers dropout touches
    "gpt2-like": dict(position="learned", norm="layernorm", mlp="gelu", bias=True,
                      num_kv_heads=4),
    "llama": {},
    "qwen3": dict(qk_norm=True, head_dim=24),         # dqkv in d.fch and d.wide
    "post-sinusoidal": dict(block="post", position="sinusoidal", norm="layernorm",
                            mlp="relu", bias=True),
    "parallel-alibi": dict(block="parallel", position="alibi", num_kv_heads=1),
    "window-interleaved": dict(sliding_window=5, rope_interleaved=True),
    # FF and (NH + 2 NKV) hs < C: the gradient buffers wide and fch widen to C
    "narrow": dict(ffn_hidden=16, mlp="gelu", position="alibi", num_kv_heads=1, head_dim=8),
}
DROPOUT = Dropout(embedding=0.1, attention=0.2, residual=0.15, seed=2024, row0=3)


@pytest.mark.parametrize("B,T", [(3, 13), (2, 32)])
@pytest.mark.parametrize("name", CONFIGS)
def test_dropout_model_matches_torch(name, B, T):
    config = dataclasses.replace(BASE, **CONFIGS[name])
    model = make_model(config, seed=B * 100 + T)
    x, y = make_batch(config, B, T, seed=T)
    check_against_reference(model, x, y, dropout=DROPOUT)


def pass_result(model, x, y, dropout, **kwargs):
    model.zero_grad()
    loss = model.forward_backward(x, y, dropout=dropout, **kwargs)
    return {"loss": np.float64(loss), "grads": model.grads.memory.copy()}


def assert_same(a, b):
    for name in a:
        assert np.array_equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def trained():
    config = dataclasses.replace(BASE, **CONFIGS["gpt2-like"])
    model = make_model(config, seed=5)
    return model, *make_batch(config, 4, 24, seed=1)


def test_dropout_with_every_p_0_is_no_dropout_bitwise(trained):
    model, x, y = trained
    assert_same(pass_result(model, x, y, Dropout(seed=77, row0=9)),
                pass_result(model, x, y, None))


def test_dropout_same_seed_same_bits_and_each_site_drops(trained):
    model, x, y = trained
    first = pass_result(model, x, y, DROPOUT)
    assert_same(first, pass_result(model, x, y, DROPOUT))
    plain = pass_result(model, x, y, None)
    for other in (dataclasses.replace(DROPOUT, seed=2025), Dropout(embedding=0.1),
                  Dropout(attention=0.1), Dropout(residual=0.1)):
        assert pass_result(model, x, y, other)["loss"] != plain["loss"], other
    assert first["loss"] != pass_result(model, x, y, dataclasses.replace(DROPOUT, seed=1))["loss"]


def test_dropout_forward_backward_equals_forward_then_backward(trained):
    model, x, y = trained
    model.zero_grad()
    loss = model.forward(x, y, dropout=DROPOUT)
    model.backward()
    assert_same({"loss": np.float64(loss), "grads": model.grads.memory.copy()},
                pass_result(model, x, y, DROPOUT))


def test_dropout_model_thread_invariant(trained, set_threads):
    model, x, y = trained
    assert_thread_invariant(set_threads, lambda: pass_result(model, x, y, DROPOUT),
                            counts=(1, 2))


def test_dropout_split_batch_takes_the_whole_batchs_masks(trained):
    # rows 2, 3 as their own batch with row0 = 2 (another rank's rows, or
    # another micro-batch's) drop as they do inside the whole batch
    model, x, y = trained
    model.forward(x, y, dropout=DROPOUT)
    whole = model.acts.losses.copy()
    model.forward(x[2:], y[2:], dropout=dataclasses.replace(DROPOUT, row0=DROPOUT.row0 + 2))
    np.testing.assert_allclose(model.acts.losses, whole[2:], rtol=1e-6)
    model.forward(x[2:], y[2:], dropout=DROPOUT)   # rows 0, 1's masks: not the same
    assert not np.allclose(model.acts.losses, whole[2:], rtol=1e-5)


def test_dropout_must_be_a_dropout(trained):
    model, x, y = trained
    with pytest.raises(TypeError, match="llmc_py.Dropout"):
        model.forward_backward(x, y, dropout=0.1)


def test_evaluation_and_decoding_never_drop(trained):
    model, x, y = trained
    plain = model.forward(x, y)
    logits = model.logits.copy()
    greedy = model.generate(x[:1, :5].tolist(), 6, temperature=0)
    model.forward_backward(x, y, dropout=DROPOUT)   # a training pass between
    assert model.forward(x, y) == plain and np.array_equal(model.logits, logits)
    assert model.forward(x, y, keep_logits=False) == plain
    assert model.generate(x[:1, :5].tolist(), 6, temperature=0) == greedy


def test_dropout_in_bf16_runs_near_fp32(trained):
    model, x, y = trained
    bf16 = type(model)(model.config, params=model.params.memory.copy(), precision="bf16")
    ours = pass_result(bf16, x, y, DROPOUT)
    want = pass_result(model, x, y, DROPOUT)
    assert abs(ours["loss"] - want["loss"]) <= 2e-2 * abs(want["loss"])
    assert np.isfinite(ours["grads"]).all()
    assert_same(ours, pass_result(bf16, x, y, DROPOUT))
