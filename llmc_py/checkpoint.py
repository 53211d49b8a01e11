"""llm.c's binary files: the model checkpoint and the debug-state file.

Model file (``gpt2_124M.bin``): 256 little-endian int32 header slots, then
every parameter in PARAM_SPECS order, fp32 (version 3) or bf16 (version 5).
Debug-state file (``gpt2_124M_debug_state.bin``): 256 int32 header slots,
then x and y as int32 (B*T each), logits fp32 (B*T*V, unpadded), the mean
loss fp32, and every parameter gradient fp32 in PARAM_SPECS order.

Every header field is checked, and the file size must match the header
exactly, before anything is allocated; a failure raises CheckpointError
naming the file, the field and the value.
"""
import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np

from .config import MLPS, NORMS, POSITIONS, GPT2Config, LlamaConfig
from .errors import CheckpointError, ShapeError
from .layout import PARAM_SPECS, llama_param_specs

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4

MAGIC_MODEL = 20240326
VERSION_FP32 = 3
VERSION_BF16 = 5
BYTES_PER_PARAM = {VERSION_FP32: 4, VERSION_BF16: 2}

MAGIC_DEBUG_STATE = 20240327
VERSION_DEBUG_STATE = 2

# model header slots 2..7
MODEL_FIELDS = ("max_seq_len", "vocab_size", "num_layers", "num_heads", "channels",
                "padded_vocab_size")
SLOT = {name: 2 + i for i, name in enumerate(MODEL_FIELDS)}

# no header field may exceed what the C kernels take as an int
INT32_MAX = 2**31 - 1


def num_parameters(config):
    """Total parameter count for a config (GPT2Config or LlamaConfig), as an
    exact Python int."""
    specs = llama_param_specs(config) if isinstance(config, LlamaConfig) else PARAM_SPECS
    return sum(math.prod(fn(config)) for _, fn in specs)


def read_header(path, what, error=CheckpointError):
    """(header as int64 [256], file size) of one of llm.c's files; a
    directory, an unreadable file or one shorter than a header raises
    ``error`` naming the file."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{path}: is a directory, not a {what} file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise error(f"{path}: cannot read {what} file: {e.strerror or e}") from e
    if len(raw) < HEADER_BYTES:
        raise error(f"{path}: file size {size} bytes is smaller than the {HEADER_BYTES}-byte "
                    f"{what} header (empty, truncated or not a {what} file)")
    return np.frombuffer(raw, dtype="<i4").astype(np.int64), size


def expect_magic_version(path, header, magic, version, kind):
    """Raises CheckpointError unless header slots 0 and 1 hold ``magic`` and ``version``."""
    if header[0] != magic:
        raise CheckpointError(f"{path}: header field magic is {header[0]}, expected {magic} "
                              f"(not {kind})")
    if header[1] != version:
        raise CheckpointError(f"{path}: header field version is {header[1]}, expected {version}")


def _expect_size(path, size, expected, what):
    if size != expected:
        kind = "truncated" if size < expected else "has trailing bytes"
        raise CheckpointError(f"{path}: file size is {size} bytes but its header describes "
                              f"{expected} bytes ({what} {kind})")


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
    _expect_size(path, size, expected, "model file")
    return config, version, size


def read_model(path):
    """(GPT2Config, params) from an llm.c model file; params is flat float32."""
    config, version, _ = read_model_header(path)
    count = num_parameters(config)
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        if version == VERSION_FP32:
            params = np.fromfile(f, dtype="<f4", count=count)
        else:
            # bf16 is the top half of an fp32: widen by shifting into place
            params = (np.fromfile(f, dtype="<u2", count=count).astype(np.uint32) << 16)
            params = params.view(np.float32)
    if params.size != count:   # the file shrank while we read it
        raise CheckpointError(f"{path}: expected {count} parameters, read {params.size}")
    return config, params.astype(np.float32, copy=False)


def model_header(config):
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0] = MAGIC_MODEL
    header[1] = VERSION_FP32
    for name in MODEL_FIELDS:
        value = getattr(config, name)
        if value > INT32_MAX:
            raise CheckpointError(f"config field {name}={value} does not fit an int32 header")
        header[SLOT[name]] = value
    return header


def write_model(path, config, params):
    """Writes an llm.c version-3 (fp32) model file atomically."""
    params = np.asarray(params)
    if params.dtype != np.float32 or params.size != num_parameters(config):
        raise ShapeError(f"params must be {num_parameters(config)} float32 values, "
                         f"got {params.size} {params.dtype}")
    atomic_write(path, [model_header(config).tobytes(), params.astype("<f4", copy=False)])


def atomic_write(path, chunks):
    """Writes ``chunks`` (bytes or arrays) to a temporary file in the same
    folder, fsyncs it, then renames it over ``path``: a reader sees the old
    file or the new one, never a partial one."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())   # mkstemp makes it 0600; give a normal file's mode
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                if isinstance(chunk, np.ndarray):
                    chunk.tofile(f)
                else:
                    f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:   # make the rename itself durable
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_debug_state(path, config, x, y, logits, loss, grads):
    """Writes llm.c's debug-state file: x, y int32 (B, T); logits (B, T, V or
    Vp; only the first V columns are stored); loss; grads flat in
    PARAM_SPECS order."""
    x = np.asarray(x)
    B, T = x.shape
    logits = np.asarray(logits, dtype=np.float32)[:, :, :config.vocab_size]
    grads = np.asarray(grads, dtype=np.float32).reshape(-1)
    if np.asarray(y).shape != (B, T) or logits.shape != (B, T, config.vocab_size):
        raise ShapeError(f"debug state: y {np.shape(y)} and logits {logits.shape} "
                         f"do not fit x {x.shape} and V={config.vocab_size}")
    if grads.size != num_parameters(config):
        raise ShapeError(f"debug state: {grads.size} gradients, expected "
                         f"{num_parameters(config)}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:4] = (MAGIC_DEBUG_STATE, VERSION_DEBUG_STATE, B, T)
    atomic_write(path, [header.tobytes(), x.astype("<i4"), np.asarray(y).astype("<i4"),
                        np.ascontiguousarray(logits, dtype="<f4"),
                        np.array([loss], dtype="<f4"), grads.astype("<f4", copy=False)])


def read_debug_state(path, config):
    """dict(x, y, logits (B, T, V), loss, grads flat) from a debug-state file
    written for a model of ``config``."""
    header, size = read_header(path, "debug-state")
    expect_magic_version(path, header, MAGIC_DEBUG_STATE, VERSION_DEBUG_STATE,
                         "an llm.c debug-state file")
    B, T = int(header[2]), int(header[3])
    for name, value in (("B", B), ("T", T)):
        if value <= 0:
            raise CheckpointError(f"{path}: header field {name} is {value}, must be positive")
    BT, V, P = B * T, config.vocab_size, num_parameters(config)
    _expect_size(path, size, HEADER_BYTES + 4 * (2 * BT + BT * V + 1 + P), "debug-state file")
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        x = np.fromfile(f, dtype="<i4", count=BT).reshape(B, T)
        y = np.fromfile(f, dtype="<i4", count=BT).reshape(B, T)
        logits = np.fromfile(f, dtype="<f4", count=BT * V).reshape(B, T, V)
        loss = float(np.fromfile(f, dtype="<f4", count=1)[0])
        grads = np.fromfile(f, dtype="<f4", count=P)
    return {"x": x.astype(np.int32), "y": y.astype(np.int32),
            "logits": logits.astype(np.float32), "loss": loss,
            "grads": grads.astype(np.float32)}


# ---- the Llama family's model file ------------------------------------------
#
# Our own format, in the spirit of llm.c's model file:
#   256 int32 header slots:
#     [0] MAGIC_LLAMA  [1] VERSION_LLAMA
#     [2] max_seq_len  [3] vocab_size  [4] num_layers  [5] num_heads
#     [6] channels     [7] padded_vocab_size   (the slots of llm.c's GPT-2 file)
#     [8] num_kv_heads [9] ffn_hidden
#     [10] norm      0 layernorm, 1 rmsnorm
#     [11] position  0 learned, 1 rope, 2 alibi
#     [12] mlp       0 gelu, 1 swiglu
#     [13] bias      0 or 1
#     [14] tied_embeddings  0 or 1
#   256 float32 header slots: [0] rope_theta  [1] norm_eps
#   every parameter, fp32, in layout.llama_param_specs order
# Unused slots are 0; a reader rejects any field out of its range.
MAGIC_LLAMA = 20261122
VERSION_LLAMA = 1
LLAMA_INT_SLOTS = {"max_seq_len": 2, "vocab_size": 3, "num_layers": 4, "num_heads": 5,
                   "channels": 6, "padded_vocab_size": 7, "num_kv_heads": 8, "ffn_hidden": 9}
LLAMA_CHOICE_SLOTS = {"norm": (10, NORMS), "position": (11, POSITIONS), "mlp": (12, MLPS)}
LLAMA_FLAG_SLOTS = {"bias": 13, "tied_embeddings": 14}
LLAMA_FLOAT_SLOTS = {"rope_theta": 0, "norm_eps": 1}
LLAMA_HEADER_BYTES = 2 * HEADER_BYTES


def llama_headers(config):
    """The (int32, float32) headers of a Llama model file for ``config``."""
    ints = np.zeros(HEADER_INTS, dtype="<i4")
    ints[0], ints[1] = MAGIC_LLAMA, VERSION_LLAMA
    for name, slot in LLAMA_INT_SLOTS.items():
        value = getattr(config, name)
        if value > INT32_MAX:
            raise CheckpointError(f"config field {name}={value} does not fit an int32 header")
        ints[slot] = value
    for name, (slot, choices) in LLAMA_CHOICE_SLOTS.items():
        ints[slot] = choices.index(getattr(config, name))
    for name, slot in LLAMA_FLAG_SLOTS.items():
        ints[slot] = int(getattr(config, name))
    floats = np.zeros(HEADER_INTS, dtype="<f4")
    for name, slot in LLAMA_FLOAT_SLOTS.items():
        floats[slot] = getattr(config, name)
    return ints, floats


def read_llama_header(path):
    """(LlamaConfig, file size) from a Llama model file's validated headers."""
    ints, size = read_header(path, "Llama model")
    expect_magic_version(path, ints, MAGIC_LLAMA, VERSION_LLAMA, "an llmc_py Llama model file")
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
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        floats = np.frombuffer(f.read(HEADER_BYTES), dtype="<f4")
    for name, slot in LLAMA_FLOAT_SLOTS.items():
        fields[name] = float(floats[slot])   # the config rejects <= 0, inf and NaN
    try:
        config = LlamaConfig(**fields)
    except ShapeError as e:
        raise CheckpointError(f"{path}: {e}") from None
    _expect_size(path, size, LLAMA_HEADER_BYTES + 4 * num_parameters(config), "Llama model file")
    return config, size


def read_llama(path):
    """(LlamaConfig, params) from a Llama model file; params is flat float32."""
    config, _ = read_llama_header(path)
    count = num_parameters(config)
    with open(path, "rb") as f:
        f.seek(LLAMA_HEADER_BYTES)
        params = np.fromfile(f, dtype="<f4", count=count)
    if params.size != count:   # the file shrank while we read it
        raise CheckpointError(f"{path}: expected {count} parameters, read {params.size}")
    return config, params.astype(np.float32, copy=False)


def write_llama(path, config, params):
    """Writes a Llama model file atomically."""
    params = np.asarray(params)
    if params.dtype != np.float32 or params.size != num_parameters(config):
        raise ShapeError(f"params must be {num_parameters(config)} float32 values, "
                         f"got {params.size} {params.dtype}")
    ints, floats = llama_headers(config)
    atomic_write(path, [ints.tobytes(), floats.tobytes(), params.astype("<f4", copy=False)])


def model_kind(path):
    """"gpt2" or "llama", from a model file's magic number."""
    header, _ = read_header(path, "model")
    if header[0] == MAGIC_LLAMA:
        return "llama"
    if header[0] == MAGIC_MODEL:
        return "gpt2"
    raise CheckpointError(f"{path}: header field magic is {header[0]}, expected {MAGIC_MODEL} "
                          f"(llm.c GPT-2) or {MAGIC_LLAMA} (llmc_py Llama): not a model file")


# ---- training state ---------------------------------------------------------
#
# state_%08d.bin, written beside llm.c's model_%08d.bin, holds what a resumed
# run needs besides the parameters. Our own format:
#   256 int32 header: [0] MAGIC_STATE, [1] VERSION_STATE, [2] step,
#                     [3] num_parameters (low 31 bits), [4] num_parameters >> 31,
#                     [5] byte length of the JSON block
#   m   fp32 [num_parameters]   AdamW first moment
#   v   fp32 [num_parameters]   AdamW second moment
#   JSON (utf-8): data loader position and shuffle state, every RNG state,
#                 the schedule and the run's settings
MAGIC_STATE = 20261121
VERSION_STATE = 1
STATE_SLOTS = {"step": 2, "nparams_low": 3, "nparams_high": 4, "json_bytes": 5}


def write_state(path, step, m, v, extra):
    """Writes a training-state file atomically; ``extra`` is JSON-serialisable."""
    m = np.asarray(m, dtype=np.float32).reshape(-1)
    v = np.asarray(v, dtype=np.float32).reshape(-1)
    if m.size != v.size:
        raise ShapeError(f"state: m has {m.size} values, v has {v.size}")
    blob = json.dumps(extra, sort_keys=True).encode("utf-8")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1] = MAGIC_STATE, VERSION_STATE
    header[STATE_SLOTS["step"]] = step
    header[STATE_SLOTS["nparams_low"]] = m.size & 0x7FFFFFFF
    header[STATE_SLOTS["nparams_high"]] = m.size >> 31
    header[STATE_SLOTS["json_bytes"]] = len(blob)
    atomic_write(path, [header.tobytes(), m.astype("<f4", copy=False),
                        v.astype("<f4", copy=False), blob])


def read_state(path, num_params):
    """(step, m, v, extra) from a training-state file for a model of
    ``num_params`` parameters."""
    header, size = read_header(path, "training-state")
    expect_magic_version(path, header, MAGIC_STATE, VERSION_STATE,
                         "an llmc_py training-state file")
    step = int(header[STATE_SLOTS["step"]])
    count = int(header[STATE_SLOTS["nparams_low"]]) + (int(header[STATE_SLOTS["nparams_high"]]) << 31)
    json_bytes = int(header[STATE_SLOTS["json_bytes"]])
    for name, value in (("step", step), ("json_bytes", json_bytes)):
        if value < 0:
            raise CheckpointError(f"{path}: header field {name} is {value}, must be >= 0")
    if count != num_params:
        raise CheckpointError(f"{path}: header field num_parameters is {count}, but the "
                              f"model has {num_params} (a state file from another model)")
    _expect_size(path, size, HEADER_BYTES + 8 * count + json_bytes, "training-state file")
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        m = np.fromfile(f, dtype="<f4", count=count).astype(np.float32)
        v = np.fromfile(f, dtype="<f4", count=count).astype(np.float32)
        blob = f.read(json_bytes)
    try:
        extra = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: the JSON block is not valid: {e}") from None
    except RecursionError:   # nesting deeper than the interpreter's stack
        raise CheckpointError(f"{path}: the JSON block is nested too deeply") from None
    if not isinstance(extra, dict):
        raise CheckpointError(f"{path}: the JSON block is not an object")
    return step, m, v, extra
