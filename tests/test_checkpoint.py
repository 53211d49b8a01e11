"""llm.c's model file: reading both versions, writing atomically, and a
clear CheckpointError (a ValueError) for every malformed file."""
import os
import re
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import llmc_py
from llmc_py import GPT2, GPT2Config, CheckpointError
from llmc_py.io import (HEADER_BYTES, MAGIC_MODEL, VERSION_BF16, VERSION_FP32, read_debug_state,
                        read_model, write_model)
from llmc_py.io.files import CHECKSUM_MARKER, to_bf16
from llmc_py.model.layout import num_parameters

CONFIG = GPT2Config(max_seq_len=8, vocab_size=30, padded_vocab_size=32,
                    num_layers=2, num_heads=2, channels=8)


def header(**slots):
    """A valid model header for CONFIG, with some slots overridden by index."""
    h = np.zeros(256, dtype="<i4")
    h[:8] = (MAGIC_MODEL, VERSION_FP32, 8, 30, 2, 2, 8, 32)
    for index, value in slots.items():
        h[int(index.lstrip("s"))] = value
    return h


@pytest.fixture
def params():
    return np.random.default_rng(0).standard_normal(num_parameters(CONFIG)).astype(np.float32)


def write_raw(path, head, body):
    path.write_bytes(head.tobytes() + body)
    return path


def test_header_layout_is_llm_c(tmp_path, params):
    """llm.c's slots and data, and our checksum in slots 254-255: the CRC-32
    of the whole file read with slot 255 as 0."""
    path = tmp_path / "model.bin"
    write_model(path, CONFIG, params)
    raw = np.fromfile(path, dtype="<i4", count=256)
    assert list(raw[:8]) == [20240326, 3, 8, 30, 2, 2, 8, 32] and not raw[8:254].any()
    assert raw[254] == CHECKSUM_MARKER
    data = bytearray(path.read_bytes())
    data[4 * 255:4 * 256] = bytes(4)
    assert raw.view("<u4")[255] == zlib.crc32(data)
    assert path.stat().st_size == HEADER_BYTES + 4 * params.size
    assert np.array_equal(np.fromfile(path, dtype="<f4", offset=HEADER_BYTES), params)


def llm_c_file(path, version, body):
    """The model file llm.c's train_gpt2.py writes for CONFIG: its 8 slots, 0 in the rest."""
    return write_raw(path, header(s1=version), body)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_bytes_llm_c_reads_are_llm_c_s(tmp_path, params, dtype):
    """Our file differs from llm.c's only in the checksum slots, which llm.c
    does not read; llm.c's file, without a checksum, loads the same."""
    ours = tmp_path / "ours.bin"
    write_model(ours, CONFIG, params, dtype=dtype)
    body = params.tobytes() if dtype == "fp32" else to_bf16(params).tobytes()
    theirs = llm_c_file(tmp_path / "theirs.bin", {"fp32": VERSION_FP32, "bf16": VERSION_BF16}[dtype],
                        body)
    a, b = ours.read_bytes(), theirs.read_bytes()
    assert len(a) == len(b)
    assert a[:4 * 254] == b[:4 * 254] and a[HEADER_BYTES:] == b[HEADER_BYTES:]
    assert np.array_equal(read_model(theirs)[1], read_model(ours)[1])


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("offset", [HEADER_BYTES + 37, 4 * 100, 4 * 255 + 2, -1])
def test_a_flipped_byte_fails_the_checksum(tmp_path, params, offset):
    """In the data, in an unused header slot, in the checksum itself: the
    load names the file and both checksums."""
    path = tmp_path / "model.bin"
    write_model(path, CONFIG, params)
    flip(path, offset)
    for load in (GPT2.from_checkpoint, llmc_py.load_model, read_model):
        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: checksum does not "
                                                  rf"match: the header records CRC-32 0x[0-9a-f]{{8}}, "
                                                  rf"the contents give 0x[0-9a-f]{{8}} "):
            load(path)


def test_a_file_without_a_checksum_loads(tmp_path, params):
    """As llm.c writes it (tested above), or ours with the marker zeroed;
    a marker that is neither 0 nor ours is refused."""
    path = tmp_path / "model.bin"
    write_model(path, CONFIG, params)
    flip(path, HEADER_BYTES + 37)
    data = bytearray(path.read_bytes())
    data[4 * 254:4 * 255] = bytes(4)
    path.write_bytes(bytes(data))
    config, loaded = read_model(path)
    assert config == CONFIG and np.sum(loaded != params) == 1   # unverified: the flip loads
    data[4 * 254:4 * 255] = (7).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.bin: header slot 254 is 7, expected 0 "
                                              r"\(no checksum\) or 20261125"):
        read_model(path)


def test_bf16_version_is_widened(tmp_path, params):
    bf16 = (params.view(np.uint32) >> 16).astype("<u2")
    path = write_raw(tmp_path / "bf16.bin", header(s1=VERSION_BF16), bf16.tobytes())
    config, loaded = read_model(path)
    assert config == CONFIG
    expected = (bf16.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(loaded, expected)
    np.testing.assert_allclose(loaded, params, rtol=1 / 128)   # bf16 keeps 8 mantissa bits
    assert np.array_equal(GPT2.from_checkpoint(path).params.memory, expected)


def test_write_replaces_atomically(tmp_path, params, monkeypatch):
    """A failed write leaves the previous file intact and no temporary file."""
    path = tmp_path / "model.bin"
    write_model(path, CONFIG, params)
    before = path.read_bytes()

    def broken_fsync(fd):
        raise OSError("disk full")
    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        write_model(path, CONFIG, params + 1)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.bin"]


def bad_files(params):
    """(name, header, body, text expected in the message) for each malformed file."""
    body = params.tobytes()
    return [
        ("empty", None, b"", "smaller than"),
        ("short-header", None, header().tobytes()[:500], "smaller than"),
        ("wrong-magic", header(s0=1234), body, "magic is 1234"),
        ("llama-magic", header(s0=20240803), body, "magic"),
        ("unknown-version", header(s1=4), body, "version is 4"),
        ("truncated-params", header(), body[:-4], "truncated"),
        ("trailing-bytes", header(), body + b"\0\0\0\0", "trailing"),
        ("zero-layers", header(s4=0), body, "num_layers is 0"),
        ("negative-channels", header(s6=-8), body, "channels is -8"),
        ("zero-maxT", header(s2=0), body, "max_seq_len is 0"),
        ("zero-vocab", header(s3=0), body, "vocab_size is 0"),
        ("zero-padded", header(s7=0), body, "padded_vocab_size is 0"),
        ("heads-do-not-divide", header(s5=3), body, "not divisible by num_heads=3"),
        ("padded-below-vocab", header(s7=16), body, "smaller than vocab_size"),
        ("overflowing-sizes", header(s2=2**31 - 1, s3=2**31 - 1, s4=2**31 - 1,
                                     s6=2**31 - 1, s7=2**31 - 1, s5=1), body, "describes"),
    ]


@pytest.mark.parametrize("case", range(15))
def test_bad_model_files_raise_checkpoint_error(tmp_path, params, case):
    name, head, body, message = bad_files(params)[case]
    path = tmp_path / f"{name}.bin"
    path.write_bytes((b"" if head is None else head.tobytes()) + body)
    with pytest.raises(CheckpointError, match=message) as info:
        GPT2.from_checkpoint(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_directory_and_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="is a directory"):
        GPT2.from_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="cannot read"):
        GPT2.from_checkpoint(tmp_path / "missing.bin")


def test_bad_debug_state_files(tmp_path):
    path = tmp_path / "state.bin"
    h = np.zeros(256, dtype="<i4")
    h[:4] = (20240327, 2, 1, 2)
    path.write_bytes(h.tobytes())
    with pytest.raises(CheckpointError, match="truncated"):
        read_debug_state(path, CONFIG)
    h[0] = 5
    path.write_bytes(h.tobytes())
    with pytest.raises(CheckpointError, match="magic is 5"):
        read_debug_state(path, CONFIG)
    h[:4] = (20240327, 2, 0, 2)
    path.write_bytes(h.tobytes())
    with pytest.raises(CheckpointError, match="B is 0"):
        read_debug_state(path, CONFIG)


def test_state_file_round_trip_and_bad_files(tmp_path):
    from llmc_py.io import read_state, write_state
    rng = np.random.default_rng(1)
    m, v = rng.standard_normal(100).astype(np.float32), rng.random(100).astype(np.float32)
    path = tmp_path / "state.bin"
    write_state(path, 42, m, v, {"loader": {"epoch": 1}, "rng": [1, 2]})
    step, m2, v2, extra = read_state(path, 100)
    assert step == 42 and np.array_equal(m, m2) and np.array_equal(v, v2)
    assert extra == {"loader": {"epoch": 1}, "rng": [1, 2]}
    with pytest.raises(CheckpointError, match="num_parameters is 100, but the model has 99"):
        read_state(path, 99)
    raw = path.read_bytes()
    unchecked = raw[:4 * 254] + bytes(4) + raw[4 * 255:]   # no checksum recorded
    cases = [(raw[:-1], "truncated"), (raw + b" ", "trailing"),
             (b"\0" * 4 + raw[4:], "magic is 0"),
             (unchecked[:-2] + b"@@", "JSON block is not valid")]
    for data, message in cases:
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=message):
            read_state(path, 100)


@pytest.mark.parametrize("offset,what", [(HEADER_BYTES + 5, "m"), (HEADER_BYTES + 400 + 5, "v"),
                                         (-3, "JSON"), (4 * 2, "the step")])
def test_a_flipped_byte_in_a_state_file_fails_the_checksum(tmp_path, offset, what):
    from llmc_py.io import read_state, write_state
    m, v = np.arange(100, dtype=np.float32), np.ones(100, np.float32)
    path = tmp_path / "state.bin"
    write_state(path, 42, m, v, {"loader": {"epoch": 1234}})
    flip(path, offset)
    with pytest.raises(CheckpointError, match=r"state\.bin: checksum does not match: the header "
                                              r"records CRC-32 0x[0-9a-f]{8}, the contents"):
        read_state(path, 100)


# A child process that writes a new model over model.bin and stops (sleeps)
# at a point inside the write, after printing "stopped"; the test then kills
# it with SIGKILL, as a power cut or an OOM kill would.
_KILLED_WRITER = r"""
import os, sys, time
import numpy as np
from llmc_py import io as ckpt
from llmc_py.config import GPT2Config
from llmc_py.model.layout import num_parameters

path, where = sys.argv[1], sys.argv[2]
config = GPT2Config(**eval(sys.argv[3]))
params = np.full(num_parameters(config), 7.0, np.float32)

def stop():
    print("stopped", flush=True)
    time.sleep(60)

if where == "mid-data":   # half of the parameters written
    def chunks():
        yield ckpt.model_header(config).tobytes()
        yield params[:params.size // 2]
        stop()
        yield params[params.size // 2:]
    ckpt.atomic_write(path, chunks())
else:                     # all written, killed before the rename
    os.fsync = lambda fd: stop()
    ckpt.write_model(path, config, params)
"""


@pytest.mark.parametrize("where", ["mid-data", "before-rename"])
def test_killed_write_leaves_the_previous_file_intact(tmp_path, params, where):
    path = tmp_path / "model.bin"
    write_model(path, CONFIG, params)
    before = path.read_bytes()
    fields = {name: getattr(CONFIG, name) for name in
              ("max_seq_len", "vocab_size", "padded_vocab_size", "num_layers", "num_heads",
               "channels")}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path), where,
                              repr(fields)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(llmc_py.__file__).resolve().parent.parent)
    try:
        assert child.stdout.readline() == "stopped\n"
        temps = [p for p in tmp_path.iterdir() if p.name != "model.bin"]
        assert len(temps) == 1 and temps[0].stat().st_size > HEADER_BYTES, \
            "the child is not in the middle of writing"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert path.read_bytes() == before
    assert np.array_equal(GPT2.from_checkpoint(path).params.memory, params)
    # the half-written temporary file stays (nothing ran to remove it), but
    # hidden and named so that no checkpoint pattern matches it
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "model.bin"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".model.bin.") \
        and leftovers[0].endswith(".tmp")
    assert [p.name for p in tmp_path.glob("*.bin")] == ["model.bin"]
    assert [p.name for p in tmp_path.glob("model*")] == ["model.bin"]
