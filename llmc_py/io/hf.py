"""Hugging Face model folders, in and out: config.json and model.safetensors
(or the shards a model.safetensors.index.json lists), for GPT2LMHeadModel,
LlamaForCausalLM, MistralForCausalLM (a Llama with a sliding window),
Qwen3ForCausalLM, and the mixtures of experts MixtralForCausalLM and
Qwen3MoeForCausalLM.

Reading maps the folder's config onto a TransformerConfig and its tensors
onto our layout (model.layout.param_specs):
- GPT-2's Conv1D weights are stored (in, out): they are transposed into
  llm.c's (out, in); c_attn already packs q, k, v as our qkvw does. The
  attention-mask buffers (attn.bias, attn.masked_bias) are dropped.
- Llama, Mistral and Qwen3: q_proj, k_proj, v_proj stack into qkvw, gate_proj and
  up_proj into fcw (gate first), Qwen3's q_norm and k_norm are qnormw and
  knormw. Hugging Face's RoPE is the half-split ("rotate half") layout our
  kernels use, so q and k need no permutation (Meta's original checkpoints,
  interleaved, would; they are not read here). A model of ours with
  rope_interleaved is written with its q and k rows permuted into the
  half-split layout (io.rope_layout): the same model, as Hugging Face's.
- Mixtral and Qwen3-MoE: each expert's gate and up (Mixtral's w1, w3) stack
  into its rows of expertfcw, its down (w2) is its expertprojw, the router
  (gate) is routerw; one tensor per expert, as save_pretrained writes them.
- The vocabulary is padded to a multiple of 128 rows, as llm.c does; the
  padding rows are zero.
Writing does the reverse. A field or tensor we cannot represent (NTK rope
scaling, a sliding window on some layers only, a bias on some layers only,
an unknown tensor) is
refused with an UnsupportedError or CheckpointError naming the file and the
field or tensor; nothing is guessed.

The tensors are read and written by the ``safetensors`` package (numpy);
``ml_dtypes`` gives numpy the bf16 type most hub checkpoints use. Both come
with ``pip install "llmc_py[hf]"``.
"""
import json
import struct
from pathlib import Path

import numpy as np

from ..config import GPT2_CHOICES, MODEL_FIELDS, REQUIRED, GPT2Config, LlamaConfig, padded_vocab
from ..errors import CheckpointError, ShapeError, UnsupportedError
from ..model.layout import WHOLE_PARAMS, TensorGroup, checked_params, param_specs
from .files import atomic_write, from_bf16, to_bf16
from .rope_layout import interleaved_to_half_split

INSTALL_HINT = 'pip install "llmc_py[hf]"'
# each architecture's families of config.json keys (the fields' HFKey declarations)
FAMILIES = {"GPT2LMHeadModel": ("gpt2",), "LlamaForCausalLM": ("llama",),
            "MistralForCausalLM": ("llama", "mistral"), "Qwen3ForCausalLM": ("llama",),
            "MixtralForCausalLM": ("llama", "mistral", "mixtral"),
            "Qwen3MoeForCausalLM": ("llama", "qwen3_moe")}
ARCHITECTURES = tuple(FAMILIES)
# each architecture's model_type in config.json (transformers picks its class by it)
MODEL_TYPES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama",
               "MistralForCausalLM": "mistral", "Qwen3ForCausalLM": "qwen3",
               "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
# architectures of experts we do not read, and why
REFUSED = {
    "OlmoeForCausalLM": "its QK-norm spans the whole q and k projections, where ours "
                        "(Qwen3's) normalises each head",
    "Qwen2MoeForCausalLM": "its shared expert, which every token passes through, is not "
                           "supported",
    "DeepseekV2ForCausalLM": "its shared experts and latent attention are not supported",
    "DeepseekV3ForCausalLM": "its shared experts and latent attention are not supported",
}
CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", \
    "model.safetensors.index.json"
DTYPES = {"fp32": np.float32, "bf16": "bfloat16"}   # what write_hf stores


def _safetensors():
    """(safe_open, save) of the safetensors package, with numpy's bf16 type
    registered; UnsupportedError with the install line if either is missing."""
    try:
        import ml_dtypes  # noqa: F401  registers numpy's bfloat16, which safetensors reads
        from safetensors import safe_open
        from safetensors.numpy import save
    except ImportError as e:
        raise UnsupportedError(f"Hugging Face checkpoints need the safetensors and ml_dtypes "
                               f"packages: {INSTALL_HINT} ({e})") from None
    return safe_open, save


def require_packages():
    """UnsupportedError with the install line unless the ``[hf]`` extra's
    packages are installed: for flags that need them later, checked first."""
    _safetensors()


# ---- config.json -------------------------------------------------------------

def _field(raw, path, name, default=None, kind=int):
    """config.json's ``name`` (``default`` when absent), checked to be a ``kind``."""
    value = raw.get(name, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise CheckpointError(f"{path}: field {name} is {value!r}, expected {kind.__name__}")
    return value


def _declared_keys(arch):
    """(field, HFKey) of each field config.json holds for ``arch``."""
    for field in MODEL_FIELDS.values():
        for family in FAMILIES[arch]:
            if family in field.hf:
                yield field, field.hf[family]


def _declared_fields(raw, path, arch):
    """The fields read from config.json's declared keys for ``arch``."""
    fields = {}
    for field, key in _declared_keys(arch):
        name = next((n for n in key.also_read if n in raw and key.names[0] not in raw),
                    key.names[0])
        if raw.get(name) is None and key.missing is not REQUIRED and (
                name not in raw or key.null_is_missing):
            fields[field.name] = key.missing(fields) if callable(key.missing) else key.missing
        else:
            fields[field.name] = _field(raw, path, name, kind=field.type)
    return fields


def _declared_values(config, arch):
    """config.json's declared keys for ``arch``, with ``config``'s values."""
    values = {}
    for field, key in _declared_keys(arch):
        values.update(dict.fromkeys(key.names, getattr(config, key.written_as or field.name)))
    return values


def _refuse(path, name, value, why):
    raise UnsupportedError(f"{path}: field {name} is {value!r}: {why}")


def _rope(raw, path):
    """RoPE's config fields from transformers 4's rope_theta / rope_scaling or
    5's rope_parameters: the base, and a "linear" or "llama3" scaling; other
    scalings (yarn, dynamic, longrope) are refused."""
    params = raw.get("rope_parameters")
    scaling = params if isinstance(params, dict) and params else raw.get("rope_scaling")
    name = "rope_parameters" if scaling is params and params else "rope_scaling"
    theta = raw.get("rope_theta", 10000.0)
    if scaling in (None, {}):
        scaling = {}
    elif not isinstance(scaling, dict):
        _refuse(path, name, scaling, "expected an object")
    theta = scaling.get("rope_theta", theta)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise CheckpointError(f"{path}: field rope_theta is {theta!r}, expected a positive "
                              f"number")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    fields = dict(rope_theta=float(theta))
    if kind == "default":
        return fields
    if kind not in ("linear", "llama3"):
        _refuse(path, f"{name}.rope_type", kind, "supported: default, linear, llama3")
    fields.update(rope_scaling=kind, rope_factor=_field(scaling, path, "factor", kind=float))
    if kind == "llama3":
        fields.update(
            rope_original_max=_field(scaling, path, "original_max_position_embeddings"),
            rope_low_freq_factor=_field(scaling, path, "low_freq_factor", kind=float),
            rope_high_freq_factor=_field(scaling, path, "high_freq_factor", kind=float))
    return fields


def _hf_rope(config):
    """config.json's rope_scaling for a config (None for plain RoPE)."""
    c = config
    if c.rope_scaling == "none":
        return None
    if c.rope_scaling == "ntk":
        raise UnsupportedError("rope_scaling='ntk' has no Hugging Face rope_type (its "
                               "'dynamic' changes with the length): export refuses it")
    scaling = dict(rope_type=c.rope_scaling, factor=c.rope_factor)
    if c.rope_scaling == "llama3":
        scaling.update(original_max_position_embeddings=c.rope_original_max,
                       low_freq_factor=c.rope_low_freq_factor,
                       high_freq_factor=c.rope_high_freq_factor)
    return scaling


def _gpt2_config(raw, path):
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        _refuse(path, "activation_function", act, "GPT-2's GELU here is the tanh "
                "approximation (gelu_new)")
    for name, expected in (("scale_attn_weights", True),
                           ("scale_attn_by_inverse_layer_idx", False)):
        if raw.get(name, expected) != expected:
            _refuse(path, name, raw[name], f"only {expected} is supported")
    fields = _declared_fields(raw, path, "GPT2LMHeadModel")
    if fields["num_heads"] > 0 and fields["channels"] % fields["num_heads"]:
        _refuse(path, "n_head", fields["num_heads"], f"it must divide n_embd = "
                f"{fields['channels']}")
    fields["padded_vocab_size"] = padded_vocab(fields["vocab_size"])
    gpt2 = LlamaConfig(num_kv_heads=fields["num_heads"], **GPT2_CHOICES | fields)
    if gpt2.is_gpt2:   # llm.c's model file can hold it
        return GPT2Config(**{k: v for k, v in fields.items() if k not in GPT2_CHOICES})
    return gpt2


def _moe_fields(raw, path, arch):
    """What config.json says of the experts beyond the declared keys: a
    router_aux_loss_coef counts only with output_router_logits (transformers
    adds the loss only then); what we cannot hold is refused."""
    if arch == "MixtralForCausalLM" and raw.get("router_jitter_noise", 0.0) not in (0, 0.0, None):
        _refuse(path, "router_jitter_noise", raw["router_jitter_noise"],
                "the router's training noise is not supported (only 0)")
    if arch == "Qwen3MoeForCausalLM" and raw.get("mlp_only_layers") not in (None, []):
        _refuse(path, "mlp_only_layers", raw["mlp_only_layers"], "dense layers are set by "
                "decoder_sparse_step alone here (every n-th layer MoE); only [] is supported")
    if not _field(raw, path, "output_router_logits", False, bool):
        return dict(router_aux_loss=0.0)
    return {}


def _llama_config(raw, path, arch):
    qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        _refuse(path, "hidden_act", act, "the MLP is SwiGLU (silu)")
    if raw.get("pretraining_tp", 1) != 1:
        _refuse(path, "pretraining_tp", raw["pretraining_tp"], "only 1 is supported")
    attention_bias = _field(raw, path, "attention_bias", False, bool)
    mlp_bias = _field(raw, path, "mlp_bias", False, bool) if not qwen3 else False
    if attention_bias != mlp_bias:
        _refuse(path, "attention_bias", attention_bias, f"biases must be on every linear "
                f"layer or none (mlp_bias is {mlp_bias})")
    layer_types = raw.get("layer_types") or []
    if raw.get("use_sliding_window", False) or not isinstance(layer_types, list) or any(
            kind != "full_attention" for kind in layer_types):
        _refuse(path, "use_sliding_window" if raw.get("use_sliding_window") else "layer_types",
                raw.get("use_sliding_window") or raw.get("layer_types"),
                "sliding-window attention is not supported")
    fields = _declared_fields(raw, path, arch) | dict(
        norm="rmsnorm", position="rope", mlp="swiglu", bias=attention_bias, qk_norm=qwen3,
        **_rope(raw, path))
    if arch in MOE_ARCHITECTURES:
        fields |= _moe_fields(raw, path, arch)
        # transformers' balancing loss is k times ours (config.router_aux_loss)
        fields["router_aux_loss"] *= fields["experts_per_token"]
    fields["padded_vocab_size"] = padded_vocab(fields["vocab_size"])
    return LlamaConfig(**fields)


def read_hf_config(folder):
    """(architecture, config) from a Hugging Face folder's config.json (or
    from the path of such a JSON file itself)."""
    path = Path(folder) if Path(folder).is_file() else Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG_FILE}: not a Hugging Face model folder "
                              f"(or a model file: give its path)")
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    archs = raw.get("architectures")
    if isinstance(archs, list) and len(archs) == 1 and archs[0] in REFUSED:
        raise UnsupportedError(f"{path}: field architectures is {archs!r}: {REFUSED[archs[0]]}")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise UnsupportedError(f"{path}: field architectures is {archs!r}; supported: one of "
                               f"{', '.join(ARCHITECTURES)}")
    arch = archs[0]
    model_type = raw.get("model_type")
    if model_type is not None and model_type != MODEL_TYPES[arch]:
        _refuse(path, "model_type", model_type, f"{arch}'s is {MODEL_TYPES[arch]!r}")
    try:
        if arch == "GPT2LMHeadModel":
            config = _gpt2_config(raw, path)
        else:
            config = _llama_config(raw, path, arch)
    except ShapeError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return arch, config


def architecture(config):
    """The Hugging Face class a config is written as."""
    if config.block != "pre":
        raise UnsupportedError(f"no Hugging Face architecture we write holds block="
                               f"{config.block!r}: GPT-2, Llama and Qwen3 are pre-norm")
    if config.num_experts:
        return _moe_architecture(config)
    if config.norm == "layernorm" and config.position == "learned" and config.mlp == "gelu" \
            and config.bias and config.num_kv_heads == config.num_heads \
            and config.head_size * config.num_heads == config.channels \
            and config.norm_eps == GPT2_CHOICES["norm_eps"]:
        return "GPT2LMHeadModel"
    if config.sliding_window:
        if config.norm == "rmsnorm" and config.position == "rope" and config.mlp == "swiglu" \
                and not config.qk_norm and not config.bias:
            return "MistralForCausalLM"
        raise UnsupportedError(f"sliding_window={config.sliding_window} is written as "
                               f"MistralForCausalLM, which has rmsnorm, rope, swiglu, no "
                               f"qk_norm and no biases; this model has norm={config.norm!r}, "
                               f"position={config.position!r}, mlp={config.mlp!r}, "
                               f"qk_norm={config.qk_norm}, bias={config.bias}")
    if config.norm == "rmsnorm" and config.position == "rope" and config.mlp == "swiglu":
        return "Qwen3ForCausalLM" if config.qk_norm else "LlamaForCausalLM"
    raise UnsupportedError(
        f"no Hugging Face architecture holds norm={config.norm!r}, "
        f"position={config.position!r}, mlp={config.mlp!r}, bias={config.bias}, "
        f"num_kv_heads={config.num_kv_heads}: GPT-2 (layernorm, learned, gelu, bias, "
        f"multi-head) or Llama/Qwen3 (rmsnorm, rope, swiglu) only")


def _moe_architecture(config):
    """Qwen3MoeForCausalLM for experts with qk_norm, MixtralForCausalLM
    without; UnsupportedError naming what neither holds."""
    c = config
    if c.norm != "rmsnorm" or c.position != "rope" or c.mlp != "swiglu":
        raise UnsupportedError(f"Mixtral and Qwen3-MoE have rmsnorm, rope and swiglu experts; "
                               f"this model has norm={c.norm!r}, position={c.position!r}, "
                               f"mlp={c.mlp!r}")
    if c.qk_norm:
        if c.sliding_window:
            raise UnsupportedError(f"sliding_window={c.sliding_window}: Qwen3MoeForCausalLM "
                                   f"(experts with qk_norm) is written without one")
        return "Qwen3MoeForCausalLM"
    if c.moe_every != 1 or not c.norm_topk_prob:
        raise UnsupportedError(f"MixtralForCausalLM (experts without qk_norm) has experts in "
                               f"every layer, their weights renormalised; this model has "
                               f"moe_every={c.moe_every}, norm_topk_prob={c.norm_topk_prob}")
    return "MixtralForCausalLM"


def _hf_moe(config, arch):
    """config.json's fields for the experts beyond the declared keys."""
    fields = dict(output_router_logits=config.router_aux_loss > 0,
                  router_aux_loss_coef=config.router_aux_loss / config.experts_per_token)
    if arch == "MixtralForCausalLM":
        return fields | dict(router_jitter_noise=0.0,
                             sliding_window=config.sliding_window or None)
    return fields | dict(mlp_only_layers=[], use_sliding_window=False)


def hf_config(config):
    """config.json's fields for ``config`` (architecture() says which class)."""
    arch = architecture(config)
    c = config
    if arch == "GPT2LMHeadModel":
        return dict(architectures=[arch], model_type=MODEL_TYPES[arch],
                    **_declared_values(c, arch), activation_function="gelu_new",
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, torch_dtype="float32")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        bias = {}   # Mistral and Mixtral have no bias fields
    elif arch == "LlamaForCausalLM" and c.bias:
        bias = dict(attention_bias=True, mlp_bias=True)
    elif c.bias:
        raise UnsupportedError("Qwen3ForCausalLM has no biases on its MLP: a qk_norm model "
                               "with bias=True has no Hugging Face architecture")
    else:
        bias = dict(attention_bias=False) | ({} if c.qk_norm else dict(mlp_bias=False))
    return dict(architectures=[arch], model_type=MODEL_TYPES[arch],
                **_declared_values(c, arch), hidden_act="silu", rope_theta=c.rope_theta,
                rope_scaling=_hf_rope(c),
                rope_parameters=dict(_hf_rope(c) or dict(rope_type="default"),
                                     rope_theta=c.rope_theta),
                attention_dropout=0.0, torch_dtype="float32", **bias) \
        | (_hf_moe(c, arch) if arch in MOE_ARCHITECTURES else {})


# ---- the tensors -------------------------------------------------------------
#
# Per parameter of ours: the Hugging Face tensors it is made of ({l} is the
# layer), stacked by rows in this order, and whether they are stored (in, out)
# (GPT-2's Conv1D) and need a transpose.

def _tensor_map(arch):
    if arch == "GPT2LMHeadModel":
        h = "transformer.h.{l}."
        return {
            "wte": (["transformer.wte.weight"], False), "wpe": (["transformer.wpe.weight"], False),
            "ln1w": ([h + "ln_1.weight"], False), "ln1b": ([h + "ln_1.bias"], False),
            "qkvw": ([h + "attn.c_attn.weight"], True), "qkvb": ([h + "attn.c_attn.bias"], False),
            "attprojw": ([h + "attn.c_proj.weight"], True),
            "attprojb": ([h + "attn.c_proj.bias"], False),
            "ln2w": ([h + "ln_2.weight"], False), "ln2b": ([h + "ln_2.bias"], False),
            "fcw": ([h + "mlp.c_fc.weight"], True), "fcb": ([h + "mlp.c_fc.bias"], False),
            "fcprojw": ([h + "mlp.c_proj.weight"], True),
            "fcprojb": ([h + "mlp.c_proj.bias"], False),
            "lnfw": (["transformer.ln_f.weight"], False), "lnfb": (["transformer.ln_f.bias"], False),
            "lm_head": (["lm_head.weight"], False),
        }
    h, att, mlp = "model.layers.{l}.", "model.layers.{l}.self_attn.", "model.layers.{l}.mlp."
    # the experts as save_pretrained writes them (transformers 5 fuses them
    # in memory but saves each expert's matrices apart): Mixtral's
    # block_sparse_moe w1 (gate), w3 (up), w2 (down); Qwen3-MoE's mlp
    if arch == "MixtralForCausalLM":
        moe, gate, up, down = h + "block_sparse_moe.", "w1", "w3", "w2"
    else:
        moe, gate, up, down = mlp, "gate_proj", "up_proj", "down_proj"
    expert = moe + "experts.{e}."
    return {
        "wte": (["model.embed_tokens.weight"], False),
        "ln1w": ([h + "input_layernorm.weight"], False),
        "qkvw": ([att + "q_proj.weight", att + "k_proj.weight", att + "v_proj.weight"], False),
        "qkvb": ([att + "q_proj.bias", att + "k_proj.bias", att + "v_proj.bias"], False),
        "qnormw": ([att + "q_norm.weight"], False), "knormw": ([att + "k_norm.weight"], False),
        "attprojw": ([att + "o_proj.weight"], False), "attprojb": ([att + "o_proj.bias"], False),
        "ln2w": ([h + "post_attention_layernorm.weight"], False),
        "fcw": ([mlp + "gate_proj.weight", mlp + "up_proj.weight"], False),
        "fcb": ([mlp + "gate_proj.bias", mlp + "up_proj.bias"], False),
        "fcprojw": ([mlp + "down_proj.weight"], False), "fcprojb": ([mlp + "down_proj.bias"], False),
        "routerw": ([moe + "gate.weight"], False),
        "expertfcw": ([expert + gate + ".weight", expert + up + ".weight"], False),
        "expertprojw": ([expert + down + ".weight"], False),
        "lnfw": (["model.norm.weight"], False), "lm_head": (["lm_head.weight"], False),
    }


# tensors a folder may hold that carry nothing of the model: GPT-2's causal
# masks, an old RoPE frequency cache
_IGNORED = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


# ... of the dense MLP layers alone, of the MoE layers, and per expert of those
_DENSE_MLP = ("fcw", "fcb", "fcprojw", "fcprojb")
_MOE = ("routerw", "expertfcw", "expertprojw")
_PER_EXPERT = ("expertfcw", "expertprojw")


def _pieces(config, name):
    """(index into our tensor, template keys) of each piece of our ``name``
    that Hugging Face stores apart, one at a time: the whole tensor (index
    None), one per layer it has (index i for the i-th of those layers, keys
    l), or one per expert of each MoE layer (index (i, e), keys l and e)."""
    c = config
    if name in WHOLE_PARAMS:
        yield None, {}
        return
    layers = range(c.num_layers)
    if name in _MOE or name in _DENSE_MLP:
        layers = (l for l in layers if c.is_moe_layer(l) == (name in _MOE))
    for i, l in enumerate(layers):
        if name in _PER_EXPERT:
            for e in range(c.num_experts):
                yield (i, e), dict(l=l, e=e)
        else:
            yield i, dict(l=l)


def _part_rows(config, name, templates):
    """Rows of each Hugging Face part of one piece of our ``name``, when it
    is stacked from several (q, k, v; gate, up); else None."""
    if len(templates) == 1:
        return None
    c = config
    if name.startswith("qkv"):
        return [c.attn_channels, c.kv_dim, c.kv_dim]
    hidden = c.expert_hidden if name == "expertfcw" else c.FF
    return [hidden, hidden]


def hf_tensors(config, params):
    """{Hugging Face name: array} for a model of ``config`` with flat
    float32 ``params``, or with {our name: array} (e.g. a frozen bf16
    base's, some as bf16 bits in uint16), each array in its own dtype (the
    inverse of what read_hf does)."""
    arch = architecture(config)
    names = _tensor_map(arch)
    out = {}
    if not isinstance(params, dict):
        params = TensorGroup(param_specs(config), config, memory=checked_params(config, params))
    for name, _ in param_specs(config):
        tensor = params[name]
        if name == "wte" or name == "lm_head":
            tensor = tensor[:config.vocab_size]   # without the padding rows
        templates, transposed = names[name]
        rows = _part_rows(config, name, templates)
        for at, keys in _pieces(config, name):
            value = tensor if at is None else tensor[at]
            parts = [value] if rows is None else np.split(value, np.cumsum(rows)[:-1], axis=0)
            for template, part in zip(templates, parts):
                hf_name = template.format(**keys)
                if config.rope_interleaved:
                    part = _as_half_split(config, hf_name, part)
                out[hf_name] = np.ascontiguousarray(part.T if transposed else part)
    return out


def _as_half_split(config, hf_name, tensor):
    """A q or k tensor (projection rows, bias, qk_norm weight) of a model with
    Meta's interleaved RoPE, reordered for Hugging Face's half-split RoPE
    (io.rope_layout): the same model. Other tensors are returned as they are."""
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads, "q_norm": 1,
             "k_norm": 1}
    for part, count in heads.items():
        if f".{part}." in hf_name:
            return interleaved_to_half_split(tensor, count, config.head_size)
    return tensor


def _open_files(folder):
    """{Hugging Face tensor name: file} from the index, or the one file."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index}: expected a JSON object with a weight_map "
                                  f"({type(e).__name__}: {e})") from None
        files = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or "/" in file or "\\" in file or file.startswith("."):
                raise CheckpointError(f"{index}: tensor {name} maps to {file!r}, not a file "
                                      f"name in the folder")
            files[name] = folder / file
        return files, index
    single = folder / WEIGHTS_FILE
    if not single.is_file():
        raise CheckpointError(f"{folder}: no {WEIGHTS_FILE} and no {INDEX_FILE} (only "
                              f"safetensors weights are read)")
    return None, single


class _Tensors:
    """{name: array} of every tensor in a folder's safetensors file(s), read
    one at a time when asked for (in the file's dtype), so that a reader
    never holds more than the tensor it is copying; ``rename`` maps a
    stored name to the one asked for."""

    def __init__(self, folder):
        safe_open, _ = _safetensors()
        self._safe_open = safe_open
        files, self.source = _open_files(folder)
        self.files = {}   # name: file
        for file in ([self.source] if files is None else sorted(set(files.values()))):
            if not file.is_file():
                raise CheckpointError(f"{self.source}: lists {file.name}, which is missing")
            with self._open(file) as f:
                keys = set(f.keys())
            wanted = keys if files is None else [n for n, f_ in files.items() if f_ == file]
            for name in wanted:
                if name not in keys:
                    raise CheckpointError(f"{file}: tensor {name} (listed in "
                                          f"{self.source.name}) is not in the file")
                if not name.endswith(_IGNORED):
                    self.files[name] = file
        self.stored = {name: name for name in self.files}   # asked-for name: stored name

    def _open(self, file):
        try:
            return self._safe_open(str(file), framework="numpy")
        except Exception as e:   # safetensors' own errors: a bad header, offsets
            raise CheckpointError(f"{file}: not a readable safetensors file "
                                  f"({type(e).__name__}: {e})") from None

    def rename(self, fn):
        self.stored = {fn(name): stored for name, stored in self.stored.items()}

    def pop(self, name, default=None):
        self.stored.pop(name, default)

    def __contains__(self, name):
        return name in self.stored

    def __iter__(self):
        return iter(self.stored)

    def __getitem__(self, name):
        stored = self.stored[name]
        file = self.files[stored]
        with self._open(file) as f:
            try:
                array = f.get_tensor(stored)
            except Exception as e:
                raise CheckpointError(f"{file}: tensor {stored} cannot be read "
                                      f"({type(e).__name__}: {e})") from None
        return _checked_float(array, file, stored)


def _checked_float(array, file, name):
    if array.dtype.name not in ("float32", "float16", "bfloat16", "float64"):
        raise CheckpointError(f"{file}: tensor {name} has dtype {array.dtype.name}; expected "
                              f"a float type")
    return array


def _as_float32(array, file, name):
    return np.asarray(_checked_float(array, file, name), dtype=np.float32)


def _folder_tensors(folder):
    """(arch, config, _Tensors) of a Hugging Face model folder, named as
    _tensor_map names them."""
    arch, config = read_hf_config(folder)
    tensors = _Tensors(folder)
    # a GPT-2 folder written by an older transformers has no "transformer." prefix
    if arch == "GPT2LMHeadModel" and "transformer.wte.weight" not in tensors:
        tensors.rename(lambda n: n if n == "lm_head.weight" else "transformer." + n)
    if config.tied_embeddings:
        tensors.pop("lm_head.weight")   # the same numbers as the embedding
    return arch, config, tensors


def read_hf(folder):
    """(config, params) from a Hugging Face model folder; params is flat
    float32 in our layout."""
    arch, config, tensors = _folder_tensors(folder)
    return config, params_from_tensors(arch, config, tensors, folder, "config.json")


def read_hf_into(folder, config, put):
    """Reads a Hugging Face model folder of ``config`` (read_hf_config's)
    tensor by tensor: put(name, at, array) gets each piece of our tensors
    (``at`` indexes it: None for a whole one, i for its i-th layer, (i, e)
    for expert e of its i-th layer; see _pieces) in the file's dtype,
    without the vocabulary's padding rows; nothing else of the model is held
    at once."""
    arch, _, tensors = _folder_tensors(folder)
    for name, at, value in our_tensors(arch, config, tensors, folder, "config.json"):
        put(name, at, value)


def params_from_tensors(arch, config, tensors, source, config_source):
    """Flat float32 params in our layout from {Hugging Face name: array} of
    an ``arch`` (io.gguf reads a GGUF file into these names too); see
    our_tensors for the checks."""
    group = TensorGroup(param_specs(config), config)
    for name, at, value in our_tensors(arch, config, tensors, source, config_source):
        view = group[name] if at is None else group[name][at]
        view[:len(value)] = value   # wte, lm_head: the padding rows stay zero
    return group.memory


def our_tensors(arch, config, tensors, source, config_source):
    """(our name, index, array) for each piece of our tensors (_pieces) of a model of
    ``config`` from {Hugging Face name: array} of an ``arch``, in the
    arrays' dtype, the embedding without its padding rows; a tensor
    missing, of the wrong shape or left over is a CheckpointError naming
    ``source`` and the tensor, its shape checked against ``config_source``."""
    names = _tensor_map(arch)
    folder = source   # the name the messages below give the file
    used = set()
    for name, fn in param_specs(config):
        shape = tuple(fn(config))
        templates, transposed = names[name]
        rows = _part_rows(config, name, templates)
        for at, keys in _pieces(config, name):
            parts = []
            for i, template in enumerate(templates):
                hf_name = template.format(**keys)
                if hf_name not in tensors:
                    raise CheckpointError(f"{folder}: tensor {hf_name} is missing (needed for "
                                          f"{name} of a {arch} with this {config_source})")
                value = tensors[hf_name]
                used.add(hf_name)
                value = value.T if transposed else value
                depth = 0 if at is None else 1 if isinstance(at, int) else len(at)
                expected = _hf_shape(config, name, shape[depth:], rows, i)
                if value.shape != expected:
                    stored = tuple(reversed(expected)) if transposed else expected
                    raise CheckpointError(f"{folder}: tensor {hf_name} has shape "
                                          f"{list(value.T.shape if transposed else value.shape)}"
                                          f", expected {list(stored)} (from {config_source})")
                parts.append(value)
            yield name, at, parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    unused = sorted(set(tensors) - used)
    if unused:
        raise CheckpointError(f"{folder}: tensor {unused[0]} is not part of a {arch} with this "
                              f"{config_source} ({len(unused)} such tensors): an option llmc_py "
                              f"does not support?")


def hf_names(config):
    """The Hugging Face names of a model of ``config``'s tensors, in our
    parameters' order."""
    names = _tensor_map(architecture(config))
    for name, _ in param_specs(config):
        for _, keys in _pieces(config, name):
            for template in names[name][0]:
                yield template.format(**keys)


def _hf_shape(config, name, shape, rows, part):
    """The shape Hugging Face's part ``part`` of a piece of our tensor of
    ``shape`` has (after any transpose)."""
    if name in ("wte", "lm_head"):
        shape = (config.V,) + shape[1:]
    if rows is not None:
        shape = (rows[part],) + shape[1:]
    return shape


# config.json fields about the tokenizer, which our model files do not hold;
# an export may carry them over from the folder it started from
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def token_ids(folder):
    """The TOKEN_ID_FIELDS of a Hugging Face folder's config.json ({} if none)."""
    try:
        raw = json.loads((Path(folder) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: raw[k] for k in TOKEN_ID_FIELDS if isinstance(raw, dict) and k in raw}


def write_hf(folder, config, params, dtype="fp32", token_ids=None):
    """Writes a Hugging Face model folder: config.json (with ``token_ids``,
    e.g. {"eos_token_id": 2}, when given) and model.safetensors (``dtype``
    "fp32", or "bf16" rounded to nearest even), each atomically, the weights
    first. ``params``: as hf_tensors takes them (bf16 bits, uint16, are
    written as they are in bf16, widened exactly in fp32).
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype is {dtype!r}, expected one of {tuple(DTYPES)}")
    _safetensors()
    raw = hf_config(config) | dict(token_ids or {})
    tensors = hf_tensors(config, params)
    if dtype == "bf16":
        import ml_dtypes
        tensors = {n: (t if t.dtype == np.uint16 else to_bf16(t)).view(ml_dtypes.bfloat16)
                   for n, t in tensors.items()}
        raw["torch_dtype"] = "bfloat16"
    else:
        tensors = {n: from_bf16(t) if t.dtype == np.uint16 else t for n, t in tensors.items()}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
    atomic_write(folder / CONFIG_FILE, [(json.dumps(raw, indent=2) + "\n").encode()])


# safetensors' names of the dtypes written
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16"}


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: array} (float32, or ml_dtypes' bfloat16) as a
    safetensors file, atomically, straight from the arrays: no copy of the
    file in memory (safetensors.numpy.save makes two), so saving a model
    costs no more than it holds. The format: the JSON header's length (8
    bytes, little-endian), the header (each tensor's dtype, shape and byte
    range; padded with spaces to 8 bytes), then the tensors' bytes."""
    header, chunks, offset = {"__metadata__": dict(metadata)} if metadata else {}, [], 0
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        header[name] = {"dtype": SAFETENSORS_DTYPES[array.dtype.name],
                        "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        chunks.append(array.view(np.uint8).reshape(-1))
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    atomic_write(path, [struct.pack("<Q", len(text)), text, *chunks])
