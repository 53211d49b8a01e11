"""The Llama family against the PyTorch reference in model_reference.py:
logits, loss, every parameter gradient and AdamW steps, for each choice of
norm, position, MLP, kv heads, bias and head; length extrapolation; the
model file. Tolerances are test_gpt2_step.py's (stated there)."""
import dataclasses

import numpy as np
import pytest

from llmc_py import GPT2, GPT2Config, Llama, LlamaConfig, load_model
from llmc_py.config import MODEL_FIELDS
from llmc_py.errors import CheckpointError, ShapeError
from llmc_py.io.files import CHECKSUM_MARKER_SLOT
from helpers import assert_thread_invariant
from test_gpt2_step import check_adamw_steps, check_against_reference, make_batch

# the model file's int32 header slot of each field
SLOT = {name: f.slot.index for name, f in MODEL_FIELDS.items() if f.slot and f.type is not float}

BASE = LlamaConfig(max_seq_len=32, vocab_size=67, padded_vocab_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, channels=64)   # hs 16, FF 192 (Llama rule)

CONFIGS = {   # id: the choices, over BASE
    "llama": {},                                                # rmsnorm rope swiglu GQA
    "mqa-untied-bias": dict(num_kv_heads=1, tied_embeddings=False, bias=True),
    "mha-theta": dict(num_kv_heads=4, rope_theta=500000.0, ffn_hidden=100),
    # BLOOM-style: ALiBi with 6 heads (not a power of two), hs = 15
    "alibi-layernorm-gelu": dict(position="alibi", norm="layernorm", mlp="gelu", bias=True,
                                 num_heads=6, num_kv_heads=3, channels=90),
    "alibi-rmsnorm-swiglu": dict(position="alibi", num_heads=4, num_kv_heads=1),
    "learned-rmsnorm": dict(position="learned", ffn_hidden=96),
    # Qwen3-style: q and k heads RMS-normed before RoPE, hs = 24 (NH hs = 96 != C)
    "qwen3": dict(qk_norm=True, head_dim=24, rope_theta=1e6, norm_eps=1e-6),
    "qknorm-alibi-untied": dict(qk_norm=True, position="alibi", head_dim=10,
                                tied_embeddings=False),
    # scaled RoPE for longer contexts; llama3's blend spans hs = 16's wavelengths at 16
    "rope-llama3": dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max=16,
                        rope_theta=500000.0),
    "rope-linear": dict(rope_scaling="linear", rope_factor=4.0),
    "rope-ntk": dict(rope_scaling="ntk", rope_factor=4.0, num_kv_heads=1),
    # the other MLPs: plain ReLU and exact GELU, gated GeGLU and ReGLU (the
    # last with Llama's hidden-size rule, ffn_hidden 0 applying it anew:
    # 2/3 of 4C = 170, x1.3 = 221, up to a multiple of 48: 240)
    "relu-layernorm-bias": dict(mlp="relu", norm="layernorm", bias=True),
    "gelu_erf-learned": dict(mlp="gelu_erf", position="learned", ffn_hidden=100),
    "geglu": dict(mlp="geglu"),
    "reglu-alibi-ffn-rule": dict(mlp="reglu", position="alibi", ffn_hidden=0,
                                 ffn_multiple_of=48, ffn_dim_multiplier=1.3),
    # the norms' places: post-norm as the original Transformer (layernorm,
    # learned positions) and with RoPE and qk_norm; the parallel block as
    # GPT-J (one layernorm, RoPE, GELU, biases) and with ALiBi
    "post-layernorm-learned": dict(block="post", norm="layernorm", position="learned",
                                   mlp="gelu", bias=True),
    "post-rope-qknorm": dict(block="post", qk_norm=True),
    "parallel-gptj": dict(block="parallel", norm="layernorm", mlp="gelu", bias=True),
    "parallel-alibi": dict(block="parallel", position="alibi", num_kv_heads=1),
    # sinusoidal positions: in the original Transformer (post-norm layernorm,
    # ReLU, biases) and in a Llama-style block with hs 15
    "sinusoidal-original": dict(position="sinusoidal", block="post", norm="layernorm",
                                mlp="relu", bias=True),
    "sinusoidal-hs15": dict(position="sinusoidal", channels=60),
    # Meta's interleaved RoPE pairs, also with qk_norm and a scaled RoPE
    "rope-interleaved": dict(rope_interleaved=True),
    "rope-interleaved-qknorm-linear": dict(rope_interleaved=True, qk_norm=True,
                                           rope_scaling="linear", rope_factor=2.0),
    # Mistral's sliding window (T = 13 and 32 run past it), also with ALiBi,
    # multi-query and post-norm
    "sliding-window": dict(sliding_window=5),
    "sliding-window-alibi-mqa-post": dict(sliding_window=3, position="alibi", num_kv_heads=1,
                                          block="post"),
}


def make_model(config, seed):
    """A GPT-2-initialised model whose norm weights and biases are also
    randomised, so that every parameter shapes the result."""
    model = Llama(config, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for name in model.params.names:
        if name in model.matrix_params:
            continue
        view = model.params[name]
        noise = rng.standard_normal(view.shape).astype(np.float32)
        view[...] += (0.1 if name.endswith("w") else 0.02) * noise
    return model


@pytest.mark.parametrize("B,T", [(3, 13), (1, 1), (2, 32)])
@pytest.mark.parametrize("name", CONFIGS)
def test_llama_matches_torch(name, B, T):
    config = dataclasses.replace(BASE, **CONFIGS[name])
    model = make_model(config, seed=B * 100 + T)
    x, y = make_batch(config, B, T, seed=T)
    _, p = check_against_reference(model, x, y)
    if (B, T) == (3, 13):
        check_adamw_steps(model, p, x, y, steps=10)


def test_llama_at_realistic_width_matches_torch():
    """Llama-shaped heads: C=512, 8 query heads of 64 over 2 kv heads, T=64."""
    config = LlamaConfig(max_seq_len=64, vocab_size=300, padded_vocab_size=384, num_layers=2,
                         num_heads=8, num_kv_heads=2, channels=512)
    model = make_model(config, seed=5)
    x, y = make_batch(config, 2, 64, seed=5)
    check_against_reference(model, x, y)


def test_gpt2_choices_reproduce_gpt2():
    """Layernorm, learned positions, GELU, biases, tied head and NKV = NH give
    GPT-2's layout, and the same loss, logits and gradients."""
    g = GPT2Config(max_seq_len=32, vocab_size=67, padded_vocab_size=128, num_layers=2,
                   num_heads=4, channels=60)
    config = LlamaConfig(max_seq_len=32, vocab_size=67, padded_vocab_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=4, channels=60, norm="layernorm",
                         position="learned", mlp="gelu", bias=True, tied_embeddings=True)
    gpt2 = GPT2(g, seed=3)
    llama = Llama(config, params=gpt2.params.memory)
    assert llama.params.names == gpt2.params.names
    x, y = make_batch(g, 2, 20, seed=1)
    logits = {}
    for model in (gpt2, llama):
        model.zero_grad()
        model.forward(x, y)
        logits[model] = model.logits.copy()   # backward overwrites them
        model.backward()
    assert abs(llama.mean_loss - gpt2.mean_loss) <= 1e-6 * abs(gpt2.mean_loss)
    np.testing.assert_allclose(logits[llama], logits[gpt2], rtol=0, atol=1e-5)
    scale = np.abs(gpt2.grads.memory).max()
    np.testing.assert_allclose(llama.grads.memory, gpt2.grads.memory, rtol=0,
                               atol=1e-5 * scale)


@pytest.mark.parametrize("position", ["rope", "alibi", "sinusoidal"])
def test_rope_alibi_and_sinusoidal_extrapolate_past_max_seq_len(position):
    config = dataclasses.replace(BASE, position=position, max_seq_len=16)
    model = make_model(config, seed=2)
    x, y = make_batch(config, 2, 40, seed=2)   # 2.5x the trained length
    check_against_reference(model, x, y)


def test_learned_positions_refuse_past_max_seq_len():
    config = dataclasses.replace(BASE, position="learned", max_seq_len=16)
    model = Llama(config)
    x, _ = make_batch(config, 1, 17, seed=2)
    with pytest.raises(ShapeError, match="T=17 exceeds the model's max_seq_len=16"):
        model.forward(x)


@pytest.mark.parametrize("name", CONFIGS)
def test_model_file_round_trip_is_exact(tmp_path, name):
    config = dataclasses.replace(BASE, **CONFIGS[name])
    model = make_model(config, seed=4)
    first = tmp_path / "a.bin"
    model.save_checkpoint(first)
    loaded = load_model(first)
    assert isinstance(loaded, Llama) and loaded.config == config
    assert np.array_equal(loaded.params.memory, model.params.memory)
    second = tmp_path / "b.bin"
    loaded.save_checkpoint(second)
    assert first.read_bytes() == second.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin"]


def test_load_model_tells_gpt2_from_llama(tmp_path):
    path = tmp_path / "gpt2.bin"
    GPT2(GPT2Config(max_seq_len=8, vocab_size=10, padded_vocab_size=16, num_layers=1,
                    num_heads=2, channels=8)).save_checkpoint(path)
    assert type(load_model(path)) is GPT2
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x01" * 4096)
    with pytest.raises(CheckpointError, match="not a model file"):
        load_model(junk)


def _corrupt(path, slot, value, floats=False):
    data = bytearray(path.read_bytes())
    offset = (1024 if floats else 0) + 4 * slot
    data[offset:offset + 4] = np.array([value], dtype="<f4" if floats else "<i4").tobytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("field,slot,value,message", [
    ("num_kv_heads", SLOT["num_kv_heads"], 3, "not divisible by num_kv_heads=3"),
    ("num_kv_heads", SLOT["num_kv_heads"], 0, "num_kv_heads is 0"),
    ("ffn_hidden", SLOT["ffn_hidden"], -5, "ffn_hidden is -5"),
    ("norm", SLOT["norm"], 7, "norm is 7, expected one of"),
    ("position", SLOT["position"], -1, "position is -1"),
    ("position", SLOT["position"], 4, r"position is 4, expected one of "
                                                       r"0 \(learned\), 1 \(rope\), "
                                                       r"2 \(alibi\), 3 \(sinusoidal\)"),
    ("block", SLOT["block"], 3, r"block is 3, expected one of 0 \(pre\), "
                                                 r"1 \(post\), 2 \(parallel\)"),
    ("bias", SLOT["bias"], 2, "bias is 2, expected 0 or 1"),
    ("vocab_size", SLOT["vocab_size"], 1000, "padded_vocab_size=128 is smaller"),
    ("channels", SLOT["channels"], 128, "file size"),   # a consistent header,
                                                                     # a file that disagrees
    ("head_dim", 15, -3, "head_dim is -3"),
    ("qk_norm", SLOT["qk_norm"], 5, "qk_norm is 5, expected 0 or 1"),
    ("rope_scaling", 24, 9, "rope_scaling is 9, expected one of"),
    ("rope_original_max", 25, 0, None),   # llama3 without its context: below
    ("sliding_window", 19, -2, "sliding_window must be an int >= 0"),
    ("rope_interleaved", SLOT["rope_interleaved"], 3,
     "rope_interleaved is 3, expected 0 or 1"),
])
def test_model_file_header_is_validated(tmp_path, field, slot, value, message):
    path = tmp_path / "m.bin"
    config = BASE
    if message is None:
        config = dataclasses.replace(BASE, rope_scaling="llama3", rope_factor=8.0,
                                     rope_original_max=16)
        message = "llama3 RoPE scaling needs rope_original_max > 0"
    Llama(config).save_checkpoint(path)
    _corrupt(path, slot, value)
    with pytest.raises(CheckpointError, match=message):
        load_model(path)


@pytest.mark.parametrize("name,value", [("rope_theta", 0.0), ("rope_theta", float("nan")),
                                        ("norm_eps", -1e-5), ("norm_eps", float("inf"))])
def test_model_file_float_header_is_validated(tmp_path, name, value):
    path = tmp_path / "m.bin"
    Llama(BASE).save_checkpoint(path)
    _corrupt(path, {"rope_theta": 0, "norm_eps": 1}[name], value, floats=True)
    with pytest.raises(CheckpointError, match=f"{name} must be a positive finite number"):
        load_model(path)


def test_a_changed_header_field_fails_the_checksum(tmp_path):
    """A change the header's checks cannot see (interleaved RoPE pairs, another
    RoPE base) would load another model: the checksum covers the header."""
    path = tmp_path / "m.bin"
    Llama(BASE).save_checkpoint(path)
    pristine = path.read_bytes()
    for slot, value, floats in ((SLOT["rope_interleaved"], 1, False), (0, 20000.0, True)):
        path.write_bytes(pristine)
        _corrupt(path, slot, value, floats)
        with pytest.raises(CheckpointError, match=r"m\.bin: checksum does not match"):
            load_model(path)


def test_no_field_uses_the_checksum_slots():
    assert all(f.slot.index < CHECKSUM_MARKER_SLOT for f in MODEL_FIELDS.values() if f.slot)


def test_truncated_model_file_is_refused(tmp_path):
    path = tmp_path / "m.bin"
    Llama(BASE).save_checkpoint(path)
    for size in (100, 1500, path.stat().st_size - 4):
        path.write_bytes(path.read_bytes()[:size])
        with pytest.raises(CheckpointError, match=str(path)):
            load_model(path)


def test_ffn_hidden_follows_llama_rule():
    # the defaults keep the sizes of files from before the rule had its fields
    assert BASE.ffn_hidden == 192 and BASE.fc_channels == 384
    assert dataclasses.replace(BASE, mlp="reglu", ffn_hidden=0).ffn_hidden == 192
    assert dataclasses.replace(BASE, **CONFIGS["reglu-alibi-ffn-rule"]).ffn_hidden == 240
    assert dataclasses.replace(BASE, mlp="geglu", ffn_hidden=0).fc_channels == 384
    for mlp in ("gelu", "relu", "gelu_erf"):   # not gated: 4C, one matrix of FF rows
        config = dataclasses.replace(BASE, mlp=mlp, ffn_hidden=0, ffn_multiple_of=48)
        assert (config.ffn_hidden, config.fc_channels) == (256, 256)
    # Llama 3 8B's own numbers: C 4096, multiplier 1.3, multiple_of 1024 -> 14336
    assert LlamaConfig(channels=4096, num_heads=32, num_kv_heads=8, ffn_multiple_of=1024,
                       ffn_dim_multiplier=1.3).ffn_hidden == 14336
    with pytest.raises(ShapeError, match="ffn_multiple_of must be a positive int"):
        dataclasses.replace(BASE, ffn_multiple_of=0)
    with pytest.raises(ShapeError, match="ffn_dim_multiplier must be a positive finite"):
        dataclasses.replace(BASE, ffn_dim_multiplier=-1.0)


def test_model_file_refuses_an_unknown_mlp_and_reads_old_ffn_slots(tmp_path):
    path = tmp_path / "m.bin"
    Llama(dataclasses.replace(BASE, mlp="geglu")).save_checkpoint(path)
    assert load_model(path).config.mlp == "geglu"
    _corrupt(path, SLOT["mlp"], 6)
    with pytest.raises(CheckpointError, match=r"mlp is 6, expected one of 0 \(gelu\), "
                                              r"1 \(swiglu\), 2 \(relu\), 3 \(gelu_erf\), "
                                              r"4 \(geglu\), 5 \(reglu\)"):
        load_model(path)
    # a file from before the rule's slots (and before checksums) holds 0 in
    # them: read as 32 and 1
    Llama(BASE).save_checkpoint(path)
    _corrupt(path, CHECKSUM_MARKER_SLOT, 0)
    _corrupt(path, 17, 0)
    _corrupt(path, 8, 0.0, floats=True)
    assert load_model(path).config == BASE
    _corrupt(path, 17, -4)
    with pytest.raises(CheckpointError, match="ffn_multiple_of must be a positive int"):
        load_model(path)


def test_block_layouts():
    """The parallel block has no second norm; post-norm keeps ln2, the layer's
    output, for every layer also when recomputing."""
    from llmc_py.model.layout import act_specs, param_specs
    parallel = dataclasses.replace(BASE, block="parallel", norm="layernorm")
    names = [name for name, _ in param_specs(parallel)]
    assert "ln2w" not in names and "ln2b" not in names and "ln1b" in names
    assert "ln2" not in dict(act_specs(parallel)) and "ln2_rstd" not in dict(act_specs(parallel))
    post = dataclasses.replace(BASE, block="post")
    specs = dict(act_specs(post, recompute=True))
    assert specs["ln2"](post, 2, 3)[0] == post.num_layers and specs["ln1"](post, 2, 3)[0] == 1
    with pytest.raises(ShapeError, match="block must be one of"):
        dataclasses.replace(BASE, block="sandwich")
    with pytest.raises(ShapeError, match="pre-norm blocks"):
        GPT2Config(num_layers=1, channels=8, num_heads=2, block="post")


def test_config_rejects_impossible_choices():
    with pytest.raises(ShapeError, match="num_heads=4 is not divisible by num_kv_heads=3"):
        dataclasses.replace(BASE, num_kv_heads=3)
    with pytest.raises(ShapeError, match="even head size"):
        dataclasses.replace(BASE, channels=60)              # hs 15 with RoPE
    with pytest.raises(ShapeError, match="norm must be one of"):
        dataclasses.replace(BASE, norm="batchnorm")
    assert dataclasses.replace(BASE, channels=60, position="alibi").head_size == 15
    with pytest.raises(ShapeError, match="sliding_window must be an int >= 0"):
        dataclasses.replace(BASE, sliding_window=-1)
    with pytest.raises(ShapeError, match="rope_interleaved is a RoPE layout"):
        dataclasses.replace(BASE, position="alibi", rope_interleaved=True)


@pytest.mark.parametrize("scheme", ["gpt2", "xavier_normal", "xavier_uniform"])
def test_initialisation_schemes(scheme):
    """Each matrix's spread is its scheme's; norm weights 1, biases 0; the
    constructor's draw is initialize(seed) with GPT-2's scheme, bitwise."""
    config = dataclasses.replace(BASE, bias=True, num_layers=3, channels=256, num_heads=4)
    model = Llama(config, seed=4)
    again = Llama(config, seed=9)
    again.initialize(4)
    assert np.array_equal(again.params.memory, model.params.memory)
    model.initialize(5, scheme, std=0.05)
    for name in model.matrix_params:
        w = model.params[name]
        rows = w[:config.V] if name == "wte" else w
        fan_out, fan_in = w.shape[-2:]
        expected = {"gpt2": 0.05 / (np.sqrt(2 * 3) if name in ("attprojw", "fcprojw") else 1),
                    "xavier_normal": np.sqrt(2 / (fan_in + fan_out)),
                    "xavier_uniform": np.sqrt(6 / (fan_in + fan_out)) / np.sqrt(3)}[scheme]
        assert abs(rows.std() / expected - 1) < 0.05, (name, rows.std(), expected)
        if scheme == "xavier_uniform":
            assert np.abs(rows).max() <= expected * np.sqrt(3)
    assert np.all(model.params.ln1w == 1) and np.all(model.params.qkvb == 0)
    assert np.all(model.params.wte[config.V:] == 0)
    with pytest.raises(ValueError, match="scheme is 'he'"):
        model.initialize(0, "he")


@pytest.mark.parametrize("name", ["relu-layernorm-bias", "gelu_erf-learned", "geglu",
                                  "post-rope-qknorm", "parallel-gptj", "sinusoidal-original",
                                  "sliding-window-alibi-mqa-post",
                                  "rope-interleaved-qknorm-linear"])
def test_new_variants_do_not_depend_on_thread_count(set_threads, name):
    """Loss and every gradient bitwise equal on 1, 2 and 3 threads."""
    config = dataclasses.replace(BASE, **CONFIGS[name])
    model = make_model(config, seed=8)
    x, y = make_batch(config, 3, 13, seed=8)

    def run():
        model.zero_grad()
        loss = model.forward(x, y)
        model.backward()
        return {"loss": np.array([loss]), "grads": model.grads.memory.copy()}
    assert_thread_invariant(set_threads, run)
