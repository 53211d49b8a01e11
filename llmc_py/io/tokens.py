"""llm.c's token files (``train.bin``, ``val.bin``, fineweb shards), and the
manifest that makes a prepared set of them one whole.

256 little-endian int32 header slots [0] magic, [1] version, [2] number of
tokens; then that many token ids. Two kinds, as llm.c writes them:
- GPT-2's: magic 20240520, version 1, uint16 ids;
- Llama 3's: magic 20240801, version 7, uint32 ids, for tokenizers whose
  vocabulary does not fit in uint16 (Llama 3's 128,256 ids, Qwen3's 151,936).
The file size must be exactly HEADER_BYTES + (2 or 4) * ntok. A malformed
file raises DataError naming the file, the field and the value.

``manifest.json`` beside a prepared set: ``{"complete": false}`` while it is
being written, then ``{"complete": true, "files": {name: {"tokens": n,
"fingerprint": f}}}`` once every file is in place. A loader refuses a file
of a folder whose manifest is incomplete or lists it with another
fingerprint: a preparation that was cut short never passes for a whole set.

A loss mask (ours, not llm.c's) may sit beside a token file: ``NAME.mask``
beside ``NAME.bin`` (another suffix, so no ``*.bin`` pattern takes it for a
shard). 256 little-endian int32 header slots [0] MAGIC_MASK, [1]
VERSION_MASK, [2] number of tokens (the token file's); then one uint8 per
token, 1 where that token is trained when it is a target, 0 where it is not
(a chat's prompt: the data loader makes such targets IGNORE_INDEX). A token
file without a mask trains every token.
"""
import hashlib
import json
import os
from pathlib import Path

import numpy as np

# the token ids' checks live with the kernels, which need them; users and the
# data loader find them here, beside the files
from .._native.tokens import IGNORE_INDEX, first_out_of_vocab  # noqa: F401
from ..errors import DataError
from .files import HEADER_BYTES, HEADER_INTS, INT32_MAX, atomic_write, read_header

MAGIC_TOKENS = 20240520
VERSION_TOKENS = 1           # uint16 tokens
TOKEN_DTYPE = np.dtype("<u2")
MAX_TOKEN_ID = 65535
MAGIC_TOKENS_32 = 20240801   # llm.c's Llama 3 token files
VERSION_TOKENS_32 = 7
TOKEN_DTYPE_32 = np.dtype("<u4")
# (magic, version) -> the ids' type
TOKEN_FORMATS = {(MAGIC_TOKENS, VERSION_TOKENS): TOKEN_DTYPE,
                 (MAGIC_TOKENS_32, VERSION_TOKENS_32): TOKEN_DTYPE_32}
NTOK_SLOT = 2


def token_dtype(vocab_size):
    """The ids' type of a token file for a vocabulary of ``vocab_size``."""
    return TOKEN_DTYPE if vocab_size <= MAX_TOKEN_ID + 1 else TOKEN_DTYPE_32


def write_tokens(path, tokens, dtype=TOKEN_DTYPE):
    """Writes llm.c's token file for the 1-D integer ``tokens``, atomically:
    uint16 ids (GPT-2's file), or with ``dtype`` uint32 Llama 3's file."""
    dtype = np.dtype(dtype)
    if dtype not in (TOKEN_DTYPE, TOKEN_DTYPE_32):
        raise ValueError(f"dtype is {dtype}, expected uint16 or uint32")
    max_id = np.iinfo(dtype).max
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise DataError(f"{path}: tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and tokens.dtype.kind not in "iu":
        raise DataError(f"{path}: tokens must be integers, got dtype {tokens.dtype}")
    if tokens.size > INT32_MAX:
        raise DataError(f"{path}: {tokens.size} tokens do not fit the int32 header")
    if tokens.size:
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi > max_id:
            bad = int(np.argmax((tokens < 0) | (tokens > max_id)))
            raise DataError(f"{path}: token {bad} is {int(tokens[bad])}, outside "
                            f"[0, {max_id}] ({dtype.name} token file)")
    magic, version = next(key for key, kind in TOKEN_FORMATS.items() if kind == dtype)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, version, tokens.size)
    atomic_write(path, [header.tobytes(), tokens.astype(dtype)])


def read_tokens_header(path):
    """The token count of a token file, after checking its header and size."""
    return token_file_info(path)[0]


def token_file_info(path):
    """(token count, ids' dtype) of a token file, after checking its header
    and size."""
    header, size = read_header(path, "token", DataError)
    magics = {magic: version for magic, version in TOKEN_FORMATS}
    if header[0] not in magics:
        raise DataError(f"{path}: header field magic is {header[0]}, expected "
                        f"{MAGIC_TOKENS} (uint16 ids) or {MAGIC_TOKENS_32} (uint32 ids): not "
                        f"an llm.c token file")
    if header[1] != magics[header[0]]:
        raise DataError(f"{path}: header field version is {header[1]}, expected "
                        f"{magics[header[0]]} for magic {header[0]}")
    dtype = TOKEN_FORMATS[(int(header[0]), int(header[1]))]
    ntok = int(header[NTOK_SLOT])
    if ntok < 0:
        raise DataError(f"{path}: header field ntok is {ntok}, must be >= 0")
    expected = HEADER_BYTES + dtype.itemsize * ntok
    if size != expected:
        kind = "truncated" if size < expected else "has trailing bytes"
        raise DataError(f"{path}: file size is {size} bytes but header field ntok={ntok} "
                        f"describes {expected} bytes (token file {kind})")
    return ntok, dtype


def read_tokens(path):
    """The tokens of a validated token file as a read-only uint16 (or uint32)
    np.memmap (an empty array for a file of 0 tokens, which cannot be mapped)."""
    ntok, dtype = token_file_info(path)
    if ntok == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(ntok,))


MAGIC_MASK = 20261125
VERSION_MASK = 1
MASK_SUFFIX = ".mask"


def mask_path(token_path):
    """Where the loss mask of the token file ``token_path`` is: NAME.mask."""
    return Path(token_path).with_suffix(MASK_SUFFIX)


def write_mask(path, mask):
    """Writes the loss mask file ``path`` for the 1-D ``mask`` of 0s and 1s
    (one per token), atomically."""
    mask = np.asarray(mask)
    if mask.ndim != 1 or (mask.size and (mask.dtype.kind not in "biu" or mask.max() > 1
                                         or mask.min() < 0)):
        raise DataError(f"{path}: a loss mask is 1-D 0s and 1s, got shape {mask.shape} "
                        f"dtype {mask.dtype}")
    if mask.size > INT32_MAX:
        raise DataError(f"{path}: {mask.size} tokens do not fit the int32 header")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC_MASK, VERSION_MASK, mask.size)
    atomic_write(path, [header.tobytes(), mask.astype(np.uint8)])


def read_mask_header(path):
    """The token count of a loss mask file, after checking its header and size."""
    header, size = read_header(path, "loss mask", DataError)
    for slot, field, expected in ((0, "magic", MAGIC_MASK), (1, "version", VERSION_MASK)):
        if header[slot] != expected:
            raise DataError(f"{path}: header field {field} is {header[slot]}, expected "
                            f"{expected} (not a loss mask file)")
    ntok = int(header[NTOK_SLOT])
    if ntok < 0 or size != HEADER_BYTES + ntok:
        raise DataError(f"{path}: file size is {size} bytes but header field ntok={ntok} "
                        f"describes {HEADER_BYTES + max(ntok, 0)} bytes")
    return ntok


def read_mask(path):
    """The loss mask of a validated mask file, as a read-only uint8 np.memmap
    of 0s and 1s (an empty array for 0 tokens)."""
    ntok = read_mask_header(path)
    if ntok == 0:
        return np.zeros(0, dtype=np.uint8)
    mask = np.memmap(path, dtype=np.uint8, mode="r", offset=HEADER_BYTES, shape=(ntok,))
    if mask.max() > 1:
        pos = int(np.argmax(mask > 1))
        raise DataError(f"{path}: entry {pos} is {int(mask[pos])}, a loss mask holds 0 or 1")
    return mask


FINGERPRINT_SPAN = 1 << 20   # bytes hashed at each end of a file


def fingerprint(paths):
    """A short hash of the files' contents, in the given order: each file's
    size and its first and last FINGERPRINT_SPAN bytes (the whole file when
    it is smaller), so that it costs the same for shards of any size."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest.update(size.to_bytes(8, "little"))
            digest.update(f.read(FINGERPRINT_SPAN))
            if size > 2 * FINGERPRINT_SPAN:
                f.seek(size - FINGERPRINT_SPAN)
            digest.update(f.read(FINGERPRINT_SPAN))
    return digest.hexdigest()[:16]


MANIFEST = "manifest.json"


def write_manifest(folder, names=None):
    """Marks the set in ``folder`` incomplete (``names`` None), or complete
    with the token counts and fingerprints of the files ``names``."""
    folder = Path(folder)
    record = {"complete": names is not None}
    if names is not None:
        record["files"] = {name: {"tokens": read_tokens_header(folder / name),
                                  "fingerprint": fingerprint([folder / name])}
                           for name in names}
    atomic_write(folder / MANIFEST, [json.dumps(record, indent=1, sort_keys=True).encode()])


def check_manifest(path):
    """Raises DataError if the token file ``path`` belongs to a set whose
    manifest says it is incomplete or lists the file with another content.
    A folder without a manifest is not a prepared set: nothing to check."""
    path = Path(path)
    manifest = path.parent / MANIFEST
    try:
        record = json.loads(manifest.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        raise DataError(f"{manifest}: unreadable ({e}); prepare the dataset again") from None
    if not isinstance(record, dict) or record.get("complete") is not True:
        raise DataError(f"{path.parent}: the dataset's preparation did not finish "
                        f"({MANIFEST} says incomplete); prepare it again")
    entry = record.get("files", {}).get(path.name)
    if entry is not None and entry.get("fingerprint") != fingerprint([path]):
        raise DataError(f"{path}: is not the file {MANIFEST} lists (another preparation "
                        f"wrote it); prepare the dataset again")
