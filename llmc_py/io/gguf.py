"""GGUF files (llama.cpp's format), in and out, through the ``gguf`` package
(llama.cpp's own reader, writer, name tables and quantizers; ``pip install
"llmc_py[gguf]"``), for GPT-2, Llama, Mistral, Qwen3 and the mixtures of
experts Mixtral and Qwen3-MoE.

Writing follows llama.cpp's convert_hf_to_gguf.py on the Hugging Face model
of the same config (io.hf.hf_tensors):
- general.architecture "gpt2", "llama" (Llama, Mistral and Mixtral, as the
  converter writes them), "qwen3" or "qwen3moe"; the hyperparameters are
  the config fields' declared GGUF keys (config.GGUFKey), the only place
  they are named (the experts': {arch}.expert_count, .expert_used_count,
  and the expert hidden size as Mixtral's feed_forward_length or
  Qwen3-MoE's expert_feed_forward_length). A key that is 0 when off (the
  sliding window) is left out then.
  Mistral's (and Mixtral's) sliding window is written (we read it back), but
  llama.cpp's llama architecture attends over every position: past the
  window its logits differ from ours.
- The experts: each MoE layer's router is ffn_gate_inp [E, C] (kept F32, as
  the converter keeps it), and each projection of its E experts one stacked
  tensor, ffn_gate_exps and ffn_up_exps [E, EH, C], ffn_down_exps [E, C, EH]
  (expert e at [e]), as the converter stacks them. What llama.cpp's
  architectures cannot run is refused by name: dense layers among the MoE
  ones (moe_every > 1, Qwen3-MoE's decoder_sparse_step) and top-k weights
  left unnormalised (norm_topk_prob=False); both always renormalise and
  route every layer. The training-only router_aux_loss and router_z_loss
  are not written (they read back as 0).
- Tensor names are gguf.tensor_mapping's for the Hugging Face names; GPT-2's
  Conv1D weights are stored (out, in) like every other weight, its q, k, v
  stay fused (attn_qkv). A tied head writes no output tensor.
- For "llama" the q and k rows are permuted from Hugging Face's half-split
  RoPE pairs into the interleaved pairs llama.cpp's llama rope uses, as the
  converter's LlamaModel.permute does; "qwen3" (NEOX rope) keeps them.
- Which tensors are quantised is the converter's rule: 1-D tensors, norms,
  biases and position_embd stay F32; every other weight gets ``dtype``,
  the head (output, or token_embd when tied) ``head_dtype`` (default the
  same: llama.cpp's quantizer with --pure; its default would be Q6_K,
  which we do not write, and "q8_0" is the nearest we do). A
  weight whose input dimension is not a multiple of the 32-wide Q8_0/Q4_0
  block falls back to F16, as the converter does. The bytes are
  gguf.quants.quantize's.
- The tokenizer ("gpt2" BPE): GPT-2's tiktoken ranks, written as byte-level
  tokens with the merges the ranks imply, or a Hugging Face tokenizer.json
  (a BPE model: its vocabulary, added tokens and merges; shorter than the
  embedding, it is padded with [PAD<i>] tokens as the converter does; its
  pre-tokenizer named as llama.cpp names it, _pre_tokenizer).
  A tokenizer with more tokens than the embedding has rows is refused.

Reading inverts all of it: the config from the declared keys (a llama file
with an expert count is a Mixtral), every tensor dequantised
(gguf.quants.dequantize) to float32, q and k permuted back, the experts
unstacked, and the tensors checked by io.hf.params_from_tensors as a
folder's are (an MoE layer's four first, by their GGUF names). A quantized
model (weights="q8_0", read_gguf_blocks) keeps the blocks of the linear
layers and stacks of experts stored in its type. Tensors
in F32, F16, BF16, Q8_0 and Q4_0 are read, and Q6_K (llama.cpp's quantizer
keeps the head of a Q4_0 model in it); other types are refused by name.
"""
import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..config import MODEL_FIELDS, REQUIRED, GPT2_CHOICES, GPT2Config, LlamaConfig, padded_vocab
from ..errors import CheckpointError, ShapeError, UnsupportedError, WriteError
from .files import open_temporary
from .hf import (FAMILIES, _tensor_map, architecture, hf_names, hf_tensors, our_tensors,
                 params_from_tensors)
from .rope_layout import half_split_to_interleaved, interleaved_to_half_split

INSTALL_HINT = 'pip install "llmc_py[gguf]"'
MAGIC = b"GGUF"
# the GGUF architecture of each Hugging Face one (llama.cpp's converter
# writes MistralForCausalLM as "llama"), and back
GGUF_ARCHS = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama",
              "MistralForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
              "MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe"}
HF_ARCHS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3moe": "Qwen3MoeForCausalLM"}
DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def gguf_arch(hf_arch):
    """The GGUF architecture a Hugging Face one is written as."""
    return GGUF_ARCHS[hf_arch]


def _refuse_unexpressible(config, hf_arch):
    """UnsupportedError naming the setting of an MoE ``config`` that
    llama.cpp's architecture for it cannot run: its qwen3moe (like its llama
    with experts) has experts in every layer and always renormalises a
    token's top-k router weights (Mixtral's own rules, which
    io.hf.architecture already requires of a Mixtral)."""
    if hf_arch != "Qwen3MoeForCausalLM":
        return
    if config.moe_every != 1:
        raise UnsupportedError(f"moe_every={config.moe_every} (Qwen3-MoE's decoder_sparse_step): "
                               f"llama.cpp's qwen3moe architecture has experts in every layer "
                               f"and no dense MLP; GGUF export needs moe_every=1")
    if not config.norm_topk_prob:
        raise UnsupportedError("norm_topk_prob=False: llama.cpp's qwen3moe architecture always "
                               "renormalises a token's top-k router weights to sum to 1; GGUF "
                               "export needs norm_topk_prob=True")


READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q6_K")
# GPT-2's Conv1D weights, which Hugging Face stores (in, out)
CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


def _gguf():
    """The gguf package; UnsupportedError with the install line if missing."""
    try:
        import gguf
    except ImportError as e:
        raise UnsupportedError(f"GGUF files need the gguf package: {INSTALL_HINT} ({e})") \
            from None
    return gguf


def is_gguf(path):
    """Whether the file at ``path`` starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


# ---- the hyperparameters -----------------------------------------------------

def _families(gguf_arch, fields):
    """The config field families (io.hf.FAMILIES) whose keys a GGUF file of
    ``gguf_arch`` with metadata ``fields`` holds: a llama file with an
    expert count is a Mixtral's."""
    if gguf_arch == "llama":
        moe = f"{gguf_arch}.expert_count" in fields
        return FAMILIES["MixtralForCausalLM" if moe else "MistralForCausalLM"]
    return FAMILIES[HF_ARCHS[gguf_arch]]


def _declared_keys(families):
    """(field, GGUFKey) of each field with a GGUF key in ``families``."""
    for field in MODEL_FIELDS.values():
        for family in families:
            if family in field.gguf:
                yield field, field.gguf[family]


def _metadata(config, hf_arch, gguf_arch):
    """{key: value} of the hyperparameters of ``config``."""
    c = config
    values = {}
    for field, key in _declared_keys(FAMILIES[hf_arch]):
        value = getattr(c, key.written_as or field.name)
        if value == 0 and key.missing == 0:
            continue   # off (no sliding window), as the converter leaves out a null
        values.update({name.format(arch=gguf_arch): value for name in key.names})
    if gguf_arch != "gpt2":
        values[f"{gguf_arch}.vocab_size"] = c.vocab_size
    if c.rope_scaling == "linear":
        values.update({f"{gguf_arch}.rope.scaling.type": "linear",
                       f"{gguf_arch}.rope.scaling.factor": c.rope_factor})
    elif c.rope_scaling != "none":
        raise UnsupportedError(f"rope_scaling={c.rope_scaling!r}: GGUF export writes plain or "
                               f"linear RoPE only (llama3 needs llama.cpp's rope_freqs tensor, "
                               f"not written yet)")
    return values


def _config(fields, path, gguf_arch, tensor_shapes):
    """The config of a GGUF file from its metadata ``fields``
    (GGUFReader.fields) and {tensor name: numpy shape}."""
    def value(name, kind):
        if name not in fields:
            raise CheckpointError(f"{path}: metadata key {name} is missing (needed for a "
                                  f"{gguf_arch} model)")
        v = fields[name].contents()
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if isinstance(v, bool) != (kind is bool) or not isinstance(v, kind):
            raise CheckpointError(f"{path}: metadata key {name} is {v!r}, expected "
                                  f"{kind.__name__}")
        return v

    config = {}
    for field, key in _declared_keys(_families(gguf_arch, fields)):
        name = key.names[0].format(arch=gguf_arch)
        if name in fields or key.missing is REQUIRED:
            config[field.name] = value(name, field.type)
        else:
            config[field.name] = key.missing
    scaling = f"{gguf_arch}.rope.scaling.type"
    if scaling in fields and value(scaling, str) not in ("none", "linear"):
        raise UnsupportedError(f"{path}: metadata key {scaling} is {value(scaling, str)!r}; "
                               f"supported: none, linear")
    if scaling in fields and value(scaling, str) == "linear":
        config.update(rope_scaling="linear",
                      rope_factor=value(f"{gguf_arch}.rope.scaling.factor", float))
    if "token_embd.weight" not in tensor_shapes:
        raise CheckpointError(f"{path}: tensor token_embd.weight is missing")
    vocab = tensor_shapes["token_embd.weight"][0]
    config.update(vocab_size=vocab, padded_vocab_size=padded_vocab(vocab),
                  tied_embeddings="output.weight" not in tensor_shapes)
    config["bias"] = any(name.endswith(".bias") and "_norm." not in name
                         for name in tensor_shapes)
    try:
        if gguf_arch == "gpt2":
            gpt2 = LlamaConfig(num_kv_heads=config["num_heads"], **GPT2_CHOICES | config)
            if gpt2.is_gpt2:
                return GPT2Config(**{k: v for k, v in config.items() if k not in GPT2_CHOICES})
            return gpt2
        return LlamaConfig(norm="rmsnorm", position="rope", mlp="swiglu",
                           qk_norm=gguf_arch in ("qwen3", "qwen3moe"), **config)
    except ShapeError as e:
        raise CheckpointError(f"{path}: {e}") from None


# ---- the tokenizer -----------------------------------------------------------

class Vocab(NamedTuple):
    """A "gpt2" (byte-level BPE) tokenizer as GGUF's tokenizer.ggml keys hold it."""
    tokens: list
    types: list     # gguf.TokenType of each token
    merges: list    # "left right", in merge order
    bos: int = None
    eos: int = None
    pre: str = None   # llama.cpp's pre-tokenizer name, when known
    pads: bool = False   # padded to the embedding's rows, as the converter pads tokenizer.json's


def _byte_chars():
    """GPT-2's printable stand-in for each byte (its bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _split(ranks, token):
    """The two tokens BPE merges into ``token``: its bytes merged by rank,
    every merge ranked below the token's own."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, len(ranks)), i) for i, (a, b) in
                 enumerate(zip(parts[:-1], parts[1:]))]
        rank, i = min(pairs)
        if rank >= ranks[token]:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def tiktoken_vocab(encoding):
    """The Vocab of a tiktoken Encoding (GPT-2's): its ranks as byte-level
    strings, then its special tokens; <|endoftext|> is bos and eos."""
    gguf = _gguf()
    ranks = encoding._mergeable_ranks   # tiktoken has no public accessor for the ranks
    chars = _byte_chars()
    text = lambda token: "".join(chars[b] for b in token)
    by_rank = sorted(ranks, key=ranks.get)
    tokens = [text(t) for t in by_rank]
    merges = [" ".join(text(part) for part in _split(ranks, t)) for t in by_rank if len(t) > 1]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for special, i in sorted(encoding._special_tokens.items(), key=lambda kv: kv[1]):
        if i != len(tokens):
            raise UnsupportedError(f"tokenizer {encoding.name}: special token {special} has id "
                                   f"{i}, expected {len(tokens)} (right after the ranks)")
        tokens.append(special)
        types.append(gguf.TokenType.CONTROL)
    return Vocab(tokens, types, merges, encoding.eot_token, encoding.eot_token, "gpt-2")


# The text splits (pre-tokenizer regexes) llama.cpp implements, by the
# tokenizer.ggml.pre name that selects each, as tokenizer.json spells them in
# a Split before a ByteLevel without its own regex: Llama 3's (numbers in
# runs of up to 3 digits) and Qwen2's and Qwen3's (one digit a piece).
SPLIT_PRES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}


def _pre_tokenizer(pre, path):
    """llama.cpp's tokenizer.ggml.pre name for a tokenizer.json's
    pre_tokenizer: "gpt-2" for a ByteLevel with GPT-2's regex, SPLIT_PRES'
    name for a Split of one of those regexes then a ByteLevel. Another one
    is refused: llama.cpp would split text by a default regex of its own
    and so tokenize differently (convert_hf_to_gguf names it by hashing
    the tokenizer's output on a sample text instead)."""
    def byte_level(step, regex):
        return (step.get("type") == "ByteLevel" and step.get("use_regex", True) == regex
                and not step.get("add_prefix_space", False))
    pre = pre or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and byte_level(steps[0], True):
        return "gpt-2"
    if len(steps) == 2 and steps[0].get("type") == "Split" and byte_level(steps[1], False) \
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
        name = SPLIT_PRES.get((steps[0].get("pattern") or {}).get("Regex"))
        if name is not None:
            return name
    raise UnsupportedError(f"{path}: field pre_tokenizer is {json.dumps(pre)[:200]}; GGUF "
                           f"export writes the byte-level pre-tokenizers llama.cpp implements: "
                           f"GPT-2's ByteLevel, or a Split of Llama 3's or Qwen2's regex before "
                           f"ByteLevel")


def tokenizer_json_vocab(path, bos=None, eos=None):
    """The Vocab of a Hugging Face tokenizer.json with a BPE model (ids
    without a token are [PAD<id>]) and a pre-tokenizer llama.cpp names
    (_pre_tokenizer)."""
    gguf = _gguf()
    try:
        raw = json.loads(Path(path).read_text())
        model = raw["model"]
        kind = model.get("type")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a readable tokenizer.json ({type(e).__name__}: "
                              f"{e})") from None
    if kind != "BPE":
        raise UnsupportedError(f"{path}: field model.type is {kind!r}; GGUF export writes BPE "
                               f"tokenizers only")
    pre = _pre_tokenizer(raw.get("pre_tokenizer"), path)
    by_id = {i: (t, gguf.TokenType.NORMAL) for t, i in model["vocab"].items()}
    for added in raw.get("added_tokens") or []:
        by_id[added["id"]] = (added["content"], gguf.TokenType.CONTROL if added.get("special")
                              else gguf.TokenType.USER_DEFINED)
    count = max(by_id) + 1 if by_id else 0
    pad = lambda i: (f"[PAD{i}]", gguf.TokenType.UNUSED)
    tokens, types = zip(*[by_id.get(i) or pad(i) for i in range(count)]) if count else ((), ())
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return Vocab(list(tokens), list(types), merges, bos, eos, pre, pads=True)


def _fit_vocab(vocab, vocab_size, source):
    """``vocab`` padded with [PAD<i>] tokens to the embedding's ``vocab_size``
    rows if it ``pads``; more tokens than rows, or fewer without padding (a
    model of another vocabulary was trained with another tokenizer), is a
    ShapeError naming ``source``."""
    count = len(vocab.tokens)
    if count > vocab_size or (not vocab.pads and count != vocab_size):
        raise ShapeError(f"{source}: the tokenizer has {count} tokens but the embedding has "
                         f"{vocab_size} rows (vocab_size): give the model's own tokenizer")
    extra = range(count, vocab_size)
    return vocab._replace(tokens=vocab.tokens + [f"[PAD{i}]" for i in extra],
                          types=vocab.types + [_gguf().TokenType.UNUSED] * len(extra))


def placeholder_vocab(size):
    """A Vocab of ``size`` tokens for a model that has no tokenizer (a
    benchmark's random one, fed token ids): the 256 byte tokens (byte b at
    id b, as GPT-2's character for it) and GPT-2's first merge ("Ġ t"), the
    least llama.cpp's byte-level tokenizer loads, then <unused{i}>."""
    gguf = _gguf()
    if size < 257:
        raise ShapeError(f"placeholder_vocab: size is {size}; at least 257 (the 256 byte "
                         f"tokens and one merge)")
    tokens = [*_byte_chars().values(), "Ġt", *(f"<unused{i}>" for i in range(257, size))]
    return Vocab(tokens, [gguf.TokenType.NORMAL] * size, ["Ġ t"], None, 0, "gpt-2")


def tokenizer_vocab(tokenizer):
    """The Vocab of a tokenizer from tokenizer.load_tokenizer: an
    HFTokenizer's tokenizer.json, or GPT-2's tiktoken Encoding; a Vocab as
    it is."""
    if isinstance(tokenizer, Vocab):
        return tokenizer
    if hasattr(tokenizer, "path"):   # an HFTokenizer: its bos is its document separator
        return tokenizer_json_vocab(tokenizer.path, tokenizer.eot_token, tokenizer.eot_token)
    return tiktoken_vocab(tokenizer)


# ---- writing -----------------------------------------------------------------

def _qtype(gguf, name, shape, dtype, head, head_dtype, experts):
    """The GGML type convert_hf_to_gguf gives a tensor: F32 for 1-D tensors,
    norms, biases, position_embd and the experts' routers (ffn_gate_inp);
    ``head_dtype`` for the ``head`` (output.weight, or token_embd.weight
    when tied); ``dtype`` for the other weights (each expert's rows
    quantised as any matrix's: the blocks run along a row of one expert),
    but with q4_0 attn_k and attn_v of a model of 8 ``experts`` Q8_0, as
    llama.cpp's quantizer raises them (seen on our f32 file)."""
    Q = gguf.GGMLQuantizationType
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") \
            or name == "position_embd.weight" or name.endswith(".ffn_gate_inp.weight"):
        return Q.F32
    if name == head:
        return Q[head_dtype.upper()]
    if dtype == "q4_0" and experts == 8 and name.endswith((".attn_k.weight", ".attn_v.weight")):
        return Q.Q8_0
    return Q[dtype.upper()]


def _quantized(gguf, data, qtype):
    """(bytes or array, type) of ``data`` as ``qtype``; a row length that is
    no whole number of blocks falls back to F16, as the converter does."""
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:
        f16 = gguf.GGMLQuantizationType.F16
        return gguf.quants.quantize(data, f16), f16


def _stacked(hf_name):
    """(the name of the tensor that stacks every expert of its layer, the
    expert) for one expert's tensor ``hf_name`` (".experts.{e}." in it), as
    convert_hf_to_gguf names the stack it makes ([E, rows, columns], expert
    e's matrix at [e]; gguf.tensor_mapping knows it); None for the others."""
    head, sep, tail = hf_name.partition(".experts.")
    expert, dot, rest = tail.partition(".")
    if not sep or not dot or not expert.isdigit():
        return None
    return f"{head}.experts.{rest}", int(expert)


def _expert_name(stacked, e):
    """Expert e's Hugging Face name in the ``stacked`` tensor (_stacked's inverse)."""
    head, _, rest = stacked.partition(".experts.")
    return f"{head}.experts.{e}.{rest}"


def gguf_tensors(config):
    """[(GGUF name, Hugging Face name)] of a model of ``config``'s tensors;
    each stack of experts (_stacked) once, by its stacked name."""
    gguf = _gguf()
    hf_arch = architecture(config)
    arch = gguf.MODEL_ARCH[gguf_arch(hf_arch).upper()]
    names = gguf.get_tensor_name_map(arch, config.num_layers)
    pairs = []
    for hf_name in hf_names(config):
        stacked = _stacked(hf_name)
        if stacked is not None:
            if stacked[1] > 0:
                continue
            hf_name = stacked[0]
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UnsupportedError(f"tensor {hf_name}: gguf.tensor_mapping has no GGUF name for "
                                   f"it in a {GGUF_ARCHS[hf_arch]} model")
        pairs.append((name, hf_name))
    return pairs


def _stacked_tensors(config, hf):
    """{Hugging Face name: array} of io.hf.hf_tensors' ``hf`` with each
    layer's experts stacked into one tensor per projection (_stacked)."""
    out = {}
    for hf_name, data in hf.items():
        stacked = _stacked(hf_name)
        if stacked is None:
            out[hf_name] = data
        elif stacked[1] == 0:
            out[stacked[0]] = np.stack([hf[_expert_name(stacked[0], e)]
                                        for e in range(config.num_experts)])
    return out


def _rope_rows(config, name):
    """The heads of a q or k tensor (weight or bias) whose rows the llama
    architecture permutes; None for the others."""
    if name.startswith("blk.") and name.split(".")[2] in ("attn_q", "attn_k"):
        return config.num_heads if name.split(".")[2] == "attn_q" else config.num_kv_heads
    return None


def write_gguf(path, config, params, dtype="f32", tokenizer=None, source=None,
               head_dtype=None):
    """Writes a GGUF file of a model of ``config`` with flat ``params``,
    weights as ``dtype`` (DTYPES), with ``tokenizer``'s vocabulary
    (tokenizer_vocab; ``source`` names it in errors), atomically."""
    gguf = _gguf()
    head_dtype = dtype if head_dtype is None else head_dtype
    for what, value in (("dtype", dtype), ("head_dtype", head_dtype)):
        if value not in DTYPES:
            raise UnsupportedError(f"{what} is {value!r}; GGUF export writes one of "
                                   f"{', '.join(DTYPES)}")
    hf_arch = architecture(config)
    arch = gguf_arch(hf_arch)
    _refuse_unexpressible(config, hf_arch)
    metadata = _metadata(config, hf_arch, arch)
    vocab = _fit_vocab(tokenizer_vocab(tokenizer), config.vocab_size, source or "tokenizer")
    hf = _stacked_tensors(config, hf_tensors(config, params))
    path = Path(path)
    made = []
    try:
        os.close(open_temporary(path, made))
        tmp = str(made[0])
        head = "token_embd.weight" if config.tied_embeddings else "output.weight"
        writer = gguf.GGUFWriter(tmp, arch)
        _add_metadata(gguf, writer, metadata, dtype)
        _add_vocab(writer, vocab)
        for name, hf_name in gguf_tensors(config):
            data = hf[hf_name]
            if hf_name.endswith(CONV1D) and arch == "gpt2":
                data = data.T
            if arch == "llama" and _rope_rows(config, name):
                data = half_split_to_interleaved(data, _rope_rows(config, name),
                                                 config.head_size)
            data = np.ascontiguousarray(data, dtype=np.float32)
            raw, qtype = _quantized(gguf, data, _qtype(gguf, name, data.shape, dtype, head,
                                                        head_dtype, config.num_experts))
            writer.add_tensor(name, raw, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException as e:
        for tmp in made:
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise WriteError(e.errno, f"{path}: cannot write ({e.strerror or e})") from e
        raise


FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16",
              "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}


def _add_metadata(gguf, writer, metadata, dtype):
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[dtype]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)


def _add_vocab(writer, vocab):
    writer.add_tokenizer_model("gpt2")
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    if vocab.bos is not None:
        writer.add_bos_token_id(vocab.bos)
    if vocab.eos is not None:
        writer.add_eos_token_id(vocab.eos)


# ---- reading -----------------------------------------------------------------

def _open(path):
    """(gguf, reader, GGUF architecture, config) of a GGUF file."""
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:   # the reader raises ValueError, struct and numpy errors alike
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: "
                              f"{e})") from None
    fields = reader.fields
    key = gguf.Keys.General.ARCHITECTURE
    arch = fields[key].contents() if key in fields else None
    if arch not in HF_ARCHS:
        raise UnsupportedError(f"{path}: metadata key {key} is {arch!r}; supported: "
                               f"{', '.join(HF_ARCHS)}")
    _check_extents(path, reader)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    config = _config(fields, path, arch, shapes)
    tokens = fields.get(gguf.Keys.Tokenizer.LIST)
    if tokens is not None and len(tokens.data) != config.vocab_size:
        raise CheckpointError(f"{path}: metadata key {gguf.Keys.Tokenizer.LIST} has "
                              f"{len(tokens.data)} tokens but tensor token_embd.weight has "
                              f"{config.vocab_size} rows")
    return gguf, reader, arch, config


def read_gguf_config(path):
    """The config of a GGUF file (its metadata and tensor shapes)."""
    return _open(path)[3]


def read_gguf(path):
    """(config, params) from a GGUF file; params is flat float32 in our
    layout, every tensor dequantised."""
    hf_arch, config, tensors = _gguf_tensors(path)
    return config, params_from_tensors(hf_arch, config, tensors, path, "metadata")


def read_gguf_into(path, put):
    """Reads a GGUF file tensor by tensor: put(name, l, float32 array) gets
    each of our tensors (layer l, None for a whole one), dequantised, without
    the vocabulary's padding rows; nothing else of the model is held at
    once. Returns the config."""
    hf_arch, config, tensors = _gguf_tensors(path)
    for name, l, value in our_tensors(hf_arch, config, tensors, path, "metadata"):
        put(name, l, value)
    return config


def _hf_arch(arch, config):
    """The Hugging Face architecture whose tensor names a GGUF file of
    ``arch`` and ``config`` is read into."""
    if config.num_experts or config.sliding_window:
        return architecture(config)
    return HF_ARCHS[arch]


def _gguf_tensors(path):
    """(Hugging Face architecture, config, _Dequantized tensors) of a GGUF file."""
    gguf, reader, arch, config = _open(path)
    return _hf_arch(arch, config), config, _Dequantized(gguf, path, reader, arch, config)


class _Dequantized:
    """A GGUF file's tensors by their Hugging Face names (as io.hf reads a
    folder's), each dequantised to float32 when it is asked for: q, k rows
    back in Hugging Face's order (llama), GPT-2's Conv1D weights transposed,
    each expert's matrix out of its layer's stack (_stacked; the last stack
    read is kept for the next expert)."""

    def __init__(self, gguf, path, reader, arch, config):
        self._gguf, self._path, self._arch, self._config = gguf, path, arch, config
        to_hf = dict(gguf_tensors(config))
        self._tensors = {}
        for t in reader.tensors:
            if t.name not in to_hf:
                raise CheckpointError(f"{path}: tensor {t.name} is not part of a {arch} model "
                                      f"with this metadata")
            self._tensors[to_hf[t.name]] = t
        _check_experts(path, arch, config, {t.name: t for t in reader.tensors})
        self._stacks = {name for name in self._tensors if ".experts." in name}
        self._experts = {_expert_name(name, e): (name, e) for name in self._stacks
                         for e in range(config.num_experts)}
        self._last = None, None   # (stacked name, its float32 values)

    def __contains__(self, hf_name):
        return hf_name in self._experts or (hf_name in self._tensors
                                            and hf_name not in self._stacks)

    def __iter__(self):
        yield from (name for name in self._tensors if name not in self._stacks)
        yield from self._experts

    def __getitem__(self, hf_name):
        if hf_name in self._experts:
            stacked, e = self._experts[hf_name]
            if self._last[0] != stacked:
                self._last = stacked, _dequantized(self._gguf, self._path,
                                                   self._tensors[stacked])
            return self._last[1][e]
        t, config = self._tensors[hf_name], self._config
        data = _dequantized(self._gguf, self._path, t)
        heads = _rope_rows(config, t.name) if self._arch == "llama" else None
        if heads and len(data) == heads * config.head_size:   # else our_tensors refuses it
            data = interleaved_to_half_split(data, heads, config.head_size)
        return data.T if self._arch == "gpt2" and hf_name.endswith(CONV1D) else data


# each MoE layer's tensors: the router [E, C], then each projection of every
# expert stacked [E, rows, columns], from the config's C, E and EH
_EXPERT_SHAPES = {"ffn_gate_inp": lambda c: (c.num_experts, c.C),
                  "ffn_gate_exps": lambda c: (c.num_experts, c.expert_hidden, c.C),
                  "ffn_up_exps": lambda c: (c.num_experts, c.expert_hidden, c.C),
                  "ffn_down_exps": lambda c: (c.num_experts, c.C, c.expert_hidden)}


def _check_experts(path, arch, config, tensors):
    """CheckpointError naming the GGUF tensor of an MoE layer that is
    missing or whose shape disagrees with the metadata (expert count, expert
    hidden size, embedding length), before any is read; ``tensors``: the
    file's, by GGUF name."""
    c = config
    if not c.num_experts:
        return
    keys = {field.name: key.names[0].format(arch=arch)
            for field, key in _declared_keys(FAMILIES[_hf_arch(arch, config)])}
    metadata = (f"{keys['num_experts']} {c.num_experts}, {keys['expert_hidden']} "
                f"{c.expert_hidden}, {keys['channels']} {c.C}")
    for l in c.moe_layers:
        for kind, shape_of in _EXPERT_SHAPES.items():
            name = f"blk.{l}.{kind}.weight"
            if name not in tensors:
                raise CheckpointError(f"{path}: tensor {name} is missing (layer {l}'s experts; "
                                      f"metadata: {metadata})")
            shape = [int(n) for n in reversed(tensors[name].shape)]
            if shape != list(shape_of(c)):
                raise CheckpointError(f"{path}: tensor {name} has shape {shape}, expected "
                                      f"{list(shape_of(c))} (metadata: {metadata})")


# our stacks of experts, from each MoE layer's GGUF stacks (expertfcw: gate then up)
_EXPERT_STACKS = {"expertfcw": ("ffn_gate_exps", "ffn_up_exps"),
                  "expertprojw": ("ffn_down_exps",)}


def read_gguf_blocks(path, qtype):
    """{our weight name: [QuantizedLinear per layer]} of the linear layers
    (qkvw, attprojw, fcw, fcprojw) whose every GGUF tensor is stored as
    ``qtype`` ("q8_0", "q4_0"): the file's blocks themselves, rows stacked
    and q, k rows permuted as read_gguf does to the floats (a block is a
    piece of one row, so rows move whole); likewise [QuantizedExperts per
    MoE layer] of the stacks of experts (expertfcw, expertprojw)."""
    from ..model.quantized import QuantizedLinear
    gguf, reader, arch, config = _open(path)
    hf_arch = _hf_arch(arch, config)
    stored = {t.name: t for t in reader.tensors}
    gguf_name = {hf: name for name, hf in gguf_tensors(config)}
    kind = gguf.GGMLQuantizationType[qtype.upper()]
    blocks = {}
    for name in ("qkvw", "attprojw", "fcw", "fcprojw"):
        templates, _ = _tensor_map(hf_arch)[name]
        layers = []
        for l in range(config.num_layers):
            parts = [stored.get(gguf_name.get(t.format(l=l))) for t in templates]
            if any(t is None or t.tensor_type != kind for t in parts):
                break   # read_gguf's floats serve it (or name what is missing)
            rows = []
            for t in parts:
                data = np.asarray(t.data)
                heads = _rope_rows(config, t.name) if arch == "llama" else None
                rows.append(interleaved_to_half_split(data, heads, config.head_size)
                            if heads else data)
            layers.append(QuantizedLinear(np.concatenate(rows), int(parts[0].shape[0]), qtype,
                                          f"{path}: {name}[{l}]"))
        else:
            blocks[name] = layers
    return blocks | _expert_blocks(path, arch, config, stored, kind, qtype)


def _expert_blocks(path, arch, config, stored, kind, qtype):
    """read_gguf_blocks' stacks of experts: {name: [QuantizedExperts per MoE
    layer]} where every layer's GGUF stacks are stored as ``kind``, gate's
    rows then up's of each expert (each [E, rows, bytes])."""
    from ..model.quantized import QuantizedExperts
    _check_experts(path, arch, config, stored)
    blocks = {}
    for name, kinds in _EXPERT_STACKS.items():
        layers = []
        for m, l in enumerate(config.moe_layers):
            parts = [stored[f"blk.{l}.{k}.weight"] for k in kinds]
            if any(t.tensor_type != kind for t in parts):
                break   # read_gguf's floats serve it
            layers.append(QuantizedExperts(
                np.concatenate([np.asarray(t.data) for t in parts], axis=1),
                int(parts[0].shape[0]), qtype,
                f"{path}: {name}[{m}] ({', '.join(t.name for t in parts)})"))
        else:
            if layers:
                blocks[name] = layers
    return blocks


def _check_extents(path, reader):
    """CheckpointError unless each tensor's bytes (by its shape and type)
    end before the next tensor's start and the file's end (the reader
    trusts the shapes)."""
    tensors = sorted(reader.tensors, key=lambda t: t.data_offset)
    ends = [t.data_offset for t in tensors[1:]] + [len(reader.data)]
    for tensor, end in zip(tensors, ends):
        if tensor.data_offset + tensor.n_bytes > end:
            shape = [int(n) for n in reversed(tensor.shape)]
            raise CheckpointError(f"{path}: tensor {tensor.name} of shape {shape} "
                                  f"({tensor.tensor_type.name}) needs {tensor.n_bytes} bytes but "
                                  f"{end - tensor.data_offset} are stored for it")


def _dequantized(gguf, path, tensor):
    """A tensor of the file as float32 in numpy's order."""
    kind = tensor.tensor_type.name
    if kind not in READ_TYPES:
        raise UnsupportedError(f"{path}: tensor {tensor.name} has type {kind}; supported: "
                               f"{', '.join(READ_TYPES)}")
    shape = tuple(int(n) for n in reversed(tensor.shape))
    values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return values.reshape(shape).astype(np.float32, copy=False)
