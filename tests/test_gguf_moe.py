"""GGUF files of the mixtures of experts (io.gguf) against the gguf package,
llama.cpp's own reader, name tables and quantizers: tiny random Mixtral (GQA,
untied, 4 experts top-2) and Qwen3-MoE (qk_norm, head_dim != C / NH, tied,
8 experts top-2) made by transformers (test_moe_hf's models, Qwen3-MoE with
every layer MoE and its top-k weights renormalised, as llama.cpp's qwen3moe
runs it) with test_gguf's tokenizer.

Round trips: f32 gives the same config, parameters and logits bitwise; the
others keep each weight within its format (test_gguf.check_within_format) and the
logits within test_gguf's BOUNDS of the model's (seen loading in fp32: bf16
7.5e-3, f16 9.7e-4, q8_0 3.5e-2, q4_0 0.43). Loading in bf16 adds bf16's
arithmetic, which alone moves these models' logits by up to 1.7e-2 (their
bf16 model against their fp32 one; the router's choices shift with them):
3e-2 more (seen up to 1.9e-2 more)."""
import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as Q

from llmc_py import CheckpointError, ShapeError, UnsupportedError, load_model
from llmc_py.convert import main as convert_main
from test_gguf import (BOUNDS, check_within_format, converter_permute, gguf_of, logits_of,
                       rewrite, saved, write_tokenizer)
from test_hf import batch, rel_to_max
from test_moe_hf import make_hf

GGUF_ARCH = {"mixtral": "llama", "qwen3-moe": "qwen3moe"}
# as llama.cpp's qwen3moe runs it: experts in every layer, top-k renormalised
GGUF_READY = {"mixtral": {}, "qwen3-moe": dict(decoder_sparse_step=1, norm_topk_prob=True)}
BF16_LOAD = 3e-2


@pytest.fixture(scope="module", params=list(GGUF_ARCH))
def folder(request, tmp_path_factory):
    """(name, a transformers MoE model's save_pretrained folder with a tokenizer)."""
    folder = tmp_path_factory.mktemp(request.param)
    make_hf(request.param, **GGUF_READY[request.param]).save_pretrained(folder)
    write_tokenizer(folder)
    return request.param, folder


# ---- round trips -------------------------------------------------------------

def test_f32_round_trip_is_bitwise(folder, tmp_path):
    name, folder = folder
    model, path = saved(folder, tmp_path, "f32")
    back = load_model(path)
    assert back.config == model.config and back.config.num_experts
    assert np.array_equal(back.params.memory, model.params.memory)
    x, _ = batch()
    assert np.array_equal(logits_of(back, x), logits_of(model, x))


@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_lossy_round_trip_within_bounds(folder, tmp_path, dtype):
    name, folder = folder
    model, path = saved(folder, tmp_path, dtype)
    check_within_format(path, converter_tensors(name, model.config, folder))
    x, _ = batch()
    for precision in ("fp32", "bf16"):
        back = load_model(path, precision=precision)
        assert rel_to_max(logits_of(back, x), logits_of(model, x)) < BOUNDS[dtype] + (
            BF16_LOAD if precision == "bf16" else 0)


def test_a_frozen_bf16_base_reads_the_experts_one_by_one(folder, tmp_path):
    """load_model(frozen=True) reads tensor by tensor (read_gguf_into), each
    expert's matrix out of its layer's stack: the same model as from the
    folder."""
    name, folder = folder
    _, path = saved(folder, tmp_path, "f32")
    x, _ = batch()
    ours, ref = (load_model(p, precision="bf16", frozen=True) for p in (path, folder))
    assert np.array_equal(logits_of(ours, x), logits_of(ref, x))


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_quantized_weights_keep_the_files_expert_blocks(folder, tmp_path, dtype):
    """load_model(weights=dtype) of a dtype file: each MoE layer's experts
    hold the file's ffn_gate_exps and ffn_up_exps (expertfcw) and
    ffn_down_exps (expertprojw) bytes as they are, and the model decodes as
    the dequantised file quantized again. Experts whose hidden size is not
    a whole number of blocks (this Mixtral's 48: the file holds its down
    projections in F16, as llama.cpp's quantizer leaves them) are refused,
    the tensor named."""
    name, folder = folder
    model, path = saved(folder, tmp_path, dtype)
    c = model.config
    if c.expert_hidden % 32:
        with pytest.raises(ShapeError, match=r"expertprojw\[0\].*48 is not a multiple of 32"):
            load_model(path, weights=dtype)
        return
    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    quantized = load_model(path, weights=dtype)
    for m, l in enumerate(c.moe_layers):
        np.testing.assert_array_equal(
            quantized._weights["expertfcw"][m].blocks,
            np.concatenate([stored[f"blk.{l}.ffn_gate_exps.weight"],
                            stored[f"blk.{l}.ffn_up_exps.weight"]], axis=1))
        np.testing.assert_array_equal(quantized._weights["expertprojw"][m].blocks,
                                      stored[f"blk.{l}.ffn_down_exps.weight"])
    again = load_model(path)
    again.quantize(dtype)
    x, _ = batch()
    assert np.array_equal(logits_of(quantized, x), logits_of(again, x))
    assert quantized.generate([3, 1, 4], 6, temperature=0) == again.generate([3, 1, 4], 6,
                                                                               temperature=0)


# ---- what llama.cpp reads ----------------------------------------------------

def converter_tensors(name, config, folder):
    """{GGUF name: float32 array} as llama.cpp's converter makes them from
    the folder's own tensors: llama's q and k permuted, each layer's experts
    stacked ([E, rows, columns], torch.stack of experts 0..E-1) under the
    name it gives the stack (Mixtral's layers.{l}.feed_forward.experts.w1,
    Qwen3-MoE's model.layers.{l}.mlp.experts.gate_proj), the names from
    gguf.tensor_mapping."""
    from safetensors.numpy import load_file
    arch = GGUF_ARCH[name]
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), config.num_layers)
    tensors = load_file(str(folder / "model.safetensors"))
    if config.tied_embeddings:
        tensors.pop("lm_head.weight", None)
    stacks = {}
    out = {}
    for hf_name, data in tensors.items():
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = converter_permute(data, config.num_heads, config.num_heads)
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = converter_permute(data, config.num_heads, config.num_kv_heads)
        head, sep, tail = hf_name.partition(".experts.")
        if sep:
            expert, _, projection = tail.partition(".")
            l = int(head.split(".")[2])
            stack = f"layers.{l}.feed_forward.experts.{projection}" if name == "mixtral" \
                else f"{head}.experts.{projection}"
            stacks.setdefault(stack, {})[int(expert)] = data
            continue
        out[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = data
    for stack, experts in stacks.items():
        assert sorted(experts) == list(range(config.num_experts))
        out[names.get_name(stack, try_suffixes=(".weight",))] = np.stack(
            [experts[e] for e in range(config.num_experts)])
    assert None not in out
    return out


def llama_cpp_shapes(arch, c):
    """{GGUF name: numpy shape} llama.cpp's loader creates each tensor of
    these models with (src/models/llama.cpp, qwen3moe.cpp: ne reversed; the
    experts' hidden size n_ff for llama, n_ff_exp for qwen3moe)."""
    V, C, E, EH, hs = c.vocab_size, c.C, c.num_experts, c.expert_hidden, c.head_size
    shapes = {"token_embd.weight": (V, C), "output_norm.weight": (C,)}
    if not c.tied_embeddings:
        shapes["output.weight"] = (V, C)
    for l in range(c.num_layers):
        block = {"attn_norm": (C,), "attn_q": (c.num_heads * hs, C),
                 "attn_k": (c.num_kv_heads * hs, C), "attn_v": (c.num_kv_heads * hs, C),
                 "attn_output": (C, c.num_heads * hs), "ffn_norm": (C,),
                 "ffn_gate_inp": (E, C), "ffn_gate_exps": (E, EH, C),
                 "ffn_up_exps": (E, EH, C), "ffn_down_exps": (E, C, EH)}
        if arch == "qwen3moe":
            block |= {"attn_q_norm": (hs,), "attn_k_norm": (hs,)}
        shapes |= {f"blk.{l}.{n}.weight": shape for n, shape in block.items()}
    return shapes


def required_keys(arch):
    """The metadata llama.cpp's loader reads for these architectures."""
    K = gguf.Keys
    keys = ["general.architecture", "general.file_type", "tokenizer.ggml.model",
            "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"]
    keys += [k.format(arch=arch) for k in (
        K.LLM.CONTEXT_LENGTH, K.LLM.EMBEDDING_LENGTH, K.LLM.BLOCK_COUNT,
        K.LLM.FEED_FORWARD_LENGTH, K.Attention.HEAD_COUNT, K.Attention.HEAD_COUNT_KV,
        K.Attention.LAYERNORM_RMS_EPS, K.Rope.FREQ_BASE, K.Rope.DIMENSION_COUNT,
        K.LLM.EXPERT_COUNT, K.LLM.EXPERT_USED_COUNT)]
    if arch == "qwen3moe":
        keys.append(K.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch))
    return keys


def test_reader_finds_every_key_and_tensor_llama_cpp_needs(folder, tmp_path):
    name, folder = folder
    model, path = saved(folder, tmp_path, "q8_0")
    arch, c = GGUF_ARCH[name], model.config
    reader = gguf.GGUFReader(path)
    fields = reader.fields
    assert fields["general.architecture"].contents() == arch
    for key in required_keys(arch):
        assert key in fields, key
    assert fields[f"{arch}.expert_count"].contents() == c.num_experts
    assert fields[f"{arch}.expert_used_count"].contents() == c.experts_per_token
    hidden = f"{arch}.expert_feed_forward_length" if arch == "qwen3moe" else \
        f"{arch}.feed_forward_length"
    assert fields[hidden].contents() == c.expert_hidden
    assert f"{arch}.attention.sliding_window" not in fields   # 0: off, left out
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    allowed = {gguf.TENSOR_NAMES[t].format(bid=l) + ".weight"
               for t in gguf.MODEL_TENSORS[model_arch] for l in range(c.num_layers)}
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    assert set(shapes) <= allowed, set(shapes) - allowed
    assert shapes == llama_cpp_shapes(arch, c)


@pytest.mark.parametrize("dtype,head_dtype", [("q8_0", None), ("q4_0", None),
                                              ("q4_0", "q8_0")])
def test_quantised_bytes_equal_gguf_quantize(folder, tmp_path, dtype, head_dtype):
    """The converter's names for the folder's own tensors, stacked as it
    stacks them; each expert's rows in ``dtype`` blocks, the router
    (ffn_gate_inp) F32 as the converter and llama.cpp's quantizer keep it,
    the head in ``head_dtype`` (default dtype; test_gguf), and under q4_0
    with 8 experts attn_k and attn_v Q8_0; rows that are no whole number of 32-wide blocks F16, as the
    converter falls back. The types llama.cpp's own quantizer
    (llama_model_quantize) gives our f32 file of these models, seen byte for
    byte equal to ours."""
    name, folder = folder
    model, path = saved(folder, tmp_path, dtype, head_dtype)
    expected = converter_tensors(name, model.config, folder)
    reader = gguf.GGUFReader(path)
    assert {t.name for t in reader.tensors} == set(expected)
    head = "token_embd.weight" if model.config.tied_embeddings else "output.weight"
    kinds = set()   # the tensors held in dtype
    for t in reader.tensors:
        data = np.ascontiguousarray(expected[t.name], dtype=np.float32)
        f32 = data.ndim == 1 or t.name.endswith(("_norm.weight", ".ffn_gate_inp.weight"))
        raised = dtype == "q4_0" and model.config.num_experts == 8 and t.name.endswith(
            (".attn_k.weight", ".attn_v.weight"))
        kind = Q.F32 if f32 else Q[(head_dtype or dtype).upper()] if t.name == head else \
            Q.Q8_0 if raised else Q[dtype.upper()]
        if data.shape[-1] % 32 and kind != Q.F32:
            kind = Q.F16   # Mixtral's ffn_down_exps: rows of 48, no whole block
        assert t.tensor_type == kind, t.name
        kinds.add(t.name.split(".")[-2] if kind == Q[dtype.upper()] else None)
        assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8),
                              gguf.quants.quantize(data, kind).reshape(-1).view(np.uint8)), \
            t.name
    stacks = {"ffn_gate_exps", "ffn_up_exps"} | ({"ffn_down_exps"} if name == "qwen3-moe"
                                                 else set())
    assert stacks <= kinds


def test_convert_cli_writes_gguf_and_reads_it_back(folder, tmp_path):
    name, folder = folder
    out = tmp_path / "out.gguf"
    assert convert_main([str(folder), str(out), "--dtype", "q8_0"]) in (None, 0)
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == GGUF_ARCH[name]
    x, _ = batch()
    model = load_model(folder)
    assert rel_to_max(logits_of(load_model(out), x), logits_of(model, x)) < BOUNDS["q8_0"]
    back = tmp_path / "back.bin"   # a GGUF file converts to a model file
    assert convert_main([str(out), str(back)]) in (None, 0)
    assert np.array_equal(load_model(back).params.memory, load_model(out).params.memory)


def test_qwen3moe_dense_feed_forward_length_as_the_converter_writes_it(tmp_path):
    """llama.cpp's converter writes Qwen3-MoE's intermediate_size (the dense
    MLP's, which no layer has) as feed_forward_length, the experts' as
    expert_feed_forward_length: read, the same model."""
    folder = tmp_path / "hf"
    make_hf("qwen3-moe", **GGUF_READY["qwen3-moe"]).save_pretrained(folder)
    write_tokenizer(folder)
    model, path = saved(folder, tmp_path, "f32")
    theirs = rewrite(path, tmp_path / "theirs.gguf",
                     fields=lambda k, v: 96 if k == "qwen3moe.feed_forward_length" else v)
    back = load_model(theirs)
    assert back.config == model.config
    assert np.array_equal(back.params.memory, model.params.memory)


def test_mixtral_sliding_window_round_trips_with_convert_s_note(tmp_path, capsys):
    """Written and read back as Mistral's; llama.cpp's llama architecture
    ignores it, which convert says."""
    folder = tmp_path / "hf"
    make_hf("mixtral", sliding_window=7).save_pretrained(folder)
    write_tokenizer(folder)
    out = tmp_path / "out.gguf"
    assert convert_main([str(folder), str(out)]) in (None, 0)
    assert "note: llama.cpp runs this model (general.architecture llama) without its " \
           "sliding window of 7 positions" in capsys.readouterr().out
    assert gguf.GGUFReader(out).fields["llama.attention.sliding_window"].contents() == 7
    model, back = load_model(folder), load_model(out)
    assert back.config == model.config and back.config.sliding_window == 7
    x, _ = batch()
    assert np.array_equal(logits_of(back, x), logits_of(model, x))


# ---- what llama.cpp cannot run -----------------------------------------------

@pytest.mark.parametrize("setting, message", [
    (dict(decoder_sparse_step=2, norm_topk_prob=True),
     r"moe_every=2 \(Qwen3-MoE's decoder_sparse_step\): llama.cpp's qwen3moe"),
    (dict(decoder_sparse_step=1, norm_topk_prob=False),
     r"norm_topk_prob=False: llama.cpp's qwen3moe architecture always renormalises")])
def test_what_llama_cpp_cannot_run_is_refused_by_setting(tmp_path, setting, message):
    folder = tmp_path / "hf"
    make_hf("qwen3-moe", **setting).save_pretrained(folder)
    write_tokenizer(folder)
    with pytest.raises(UnsupportedError, match=message):
        load_model(folder).save_gguf(tmp_path / "m.gguf", tokenizer=folder)
    assert not (tmp_path / "m.gguf").exists()


# ---- bad input -----------------------------------------------------------------

@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A Mixtral GGUF file (f32) to spoil."""
    return gguf_of(tmp_path_factory.mktemp("mixtral_small"), make_hf("mixtral"))


def test_a_wrong_expert_count_is_refused_naming_the_tensor(mixtral, tmp_path):
    bad = rewrite(mixtral, tmp_path / "count.gguf",
                  fields=lambda k, v: 3 if k == "llama.expert_count" else v)
    with pytest.raises(CheckpointError, match=r"tensor blk.0.ffn_gate_inp.weight has shape "
                                              r"\[4, 64\], expected \[3, 64\] \(metadata: "
                                              r"llama.expert_count 3, "):
        load_model(bad)


def test_a_stack_with_an_expert_missing_is_refused_naming_it(mixtral, tmp_path):
    def three(name, data, kind):
        return (data[:3], kind, None) if name == "blk.1.ffn_down_exps.weight" else \
            (data, kind, None)
    bad = rewrite(mixtral, tmp_path / "three.gguf", tensor=three)
    with pytest.raises(CheckpointError, match=r"tensor blk.1.ffn_down_exps.weight has shape "
                                              r"\[3, 64, 48\], expected \[4, 64, 48\]"):
        load_model(bad)


def test_a_missing_expert_tensor_is_refused_by_name(mixtral, tmp_path):
    bad = rewrite(mixtral, tmp_path / "noup.gguf", tensor=lambda name, data, kind: None
                  if name == "blk.1.ffn_up_exps.weight" else (data, kind, None))
    with pytest.raises(CheckpointError, match=r"tensor blk.1.ffn_up_exps.weight is missing "
                                              r"\(layer 1's experts; metadata: "
                                              r"llama.expert_count 4"):
        load_model(bad)


def test_a_truncated_moe_file_is_refused(mixtral, tmp_path):
    for keep in (2000, mixtral.stat().st_size - 100):
        bad = tmp_path / f"cut{keep}.gguf"
        bad.write_bytes(mixtral.read_bytes()[:keep])
        with pytest.raises(CheckpointError, match=f"{bad}: "):
            load_model(bad)


def test_more_experts_used_than_there_are_is_refused(mixtral, tmp_path):
    bad = rewrite(mixtral, tmp_path / "k.gguf",
                  fields=lambda k, v: 5 if k == "llama.expert_used_count" else v)
    with pytest.raises(CheckpointError, match="experts_per_token=5 is more than num_experts=4"):
        load_model(bad)
