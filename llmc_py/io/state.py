"""The training state beside each checkpoint: AdamW moments, data position,
RNG states and the run's settings."""
import json

import numpy as np

from ..errors import CheckpointError, ShapeError
from .files import (HEADER_BYTES, HEADER_INTS, atomic_write, expect_magic_version, expect_size,
                    read_header, verify_checksum)

# ---- training state ---------------------------------------------------------
#
# state_%08d.bin, written beside llm.c's model_%08d.bin, holds what a resumed
# run needs besides the parameters. Our own format:
#   256 int32 header: [0] MAGIC_STATE, [1] VERSION_STATE, [2] step,
#                     [3] num_parameters (low 31 bits), [4] num_parameters >> 31,
#                     [5] byte length of the JSON block,
#                     [254] [255] the checksum (io.files.CHECKSUM_SLOT)
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
    atomic_write(path, [header, m.astype("<f4", copy=False), v.astype("<f4", copy=False), blob],
                 checksummed=True)


def read_state(path, num_params):
    """(step, m, v, extra) from a training-state file for a model of
    ``num_params`` parameters (None: as many as the file holds)."""
    header, size = read_header(path, "training-state")
    expect_magic_version(path, header, MAGIC_STATE, VERSION_STATE,
                         "an llmc_py training-state file")
    step = int(header[STATE_SLOTS["step"]])
    count = int(header[STATE_SLOTS["nparams_low"]]) + (int(header[STATE_SLOTS["nparams_high"]]) << 31)
    json_bytes = int(header[STATE_SLOTS["json_bytes"]])
    for name, value in (("step", step), ("json_bytes", json_bytes)):
        if value < 0:
            raise CheckpointError(f"{path}: header field {name} is {value}, must be >= 0")
    if num_params is not None and count != num_params:
        raise CheckpointError(f"{path}: header field num_parameters is {count}, but the "
                              f"model has {num_params} (a state file from another model)")
    expect_size(path, size, HEADER_BYTES + 8 * count + json_bytes, "training-state file")
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
        m = np.fromfile(f, dtype="<f4", count=count).astype(np.float32, copy=False)
        v = np.fromfile(f, dtype="<f4", count=count).astype(np.float32, copy=False)
        blob = f.read(json_bytes)
    verify_checksum(path, head, [m, v, blob])
    try:
        extra = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: the JSON block is not valid: {e}") from None
    except RecursionError:   # nesting deeper than the interpreter's stack
        raise CheckpointError(f"{path}: the JSON block is nested too deeply") from None
    if not isinstance(extra, dict):
        raise CheckpointError(f"{path}: the JSON block is not an object")
    return step, m, v, extra
