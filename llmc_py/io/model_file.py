"""Model files: llm.c's GPT-2 checkpoint and our Llama-family file.

llm.c's model file (``gpt2_124M.bin``): 256 little-endian int32 header slots,
then every parameter in llm.c's order (model.layout), fp32 (version 3) or bf16
(version 5). Every header field is checked, and the file size must match the
header exactly, before anything is allocated; a failure raises
CheckpointError naming the file, the field and the value. The files we write
also record a checksum in slots 254-255 (io.files.CHECKSUM_SLOT), which
llm.c does not read; a file without one (llm.c's) loads unverified.
"""
import math
import zlib

import numpy as np

from ..config import MODEL_FIELDS, GPT2Config, LlamaConfig
from ..errors import CheckpointError, ShapeError
from ..model.layout import WHOLE_PARAMS, TensorGroup, checked_params, num_parameters, param_specs
from .files import (HEADER_BYTES, HEADER_INTS, INT32_MAX, atomic_write, checksum_of_head,
                    expect_checksum, expect_magic_version, expect_size, from_bf16, read_header,
                    to_bf16)

MAGIC_MODEL = 20240326
VERSION_FP32 = 3
VERSION_BF16 = 5
BYTES_PER_PARAM = {VERSION_FP32: 4, VERSION_BF16: 2}

# model header slots 2..7
GPT2_FIELDS = ("max_seq_len", "vocab_size", "num_layers", "num_heads", "channels",
               "padded_vocab_size")
SLOT = {name: 2 + i for i, name in enumerate(GPT2_FIELDS)}



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
    for name in GPT2_FIELDS:
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
    return config, _read_params(path, HEADER_BYTES, config, version == VERSION_BF16)


def read_model_into(path, put):
    """Reads an llm.c model file tensor by tensor (_read_params_into); its config."""
    config, version, _ = read_model_header(path)
    _read_params_into(path, HEADER_BYTES, config, version == VERSION_BF16, put)
    return config


def _read_params(path, offset, config, bf16):
    """The parameters of ``config`` at byte ``offset`` of a model file, flat
    float32, stored as fp32 or (``bf16``) as bf16; its checksum verified."""
    group = TensorGroup(param_specs(config), config)

    def put(name, l, values):
        (group[name] if l is None else group[name][l])[...] = values
    _read_params_into(path, offset, config, bf16, put)
    return group.memory


def _read_params_into(path, offset, config, bf16, put):
    """Reads the parameters of ``config`` at byte ``offset`` of a model file
    (fp32, or ``bf16``) tensor by tensor: put(name, l, float32 array) gets
    each (l its index in the per-layer stack, None for a whole one), and
    nothing else is held at once.
    The checksum, summed as the bytes are read, is verified after the last."""
    with open(path, "rb") as f:
        head = f.read(offset)
        recorded, found = checksum_of_head(path, head)
        for name, fn in param_specs(config):
            shape = fn(config)
            # per-layer tensors stack one per layer that has them (dense or MoE MLPs: some)
            for l in [None] if name in WHOLE_PARAMS else range(shape[0]):
                part = shape if l is None else shape[1:]
                count = math.prod(part)
                stored = np.fromfile(f, dtype="<u2" if bf16 else "<f4", count=count)
                if stored.size != count:   # the file shrank while we read it
                    raise CheckpointError(f"{path}: tensor {name} is cut short: expected "
                                          f"{count} parameters, read {stored.size}")
                if recorded is not None:
                    found = zlib.crc32(stored, found)
                values = from_bf16(stored) if bf16 else stored.astype(np.float32, copy=False)
                put(name, l, values.reshape(part))
    if recorded is not None:
        expect_checksum(path, recorded, found)


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
    for name in GPT2_FIELDS:
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
    atomic_write(path, [model_header(config, version), data], checksummed=True)


# ---- the Llama family's model file ------------------------------------------
#
# Our own format, in the spirit of llm.c's model file:
#   256 int32 header slots: [0] MAGIC_LLAMA  [1] VERSION_LLAMA, then each
#     model field at its slot (config.TransformerConfig's declarations):
#     slots 2-7 are those of llm.c's GPT-2 file; a choice is held as its
#     index in config's tuple (NORMS, ...), a bool as 0 or 1
#   256 float32 header slots: the float fields
#   every parameter in layout.param_specs order: fp32 (version 1) or bf16
#   (version 2)
# and int32 slots 254-255 hold the checksum (io.files.CHECKSUM_SLOT).
# Unused slots are 0; a reader rejects any field out of its range. Slots that
# came later hold 0 in files from before, which reads as before (a Slot's
# zero_reads_as); the RoPE scaling's factors and context are read only when
# it is not "none". ffn_hidden is always explicit, so the Llama rule's two
# fields only record how it was chosen.
MAGIC_LLAMA = 20261122
VERSION_LLAMA = 1
VERSION_LLAMA_BF16 = 2
LLAMA_BYTES_PER_PARAM = {VERSION_LLAMA: 4, VERSION_LLAMA_BF16: 2}
LLAMA_HEADER_BYTES = 2 * HEADER_BYTES
# the fields the header holds, in the order they are read (a field's only_with first)
LLAMA_FIELDS = [f for f in MODEL_FIELDS.values() if f.slot]


def llama_headers(config, version=VERSION_LLAMA):
    """The (int32, float32) headers of a Llama model file for ``config``."""
    ints = np.zeros(HEADER_INTS, dtype="<i4")
    ints[0], ints[1] = MAGIC_LLAMA, version
    floats = np.zeros(HEADER_INTS, dtype="<f4")
    for field in LLAMA_FIELDS:
        value = getattr(config, field.name)
        if field.type is float:
            floats[field.slot.index] = value
            continue
        value = field.choices.index(value) if field.choices else int(value)
        if value > INT32_MAX:
            raise CheckpointError(f"config field {field.name}={value} does not fit an int32 "
                                  f"header")
        ints[field.slot.index] = value
    return ints, floats


def _header_field(path, field, ints, floats):
    """A field's value from the headers, checked as far as the header alone can be."""
    name, slot = field.name, field.slot
    if field.type is float:   # the config rejects <= 0, inf and NaN
        return _before_slot(slot, float(floats[slot.index]))
    code = int(ints[slot.index])
    if field.type is bool:
        if code not in (0, 1):
            raise CheckpointError(f"{path}: header field {name} is {code}, expected 0 or 1")
        return bool(code)
    if field.choices:
        if not 0 <= code < len(field.choices):
            raise CheckpointError(f"{path}: header field {name} is {code}, expected one of "
                                  + ", ".join(f"{i} ({c})" for i, c in enumerate(field.choices)))
        return field.choices[code]
    if slot.range and not slot.range.holds(code):
        raise CheckpointError(f"{path}: header field {name} is {code}, must be "
                              f"{slot.range.describe()}")
    return _before_slot(slot, code)   # the config checks the rest


def _before_slot(slot, value):
    """A slot's value, or for a 0 in a slot that came later what a file from
    before it means."""
    return slot.zero_reads_as if value == 0 and slot.zero_reads_as is not None else value


def read_llama_header(path):
    """(LlamaConfig, version, file size) from a Llama model file's validated headers."""
    ints, size = read_header(path, "Llama model")
    expect_magic_version(path, ints, MAGIC_LLAMA, tuple(LLAMA_BYTES_PER_PARAM),
                         "an llmc_py Llama model file")
    version = int(ints[1])
    if size < LLAMA_HEADER_BYTES:
        raise CheckpointError(f"{path}: file size {size} bytes is smaller than the "
                              f"{LLAMA_HEADER_BYTES}-byte Llama header (truncated)")
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        floats = np.frombuffer(f.read(HEADER_BYTES), dtype="<f4")
    fields = {}
    for field in LLAMA_FIELDS:
        needs = field.slot.only_with
        if needs and fields[needs] == MODEL_FIELDS[needs].default:
            continue   # e.g. RoPE scaling's factors, with no RoPE scaling: left at their defaults
        fields[field.name] = _header_field(path, field, ints, floats)
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
    return config, _read_params(path, LLAMA_HEADER_BYTES, config, version == VERSION_LLAMA_BF16)


def read_llama_into(path, put):
    """Reads a Llama model file tensor by tensor (_read_params_into); its config."""
    config, version, _ = read_llama_header(path)
    _read_params_into(path, LLAMA_HEADER_BYTES, config, version == VERSION_LLAMA_BF16, put)
    return config


def write_llama(path, config, params, dtype="fp32"):
    """Writes a Llama model file atomically: version 1 (fp32), or with
    ``dtype="bf16"`` version 2 (each parameter rounded to the nearest bf16)."""
    data = _param_bytes(config, params, dtype)
    ints, floats = llama_headers(config, VERSION_LLAMA if dtype == "fp32" else VERSION_LLAMA_BF16)
    atomic_write(path, [ints, floats, data], checksummed=True)
