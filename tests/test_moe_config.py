"""Mixture of experts in the config, the parameter layout, our model file,
Hugging Face's config.json and tensors (against transformers' own tiny
Mixtral and Qwen3-MoE), memory_plan and summary (the hub configs' total and
active parameters). The MoE forward itself is not wired into the block yet:
building such a model is refused with one line saying so."""
import json
import math

import numpy as np
import pytest

from llmc_py import CheckpointError, ShapeError, UnsupportedError, UsageError, load_model
from llmc_py import summary
from llmc_py.config import LlamaConfig
from llmc_py.io.hf import hf_config, hf_names, hf_tensors, read_hf, read_hf_config, write_hf
from llmc_py.io.model_file import read_llama, write_llama
from llmc_py.model.layout import frozen_bf16_parameters, num_parameters, param_specs
from llmc_py.model.planning import memory_plan
from llmc_py.model.presets import config_from_depth
from llmc_py.model.transformer import Transformer

TINY = dict(vocab_size=100, padded_vocab_size=128, max_seq_len=32, num_layers=4, channels=32,
            num_heads=4, num_kv_heads=2)
MOE = dict(num_experts=3, experts_per_token=2, expert_hidden=24)


def moe_config(**changes):
    return LlamaConfig(**TINY | MOE | changes)


def random_params(config, seed=0):
    return np.random.default_rng(seed).standard_normal(num_parameters(config)).astype(np.float32)


# ---- the config ----------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    (dict(experts_per_token=4), "experts_per_token=4 is more than num_experts=3"),
    (dict(num_experts=0), "num_experts is 0 (one dense MLP per layer), but "
                          "experts_per_token=2"),
    (dict(experts_per_token=0), "experts_per_token must be >= 1 with num_experts=3, got 0"),
    (dict(expert_hidden=0), "expert_hidden must be >= 1 with num_experts=3, got 0"),
    (dict(num_experts=-1), "num_experts must be an int >= 0, got -1"),
    (dict(router_aux_loss=-0.01), "router_aux_loss is a loss coefficient: it must be a "
                                  "finite number >= 0, got -0.01"),
    (dict(router_aux_loss=float("nan")), "router_aux_loss is a loss coefficient: it must be "
                                         "a finite number >= 0, got nan"),
    (dict(router_z_loss=-1.0), "router_z_loss is a loss coefficient: it must be a finite "
                               "number >= 0, got -1"),
    (dict(router_z_loss=float("inf")), "router_z_loss is a loss coefficient"),
    (dict(moe_every=5), "moe_every=5 must be in 1..num_layers=4"),
    (dict(moe_every=0), "moe_every=0 must be in 1..num_layers=4"),
    (dict(bias=True), "a bias=True model cannot have num_experts=3"),
])
def test_a_bad_moe_field_is_one_error_naming_it_and_its_value(changes, message):
    with pytest.raises(ShapeError) as e:
        moe_config(**changes)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_dense_model_refuses_moe_settings_without_experts():
    for name, value in (("expert_hidden", 8), ("router_aux_loss", 0.01), ("moe_every", 2),
                        ("norm_topk_prob", False), ("router_z_loss", 0.001)):
        with pytest.raises(ShapeError, match=f"num_experts is 0 .* {name}="):
            LlamaConfig(**TINY, **{name: value})
    assert not LlamaConfig(**TINY).moe_layers


def test_bad_moe_flags_fail_before_any_model_is_built(monkeypatch):
    from llmc_py.model import layout
    from llmc_py.train.cli import parse

    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before the config was checked")
    monkeypatch.setattr(layout, "aligned_zeros", no_allocation)
    monkeypatch.setattr(layout, "aligned_empty", no_allocation)
    family = dict(arch="llama", experts=2, experts_per_token=3, expert_hidden=8)
    with pytest.raises(UsageError, match=r"^-e d2 --arch llama: LlamaConfig.experts_per_token=3 "
                                         r"is more than num_experts=2$"):
        config_from_depth("d2", family=family)
    with pytest.raises(UsageError, match="^--router-aux-loss must be >= 0, got nan$"):
        parse(["--arch", "llama", "--router-aux-loss", "nan"]).check()
    with pytest.raises(UsageError, match="^--moe-every must be positive, got 0$"):
        parse(["--arch", "llama", "--moe-every", "0"]).check()


def test_the_flags_make_the_config():
    c = config_from_depth("d4", family=dict(arch="llama", experts=8, experts_per_token=2,
                                            expert_hidden=64, moe_every=2,
                                            router_aux_loss=0.01, router_z_loss=0.001,
                                            norm_topk_prob=0))
    assert (c.num_experts, c.experts_per_token, c.expert_hidden, c.moe_every) == (8, 2, 64, 2)
    assert (c.router_aux_loss, c.router_z_loss, c.norm_topk_prob) == \
        (np.float32(0.01), np.float32(0.001), False)
    assert tuple(c.moe_layers) == (1, 3) and c.dense_mlp_layers == (0, 2)


def test_qwen3_moes_layer_rule():
    # transformers' Qwen3MoeDecoderLayer: MoE when (l + 1) % decoder_sparse_step == 0
    assert tuple(moe_config(num_layers=7, moe_every=3).moe_layers) == (2, 5)
    assert moe_config(num_layers=7, moe_every=3).dense_mlp_layers == (0, 1, 3, 4, 6)
    assert tuple(moe_config(moe_every=1).moe_layers) == (0, 1, 2, 3)
    assert moe_config(moe_every=1).dense_mlp_layers == ()


def test_with_experts_in_every_layer_ffn_hidden_is_the_experts():
    # no dense MLP is left: one way to say it, so a round trip gives the same config
    assert moe_config(ffn_hidden=96).ffn_hidden == 24
    assert moe_config(ffn_hidden=96, moe_every=2).ffn_hidden == 96


# ---- the layout and our model file ---------------------------------------------

@pytest.mark.parametrize("mlp, fc", [("swiglu", 2 * 24), ("gelu", 24)])
def test_the_parameter_layout_of_moe_and_dense_layers(mlp, fc):
    c = moe_config(moe_every=2, mlp=mlp, ffn_hidden=40)
    shapes = {name: tuple(fn(c)) for name, fn in param_specs(c)}
    dense_fc = 80 if mlp == "swiglu" else 40
    assert shapes["fcw"] == (2, dense_fc, 32) and shapes["fcprojw"] == (2, 32, 40)
    assert shapes["routerw"] == (2, 3, 32)
    assert shapes["expertfcw"] == (2, 3, fc, 32)
    assert shapes["expertprojw"] == (2, 3, 32, 24)
    assert shapes["ln2w"] == (4, 32) and shapes["qkvw"][0] == 4
    # every layer MoE: no dense slots at all
    names = [name for name, _ in param_specs(moe_config())]
    assert "fcw" not in names and "fcprojw" not in names
    # the experts and the router are matmul weights: a frozen bf16 base holds them in bf16
    assert frozen_bf16_parameters(c) - frozen_bf16_parameters(
        LlamaConfig(**TINY, ffn_hidden=40, mlp=mlp)) == 2 * (3 * 32 + 3 * (fc + 24) * 32) \
        - 2 * (dense_fc + 40) * 32


def test_dense_layouts_are_unchanged():
    c = LlamaConfig(**TINY)
    shapes = {name: tuple(fn(c)) for name, fn in param_specs(c)}
    assert shapes["fcw"] == (4, c.fc_channels, 32) and shapes["fcprojw"] == (4, 32, c.FF)
    assert not {"routerw", "expertfcw", "expertprojw"} & set(shapes)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_our_model_file_carries_the_experts(tmp_path, dtype):
    c = moe_config(moe_every=2, ffn_hidden=40, norm_topk_prob=False, router_aux_loss=0.01,
                   router_z_loss=0.001)
    params = random_params(c)
    write_llama(tmp_path / "moe.bin", c, params, dtype)
    config, read = read_llama(tmp_path / "moe.bin")
    assert config == c
    if dtype == "fp32":
        assert np.array_equal(read, params)
    else:
        assert np.abs(read - params).max() <= 2 ** -8 * np.abs(params).max()
    # a dense model file reads as before: no experts
    write_llama(tmp_path / "dense.bin", LlamaConfig(**TINY), random_params(LlamaConfig(**TINY)))
    assert read_llama(tmp_path / "dense.bin")[0].num_experts == 0


def test_a_model_file_whose_expert_fields_are_wrong_is_named(tmp_path):
    c = moe_config()
    write_llama(tmp_path / "moe.bin", c, random_params(c))
    raw = bytearray((tmp_path / "moe.bin").read_bytes())
    raw[22 * 4:23 * 4] = np.int32(5).tobytes()   # experts_per_token 5 of 3
    (tmp_path / "bad.bin").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"bad.bin: LlamaConfig.experts_per_token=5 is "
                                              r"more than num_experts=3"):
        read_llama(tmp_path / "bad.bin")


def test_a_model_file_with_experts_loads_and_runs(tmp_path):
    c = moe_config()
    params = random_params(c)
    write_llama(tmp_path / "moe.bin", c, params)
    model = load_model(tmp_path / "moe.bin")
    tokens = np.arange(12).reshape(2, 6) % c.vocab_size
    assert np.isfinite(model.forward(tokens, tokens))
    again = Transformer(c, params=params)
    again.forward(tokens, tokens)
    assert np.array_equal(model.logits, again.logits)


# ---- memory_plan -----------------------------------------------------------------

@pytest.mark.parametrize("recompute", [False, True])
def test_memory_plan_counts_the_routed_rows(recompute):
    """Each routed row (k per token) of each MoE layer keeps its expert's first
    projection, activation (one layer's with recompute) and output, and its
    expert index and weight; one layer's gathered inputs; backward holds
    two such rows' worth and the router's gradient."""
    B, T, C, EH, Lm = 2, 8, 32, 24, 2
    plans = {k: memory_plan(moe_config(moe_every=2, ffn_hidden=40, experts_per_token=k), B, T,
                            recompute=recompute) for k in (1, 2)}
    per_row = Lm * (2 + 2 * EH + C) + (1 if recompute else Lm) * EH + C
    assert plans[2]["activations"] - plans[1]["activations"] == 4 * B * T * per_row
    assert plans[2]["activation gradients"] - plans[1]["activation gradients"] == \
        4 * B * T * (2 * EH + C)
    assert plans[2]["parameters"] == plans[1]["parameters"] == \
        4 * num_parameters(moe_config(moe_every=2, ffn_hidden=40))


# ---- Hugging Face --------------------------------------------------------------

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
COMMON = dict(vocab_size=100, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
HF_MODELS = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=24, num_hidden_layers=2, num_local_experts=3, num_experts_per_tok=2,
        tie_word_embeddings=False, **COMMON)),
    # dense layers 0 and 2 between MoE layers 1 and 3 (decoder_sparse_step 2)
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=4, num_experts=3,
        num_experts_per_tok=2, decoder_sparse_step=2, head_dim=16, norm_topk_prob=True,
        tie_word_embeddings=True, **COMMON)),
}


@pytest.fixture(scope="module", params=list(HF_MODELS))
def hf_folder(request, tmp_path_factory):
    """(transformers model, its save_pretrained folder)."""
    torch.manual_seed(0)
    model = HF_MODELS[request.param]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


def stored(folder):
    from safetensors.numpy import load_file
    return load_file(folder / "model.safetensors")


def expected_shapes(config):
    """{Hugging Face name: shape} our map expects of a model of ``config``."""
    return {name: tensor.shape for name, tensor in
            hf_tensors(config, np.zeros(num_parameters(config), np.float32)).items()}


def test_save_pretrained_has_exactly_the_tensors_our_map_expects(hf_folder):
    model, folder = hf_folder
    arch, config = read_hf_config(folder)
    assert arch == type(model).__name__
    on_disk = {name: tensor.shape for name, tensor in stored(folder).items()}
    if config.tied_embeddings:
        on_disk.pop("lm_head.weight", None)
    assert expected_shapes(config) == on_disk
    assert sorted(hf_names(config)) == sorted(on_disk)


def test_the_config_as_transformers_has_it(hf_folder):
    model, folder = hf_folder
    _, c = read_hf_config(folder)
    t = model.config
    assert (c.num_experts, c.experts_per_token, c.expert_hidden) == \
        (t.num_local_experts, t.num_experts_per_tok,
         getattr(t, "moe_intermediate_size", t.intermediate_size))
    assert tuple(c.moe_layers) == tuple(l for l, layer in enumerate(model.model.layers)
                                 if hasattr(layer.mlp, "experts"))
    assert c.norm_topk_prob == getattr(t, "norm_topk_prob", True)
    assert c.router_aux_loss == 0.0   # transformers adds it only with output_router_logits


def test_hf_to_ours_to_hf_gives_identical_tensors_and_transformers_loads_it(hf_folder,
                                                                           tmp_path):
    model, folder = hf_folder
    config, params = read_hf(folder)
    write_hf(tmp_path, config, params)
    ours, theirs = stored(tmp_path), stored(folder)
    if config.tied_embeddings:
        theirs.pop("lm_head.weight", None)
    assert ours.keys() == theirs.keys()
    assert all(np.array_equal(ours[n], theirs[n]) for n in ours)
    assert read_hf_config(tmp_path) == read_hf_config(folder)
    loaded = type(model).from_pretrained(tmp_path)
    for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size",
                "moe_intermediate_size", "decoder_sparse_step", "norm_topk_prob",
                "mlp_only_layers", "hidden_size", "num_hidden_layers", "num_key_value_heads",
                "tie_word_embeddings", "sliding_window"):
        assert getattr(loaded.config, key, None) == getattr(model.config, key, None), key
    mine, original = loaded.state_dict(), model.state_dict()
    assert mine.keys() == original.keys()
    assert all(torch.equal(mine[n], original[n]) for n in mine)


def write_config(folder, **fields):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                 num_experts_per_tok=2, vocab_size=100, max_position_embeddings=64)


def test_the_experts_count_by_either_name_and_the_aux_loss_with_router_logits(tmp_path):
    # the hub's config.json says num_experts; transformers 5 writes num_local_experts
    hub = read_hf_config(write_config(tmp_path / "hub", **QWEN3_MOE))[1]
    renamed = dict(QWEN3_MOE, num_local_experts=4)
    del renamed["num_experts"]
    assert read_hf_config(write_config(tmp_path / "t5", **renamed))[1] == hub
    assert hub.num_experts == 4 and hub.norm_topk_prob is False   # Qwen3-MoE's default
    on = read_hf_config(write_config(tmp_path / "on", **QWEN3_MOE, output_router_logits=True,
                                     router_aux_loss_coef=0.02))[1]
    off = read_hf_config(write_config(tmp_path / "off", **QWEN3_MOE, router_aux_loss_coef=0.02))[1]
    # ours is k = 2 times transformers' coefficient (config.router_aux_loss)
    assert on.router_aux_loss == np.float32(0.04) and off.router_aux_loss == 0.0
    written = hf_config(on)
    assert written["output_router_logits"] is True and written["mlp_only_layers"] == []


@pytest.mark.parametrize("fields, error, message", [
    (dict(architectures=["OlmoeForCausalLM"]), UnsupportedError, "QK-norm spans the whole"),
    (dict(architectures=["Qwen2MoeForCausalLM"]), UnsupportedError, "shared expert"),
    (dict(mlp_only_layers=[1]), UnsupportedError, "field mlp_only_layers is [1]"),
    (dict(num_experts=0), CheckpointError, "num_experts is 0"),
    (dict(num_experts_per_tok=5), CheckpointError, "experts_per_token=5 is more than "
                                                   "num_experts=4"),
    (dict(moe_intermediate_size=0), CheckpointError, "expert_hidden must be >= 1"),
    (dict(router_aux_loss_coef=-1.0, output_router_logits=True), CheckpointError,
     "router_aux_loss is a loss coefficient"),
])
def test_what_we_cannot_read_is_named(tmp_path, fields, error, message):
    folder = write_config(tmp_path, **QWEN3_MOE | fields)
    with pytest.raises(error) as e:
        read_hf_config(folder)
    assert message in str(e.value) and "config.json" in str(e.value)


def test_mixtrals_router_noise_is_refused(tmp_path):
    fields = dict(QWEN3_MOE, architectures=["MixtralForCausalLM"], model_type="mixtral",
                  num_local_experts=4, router_jitter_noise=0.1)
    with pytest.raises(UnsupportedError, match="field router_jitter_noise is 0.1"):
        read_hf_config(write_config(tmp_path, **fields))


def test_expert_tensors_of_the_wrong_count_or_shape_are_named(hf_folder, tmp_path):
    from safetensors.numpy import save_file
    _, folder = hf_folder
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    config = read_hf_config(folder)[1]
    layer = config.moe_layers[0]
    expert = next(n for n in stored(folder) if f"layers.{layer}." in n and ".experts.2." in n)
    tensors = stored(folder)
    del tensors[expert]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor {expert} is missing"):
        read_hf(tmp_path)
    tensors = stored(folder)
    tensors[expert.replace(".experts.2.", ".experts.3.")] = tensors[expert]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.3\..* is not part of"):
        read_hf(tmp_path)
    tensors = stored(folder)
    tensors[expert] = tensors[expert][:-1]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor {expert} has shape"):
        read_hf(tmp_path)


def test_export_refuses_experts_no_architecture_holds():
    with pytest.raises(UnsupportedError, match="rmsnorm, rope and swiglu experts"):
        hf_config(moe_config(mlp="gelu"))
    with pytest.raises(UnsupportedError, match="moe_every=2"):
        hf_config(moe_config(moe_every=2))   # no qk_norm: Mixtral, every layer MoE
    assert hf_config(moe_config(moe_every=2, qk_norm=True))["decoder_sparse_step"] == 2
    pytest.importorskip("gguf")
    from llmc_py.io.gguf import write_gguf
    c = moe_config(moe_every=2, qk_norm=True)   # a Qwen3-MoE llama.cpp cannot run
    with pytest.raises(UnsupportedError, match=r"moe_every=2 \(Qwen3-MoE's decoder_sparse_step\)"
                                               r": llama.cpp's qwen3moe architecture"):
        write_gguf("unused.gguf", c, random_params(c))


# ---- summary: the hub configs' own figures ------------------------------------------

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    vocab_size=151936, tie_word_embeddings=False, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
    hidden_act="silu", output_router_logits=False, router_aux_loss_coef=0.001)
MIXTRAL_8X7B = dict(
    architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
    tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-5,
    rope_theta=1e6, hidden_act="silu", sliding_window=None, router_aux_loss_coef=0.02)


@pytest.mark.parametrize("fields, total, active", [
    (QWEN3_30B_A3B, 30.5e9, 3.3e9), (MIXTRAL_8X7B, 46.7e9, 12.9e9)])
def test_summary_gives_the_hub_configs_total_and_active_parameters(tmp_path, capsys, fields,
                                                                   total, active):
    """The published figures, rounded to 0.1B: ours within 0.06B of them (Qwen3's
    3.35B active is published as 3.3B)."""
    folder = write_config(tmp_path / "hub", **fields)
    assert summary.main([str(folder), "-t", "256"]) == 0
    out = capsys.readouterr().out
    config = summary.load_config(folder)
    counts, used = summary.parameter_counts(config), summary.active_parameter_counts(config)
    assert abs(sum(counts.values()) - total) < 0.06e9
    assert abs(sum(used.values()) - active) < 0.06e9
    assert sum(counts.values()) == num_parameters(config)
    E, k, L, C = config.num_experts, config.experts_per_token, config.num_layers, config.C
    expert = 3 * C * config.expert_hidden
    assert counts["experts"] == L * E * expert and used["experts"] == L * k * expert
    assert counts["router"] == used["router"] == L * E * C
    assert used["embeddings"] == counts["embeddings"] and used["head"] == counts["head"]
    line = f"{sum(counts.values()) / 1e9:.2f}B parameters in total, " \
           f"{sum(used.values()) / 1e9:.2f}B active per token ({k} of {E} experts in {L} of {L}"
    assert line in out
    assert "active per token: every parameter but the experts a token is not routed to" in \
        " ".join(out.split())
    assert f"total: {summary.format_bytes(4 * sum(counts.values()))} fp32" in out


def test_summary_help_says_what_active_counts(capsys):
    with pytest.raises(SystemExit):
        summary.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "active per token: every parameter but the experts a token is not routed to" in text
    assert "embeddings" in text and "k of the E experts" in text


def test_a_dense_summary_has_no_expert_rows(capsys):
    assert summary.main(["d2"]) == 0
    out = capsys.readouterr().out
    assert "experts" not in out and "router" not in out and "active" not in out


def test_summary_tensors_of_an_moe_model(capsys, tmp_path):
    folder = write_config(tmp_path / "hub", **MIXTRAL_8X7B)
    assert summary.main([str(folder), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "  expertprojw (32, 8, 4096, 14336)" in out
    assert f"{math.prod((32, 8, 2 * 14336, 4096)):,}" in out


def test_summary_refuses_lora_on_experts(capsys, tmp_path):
    folder = write_config(tmp_path / "hub", **MIXTRAL_8X7B)
    assert summary.main([str(folder), "--lora-rank", "8"]) == 1
    err = capsys.readouterr().err
    assert "LoRA on a mixture of experts is not planned yet" in err and err.count("\n") == 1


def test_convert_both_ways_keeps_every_expert(hf_folder, tmp_path):
    from llmc_py.convert import main as convert
    _, folder = hf_folder
    assert convert([str(folder), str(tmp_path / "moe.bin")]) == 0
    assert convert([str(tmp_path / "moe.bin"), str(tmp_path / "back")]) == 0
    ours, theirs = stored(tmp_path / "back"), stored(folder)
    if read_hf_config(folder)[1].tied_embeddings:
        theirs.pop("lm_head.weight", None)
    assert ours.keys() == theirs.keys()
    assert all(np.array_equal(ours[n], theirs[n]) for n in ours)
