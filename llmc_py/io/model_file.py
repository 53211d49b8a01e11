"""Model files: llm.c's GPT-2 checkpoint and our Llama-family file.

llm.c's model file (``gpt2_124M.bin``): 256 little-endian int32 header slots,
then every parameter in llm.c's order (model.layout), fp32 (version 3) or bf16
(version 5). Every header field is checked, and the file size must match the
header exactly, before anything is allocated; a failure raises
CheckpointError naming the file, the field and the value.
"""
import numpy as np

from ..config import (BLOCKS, FFN_MULTIPLE, MLPS, NORMS, POSITIONS, ROPE_SCALINGS, GPT2Config,
                      LlamaConfig)
from ..errors import CheckpointError, ShapeError
from ..model.layout import checked_params, num_parameters
from .files import (HEADER_BYTES, HEADER_INTS, INT32_MAX, atomic_write, expect_magic_version,
                    expect_size, from_bf16, read_header, to_bf16)

MAGIC_MODEL = 20240326
VERSION_FP32 = 3
VERSION_BF16 = 5
BYTES_PER_PARAM = {VERSION_FP32: 4, VERSION_BF16: 2}

# model header slots 2..7
MODEL_FIELDS = ("max_seq_len", "vocab_size", "num_layers", "num_heads", "channels",
                "padded_vocab_size")
SLOT = {name: 2 + i for i, name in enumerate(MODEL_FIELDS)}



def read_model_header(path):
    """(GPT2Config, version, file size) from a model file's validated header."""
    header, size = read_header(path, "model")
    if header[0] != MAGIC_MODEL:
        raise CheckpointError(f"{path}: header field magic is {header[0]}, expected "
                              f"{MAGIC_MODEL} (not an llm.c model file)")
    version = int(header[1])
    if version not in BYTES_PER_PARAM:
        raise CheckpointError(f"{path}: header field version is {version}, expected "
                              f"{VERSION_FP32} (fp32) or {VERSION_BF16} (bf16); "
                              f"re-export the model with llm.c's train_gpt2.py")
    fields = {}
    for name in MODEL_FIELDS:
        value = int(header[SLOT[name]])
        if value <= 0:
            raise CheckpointError(f"{path}: header field {name} is {value}, must be positive")
        fields[name] = value
    try:
        config = GPT2Config(**fields)
    except ShapeError as e:
        raise CheckpointError(f"{path}: {e}") from None
    expected = HEADER_BYTES + num_parameters(config) * BYTES_PER_PARAM[version]
    expect_size(path, size, expected, "model file")
    return config, version, size


def read_model(path):
    """(GPT2Config, params) from an llm.c model file; params is flat float32."""
    config, version, _ = read_model_header(path)
    return config, _read_params(path, HEADER_BYTES, num_parameters(config),
                                version == VERSION_BF16)


def _read_params(path, offset, count, bf16):
    """The ``count`` parameters at byte ``offset`` of a model file, flat
    float32, stored as fp32 or (``bf16``) as bf16."""
    with open(path, "rb") as f:
        f.seek(offset)
        stored = np.fromfile(f, dtype="<u2" if bf16 else "<f4", count=count)
    if stored.size != count:   # the file shrank while we read it
        raise CheckpointError(f"{path}: expected {count} parameters, read {stored.size}")
    return from_bf16(stored) if bf16 else stored.astype(np.float32, copy=False)


DTYPES = ("fp32", "bf16")   # a model file's parameters


def _param_bytes(config, params, dtype):
    """The parameters as a model file stores them: little-endian fp32 or bf16."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype is {dtype!r}, expected one of {DTYPES}")
    params = checked_params(config, params)
    return params.astype("<f4", copy=False) if dtype == "fp32" else to_bf16(params)


def model_header(config, version=VERSION_FP32):
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0] = MAGIC_MODEL
    header[1] = version
    for name in MODEL_FIELDS:
        value = getattr(config, name)
        if value > INT32_MAX:
            raise CheckpointError(f"config field {name}={value} does not fit an int32 header")
        header[SLOT[name]] = value
    return header


def write_model(path, config, params, dtype="fp32"):
    """Writes an llm.c model file atomically: version 3 (fp32), or with
    ``dtype="bf16"`` version 5 (each parameter rounded to the nearest bf16)."""
    data = _param_bytes(config, params, dtype)
    version = VERSION_FP32 if dtype == "fp32" else VERSION_BF16
    atomic_write(path, [model_header(config, version).tobytes(), data])


# ---- the Llama family's model file ------------------------------------------
#
# Our own format, in the spirit of llm.c's model file:
#   256 int32 header slots:
#     [0] MAGIC_LLAMA  [1] VERSION_LLAMA
#     [2] max_seq_len  [3] vocab_size  [4] num_layers  [5] num_heads
#     [6] channels     [7] padded_vocab_size   (the slots of llm.c's GPT-2 file)
#     [8] num_kv_heads [9] ffn_hidden
#     [10] norm      0 layernorm, 1 rmsnorm
#     [11] position  0 learned, 1 rope, 2 alibi, 3 sinusoidal
#     [12] mlp       0 gelu, 1 swiglu, 2 relu, 3 gelu_erf, 4 geglu, 5 reglu
#     [13] bias      0 or 1
#     [14] tied_embeddings  0 or 1
#     [15] head_dim  0 (channels / num_heads) or the head size (Qwen3)
#     [16] qk_norm   0 or 1 (RMSNorm on each q and k head before RoPE; its
#          weights qnormw, knormw [L, hs] follow qkvb in the parameters)
#     [17] ffn_multiple_of  the Llama hidden-size rule's rounding (0: 32)
#     [18] block     0 pre, 1 post, 2 parallel (the norms' places)
#     [19] sliding_window  0 (none) or the keys a query attends to
#     [20] rope_interleaved  0 (pairs i, i + hs/2) or 1 (pairs 2i, 2i + 1)
#     [24] rope_scaling  0 none, 1 linear, 2 ntk, 3 llama3
#     [25] rope_original_max  (llama3)
#   256 float32 header slots: [0] rope_theta  [1] norm_eps  [2] rope_factor
#     [3] rope_low_freq_factor  [4] rope_high_freq_factor  (read when [24] != 0)
#     [8] ffn_dim_multiplier  the Llama rule's factor (0: 1)
#   every parameter in layout.param_specs order: fp32 (version 1) or bf16
#   (version 2)
# Unused slots are 0; a reader rejects any field out of its range. Slots 15
# to 20, 24, 25 and float slots 2-4 and 8 came later: files from before hold
# 0 there, which reads as before. ffn_hidden is always explicit, so the
# Llama rule's two fields only record how it was chosen.
MAGIC_LLAMA = 20261122
VERSION_LLAMA = 1
VERSION_LLAMA_BF16 = 2
LLAMA_BYTES_PER_PARAM = {VERSION_LLAMA: 4, VERSION_LLAMA_BF16: 2}
LLAMA_INT_SLOTS = {"max_seq_len": 2, "vocab_size": 3, "num_layers": 4, "num_heads": 5,
                   "channels": 6, "padded_vocab_size": 7, "num_kv_heads": 8, "ffn_hidden": 9}
LLAMA_CHOICE_SLOTS = {"norm": (10, NORMS), "position": (11, POSITIONS), "mlp": (12, MLPS),
                      "block": (18, BLOCKS)}
LLAMA_FLAG_SLOTS = {"bias": 13, "tied_embeddings": 14, "qk_norm": 16, "rope_interleaved": 20}
LLAMA_HEAD_DIM_SLOT = 15
LLAMA_FLOAT_SLOTS = {"rope_theta": 0, "norm_eps": 1, "ffn_dim_multiplier": 8}
# later slots, and the value their 0 (a file from before them) stands for
LLAMA_LATER_INT_SLOTS = {"ffn_multiple_of": (17, FFN_MULTIPLE), "sliding_window": (19, 0)}
LLAMA_LATER_FLOAT_SLOTS = {"ffn_dim_multiplier": 1.0}
# RoPE scaling: its kind and trained context (int slots), its factors (float slots)
LLAMA_ROPE_SCALING_SLOT, LLAMA_ROPE_ORIGINAL_MAX_SLOT = 24, 25
LLAMA_ROPE_FLOAT_SLOTS = {"rope_factor": 2, "rope_low_freq_factor": 3,
                          "rope_high_freq_factor": 4}
LLAMA_HEADER_BYTES = 2 * HEADER_BYTES


def llama_headers(config, version=VERSION_LLAMA):
    """The (int32, float32) headers of a Llama model file for ``config``."""
    ints = np.zeros(HEADER_INTS, dtype="<i4")
    ints[0], ints[1] = MAGIC_LLAMA, version
    for name, slot in LLAMA_INT_SLOTS.items():
        value = getattr(config, name)
        if value > INT32_MAX:
            raise CheckpointError(f"config field {name}={value} does not fit an int32 header")
        ints[slot] = value
    for name, (slot, choices) in LLAMA_CHOICE_SLOTS.items():
        ints[slot] = choices.index(getattr(config, name))
    for name, slot in LLAMA_FLAG_SLOTS.items():
        ints[slot] = int(getattr(config, name))
    ints[LLAMA_HEAD_DIM_SLOT] = config.head_dim
    for name, (slot, _) in LLAMA_LATER_INT_SLOTS.items():
        ints[slot] = getattr(config, name)
    ints[LLAMA_ROPE_SCALING_SLOT] = ROPE_SCALINGS.index(config.rope_scaling)
    ints[LLAMA_ROPE_ORIGINAL_MAX_SLOT] = config.rope_original_max
    floats = np.zeros(HEADER_INTS, dtype="<f4")
    for name, slot in (LLAMA_FLOAT_SLOTS | LLAMA_ROPE_FLOAT_SLOTS).items():
        floats[slot] = getattr(config, name)
    return ints, floats


def read_llama_header(path):
    """(LlamaConfig, version, file size) from a Llama model file's validated headers."""
    ints, size = read_header(path, "Llama model")
    expect_magic_version(path, ints, MAGIC_LLAMA, tuple(LLAMA_BYTES_PER_PARAM),
                         "an llmc_py Llama model file")
    version = int(ints[1])
    if size < LLAMA_HEADER_BYTES:
        raise CheckpointError(f"{path}: file size {size} bytes is smaller than the "
                              f"{LLAMA_HEADER_BYTES}-byte Llama header (truncated)")
    fields = {}
    for name, slot in LLAMA_INT_SLOTS.items():
        value = int(ints[slot])
        if value <= 0:
            raise CheckpointError(f"{path}: header field {name} is {value}, must be positive")
        fields[name] = value
    for name, (slot, choices) in LLAMA_CHOICE_SLOTS.items():
        code = int(ints[slot])
        if not 0 <= code < len(choices):
            raise CheckpointError(f"{path}: header field {name} is {code}, expected one of "
                                  + ", ".join(f"{i} ({c})" for i, c in enumerate(choices)))
        fields[name] = choices[code]
    for name, slot in LLAMA_FLAG_SLOTS.items():
        flag = int(ints[slot])
        if flag not in (0, 1):
            raise CheckpointError(f"{path}: header field {name} is {flag}, expected 0 or 1")
        fields[name] = bool(flag)
    fields["head_dim"] = int(ints[LLAMA_HEAD_DIM_SLOT])
    if fields["head_dim"] < 0:
        raise CheckpointError(f"{path}: header field head_dim is {fields['head_dim']}, must "
                              f"be >= 0 (0: channels / num_heads)")
    for name, (slot, before) in LLAMA_LATER_INT_SLOTS.items():
        fields[name] = int(ints[slot]) or before   # the config rejects < 0
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        floats = np.frombuffer(f.read(HEADER_BYTES), dtype="<f4")
    for name, slot in LLAMA_FLOAT_SLOTS.items():
        fields[name] = float(floats[slot])   # the config rejects <= 0, inf and NaN
        if fields[name] == 0.0 and name in LLAMA_LATER_FLOAT_SLOTS:
            fields[name] = LLAMA_LATER_FLOAT_SLOTS[name]
    code = int(ints[LLAMA_ROPE_SCALING_SLOT])
    if not 0 <= code < len(ROPE_SCALINGS):
        raise CheckpointError(f"{path}: header field rope_scaling is {code}, expected one of "
                              + ", ".join(f"{i} ({c})" for i, c in enumerate(ROPE_SCALINGS)))
    if code:
        fields["rope_scaling"] = ROPE_SCALINGS[code]
        fields["rope_original_max"] = int(ints[LLAMA_ROPE_ORIGINAL_MAX_SLOT])
        for name, slot in LLAMA_ROPE_FLOAT_SLOTS.items():
            fields[name] = float(floats[slot])
    try:
        config = LlamaConfig(**fields)
    except ShapeError as e:
        raise CheckpointError(f"{path}: {e}") from None
    expect_size(path, size, LLAMA_HEADER_BYTES + LLAMA_BYTES_PER_PARAM[version]
                * num_parameters(config), "Llama model file")
    return config, version, size


def read_llama(path):
    """(LlamaConfig, params) from a Llama model file; params is flat float32."""
    config, version, _ = read_llama_header(path)
    return config, _read_params(path, LLAMA_HEADER_BYTES, num_parameters(config),
                                version == VERSION_LLAMA_BF16)


def write_llama(path, config, params, dtype="fp32"):
    """Writes a Llama model file atomically: version 1 (fp32), or with
    ``dtype="bf16"`` version 2 (each parameter rounded to the nearest bf16)."""
    data = _param_bytes(config, params, dtype)
    ints, floats = llama_headers(config, VERSION_LLAMA if dtype == "fp32" else VERSION_LLAMA_BF16)
    atomic_write(path, [ints.tobytes(), floats.tobytes(), data])
