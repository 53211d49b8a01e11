"""GPT-2's byte-pair encoding (through tiktoken) and llm.c's tokenizer file.

``get_encoding()`` returns tiktoken's GPT-2 Encoding. tiktoken fetches its
files from the network on first use; offline, the same BPE ranks are taken
from ``whisper/assets/gpt2.tiktoken`` in the openai-whisper source
distribution on PyPI (byte-identical to tiktoken's r50k_base file, which is
GPT-2's vocabulary), checked against GPT2_RANKS_SHA256 and cached. Where it
looks, in order:

1. ``tiktoken.get_encoding("gpt2")``, the normal source (tiktoken's own
   cache, else the network);
2. the llmc_py cache, ``cached_ranks_path()`` (no network);
3. ``pip download`` of the openai-whisper sdist (PyPI only), once, into the
   cache.

``LLMC_OFFLINE=1`` skips steps 1 and 3. ``python -m llmc_py.tokenizer``
fills the cache ahead of time (tests use it, and never download). The cache folder is ``$LLMC_CACHE_DIR``,
else ``$XDG_CACHE_HOME/llmc_py``, else ``~/.cache/llmc_py``.

Tokenizer file (``gpt2_tokenizer.bin``, decode only, read by llm.c's
tokenizer.h): 256 little-endian int32 header slots [0] MAGIC_TOKENIZER,
[1] VERSION_TOKENIZER, [2] vocab size, [3] end-of-text id; then for each
token id in order a uint8 byte length (1..255) followed by the token's bytes.
A malformed file raises CheckpointError naming the file, field and value.
"""
import base64
import binascii
import functools
import hashlib
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from .cli import command
from .errors import CheckpointError, RangeError, TokenizerUnavailableError
from .io import fetch
from .io.fetch import OFFLINE_ENV
from .io.files import HEADER_BYTES, HEADER_INTS, atomic_write

EOT = 50256                  # GPT-2's <|endoftext|> id
EOT_TEXT = "<|endoftext|>"

# GPT-2's pre-tokenizer regex, as in OpenAI's gpt-2 encoder.py (tiktoken's
# possessive rewrite of it splits text identically)
GPT2_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# the offline source of GPT-2's mergeable ranks, and what it must hash to
RANKS_FILENAME = "gpt2.tiktoken"
GPT2_NUM_RANKS = 50256       # byte-level tokens and merges; EOT comes after them
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
WHISPER_SDIST = "openai-whisper==20250625"
WHISPER_RANKS_MEMBER = "whisper/assets/gpt2.tiktoken"

# llm.c's tokenizer file
MAGIC_TOKENIZER = 20240328
VERSION_TOKENIZER = 2        # version 1 has no eot slot (it is implied: EOT)
MAX_TOKEN_BYTES = 255        # a token's length is one uint8



# ---- the cache folder ----------------------------------------------------------

def cached_ranks_path():
    """Where the GPT-2 ranks file is cached."""
    return fetch.cache_dir() / RANKS_FILENAME


# ---- BPE ranks -> tiktoken Encoding ----------------------------------------------

def parse_ranks(data, path="<bytes>"):
    """{token bytes: rank} from the text of a .tiktoken file: one
    ``base64(token) rank`` pair per line."""
    ranks = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected 2 fields")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise CheckpointError(f"{path}: line {lineno} is not 'base64-token rank': "
                                  f"{line[:60]!r} ({e})") from None
        if token in ranks:
            raise CheckpointError(f"{path}: line {lineno}: token {token!r} appears twice")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(f"{path}: ranks are not exactly 0..{len(ranks) - 1}")
    return ranks


def load_ranks_file(path):
    """{token bytes: rank} from a .tiktoken file on disk.

    (tiktoken.load.load_tiktoken_bpe accepts a local path too, but copies the
    file into tiktoken's own cache folder; parsing the base64 lines here
    avoids that.)"""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ranks file: {e.strerror or e}") from e
    return parse_ranks(data, path)


def encoding_from_ranks(ranks, name="gpt2"):
    """A tiktoken Encoding with GPT-2's regex and the given ranks; its only
    special token is <|endoftext|>, numbered right after the ranks (50256
    for GPT-2's 50256 ranks)."""
    import tiktoken
    return tiktoken.Encoding(name=name, pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                             special_tokens={EOT_TEXT: len(ranks)},
                             explicit_n_vocab=len(ranks) + 1)


def check_ranks(data, source, sha256=None, num_ranks=None):
    """Checks a ranks file's bytes against the recorded hash and rank count
    (module defaults); returns the parsed ranks."""
    sha256 = GPT2_RANKS_SHA256 if sha256 is None else sha256
    num_ranks = GPT2_NUM_RANKS if num_ranks is None else num_ranks
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise CheckpointError(f"{source}: sha256 is {digest}, expected {sha256} "
                              f"(not GPT-2's ranks file, or damaged)")
    ranks = parse_ranks(data, source)
    if len(ranks) != num_ranks:
        raise CheckpointError(f"{source}: has {len(ranks)} ranks, expected {num_ranks}")
    return ranks


def extract_ranks_from_sdist(sdist, dest, *, member=WHISPER_RANKS_MEMBER,
                             sha256=None, num_ranks=None):
    """Copies ``member`` (matched by its path under the sdist's top folder)
    out of a .tar.gz source distribution to ``dest``, atomically, after
    check_ranks; returns the ranks."""
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            found = [m for m in tar.getmembers()
                     if m.isfile() and m.name.split("/", 1)[-1] == member]
            if not found:
                raise CheckpointError(f"{sdist}: has no file {member}")
            data = tar.extractfile(found[0]).read()
    except (OSError, tarfile.TarError) as e:
        raise CheckpointError(f"{sdist}: cannot read the archive: {e}") from e
    ranks = check_ranks(data, f"{sdist}:{member}", sha256, num_ranks)
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dest, [data])
    return ranks


def fetch_ranks_from_pypi(dest):
    """Downloads the openai-whisper sdist into a temporary folder and caches
    its gpt2.tiktoken at ``dest``; returns the ranks."""
    with tempfile.TemporaryDirectory(prefix="llmc_py_") as tmp:
        sdist = fetch.pip_download(WHISPER_SDIST, tmp, sdist=True)
        return extract_ranks_from_sdist(sdist, dest)


def _cached_ranks(path):
    """The cached ranks if the file is there and checks out, else None."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        return check_ranks(data, path)
    except CheckpointError:
        return None


@functools.lru_cache(maxsize=None)
def get_encoding():
    """tiktoken's GPT-2 Encoding (cached per process); see the module
    docstring for where the ranks come from."""
    path = cached_ranks_path()
    reasons = []
    if not fetch.offline():
        try:
            import tiktoken
            return tiktoken.get_encoding("gpt2")
        except Exception as e:   # tiktoken raises whatever its HTTP client raises
            reasons.append(f"tiktoken: {type(e).__name__}: {e}")
    ranks = _cached_ranks(path)
    if ranks is not None:
        return encoding_from_ranks(ranks)
    if fetch.offline():
        raise TokenizerUnavailableError(
            f"GPT-2's BPE ranks are not in the cache ({path}: missing or damaged) and "
            f"{OFFLINE_ENV} is set; "
            f"unset it to fetch them once, or place gpt2.tiktoken (sha256 "
            f"{GPT2_RANKS_SHA256}) there")
    try:
        ranks = fetch_ranks_from_pypi(path)
    except (OSError, CheckpointError) as e:
        reasons.append(f"PyPI {WHISPER_SDIST}: {e}")
        raise TokenizerUnavailableError(
            f"cannot load GPT-2's BPE ranks ({'; '.join(reasons)}). Connect to the "
            f"network once (tiktoken or PyPI), or place gpt2.tiktoken (sha256 "
            f"{GPT2_RANKS_SHA256}) at {path}") from None
    # the fallback working: information, not an error
    print(f"llmc_py: tiktoken's GPT-2 files are not reachable (offline?); using the copy in "
          f"PyPI's {WHISPER_SDIST} sdist, checked and cached at {path} (fine)", file=sys.stderr)
    return encoding_from_ranks(ranks)


# ---- a Hugging Face tokenizer.json ---------------------------------------------

HF_TOKENIZER_FILE = "tokenizer.json"


def read_tokenizer_json(path):
    """The ``tokenizers`` package's Tokenizer of a tokenizer.json."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise TokenizerUnavailableError(f"{path}: reading a tokenizer.json needs the "
                                        f'tokenizers package: pip install "llmc_py[hf]" '
                                        f"({e})") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:   # the tokenizers package raises its own Exception types
        raise CheckpointError(f"{path}: not a readable tokenizer.json ({e})") from None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (through the ``tokenizers`` package,
    ``pip install "llmc_py[hf]"``) with what data and sample use of
    tiktoken's Encoding: ``encode``, ``encode_ordinary_batch``, ``decode``,
    ``n_vocab``, ``name`` and ``eot_token``, the id that starts each
    document: the model's bos token, else its eos token (Qwen3's and
    GPT-2's <|endoftext|>), from the folder's config.json."""

    def __init__(self, path, eot_token=None):
        path = Path(path)
        self._tokenizer = read_tokenizer_json(path)
        self.path = path
        self.n_vocab = self._tokenizer.get_vocab_size(with_added_tokens=True)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:10]
        self.name = f"hf-{digest}"
        self.eot_token = eot_token
        if eot_token is None or not 0 <= eot_token < self.n_vocab:
            raise CheckpointError(f"{path}: no document separator: config.json beside it "
                                  f"gives no bos_token_id or eos_token_id within the "
                                  f"{self.n_vocab} tokens (got {eot_token!r})")

    def encode(self, text, allowed_special=None):
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts):
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids):
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self):
        return f"HFTokenizer({str(self.path)!r}, n_vocab={self.n_vocab}, eot={self.eot_token})"


def _separator_id(config_path):
    """bos_token_id, else eos_token_id (the first of a list), of a config.json."""
    import json
    try:
        raw = json.loads(Path(config_path).read_text())
    except (OSError, ValueError):
        return None
    for key in ("bos_token_id", "eos_token_id"):
        value = raw.get(key)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def load_tokenizer(path=None):
    """The tokenizer for a model: with ``path`` a Hugging Face folder holding
    tokenizer.json (or that file), its HFTokenizer; otherwise (None, a
    folder without one such as GPT-2's, or a model file) GPT-2's Encoding
    (get_encoding)."""
    if path is not None:
        path = Path(path)
        file = path / HF_TOKENIZER_FILE if path.is_dir() else path
        if file.name == HF_TOKENIZER_FILE and file.is_file():
            return HFTokenizer(file, _separator_id(file.parent / "config.json"))
        if path.suffix == ".json":
            raise TokenizerUnavailableError(f"{path}: no such tokenizer file")
    return get_encoding()


# ---- llm.c's tokenizer file ------------------------------------------------------

class Tokenizer:
    """A decode-only tokenizer read from llm.c's tokenizer file."""

    def __init__(self, tokens, eot, path=None):
        self._tokens = list(tokens)
        self.vocab_size = len(self._tokens)
        self.eot = eot
        self.path = path

    def token_bytes(self, i):
        """The bytes of token ``i``."""
        i = int(i)
        if not 0 <= i < self.vocab_size:
            raise RangeError(f"token id {i} is outside [0, {self.vocab_size})")
        return self._tokens[i]

    def decode_bytes(self, ids):
        return b"".join(self.token_bytes(i) for i in ids)

    def decode(self, ids):
        """The tokens' bytes joined, as utf-8 (invalid bytes become U+FFFD)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def __repr__(self):
        return f"Tokenizer(vocab_size={self.vocab_size}, eot={self.eot}, path={self.path!r})"


def write_token_table(path, tokens, eot):
    """Writes llm.c's tokenizer file for ``tokens`` (a sequence of bytes, one
    per id), atomically."""
    tokens = [bytes(t) for t in tokens]
    if not tokens:
        raise CheckpointError(f"{path}: cannot write a tokenizer with no tokens")
    if not 0 <= eot < len(tokens):
        raise CheckpointError(f"{path}: eot {eot} is outside [0, {len(tokens)})")
    body = bytearray()
    for i, t in enumerate(tokens):
        if not 1 <= len(t) <= MAX_TOKEN_BYTES:
            raise CheckpointError(f"{path}: token {i} is {len(t)} bytes long; the tokenizer "
                                  f"file stores 1..{MAX_TOKEN_BYTES} bytes per token")
        body.append(len(t))
        body += t
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:4] = (MAGIC_TOKENIZER, VERSION_TOKENIZER, len(tokens), eot)
    atomic_write(path, [header.tobytes(), bytes(body)])


def write_tokenizer_file(path, encoding):
    """Writes llm.c's tokenizer file for a tiktoken Encoding (every id up to
    its largest, special tokens included), atomically."""
    n = encoding.max_token_value + 1
    write_token_table(path, [encoding.decode_single_token_bytes(i) for i in range(n)],
                      encoding.eot_token)


def read_tokenizer_file(path):
    """A Tokenizer from llm.c's tokenizer file, every field validated."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, not a tokenizer file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read tokenizer file: {e.strerror or e}") from e
    if len(data) < HEADER_BYTES:
        raise CheckpointError(f"{path}: file size {len(data)} bytes is smaller than the "
                              f"{HEADER_BYTES}-byte tokenizer header")
    header = np.frombuffer(data, dtype="<i4", count=HEADER_INTS).astype(np.int64)
    if header[0] != MAGIC_TOKENIZER:
        raise CheckpointError(f"{path}: header field magic is {header[0]}, expected "
                              f"{MAGIC_TOKENIZER} (not an llm.c tokenizer file)")
    version = int(header[1])
    if version not in (1, VERSION_TOKENIZER):
        raise CheckpointError(f"{path}: header field version is {version}, expected "
                              f"{VERSION_TOKENIZER} (or 1)")
    vocab_size = int(header[2])
    eot = int(header[3]) if version == VERSION_TOKENIZER else EOT
    body = len(data) - HEADER_BYTES
    if not 0 < vocab_size <= body // 2:   # every token takes >= 2 bytes
        raise CheckpointError(f"{path}: header field vocab_size is {vocab_size}, must be in "
                              f"1..{body // 2} for a {len(data)}-byte file")
    if not 0 <= eot < vocab_size:
        raise CheckpointError(f"{path}: header field eot is {eot}, must be in "
                              f"[0, {vocab_size})")
    tokens, pos = [], HEADER_BYTES
    for i in range(vocab_size):
        if pos >= len(data):
            raise CheckpointError(f"{path}: token {i} length byte is past the end of the "
                                  f"file (truncated at {len(data)} bytes)")
        n = data[pos]
        if n == 0:
            raise CheckpointError(f"{path}: token {i} length is 0 (at byte {pos})")
        if pos + 1 + n > len(data):
            raise CheckpointError(f"{path}: token {i} of length {n} at byte {pos} runs past "
                                  f"the end of the file (truncated at {len(data)} bytes)")
        tokens.append(data[pos + 1:pos + 1 + n])
        pos += 1 + n
    if pos != len(data):
        raise CheckpointError(f"{path}: {len(data) - pos} trailing bytes after the "
                              f"{vocab_size} tokens (file is {len(data)} bytes)")
    return Tokenizer(tokens, eot, path)


@command
def main(argv=None):
    """``python -m llmc_py.tokenizer [--write-llmc PATH]``: caches GPT-2's
    ranks for offline use and, if asked, writes llm.c's tokenizer file."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m llmc_py.tokenizer", description=main.__doc__)
    p.add_argument("--write-llmc", metavar="PATH", default=None,
                   help="also write llm.c's decode-only tokenizer file (gpt2_tokenizer.bin)")
    args = p.parse_args(argv)
    path = cached_ranks_path()
    if _cached_ranks(path) is None:
        if fetch.offline():
            raise TokenizerUnavailableError(f"{path} is missing and {OFFLINE_ENV} is set")
        fetch_ranks_from_pypi(path)
    print(f"GPT-2 BPE ranks cached at {path}")
    if args.write_llmc:
        write_tokenizer_file(args.write_llmc, get_encoding())
        print(f"wrote {args.write_llmc}")


if __name__ == "__main__":
    sys.exit(main())
