"""Property-based fuzzing of every file reader: a small valid file is
mutated (truncated, header bytes flipped, header fields set to edge values,
bytes overwritten, junk appended) or replaced by random bytes, and the reader
must either return a valid result or raise one of the package's errors,
never another exception, and never allocate far more than the file holds.

The runs are derandomized (the same examples every time) and bounded:
LLMC_FUZZ_EXAMPLES examples per reader (default 300; ``make fuzz`` runs many
more, with fresh randomness). Run with -s to see how many cases each reader
saw, accepted and rejected.
"""
import json
import os
import struct
import tracemalloc
from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmc_py import GPT2Config, LlmcError
from llmc_py.io import (HEADER_BYTES, MAGIC_MODEL, VERSION_BF16, read_debug_state, read_model,
                        read_state, write_debug_state, write_model, write_state)
from llmc_py.io.files import CHECKSUM_MARKER_SLOT
from llmc_py.io.tokens import read_mask, write_mask
from llmc_py.model.layout import num_parameters
from llmc_py.data import DataLoader, read_tokens, write_tokens
from llmc_py.tokenizer import load_ranks_file, read_tokenizer_file, write_token_table
from data_helpers import ranks_file_bytes, tiny_ranks

EXAMPLES = int(os.environ.get("LLMC_FUZZ_EXAMPLES", "300"))
FRESH = os.environ.get("LLMC_FUZZ_FRESH", "0") not in ("", "0")   # new randomness each run
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not FRESH, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

CONFIG = GPT2Config(max_seq_len=4, vocab_size=10, padded_vocab_size=16, num_layers=1,
                    num_heads=1, channels=4)
NUM_PARAMS = num_parameters(CONFIG)
SHARD_VOCAB = 1000
# what a reader may allocate beyond the file's own size while it reads it
ALLOC_SLACK = 4 << 20

INT32_EDGES = [0, 1, -1, 2, 3, 4, 255, 256, 65535, 65536, 2**24, 2**30, 2**31 - 1,
               -2**31, -2**31 + 1, MAGIC_MODEL]
header_values = st.one_of(st.sampled_from(INT32_EDGES), st.integers(-2**31, 2**31 - 1))

CASES = defaultdict(Counter)   # reader -> {"cases", "accepted", error class name: count}


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    for reader, counts in sorted(CASES.items()):
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())
                             if k not in ("cases", "accepted"))
        print(f"\nfuzz {reader}: {counts['cases']} cases, {counts['accepted']} accepted, "
              f"rejected: {rejected or 'none'}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


# ---- mutations ---------------------------------------------------------------------

def mutations(size, slots):
    """A list of 1-4 edits of a file of ``size`` bytes; ``slots`` are the
    header's meaningful int32 slots."""
    edit = st.one_of(
        st.tuples(st.just("truncate"), st.integers(0, max(size - 1, 0))),
        st.tuples(st.just("flip"), st.integers(0, HEADER_BYTES - 1), st.integers(1, 255)),
        st.tuples(st.just("field"), st.sampled_from(slots), header_values),
        st.tuples(st.just("field"), st.integers(0, 255), header_values),
        st.tuples(st.just("overwrite"), st.integers(0, max(size - 1, 0)),
                  st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
    )
    return st.lists(edit, min_size=1, max_size=4)


def apply(valid, edits):
    data = bytearray(valid)
    for op, *args in edits:
        if op == "truncate":
            del data[args[0]:]
        elif op == "flip":
            if args[0] < len(data):
                data[args[0]] ^= args[1]
        elif op == "field":
            offset = 4 * args[0]
            if offset + 4 <= len(data):
                data[offset:offset + 4] = struct.pack("<i", args[1])
        elif op == "overwrite":
            data[args[0]:args[0] + len(args[1])] = args[1]
        else:
            data += args[0]
    return bytes(data)


def files(valid, slots):
    """Mutated copies of ``valid`` and random files (some behind its header,
    some behind only its magic and version)."""
    return st.one_of(
        mutations(len(valid), slots).map(lambda edits: apply(valid, edits)),
        mutations(len(valid), slots).map(lambda edits: apply(valid, edits)),
        st.binary(max_size=2 * len(valid)),
        st.binary(max_size=len(valid)).map(lambda b: valid[:8] + b),
        st.binary(max_size=len(valid)).map(lambda b: valid[:HEADER_BYTES] + b),
    )


def run_reader(name, path, data, read):
    """Writes ``data`` to ``path`` and runs ``read(path)``; it must return or
    raise an LlmcError, within the allocation bound. Counts the outcome."""
    path.write_bytes(data)
    CASES[name]["cases"] += 1
    tracemalloc.start()
    try:
        read(path)
    except LlmcError as e:
        CASES[name][type(e).__name__] += 1
    else:
        CASES[name]["accepted"] += 1
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak <= len(data) * 8 + ALLOC_SLACK, \
        f"{name}: reading a {len(data)}-byte file allocated {peak} bytes"


# ---- the valid files -----------------------------------------------------------------

def _params():
    return np.random.default_rng(0).standard_normal(NUM_PARAMS).astype(np.float32)


@pytest.fixture(scope="module")
def model_v3(folder):
    write_model(folder / "valid_v3.bin", CONFIG, _params())
    return (folder / "valid_v3.bin").read_bytes()


@pytest.fixture(scope="module")
def model_v5(model_v3):
    """A bf16 file as llm.c writes it: no checksum recorded, so the mutations
    reach the reader's other checks."""
    header = bytearray(model_v3[:HEADER_BYTES])
    header[4:8] = struct.pack("<i", VERSION_BF16)
    header[4 * CHECKSUM_MARKER_SLOT:4 * CHECKSUM_MARKER_SLOT + 4] = bytes(4)
    bf16 = (_params().view(np.uint32) >> 16).astype("<u2")
    return bytes(header) + bf16.tobytes()


@pytest.fixture(scope="module")
def shard(folder):
    tokens = np.random.default_rng(1).integers(0, SHARD_VOCAB, size=64)
    write_tokens(folder / "valid_shard.bin", tokens)
    return (folder / "valid_shard.bin").read_bytes()


@pytest.fixture(scope="module")
def loss_mask(folder):
    write_mask(folder / "valid.mask", np.random.default_rng(5).integers(0, 2, size=64))
    return (folder / "valid.mask").read_bytes()


@pytest.fixture(scope="module")
def tokenizer_file(folder):
    rng = np.random.default_rng(2)
    tokens = [rng.integers(0, 256, size=rng.integers(1, 6)).astype(np.uint8).tobytes()
              for _ in range(20)]
    write_token_table(folder / "valid_tokenizer.bin", tokens, 19)
    return (folder / "valid_tokenizer.bin").read_bytes()


@pytest.fixture(scope="module")
def debug_state(folder):
    rng = np.random.default_rng(3)
    B, T = 1, 2
    write_debug_state(folder / "valid_debug.bin", CONFIG, rng.integers(0, 10, (B, T)),
                      rng.integers(0, 10, (B, T)),
                      rng.standard_normal((B, T, CONFIG.vocab_size)).astype(np.float32),
                      2.5, _params())
    return (folder / "valid_debug.bin").read_bytes()


STATE_PARAMS = 50


def state_bytes(folder, blob=None):
    """A valid training-state file, or one whose JSON block is ``blob`` (with
    a header that agrees with its length)."""
    rng = np.random.default_rng(4)
    m, v = rng.standard_normal((2, STATE_PARAMS)).astype(np.float32)
    path = folder / "valid_state.bin"
    write_state(path, 7, m, v, {"train_loader": {"epoch": 1}, "rng": [1, 2, 3]})
    data = path.read_bytes()
    if blob is None:
        return data
    head = bytearray(data[:HEADER_BYTES])
    head[20:24] = struct.pack("<i", len(blob))
    head[4 * CHECKSUM_MARKER_SLOT:4 * CHECKSUM_MARKER_SLOT + 4] = bytes(4)   # none recorded
    return bytes(head) + data[HEADER_BYTES:HEADER_BYTES + 8 * STATE_PARAMS] + blob


# ---- what a reader's accepted result must satisfy --------------------------------------

def check_model(path):
    config, params = read_model(path)
    assert isinstance(config, GPT2Config)
    assert params.dtype == np.float32 and params.size == num_parameters(config)


def check_tokens(path):
    tokens = read_tokens(path)
    assert tokens.dtype == np.uint16
    assert path.stat().st_size == HEADER_BYTES + 2 * tokens.size
    loader = DataLoader(str(path), 1, 8, vocab_size=SHARD_VOCAB)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (1, 8) and 0 <= x.min() and x.max() < SHARD_VOCAB


def check_mask(path):
    mask = read_mask(path)
    assert mask.dtype == np.uint8 and path.stat().st_size == HEADER_BYTES + mask.size
    assert mask.size == 0 or mask.max() <= 1


def check_tokenizer(path):
    tok = read_tokenizer_file(path)
    assert tok.vocab_size >= 1 and 0 <= tok.eot < tok.vocab_size
    assert all(1 <= len(tok.token_bytes(i)) <= 255 for i in range(tok.vocab_size))
    tok.decode(range(tok.vocab_size))


def check_debug_state(path):
    state = read_debug_state(path, CONFIG)
    B, T = state["x"].shape
    assert state["y"].shape == (B, T) and state["logits"].shape == (B, T, CONFIG.vocab_size)
    assert state["grads"].size == NUM_PARAMS and isinstance(state["loss"], float)


def check_state(path):
    step, m, v, extra = read_state(path, STATE_PARAMS)
    assert step >= 0 and m.shape == v.shape == (STATE_PARAMS,) and isinstance(extra, dict)


# ---- the properties ----------------------------------------------------------------------

MODEL_SLOTS = list(range(8))


@FUZZ
@given(data=st.data())
def test_fuzz_model_v3(folder, model_v3, data):
    run_reader("model v3", folder / "case.bin", data.draw(files(model_v3, MODEL_SLOTS)),
               check_model)


@FUZZ
@given(data=st.data())
def test_fuzz_model_v5(folder, model_v5, data):
    run_reader("model v5", folder / "case.bin", data.draw(files(model_v5, MODEL_SLOTS)),
               check_model)


@FUZZ
@given(data=st.data())
def test_fuzz_token_shard(folder, shard, data):
    run_reader("token shard", folder / "case.bin", data.draw(files(shard, [0, 1, 2])),
               check_tokens)


@FUZZ
@given(data=st.data())
def test_fuzz_loss_mask(folder, loss_mask, data):
    run_reader("loss mask", folder / "case.mask", data.draw(files(loss_mask, [0, 1, 2])),
               check_mask)


@FUZZ
@given(data=st.data())
def test_fuzz_tokenizer_file(folder, tokenizer_file, data):
    run_reader("tokenizer", folder / "case.bin",
               data.draw(files(tokenizer_file, [0, 1, 2, 3])), check_tokenizer)


@FUZZ
@given(data=st.data())
def test_fuzz_debug_state(folder, debug_state, data):
    run_reader("debug state", folder / "case.bin",
               data.draw(files(debug_state, [0, 1, 2, 3])), check_debug_state)


def json_blobs():
    """Text for the training state's JSON block: random bytes and text, JSON
    of the wrong type, and deep nesting."""
    depth = st.integers(1, 100_000)
    return st.one_of(
        st.binary(max_size=64),
        st.text(max_size=64).map(str.encode),
        st.sampled_from([b"[]", b"null", b"1", b'"x"', b"{}", b'{"a": NaN}', b"\xff\xfe"]),
        depth.map(lambda n: b"[" * n + b"]" * n),
        depth.map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
        st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                     lambda kids: st.lists(kids) | st.dictionaries(st.text(), kids),
                     max_leaves=10).map(lambda x: json.dumps(x).encode()),
    )


@FUZZ
@given(data=st.data())
def test_fuzz_training_state(folder, data):
    valid = state_bytes(folder)
    case = data.draw(st.one_of(files(valid, [0, 1, 2, 3, 4, 5]),
                               json_blobs().map(lambda blob: state_bytes(folder, blob))))
    run_reader("training state", folder / "case.bin", case, check_state)


def check_ranks(path):
    ranks = load_ranks_file(path)
    assert sorted(ranks.values()) == list(range(len(ranks)))
    assert all(isinstance(t, bytes) for t in ranks)


RANKS_FILE = ranks_file_bytes(tiny_ranks())


@FUZZ
@given(data=st.data())
def test_fuzz_bpe_ranks_file(folder, data):
    """The .tiktoken ranks text (read when no checksum vouches for it): lines
    cut, bytes overwritten, and lines of random text."""
    lines = st.lists(st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode),
                               st.integers().map(lambda n: b"YQ== " + str(n).encode())),
                     max_size=8).map(b"\n".join)
    case = data.draw(st.one_of(
        st.tuples(st.integers(0, len(RANKS_FILE)), lines).map(
            lambda t: RANKS_FILE[:t[0]] + t[1] + RANKS_FILE[t[0]:]),
        st.tuples(st.integers(0, len(RANKS_FILE) - 1), st.binary(min_size=1, max_size=8)).map(
            lambda t: RANKS_FILE[:t[0]] + t[1] + RANKS_FILE[t[0] + len(t[1]):]),
        st.integers(0, len(RANKS_FILE) - 1).map(lambda n: RANKS_FILE[:n]),
        st.integers(1, 10_000).map(lambda n: b"YQ== " + b"9" * n),   # ranks of many digits
    ))
    run_reader("BPE ranks", folder / "case.tiktoken", case, check_ranks)


def test_the_valid_files_are_accepted(folder, model_v3, model_v5, shard, tokenizer_file,
                                      debug_state, loss_mask):
    """The unmutated files pass their readers' checks: the properties start
    from files that parse."""
    for data, check in [(model_v3, check_model), (model_v5, check_model), (shard, check_tokens),
                        (loss_mask, check_mask),
                        (tokenizer_file, check_tokenizer), (debug_state, check_debug_state),
                        (state_bytes(folder), check_state),
                        (state_bytes(folder, b'{"a": [1, 2]}'), check_state),
                        (RANKS_FILE, check_ranks)]:
        path = folder / "valid.bin"
        path.write_bytes(data)
        check(path)
