"""GGUF files (io.gguf) against the gguf package, llama.cpp's own reader,
name tables and quantizers: tiny random GPT-2, Llama (GQA, untied), Qwen3
(qk_norm, head_dim != C / NH, tied) and Mistral (sliding window) made by
transformers (test_hf's models) with a tiny byte-level BPE tokenizer.json,
plus a GPT-2 of our own init with GPT-2's tiktoken vocabulary.

Round trips: f32 gives the same parameters and logits bitwise. The others
keep each weight within its format (bf16 and f16: 2^-8 and 2^-11 relative,
f16 also 2^-25 absolute for its subnormals; Q8_0: half a step of its
32-weight block, the step d = amax / 127; Q4_0: one step, d = amax / 8, the
top code clipped; each plus the code times d's fp16 rounding), and the
logits within these bounds relative to the largest logit (these tiny random
models, whose logits are near 1, are a hard case; seen loading in fp32: bf16
7.0e-3, f16 7.2e-4, q8_0 2.3e-2, q4_0 0.32): bf16 1e-2, f16 2e-3, q8_0 5e-2,
q4_0 0.6; loading in bf16 adds bf16's 1e-2 (seen up to 2.7e-2 for q8_0)."""
import json

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as Q

from llmc_py import CheckpointError, UnsupportedError, load_model
from llmc_py.config import MODEL_FIELDS, GPT2Config
from llmc_py.convert import build_parser, convert, main as convert_main
from llmc_py.errors import ShapeError, UsageError
from llmc_py.io.fetch import OFFLINE_ENV
from llmc_py.io.hf import hf_tensors
from llmc_py.model.presets import GPT2, Llama
from test_hf import MODELS, V, batch, make_hf, rel_to_max

EOS = V - 1
BOUNDS = {"bf16": 1e-2, "f16": 2e-3, "q8_0": 5e-2, "q4_0": 0.6}
GGUF_ARCH = {"gpt2": "gpt2", "llama-gqa-untied": "llama", "qwen3-qknorm-tied": "qwen3",
             "mistral-window": "llama"}


def write_tokenizer(folder):
    """A byte-level BPE tokenizer.json of V tokens: the 256 bytes, V - 257
    merges and <|endoftext|> (id EOS), and config.json's eos_token_id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    letters = "etaoinshrd"
    merges = [(a, b) for a in letters for b in letters][:V - 257]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    config.update(eos_token_id=EOS)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module", params=list(MODELS))
def folder(request, tmp_path_factory):
    """(name, a transformers model's save_pretrained folder with a tokenizer)."""
    folder = tmp_path_factory.mktemp(request.param)
    make_hf(request.param).save_pretrained(folder)
    write_tokenizer(folder)
    return request.param, folder


@pytest.fixture(scope="module")
def gpt2_own(tmp_path_factory):
    """A GPT-2 of our own init with GPT-2's 50257 tokens, saved as f32 GGUF."""
    mp = pytest.MonkeyPatch()
    mp.setenv(OFFLINE_ENV, "1")   # the tokenizer's ranks from the cache only
    config = GPT2Config(max_seq_len=64, vocab_size=50257, padded_vocab_size=50304,
                        num_layers=2, num_heads=4, channels=64)
    model = GPT2(config, seed=1)
    path = tmp_path_factory.mktemp("gpt2_own") / "model.gguf"
    model.save_gguf(path)
    mp.undo()
    return model, path


def logits_of(model, x):
    model.forward(x)
    return model.logits[..., :model.config.vocab_size].copy()


def saved(folder, tmp_path, dtype, head_dtype=None):
    """Our model of ``folder`` and its GGUF file of ``dtype`` (the head
    ``head_dtype``)."""
    model = load_model(folder)
    path = tmp_path / f"model.{dtype}.{head_dtype}.gguf"
    model.save_gguf(path, dtype=dtype, tokenizer=folder, head_dtype=head_dtype)
    return model, path


# ---- round trips -------------------------------------------------------------

def test_f32_round_trip_is_bitwise(folder, tmp_path):
    name, folder = folder
    model, path = saved(folder, tmp_path, "f32")
    back = load_model(path)
    assert back.config.sliding_window == model.config.sliding_window
    assert np.array_equal(back.params.memory, model.params.memory)
    x, _ = batch()
    assert np.array_equal(logits_of(back, x), logits_of(model, x))


def test_gpt2_of_our_init_round_trips_bitwise(gpt2_own):
    model, path = gpt2_own
    back = load_model(path)
    assert back.config == model.config
    assert np.array_equal(back.params.memory, model.params.memory)


@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_lossy_round_trip_within_bounds(folder, tmp_path, dtype):
    name, folder = folder
    model, path = saved(folder, tmp_path, dtype)
    check_within_format(path, converter_tensors(name, model.config, model.params.memory))
    x, _ = batch()
    for precision in ("fp32", "bf16"):
        back = load_model(path, precision=precision)
        assert back.params.memory.dtype == np.float32
        assert rel_to_max(logits_of(back, x), logits_of(model, x)) < BOUNDS[dtype] + (
            BOUNDS["bf16"] if precision == "bf16" else 0)


def check_within_format(path, expected):
    """Each tensor of the GGUF file at ``path`` within its format's bound of
    ``expected`` {GGUF name: array}."""
    for t in gguf.GGUFReader(path).tensors:
        weights = expected[t.name].astype(np.float32)
        error = np.abs(gguf.quants.dequantize(t.data, t.tensor_type).reshape(weights.shape)
                       - weights)
        assert (error <= format_bound(weights, t.tensor_type)).all(), t.name


def format_bound(weights, kind):
    """The largest error ``kind`` allows on each weight (the module's docstring)."""
    if kind == Q.F32:
        return np.zeros_like(weights)
    if kind == Q.BF16:
        return np.abs(weights) * 2.0 ** -8
    if kind == Q.F16:   # below 2^-14, f16's subnormals: a fixed spacing of 2^-24
        return np.abs(weights) * 2.0 ** -11 + 2.0 ** -25
    blocks = np.abs(weights.reshape(-1, 32)).max(axis=1, keepdims=True)
    top = 127 if kind == Q.Q8_0 else 8   # the largest code: the step d is amax / top
    rounding = 0.5 if kind == Q.Q8_0 else 1.0
    # plus the code times d's own fp16 rounding
    per_block = blocks / top * (rounding + top * 2.0 ** -11)
    return np.broadcast_to(per_block + 1e-7, (len(blocks), 32)).reshape(weights.shape)


# ---- what llama.cpp needs ------------------------------------------------------

def required_tensors(arch, config):
    """The tensors llama.cpp's loader requires of these models (llama-model.cpp)."""
    names = ["token_embd.weight", "output_norm.weight"]
    names += [] if config.tied_embeddings else ["output.weight"]
    if arch == "gpt2":
        names += ["position_embd.weight", "output_norm.bias"]
        per_block = ["attn_norm.weight", "attn_norm.bias", "attn_qkv.weight", "attn_qkv.bias",
                     "attn_output.weight", "attn_output.bias", "ffn_norm.weight",
                     "ffn_norm.bias", "ffn_up.weight", "ffn_up.bias", "ffn_down.weight",
                     "ffn_down.bias"]
    else:
        per_block = ["attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                     "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight",
                     "ffn_up.weight", "ffn_down.weight"]
        per_block += ["attn_q_norm.weight", "attn_k_norm.weight"] if arch == "qwen3" else []
    return set(names) | {f"blk.{l}.{n}" for l in range(config.num_layers) for n in per_block}


def required_keys(arch):
    keys = ["general.architecture", "general.file_type", "tokenizer.ggml.model",
            "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
            "tokenizer.ggml.eos_token_id"]
    K = gguf.Keys
    keys += [k.format(arch=arch) for k in (
        K.LLM.CONTEXT_LENGTH, K.LLM.EMBEDDING_LENGTH, K.LLM.BLOCK_COUNT,
        K.LLM.FEED_FORWARD_LENGTH, K.Attention.HEAD_COUNT)]
    if arch == "gpt2":
        return keys + [K.Attention.LAYERNORM_EPS.format(arch=arch)]
    return keys + [k.format(arch=arch) for k in (
        K.Attention.HEAD_COUNT_KV, K.Attention.LAYERNORM_RMS_EPS, K.Rope.FREQ_BASE,
        K.Attention.KEY_LENGTH, K.Attention.VALUE_LENGTH, K.Rope.DIMENSION_COUNT,
        K.LLM.VOCAB_SIZE)]


def check_file(path, arch, config):
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == arch
    for key in required_keys(arch):
        assert key in reader.fields, key
    names = {t.name for t in reader.tensors}
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    allowed = {gguf.TENSOR_NAMES[t].format(bid=l) + suffix
               for t in gguf.MODEL_TENSORS[model_arch] for l in range(config.num_layers)
               for suffix in (".weight", ".bias")}
    assert names <= allowed, names - allowed
    assert names >= required_tensors(arch, config), required_tensors(arch, config) - names
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == config.vocab_size
    return reader


def test_reader_finds_every_key_and_tensor_llama_cpp_needs(folder, tmp_path):
    name, folder = folder
    model, path = saved(folder, tmp_path, "q8_0")
    reader = check_file(path, GGUF_ARCH[name], model.config)
    fields = reader.fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.eos_token_id"].contents() == EOS
    assert fields["tokenizer.ggml.tokens"].contents()[EOS] == "<|endoftext|>"
    assert fields["tokenizer.ggml.token_type"].contents()[EOS] == gguf.TokenType.CONTROL
    assert fields["tokenizer.ggml.merges"].contents()[:2] == ["e e", "e t"]
    if name == "mistral-window":
        assert fields["llama.attention.sliding_window"].contents() == 7


def test_gpt2_vocabulary_and_merges_from_the_tiktoken_ranks(gpt2_own):
    model, path = gpt2_own
    reader = check_file(path, "gpt2", model.config)
    fields = reader.fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    # GPT-2's vocab.json and merges.txt, as Hugging Face's tokenizer has them
    assert tokens[:3] == ["!", '"', "#"] and tokens[256] == "Ġt" and tokens[50256] == \
        "<|endoftext|>"
    merges = fields["tokenizer.ggml.merges"].contents()
    assert len(merges) == 50000 and merges[:5] == ["Ġ t", "Ġ a", "h e", "i n", "r e"]
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 50256


def tokenizer_with(folder, pre_tokenizer):
    """write_tokenizer's tokenizer.json in ``folder`` with ``pre_tokenizer``."""
    from tokenizers import Tokenizer
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    write_tokenizer(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.save(str(folder / "tokenizer.json"))
    return tokenizer


def split_then_byte_level(regex):
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def test_a_tokenizer_json_names_llama_cpps_pre_tokenizer(folder, tmp_path):
    """Without tokenizer.ggml.pre llama.cpp splits text by a default regex of
    its own and tokenizes differently (seen: "fox's" as "'", "s" where the
    tokenizer gives "'s"): GPT-2's ByteLevel is "gpt-2"."""
    name, folder = folder
    model, path = saved(folder, tmp_path, "f32")
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "gpt-2"


@pytest.mark.parametrize("pre, digits", [("llama-bpe", ["123", "456", "7"]),
                                         ("qwen2", list("1234567"))])
def test_split_regexes_of_llama3_and_qwen2_are_named(tmp_path, pre, digits):
    """A Split of Llama 3's or Qwen2's regex (as their tokenizer.json spell
    it) before a ByteLevel without its own regex: the pre-tokenizer names
    llama.cpp selects those splits by; the regexes split digits as theirs."""
    from llmc_py.io.gguf import SPLIT_PRES
    regex = {v: k for k, v in SPLIT_PRES.items()}[pre]
    tokenizer = tokenizer_with(tmp_path / "hf", split_then_byte_level(regex))
    words = [w for w, _ in tokenizer.pre_tokenizer.pre_tokenize_str("I'm 1234567 DON'T")]
    assert words == ["I", "'m", "Ġ", *digits, "ĠDON", "'T"]
    Llama(tiny_llama()).save_gguf(tmp_path / "m.gguf", tokenizer=tmp_path / "hf")
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert fields["tokenizer.ggml.pre"].contents() == pre


def test_other_pre_tokenizers_are_refused_by_field(tmp_path):
    """Metaspace (SentencePiece-style), another Split regex, or a ByteLevel
    that adds a prefix space: llama.cpp would not split text as they do."""
    from tokenizers import pre_tokenizers
    for i, pre in enumerate([pre_tokenizers.Metaspace(),
                             split_then_byte_level(r"\p{L}+|\p{N}+|\s+"),
                             pre_tokenizers.ByteLevel(add_prefix_space=True)]):
        folder = tmp_path / str(i)
        tokenizer_with(folder, pre)
        with pytest.raises(UnsupportedError, match=r"tokenizer.json: field pre_tokenizer is "
                                                   r".*GPT-2's ByteLevel, or a Split of Llama "
                                                   r"3's or Qwen2's regex before ByteLevel"):
            Llama(tiny_llama()).save_gguf(folder / "m.gguf", tokenizer=folder)
        assert not (folder / "m.gguf").exists()


def test_every_declared_key_is_spelled_as_gguf_spells_it():
    known = {v for group in (gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope)
             for k, v in vars(group).items() if k.isupper()}
    declared = {n for f in MODEL_FIELDS.values() for key in f.gguf.values() for n in key.names}
    assert declared and declared <= known, declared - known


def converter_permute(weights, n_head, n_head_kv=None):
    """convert_hf_to_gguf.py's LlamaModel.permute, restated."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def converter_tensors(name, config, params):
    """{GGUF name: float32 array} as llama.cpp's converter makes them from
    the Hugging Face tensors: GPT-2's Conv1D transposed, llama's q and k
    permuted, the names from gguf.tensor_mapping."""
    arch = GGUF_ARCH[name]
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), config.num_layers)
    out = {}
    for hf_name, data in hf_tensors(config, params).items():
        if hf_name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            data = data.T
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = converter_permute(data, config.num_heads, config.num_heads)
        if arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = converter_permute(data, config.num_heads, config.num_kv_heads)
        out[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = data
    return out


@pytest.mark.parametrize("dtype,head_dtype", [("q8_0", None), ("q4_0", None),
                                              ("q4_0", "q8_0")])
def test_quantised_bytes_equal_gguf_quantize(folder, tmp_path, dtype, head_dtype):
    """Every weight in ``dtype``, the head (the output matrix: output, or
    token_embd when tied) too (llama.cpp's quantizer with --pure) or in
    ``head_dtype``: q4_0 with a Q8_0 head are the types llama.cpp's own
    quantizer (llama_model_quantize) gives our f32 file of these models by
    default, seen byte for byte equal to ours."""
    name, folder = folder
    model, path = saved(folder, tmp_path, dtype, head_dtype)
    expected = converter_tensors(name, model.config, model.params.memory)
    reader = gguf.GGUFReader(path)
    assert {t.name for t in reader.tensors} == set(expected)
    kinds = set()
    for t in reader.tensors:
        data = np.ascontiguousarray(expected[t.name], dtype=np.float32)
        one_d = data.ndim == 1 or t.name.endswith("_norm.weight") or t.name.endswith(".bias") \
            or t.name == "position_embd.weight"
        head = t.name == ("token_embd.weight" if model.config.tied_embeddings else
                          "output.weight")
        kind = Q.F32 if one_d else Q[(head_dtype or dtype).upper()] if head else \
            Q[dtype.upper()]
        assert t.tensor_type == kind, t.name
        assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8),
                              gguf.quants.quantize(data, kind).reshape(-1).view(np.uint8)), \
            t.name
        kinds.add(kind)
    assert Q[dtype.upper()] in kinds


def test_hf_folder_names_the_tensors_gguf_tensor_mapping_does(folder, tmp_path):
    """Our GGUF names are the gguf package's names for the folder's own
    tensors (without the masks the converter drops)."""
    from safetensors import safe_open
    name, folder = folder
    _, path = saved(folder, tmp_path, "f32")
    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        hf_names = [n for n in f.keys() if not n.endswith((".attn.bias", ".attn.masked_bias"))]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == GGUF_ARCH[name])
    mapping = gguf.get_tensor_name_map(arch, 2)
    theirs = {mapping.get_name(n, try_suffixes=(".weight", ".bias")) for n in hf_names}
    assert None not in theirs
    assert {t.name for t in gguf.GGUFReader(path).tensors} == theirs


def test_input_dimension_not_a_multiple_of_32_falls_back_to_f16(tmp_path):
    """As convert_hf_to_gguf does on gguf.QuantError: C = 48, so every
    weight reading the residual stream is F16, ffn_down (input 96) Q8_0."""
    from llmc_py.config import LlamaConfig
    from llmc_py.model.presets import Llama
    config = LlamaConfig(max_seq_len=32, vocab_size=V, padded_vocab_size=384, num_layers=1,
                         num_heads=4, num_kv_heads=2, channels=48, ffn_hidden=96)
    folder = tmp_path / "hf"
    Llama(config, seed=0).save_pretrained(folder)
    write_tokenizer(folder)
    model, path = saved(folder, tmp_path, "q8_0")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == Q.F16 and types["token_embd.weight"] == Q.F16
    assert types["blk.0.ffn_down.weight"] == Q.Q8_0
    x, _ = batch()
    assert rel_to_max(logits_of(load_model(path), x), logits_of(model, x)) < BOUNDS["q8_0"]


def test_convert_cli_writes_gguf_and_reads_it_back(folder, tmp_path, capsys):
    name, folder = folder
    out = tmp_path / "out.gguf"
    assert convert_main([str(folder), str(out), "--dtype", "q8_0"]) in (None, 0)
    # llama.cpp's llama architecture attends over every position (checked in
    # llama.cpp: its logits past the window equal ours with the window off)
    note = "note: llama.cpp runs this model (general.architecture llama) without its sliding " \
           "window of 7 positions: its output equals ours only while the text fits in 7 " \
           "positions\n"
    assert capsys.readouterr().out.endswith(note) == (name == "mistral-window")
    model = load_model(folder)
    x, _ = batch()
    assert rel_to_max(logits_of(load_model(out), x), logits_of(model, x)) < BOUNDS["q8_0"]
    back = tmp_path / "back.bin"   # a GGUF file converts to a model file
    assert convert_main([str(out), str(back)]) in (None, 0)
    assert np.array_equal(load_model(back).params.memory, load_model(out).params.memory)


def test_convert_refuses_a_gguf_dtype_for_other_formats(folder, tmp_path):
    name, folder = folder
    args = build_parser().parse_args([str(folder), str(tmp_path / "m.bin"), "--dtype", "q4_0"])
    with pytest.raises(UsageError, match="--dtype q4_0: only a .gguf DST"):
        convert(args)


# ---- bad input -----------------------------------------------------------------

def rewrite(src, dst, arch=None, tensor=None, fields=None):
    """A copy of the GGUF file ``src`` through the gguf package's writer, with
    ``arch``, ``tensor(name, data, type) -> (data, type, numpy shape or
    None)`` (or None: dropped) applied to each tensor and ``fields(name,
    value) -> value`` to each metadata value."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch or reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        value = fields(key, value) if fields else value
        if value is None:   # dropped
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        data, kind, shape = np.asarray(t.data), t.tensor_type, None
        if tensor:
            kept = tensor(t.name, data, kind)
            if kept is None:
                continue
            data, kind, shape = kept
        writer.add_tensor(t.name, data, raw_shape=shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def gguf_of(folder, hf):
    """Our f32 GGUF file of the transformers model ``hf``, saved with
    write_tokenizer's tokenizer in ``folder``."""
    hf.save_pretrained(folder)
    write_tokenizer(folder)
    path = folder / "model.gguf"
    load_model(folder).save_gguf(path, tokenizer=folder)
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A Llama GGUF file (f32) to spoil."""
    return gguf_of(tmp_path_factory.mktemp("small"), make_hf("llama-gqa-untied"))


def test_a_copy_through_the_gguf_writer_reads_the_same(small, tmp_path):
    copy = rewrite(small, tmp_path / "copy.gguf")
    assert np.array_equal(load_model(copy).params.memory, load_model(small).params.memory)


def test_truncated_file_is_refused(small, tmp_path):
    for keep in (10, 2000, small.stat().st_size - 100):
        bad = tmp_path / f"cut{keep}.gguf"
        bad.write_bytes(small.read_bytes()[:keep])
        with pytest.raises(CheckpointError, match=f"{bad}: .*"):
            load_model(bad)


def test_unknown_architecture_is_refused_by_name(small, tmp_path):
    bad = rewrite(small, tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(UnsupportedError, match="general.architecture is 'falcon'"):
        load_model(bad)


def test_unsupported_quantisation_type_is_refused_by_name(small, tmp_path):
    def q5(name, data, kind):
        if name == "blk.0.attn_v.weight":
            return gguf.quants.quantize(data, Q.Q5_0), Q.Q5_0, None
        return data, kind, None
    bad = rewrite(small, tmp_path / "q5.gguf", tensor=q5)
    with pytest.raises(UnsupportedError, match="tensor blk.0.attn_v.weight has type Q5_0"):
        load_model(bad)


def test_a_q6_k_head_reads_as_gguf_dequantizes_it(tmp_path):
    """llama.cpp's quantizer keeps a Q4_0 model's head in Q6_K when its rows
    are a multiple of 256 (seen: token_embd of a tied C = 256 model): any
    bytes of it read back as gguf.quants.dequantize gives them."""
    from llmc_py.config import LlamaConfig
    config = LlamaConfig(max_seq_len=16, vocab_size=V, padded_vocab_size=384, num_layers=1,
                         num_heads=4, num_kv_heads=2, channels=256, tied_embeddings=True)
    src = tmp_path / "f32.gguf"
    Llama(config, seed=0).save_gguf(src, tokenizer=tiktoken_free_tokenizer(tmp_path / "hf"))
    blocks = np.random.default_rng(0).integers(0, 256, (V, 210), dtype=np.uint8)
    blocks[:, -2:] = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)   # each block's d
    expected = gguf.quants.dequantize(blocks, Q.Q6_K)

    def q6_k_head(name, data, kind):
        return (blocks, Q.Q6_K, None) if name == "token_embd.weight" else (data, kind, None)
    back = load_model(rewrite(src, tmp_path / "q6_k.gguf", tensor=q6_k_head))
    assert np.array_equal(back.params["wte"][:V], expected)


def test_tensor_whose_size_disagrees_with_its_shape_is_refused(small, tmp_path):
    """A tensor stored with fewer rows than its recorded shape has: the
    reader would take the next tensor's bytes for its last rows."""
    def short(name, data, kind):
        if name == "blk.0.attn_k.weight":
            return data[:-2], kind, data.shape
        return data, kind, None
    bad = rewrite(small, tmp_path / "short.gguf", tensor=short)
    with pytest.raises(CheckpointError, match=r"tensor blk.0.attn_k.weight of shape \[32, 64\] "
                                              r"\(F32\) needs 8192 bytes but 7680 are stored"):
        load_model(bad)


def test_tensor_shape_disagreeing_with_the_metadata_is_refused(small, tmp_path):
    bad = rewrite(small, tmp_path / "heads.gguf",
                  fields=lambda k, v: 8 if k == "llama.attention.head_count" else v)
    with pytest.raises(CheckpointError, match="tensor model.layers.0.self_attn.q_proj.weight "
                                              "has shape"):
        load_model(bad)


def test_vocabulary_disagreeing_with_the_embedding_is_refused(small, tmp_path):
    bad = rewrite(small, tmp_path / "vocab.gguf",
                  fields=lambda k, v: v[:-1] if k.startswith("tokenizer.ggml.to") else v)
    with pytest.raises(CheckpointError, match=f"has {V - 1} tokens but tensor "
                                              f"token_embd.weight has {V} rows"):
        load_model(bad)


@pytest.mark.parametrize("vocab_size", [1000, 60000])
def test_writing_gpt2s_tokenizer_for_another_vocabulary_is_refused(tmp_path, monkeypatch,
                                                                    vocab_size):
    """Larger or smaller than GPT-2's 50257: the model had another tokenizer."""
    monkeypatch.setenv(OFFLINE_ENV, "1")
    model = GPT2(GPT2Config(max_seq_len=16, vocab_size=vocab_size,
                            padded_vocab_size=vocab_size + 128 - vocab_size % 128,
                            num_layers=1, num_heads=2, channels=32))
    with pytest.raises(ShapeError, match=f"the tokenizer has 50257 tokens but the embedding "
                                         f"has {vocab_size} rows"):
        model.save_gguf(tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())   # nothing half-written


def tiktoken_free_tokenizer(folder):
    """write_tokenizer's tokenizer.json in a folder of its own."""
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    write_tokenizer(folder)
    return folder


def tiny_llama(vocab_size=V):
    from llmc_py.config import LlamaConfig
    return LlamaConfig(max_seq_len=16, vocab_size=vocab_size, padded_vocab_size=384,
                       num_layers=1, num_heads=2, num_kv_heads=2, channels=32)


def test_a_tokenizer_json_is_padded_to_the_embedding(tmp_path):
    """As convert_hf_to_gguf pads (Qwen3's 151669 tokens, 151936 rows)."""
    config = tiny_llama(V + 20)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    write_tokenizer(folder)
    Llama(config).save_gguf(tmp_path / "m.gguf", tokenizer=folder)
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert fields["tokenizer.ggml.tokens"].contents()[V:] == [f"[PAD{i}]" for i in
                                                               range(V, V + 20)]
    assert set(fields["tokenizer.ggml.token_type"].contents()[V:]) == {gguf.TokenType.UNUSED}


def test_without_the_gguf_package_the_error_names_the_extra(small, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)
    with pytest.raises(UnsupportedError, match=r'pip install "llmc_py\[gguf\]"'):
        load_model(small)


# ---- RoPE variants -------------------------------------------------------------

def llama_of(tmp_path, **choices):
    """Our Llama of ``choices`` saved as f32 GGUF with the test tokenizer."""
    from llmc_py.config import LlamaConfig
    from llmc_py.model.presets import Llama
    config = LlamaConfig(max_seq_len=32, vocab_size=V, padded_vocab_size=384, num_layers=2,
                         num_heads=4, num_kv_heads=2, channels=64, **choices)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    write_tokenizer(folder)
    model = Llama(config, seed=3)
    path = tmp_path / "model.gguf"
    model.save_gguf(path, tokenizer=folder)
    return model, path


def test_linear_rope_scaling_round_trips(tmp_path):
    model, path = llama_of(tmp_path, rope_scaling="linear", rope_factor=2.0)
    fields = gguf.GGUFReader(path).fields
    assert fields["llama.rope.scaling.type"].contents() == "linear"
    assert fields["llama.rope.scaling.factor"].contents() == 2.0
    back = load_model(path)
    assert (back.config.rope_scaling, back.config.rope_factor) == ("linear", 2.0)
    x, _ = batch()
    assert np.array_equal(logits_of(back, x), logits_of(model, x))


def test_llama3_rope_scaling_is_refused_by_name(tmp_path):
    with pytest.raises(UnsupportedError, match="rope_scaling='llama3'"):
        llama_of(tmp_path, rope_scaling="llama3", rope_factor=8.0, rope_original_max=16)


def test_interleaved_rope_model_reads_back_as_the_same_model(tmp_path):
    """A model of ours with Meta's interleaved pairs: written as llama.cpp's
    (interleaved) rows, read back half-split: the same logits, summed in
    another order."""
    model, path = llama_of(tmp_path, rope_interleaved=True)
    back = load_model(path)
    assert not back.config.rope_interleaved
    x, _ = batch()
    assert rel_to_max(logits_of(back, x), logits_of(model, x)) < 1e-5


def test_missing_metadata_is_refused_by_name(small, tmp_path):
    bad = rewrite(small, tmp_path / "nolayers.gguf",
                  fields=lambda k, v: None if k == "llama.block_count" else v)
    with pytest.raises(CheckpointError, match="metadata key llama.block_count is missing"):
        load_model(bad)


def test_writing_into_a_missing_folder_is_a_write_error(small, tmp_path):
    from llmc_py.errors import WriteError
    model = load_model(small)
    with pytest.raises(WriteError, match="nowhere/m.gguf: cannot write"):
        model.save_gguf(tmp_path / "nowhere" / "m.gguf", tokenizer=small.parent)


def test_llama_with_biases_round_trips_bitwise(tmp_path):
    """q and k biases are permuted with their rows."""
    model, path = llama_of(tmp_path, bias=True)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.ffn_gate.bias"} <= names
    back = load_model(path)
    assert back.config.bias and np.array_equal(back.params.memory, model.params.memory)


def test_read_config_reads_the_metadata(small):
    from llmc_py.io import read_config
    assert read_config(small) == load_model(small).config
