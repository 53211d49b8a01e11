"""llm.c's debug-state file (``gpt2_124M_debug_state.bin``): 256 int32
header slots, then x and y as int32 (B*T each), logits fp32 (B*T*V,
unpadded), the mean loss fp32, and every parameter gradient fp32 in llm.c's
parameter order."""
import numpy as np

from ..errors import CheckpointError, ShapeError
from .files import HEADER_BYTES, HEADER_INTS, atomic_write, expect_magic_version, expect_size, read_header
from ..model.layout import num_parameters

MAGIC_DEBUG_STATE = 20240327
VERSION_DEBUG_STATE = 2


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
    expect_size(path, size, HEADER_BYTES + 4 * (2 * BT + BT * V + 1 + P), "debug-state file")
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
