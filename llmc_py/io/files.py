"""Generic file helpers: atomic writes, the 256-int32 header that every
binary file here (llm.c's and ours) starts with, its checksum slots, and bf16
numbers as files store them."""
import os
import random
import re
import struct
import zlib
from pathlib import Path

import numpy as np

from .._native import kernels as K
from ..errors import CheckpointError, WriteError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4

# no header field may exceed what the C kernels take as an int
INT32_MAX = 2**31 - 1

# The checkpoints we write (both model files and the training state) record a
# checksum in the last two int32 header slots, which no format here uses
# otherwise (llm.c reads slots 0-7 of its model file and writes 0 in the rest):
#   [254] CHECKSUM_MARKER: a checksum is recorded (0: none, as in llm.c's files)
#   [255] the CRC-32 (zlib.crc32, as uint32) of the whole file read with this
#         slot as 0: the header too, since a changed header field that still
#         passes its checks (a Llama model's RoPE pairing or base, a state's
#         step) would otherwise load silently as something else
CHECKSUM_MARKER_SLOT = 254
CHECKSUM_SLOT = 255
CHECKSUM_MARKER = 20261125
# the random part of a temporary file's name (remove_temporaries knows it)
NAME_CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789_"


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
    """Raises CheckpointError unless header slots 0 and 1 hold ``magic`` and
    ``version`` (one int, or a tuple of the versions accepted)."""
    if header[0] != magic:
        raise CheckpointError(f"{path}: header field magic is {header[0]}, expected {magic} "
                              f"(not {kind})")
    versions = version if isinstance(version, tuple) else (version,)
    if header[1] not in versions:
        expected = " or ".join(str(v) for v in versions)
        raise CheckpointError(f"{path}: header field version is {header[1]}, expected {expected}")


def expect_size(path, size, expected, what):
    if size != expected:
        kind = "truncated" if size < expected else "has trailing bytes"
        raise CheckpointError(f"{path}: file size is {size} bytes but its header describes "
                              f"{expected} bytes ({what} {kind})")


def to_bf16(values):
    """``values`` rounded to the nearest bf16 as the kernels round them
    (float_to_bf16: ties to even, a NaN stays a quiet NaN), as uint16."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = np.empty(values.shape, np.uint16)
    if values.size:   # the kernel takes no empty array
        K.float_to_bf16(bits, values)
    return bits


def from_bf16(bits):
    """float32 from bf16 numbers (uint16), exactly (bf16_to_float)."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    values = np.empty(bits.shape, np.float32)
    if bits.size:
        K.bf16_to_float(values, bits)
    return values


def verify_checksum(path, head, data):
    """Raises CheckpointError unless the CRC-32 recorded in the file's header
    matches its contents: ``head``, its bytes up to the data (the int32
    header first), then ``data``, the rest as read (buffers or arrays), so the
    data are not read twice. A file with none recorded (llm.c's) passes."""
    recorded, found = checksum_of_head(path, head)
    if recorded is None:
        return
    for chunk in data:
        found = zlib.crc32(chunk, found)
    expect_checksum(path, recorded, found)


def checksum_of_head(path, head):
    """(the CRC-32 the header of ``head`` records, or None if it records
    none (llm.c's files), the CRC-32 of ``head`` as written), for
    verify_checksum or a reader that sums the data as it reads them."""
    header = np.frombuffer(head, dtype="<i4", count=HEADER_INTS)
    marker = int(header[CHECKSUM_MARKER_SLOT])
    if marker == 0:
        return None, 0
    if marker != CHECKSUM_MARKER:
        raise CheckpointError(f"{path}: header slot {CHECKSUM_MARKER_SLOT} is {marker}, expected "
                              f"0 (no checksum) or {CHECKSUM_MARKER} (checksum recorded)")
    as_written = header.copy()
    as_written[CHECKSUM_SLOT] = 0
    return int(header.view("<u4")[CHECKSUM_SLOT]), zlib.crc32(head[HEADER_BYTES:],
                                                             zlib.crc32(as_written))


def expect_checksum(path, recorded, found):
    if found != recorded:
        raise CheckpointError(f"{path}: checksum does not match: the header records CRC-32 "
                              f"{recorded:#010x}, the contents give {found:#010x} (the file is "
                              f"corrupted)")


def atomic_write(path, chunks, checksummed=False):
    """Writes ``chunks`` (bytes or arrays) to a temporary file in the same
    folder, fsyncs it, then renames it over ``path``: a reader sees the old
    file or the new one, never a partial one. A failure removes the
    temporary file and raises WriteError naming ``path`` and the reason.
    With ``checksummed`` the first chunk is the file's int32 header, written
    with the checksum slots filled in: the CRC-32 is accumulated as the
    chunks are written and put in its slot last, so nothing is read back."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    made = []
    try:
        fd = open_temporary(path, made)
        with os.fdopen(fd, "wb") as f:
            crc = 0
            for i, chunk in enumerate(chunks):
                if checksummed and i == 0:
                    chunk = np.array(chunk, dtype="<i4")
                    chunk[CHECKSUM_MARKER_SLOT], chunk[CHECKSUM_SLOT] = CHECKSUM_MARKER, 0
                if isinstance(chunk, np.ndarray):   # its bytes, uncopied (a full disk
                    chunk = np.ascontiguousarray(chunk).data   # then raises ENOSPC)
                f.write(chunk)
                if checksummed:
                    crc = zlib.crc32(chunk, crc)
            if checksummed:
                f.seek(4 * CHECKSUM_SLOT)
                f.write(struct.pack("<I", crc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(made[0], path)
    except BaseException as e:
        for tmp in made:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, WriteError):
            raise WriteError(e.errno, f"{path}: cannot write ({e.strerror or e})") from e
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


def open_temporary(path, made):
    """Creates atomic_write's temporary file for ``path`` beside it
    (".NAME.<8 random characters>.tmp", a normal file's mode) and returns
    its descriptor; its name is appended to ``made`` before the file exists,
    so that a signal raised anywhere after (Ctrl-C, SIGTERM) still finds it
    to remove."""
    folder = path.parent if str(path.parent) else Path(".")
    while True:
        made.append(folder / f".{path.name}.{''.join(random.choices(NAME_CHARACTERS, k=8))}.tmp")
        try:
            return os.open(made[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            made.pop()   # another writer's


def remove_temporaries(folder, names):
    """Deletes atomic_write's temporary files for the files ``names`` in
    ``folder`` (".NAME.<mkstemp's 8 characters>.tmp"), which stay behind only
    when a writer was killed; returns how many."""
    ours = re.compile(r"\.(" + "|".join(map(re.escape, names)) + r")\.[a-z0-9_]{8}\.tmp")
    stale = [path for path in Path(folder).iterdir() if ours.fullmatch(path.name)]
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)
