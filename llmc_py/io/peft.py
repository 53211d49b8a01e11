"""PEFT's LoRA folders, in and out: adapter_config.json and
adapter_model.safetensors, as peft's save_pretrained writes them for a
GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM or Qwen3ForCausalLM
(io.hf) and PeftModel.from_pretrained reads them.

A tensor is named by its module in the Hugging Face model, e.g.
base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight; lora_A is
(r, in) and lora_B (out, r), also for GPT-2's Conv1D layers (peft's
fan_in_fan_out concerns the base weight only). Options that change what
an adapter computes and that model.lora does not (DoRA, biases, rank or
alpha per module, adapters on some layers only, saved extra modules, ...)
are refused by name; options that only concern how peft initialised or
trained the adapter are ignored.
"""
import json
from pathlib import Path

from ..errors import CheckpointError, UnsupportedError
from ..model.lora import Lora, layer_prefix
from .files import atomic_write
from .hf import _as_float32, _safetensors, architecture, write_safetensors

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# options that change the adapted model, each with the value that leaves it
# as model.lora computes it (peft's default); other values are refused. The
# first ones are written too (older peft versions know them all)
WRITTEN = {"use_dora": False, "bias": "none", "modules_to_save": None,
           "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
           "alpha_pattern": {}}
NEUTRAL = {**WRITTEN, "lora_bias": False, "layer_replication": None,
           "trainable_token_indices": None, "target_parameters": None, "exclude_modules": None,
           "use_qalora": False, "alora_invocation_tokens": None, "use_bdlora": None,
           "arrow_config": None, "kasa_config": None, "monteclora_config": None,
           "velora_config": None}
TASK_TYPES = ("CAUSAL_LM", None)   # None: a PeftModel without a task's head


def _key(config, target, l, matrix):
    """peft's name of layer l's ``matrix`` ("lora_A", "lora_B") of ``target``."""
    return f"base_model.model.{layer_prefix(config).format(l=l)}{target.module}.{matrix}.weight"


def _tensors(lora):
    """{peft's name: our view} of every adapter tensor."""
    out = {}
    for t in lora.targets:
        for l in range(lora.config.L):
            out[_key(lora.config, t, l, "lora_A")] = lora.params[t.name + ".A"][l]
            out[_key(lora.config, t, l, "lora_B")] = lora.params[t.name + ".B"][l]
    return out


def _checked_architecture(config):
    arch = architecture(config)   # UnsupportedError for a model no Hugging Face class holds
    if config.rope_interleaved:
        raise UnsupportedError("PEFT folders of a model with rope_interleaved are not written "
                               "or read: Hugging Face's q and k rows are in another order")
    return arch


def write_peft(folder, lora):
    """Writes ``lora`` (model.lora.Lora) as a PEFT folder, each file atomically."""
    arch = _checked_architecture(lora.config)
    _safetensors()
    raw = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
           "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
           "use_rslora": lora.rslora, "target_modules": [t.name for t in lora.targets],
           "fan_in_fan_out": arch == "GPT2LMHeadModel", "init_lora_weights": True,
           "inference_mode": True, **WRITTEN}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / WEIGHTS_FILE, _tensors(lora), metadata={"format": "pt"})
    atomic_write(folder / CONFIG_FILE, [(json.dumps(raw, indent=2) + "\n").encode()])


def read_peft(folder, config):
    """The Lora of a PEFT folder, for a model of ``config``. CheckpointError
    or UnsupportedError names the file and the field or tensor at fault."""
    _checked_architecture(config)
    folder = Path(folder)
    path = folder / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
        assert isinstance(raw, dict)
    except (OSError, ValueError, AssertionError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: expected a JSON object ({type(e).__name__}: {e})") \
            from None
    if raw.get("peft_type") != "LORA":
        raise UnsupportedError(f"{path}: peft_type is {raw.get('peft_type')!r}; only LORA is read")
    if raw.get("task_type") not in TASK_TYPES:
        raise UnsupportedError(f"{path}: task_type is {raw.get('task_type')!r}; only CAUSAL_LM "
                               f"is read")
    for name, neutral in NEUTRAL.items():
        value = raw.get(name, neutral)
        if value != neutral and not (neutral is None and value in ({}, [])):
            raise UnsupportedError(f"{path}: {name} is {value!r}; only {neutral!r} is supported")
    modules = raw.get("target_modules")
    if modules == "all-linear":
        modules = None
    elif not isinstance(modules, list):
        raise UnsupportedError(f"{path}: target_modules is {modules!r}; a list of module names "
                               f"or 'all-linear' is read (not a regular expression)")
    try:
        lora = Lora(config, raw.get("r"), raw.get("lora_alpha"), modules,
                    raw.get("lora_dropout", 0.0), raw.get("use_rslora", False))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    _read_tensors(folder / WEIGHTS_FILE, lora)
    return lora


def _read_tensors(path, lora):
    """Reads every adapter tensor of ``lora`` from ``path``, checked by name and shape."""
    safe_open, _ = _safetensors()
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (only safetensors adapters are read)")
    wanted = _tensors(lora)
    try:
        with safe_open(str(path), framework="numpy") as f:
            names = set(f.keys())
            extra = sorted(names - set(wanted))
            if extra:
                raise CheckpointError(f"{path}: tensor {extra[0]} adapts nothing in this model "
                                      f"(the targets of {CONFIG_FILE}, in every layer)")
            for name, view in wanted.items():
                if name not in names:
                    raise CheckpointError(f"{path}: tensor {name} is missing")
                tensor = _as_float32(f.get_tensor(name), path, name)
                if tensor.shape != view.shape:
                    raise CheckpointError(f"{path}: tensor {name} has shape {tensor.shape}; "
                                          f"this model's is {view.shape}")
                view[...] = tensor
    except CheckpointError:
        raise
    except Exception as e:   # safetensors' own errors: a bad header, offsets, dtypes
        raise CheckpointError(f"{path}: not a readable safetensors file "
                              f"({type(e).__name__}: {e})") from None
