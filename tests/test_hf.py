"""Hugging Face folders (io.hf) against transformers' own models: tiny random
GPT-2, Llama (GQA, untied head) and Qwen3 (qk_norm, head_dim != C / NH, tied)
saved by transformers, loaded here, and compared on logits, loss, every
parameter gradient and greedy generation; our export loaded by transformers;
round trips; and folders that are wrong in every way we could think of.

Tolerances (fp32 on both sides, summing in different orders): logits within
1e-5 of the largest logit (seen: 7e-7), the loss within 1e-6 relative (seen:
1.3e-7), each gradient within 2e-5 of its tensor's largest entry (seen:
1.2e-6). Nothing is downloaded: transformers builds the models from configs
here."""
import dataclasses
import json

import numpy as np
import pytest
import torch

import transformers
from safetensors.numpy import load_file, save_file

import llmc_py
from llmc_py import CheckpointError, UnsupportedError, load_model
from llmc_py.io.hf import hf_tensors, read_hf, write_hf

V = 300
COMMON = dict(vocab_size=V, bos_token_id=None, eos_token_id=None, pad_token_id=None)
MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, **COMMON)),
    "llama-gqa-untied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        rope_theta=500000.0, rms_norm_eps=1e-5, **COMMON)),
    "qwen3-qknorm-tied": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
        tie_word_embeddings=True, rope_theta=1e6, **COMMON)),
    # a sliding window of 7 positions: the 19-token batches and the generation
    # run past it
    "mistral-window": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, sliding_window=7,
        tie_word_embeddings=False, **COMMON)),
}
ARCHS = {"gpt2": "GPT2LMHeadModel", "llama-gqa-untied": "LlamaForCausalLM",
         "qwen3-qknorm-tied": "Qwen3ForCausalLM", "mistral-window": "MistralForCausalLM"}


def make_hf(name, seed=0):
    """A transformers model with every weight jittered (no norm weight is 1,
    no bias 0), in eval mode with eager attention."""
    torch.manual_seed(seed)
    model = MODELS[name]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module", params=list(MODELS))
def saved(request, tmp_path_factory):
    """(name, transformers model, its save_pretrained folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    model = make_hf(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder


def batch(B=2, T=19, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


def rel_to_max(ours, ref):
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def test_logits_loss_and_every_gradient_match_transformers(saved):
    name, hf, folder = saved
    model = load_model(folder)
    assert model.config.vocab_size == V and model.config.padded_vocab_size == 384
    check_logits_and_loss(model, hf)
    ours = hf_tensors(model.config, model.grads.memory)   # our gradients, by HF's names
    ref = {n: p.grad.numpy() for n, p in hf.named_parameters()}
    assert set(ours) == set(ref) - ({"lm_head.weight"} if model.config.tied_embeddings else set())
    for n, grad in ours.items():
        assert rel_to_max(grad, ref[n]) < 2e-5, n


def check_logits_and_loss(model, hf):
    """Our model's and transformers' logits and cross-entropy on a batch
    compared, and both backward from it (into their gradients)."""
    x, y = batch()
    model.zero_grad()
    loss = model.forward(x, y)
    logits = model.logits[..., :V].copy()
    model.backward()

    hf.zero_grad()
    ref_logits = hf(torch.tensor(x)).logits
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.reshape(-1, V),
                                                 torch.tensor(y).reshape(-1))
    ref_loss.backward()
    assert rel_to_max(logits, ref_logits.detach().numpy()) < 1e-5
    assert abs(loss - ref_loss.item()) < 1e-6 * ref_loss.item()


def test_greedy_generation_matches_transformers(saved):
    name, hf, folder = saved
    check_greedy_generation(hf, folder)


def check_greedy_generation(hf, folder):
    model = load_model(folder)
    prompt = [5, 17, 200, 3, 99, 42, 7]
    ours = model.generate(prompt, 20, temperature=0)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                      min_new_tokens=20)[0, len(prompt):].tolist()
    assert ours == ref


def test_export_loads_in_transformers_with_the_same_logits(saved, tmp_path):
    name, _, folder = saved
    check_export(folder, ARCHS[name], tmp_path)


def check_export(folder, arch, tmp_path):
    """Our model of ``folder``, one step trained, saved and loaded by
    transformers as ``arch``: the same logits."""
    model = load_model(folder)
    # train one step, so the export differs from what was imported
    x, y = batch(seed=1)
    model.zero_grad()
    model.forward_backward(x, y)
    model.update(1e-2)
    model.save_pretrained(tmp_path / "out")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["architectures"] == [arch]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                             attn_implementation="eager").eval()
    assert type(back).__name__ == arch
    model.forward(x)
    with torch.no_grad():
        ref = back(torch.tensor(x)).logits.numpy()
    assert rel_to_max(model.logits[..., :V], ref) < 1e-5


def test_hf_to_ours_to_hf_gives_identical_tensors(saved, tmp_path):
    _, _, folder = saved
    config, params = read_hf(folder)
    write_hf(tmp_path, config, params)
    original, again = load_file(folder / "model.safetensors"), \
        load_file(tmp_path / "model.safetensors")
    if config.tied_embeddings:
        original.pop("lm_head.weight", None)
    original = {n: t for n, t in original.items() if not n.endswith((".attn.bias",
                                                                      ".attn.masked_bias"))}
    assert set(again) == set(original)
    for n in original:
        assert again[n].dtype == original[n].dtype and np.array_equal(again[n], original[n]), n


def test_bf16_and_sharded_folders(tmp_path):
    """A bf16 checkpoint in shards: read exactly (bf16 widens to fp32 without
    rounding), written back as bf16 tensor for tensor."""
    hf = make_hf("qwen3-qknorm-tied").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").exists()
    config, params = read_hf(tmp_path / "src")
    expected = {n: p.float().numpy() for n, p in hf.state_dict().items()}
    for n, t in hf_tensors(config, params).items():
        assert np.array_equal(t, expected[n]), n
    write_hf(tmp_path / "dst", config, params, dtype="bf16")
    again = load_file(tmp_path / "dst" / "model.safetensors")
    for n, p in hf.state_dict().items():
        if n != "lm_head.weight":
            assert np.array_equal(again[n].view(np.uint16), p.view(torch.int16).numpy()
                                  .view(np.uint16)), n


def test_safetensors_are_written_from_the_arrays_themselves(tmp_path):
    """write_safetensors: what safetensors reads back, tensor for tensor (any
    shape, float32 and bf16), and no copy of the data in memory while writing."""
    import ml_dtypes
    import tracemalloc
    from safetensors import safe_open
    from llmc_py.io.hf import write_safetensors
    rng = np.random.default_rng(0)
    tensors = {"big": rng.standard_normal((1000, 2500), dtype=np.float32),
               "a.bf16": rng.standard_normal(7, dtype=np.float32).astype(ml_dtypes.bfloat16),
               "empty": np.zeros((0, 3), np.float32), "odd": np.arange(5, dtype=np.float32)}
    path = tmp_path / "x.safetensors"
    tracemalloc.start()
    try:
        write_safetensors(path, tensors, metadata={"format": "pt"})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < tensors["big"].nbytes / 10   # 10 MB written, no copy of it made
    again = load_file(path)
    assert again.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert again[name].dtype == tensor.dtype and np.array_equal(again[name], tensor), name
    with safe_open(str(path), "np") as f:
        assert f.metadata() == {"format": "pt"}


def test_our_model_files_convert_both_ways(saved, tmp_path):
    """HF folder -> our model file (llm.c's for GPT-2) -> HF folder, with
    python -m llmc_py.convert."""
    from llmc_py.convert import main as convert
    _, _, folder = saved
    convert([str(folder), str(tmp_path / "model.bin")])
    convert([str(tmp_path / "model.bin"), str(tmp_path / "back")])
    config, params = read_hf(folder)
    config2, params2 = read_hf(tmp_path / "back")
    assert config2 == config and np.array_equal(params2, params)
    assert load_model(tmp_path / "model.bin").config == config


# ---- folders that are wrong ---------------------------------------------------

@pytest.fixture
def gpt2_folder(tmp_path):
    make_hf("gpt2").save_pretrained(tmp_path)
    return tmp_path


def test_gpt2_folders_in_the_older_layout(gpt2_folder):
    """The hub's gpt2 folder predates the "transformer." prefix and keeps the
    causal-mask buffers attn.bias and attn.masked_bias: the same model."""
    tensors = load_file(gpt2_folder / "model.safetensors")
    old = {n.removeprefix("transformer."): t for n, t in tensors.items()}
    assert len(old) == len(tensors) and "wte.weight" in old
    old["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    old["h.0.attn.masked_bias"] = np.array(-1e4, np.float32)
    folder = gpt2_folder / "older"
    folder.mkdir()
    (folder / "config.json").write_bytes((gpt2_folder / "config.json").read_bytes())
    save_file(old, folder / "model.safetensors")
    config, params = read_hf(folder)
    expected_config, expected = read_hf(gpt2_folder)
    assert config == expected_config and np.array_equal(params, expected)


def edit_config(folder, **changes):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_a_folder_without_config_json(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)


@pytest.mark.parametrize("archs", [["BertModel"], [], "GPT2LMHeadModel", None])
def test_an_unsupported_architecture_is_named(gpt2_folder, archs):
    edit_config(gpt2_folder, architectures=archs)
    with pytest.raises(UnsupportedError, match="field architectures"):
        load_model(gpt2_folder)


def test_a_model_type_other_than_the_architectures_is_named(gpt2_folder):
    edit_config(gpt2_folder, model_type="bert")
    with pytest.raises(UnsupportedError,
                       match="field model_type is 'bert': GPT2LMHeadModel's is 'gpt2'"):
        load_model(gpt2_folder)


def test_gpt2_heads_that_do_not_divide_the_width_are_blamed_on_n_head(gpt2_folder):
    edit_config(gpt2_folder, n_head=5)   # n_embd 64
    with pytest.raises(UnsupportedError, match="field n_head is 5: it must divide n_embd = 64"):
        load_model(gpt2_folder)


@pytest.mark.parametrize("field,value", [
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
    ("use_sliding_window", True),
    ("hidden_act", "gelu"),
    ("attention_bias", True),
])
def test_unsupported_options_are_named(tmp_path, field, value):
    make_hf("qwen3-qknorm-tied").save_pretrained(tmp_path)
    edit_config(tmp_path, **{field: value})
    if field == "rope_scaling":   # transformers 4's field, read when 5's is absent
        edit_config(tmp_path, rope_parameters=None)
    with pytest.raises(UnsupportedError, match=f"field {field.split('_parameters')[0]}"):
        load_model(tmp_path)


def test_a_missing_tensor_is_named(gpt2_folder):
    edit_tensors(gpt2_folder, lambda t: t.pop("transformer.h.1.mlp.c_fc.weight"))
    with pytest.raises(CheckpointError, match=r"tensor transformer\.h\.1\.mlp\.c_fc\.weight "
                                              r"is missing"):
        load_model(gpt2_folder)


def test_a_misshaped_tensor_is_named(gpt2_folder):
    def edit(t):
        t["transformer.h.0.attn.c_attn.weight"] = t["transformer.h.0.attn.c_attn.weight"][:, :-3]
    edit_tensors(gpt2_folder, edit)
    with pytest.raises(CheckpointError, match=r"c_attn\.weight has shape \[64, 189\], "
                                              r"expected \[64, 192\]"):
        load_model(gpt2_folder)


def test_an_unknown_tensor_is_named(gpt2_folder):
    edit_tensors(gpt2_folder, lambda t: t.update(extra=np.zeros(3, np.float32)))
    with pytest.raises(CheckpointError, match="tensor extra is not part of a GPT2LMHeadModel"):
        load_model(gpt2_folder)


def test_a_non_float_tensor_is_named(gpt2_folder):
    edit_tensors(gpt2_folder, lambda t: t.update({"transformer.ln_f.bias": np.zeros(64, np.int32)}))
    with pytest.raises(CheckpointError, match="ln_f.bias has dtype int32"):
        load_model(gpt2_folder)


def header_of(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_with_header(path, header, body):
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + body)


def test_a_header_that_lies_about_offsets(gpt2_folder):
    path = gpt2_folder / "model.safetensors"
    header, body = header_of(path)
    header["transformer.wpe.weight"]["data_offsets"][1] += 4 * 64   # past its neighbour
    write_with_header(path, header, body)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable"):
        load_model(gpt2_folder)


def test_a_shard_index_naming_a_missing_file(tmp_path):
    make_hf("llama-gqa-untied").save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / victim).unlink()
    with pytest.raises(CheckpointError, match=f"lists {victim}, which is missing"):
        load_model(tmp_path)


def test_fuzzed_safetensors_never_crash(gpt2_folder):
    """Random truncations and byte flips in the header and data: the folder
    loads (a flip inside tensor data is still a file) or raises
    CheckpointError naming the file; nothing else."""
    path = gpt2_folder / "model.safetensors"
    pristine = path.read_bytes()
    header_end = 8 + int.from_bytes(pristine[:8], "little")
    rng = np.random.default_rng(0)
    outcomes = {"loaded": 0, "refused": 0}
    for trial in range(60):
        data = bytearray(pristine)
        if trial % 3 == 0:
            data = data[:int(rng.integers(0, len(data)))]
        else:
            for _ in range(int(rng.integers(1, 4))):
                at = int(rng.integers(0, header_end if trial % 3 == 1 else len(data)))
                data[at] = int(rng.integers(0, 256))
        path.write_bytes(bytes(data))
        try:
            load_model(gpt2_folder)
            outcomes["loaded"] += 1
        except (CheckpointError, UnsupportedError) as e:
            assert "model.safetensors" in str(e) or "config.json" in str(e) or "tensor" in str(e)
            outcomes["refused"] += 1
    assert outcomes["refused"] >= 20, outcomes


def test_export_refuses_what_no_architecture_holds(tmp_path):
    config = llmc_py.LlamaConfig(max_seq_len=16, vocab_size=V, padded_vocab_size=384,
                                 num_layers=1, num_heads=4, num_kv_heads=2, channels=32,
                                 position="alibi")
    with pytest.raises(UnsupportedError, match="position='alibi'"):
        llmc_py.Llama(config).save_pretrained(tmp_path)
    for choice, match in (("mlp", "mlp='geglu'"), ("block", "block='post'")):
        other = dataclasses.replace(config, position="rope",
                                    **{choice: match.split("'")[1]})
        with pytest.raises(UnsupportedError, match=match):
            llmc_py.Llama(other).save_pretrained(tmp_path)
    # a sliding window is Mistral's, which has neither ALiBi nor qk_norm
    for choice in (dict(), dict(position="rope", qk_norm=True)):
        windowed = dataclasses.replace(config, sliding_window=4, **choice)
        with pytest.raises(UnsupportedError, match="sliding_window=4 is written as Mistral"):
            llmc_py.Llama(windowed).save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("qk_norm", [False, True])
def test_interleaved_rope_exports_as_the_same_model(tmp_path, qk_norm):
    """A model with Meta's interleaved RoPE is written with its q and k
    rows (and qk_norm weights) in the half-split order: transformers gives
    its logits."""
    config = llmc_py.LlamaConfig(max_seq_len=32, vocab_size=V, padded_vocab_size=384,
                                 num_layers=2, num_heads=4, num_kv_heads=2, channels=64,
                                 rope_interleaved=True, qk_norm=qk_norm)
    model = llmc_py.Llama(config, seed=3)
    rng = np.random.default_rng(3)
    for name in model.params.names:   # norm weights away from 1
        if name.endswith("normw") or name.startswith("ln"):
            model.params[name][...] += 0.1 * rng.standard_normal(model.params[name].shape)
    model.save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = rng.integers(0, V, (2, 19))
    model.forward(x)
    with torch.no_grad():
        ref = hf(torch.tensor(x)).logits.numpy()
    assert rel_to_max(model.logits[..., :V], ref) < 1e-5
    back = load_model(tmp_path)   # read back: half-split, the same logits
    assert not back.config.rope_interleaved
    back.forward(x)
    assert rel_to_max(back.logits[..., :V], model.logits[..., :V]) < 1e-5


def test_fuzzed_config_fields_raise_our_errors(tmp_path):
    """Every config.json field set to values of the wrong type or range: the
    folder loads (a field that does not matter) or raises an LlmcError
    naming the file; never a TypeError, KeyError or AttributeError."""
    make_hf("qwen3-qknorm-tied").save_pretrained(tmp_path)
    pristine = json.loads((tmp_path / "config.json").read_text())
    values = [None, "x", -1, 0, 1.5, [], {}, True, 10**12, ["x"], {"rope_type": 3}]
    refused = 0
    for field in pristine:
        for value in values:
            (tmp_path / "config.json").write_text(json.dumps(pristine | {field: value}))
            try:
                load_model(tmp_path)
            except llmc_py.LlmcError as e:
                assert "config.json" in str(e) or "tensor" in str(e), (field, value, e)
                refused += 1
    assert refused > 60


@pytest.mark.parametrize("rope_type,scaling", [
    ("llama3", dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16)),
    ("linear", dict(factor=4.0)),
])
def test_scaled_rope_matches_transformers(tmp_path, rope_type, scaling):
    """A Llama with rope scaling (Llama 3.1's rule, or linear interpolation):
    the frequencies equal transformers' own, and the logits past the
    original context too."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=500000.0,
        rope_scaling=dict(rope_type=rope_type, **scaling), **COMMON)).eval()
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.rope_scaling == rope_type
    expected, _ = ROPE_INIT_FUNCTIONS[rope_type](hf.config, "cpu")
    np.testing.assert_allclose(model.config.rope_inv_freq(), expected.numpy(), rtol=1e-6)
    x = np.random.default_rng(0).integers(0, V, (1, 60))   # past 16 positions
    model.forward(x)
    with torch.no_grad():
        ref = hf(torch.tensor(x)).logits.numpy()
    assert rel_to_max(model.logits[..., :V], ref) < 1e-5
    model.save_pretrained(tmp_path / "back")   # and back: the same scaling
    assert read_hf(tmp_path / "back")[0] == model.config
