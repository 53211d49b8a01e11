"""The GPT-2 encoding's offline fallback (on a tiny self-written vocabulary)
and llm.c's tokenizer file: round trip, and a clear CheckpointError (a
ValueError) naming the file for every malformed variant."""
import hashlib
import io
import tarfile

import numpy as np
import pytest

import llmc_py.tokenizer as tok
from llmc_py.io import fetch
from llmc_py import CheckpointError, RangeError
from llmc_py.io import HEADER_BYTES
from data_helpers import REAL_RANKS, no_network, require_real_ranks, ranks_file_bytes, tiny_encoding, tiny_ranks  # noqa: F401

# the user's real cache, looked up before the no_network fixture redirects it


# ---- ranks -> Encoding ---------------------------------------------------------------

def test_encoding_from_a_ranks_file(tmp_path):
    path = tmp_path / "tiny.tiktoken"
    path.write_bytes(ranks_file_bytes(tiny_ranks()))
    ranks = tok.load_ranks_file(path)
    assert ranks == tiny_ranks()
    enc = tok.encoding_from_ranks(ranks, name="tiny")
    ids = enc.encode_ordinary("hello world")
    assert ids == [ranks[b"hello"], ranks[b" world"]]
    assert enc.decode(ids) == "hello world"
    assert enc.eot_token == len(ranks) == enc.n_vocab - 1
    assert enc.encode("<|endoftext|>hi", allowed_special="all")[0] == enc.eot_token
    text = "héllo, wörld 123 \n\n 'll"           # bytes outside the merges still round-trip
    assert enc.decode(enc.encode_ordinary(text)) == text


@pytest.mark.parametrize("body, match", [
    (b"not-base64! 0\n", "line 1"),
    (b"YQ== 0\nYg== x\n", "line 2"),
    (b"YQ== 0\nYQ== 1\n", "twice"),
    (b"YQ== 0\nYg== 2\n", "0..1"),
])
def test_malformed_ranks_file(tmp_path, body, match):
    path = tmp_path / "bad.tiktoken"
    path.write_bytes(body)
    with pytest.raises(CheckpointError, match=match) as e:
        tok.load_ranks_file(path)
    assert str(path) in str(e.value)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "mine"))
    assert tok.cached_ranks_path() == tmp_path / "mine" / "gpt2.tiktoken"
    monkeypatch.delenv(fetch.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fetch.cache_dir() == tmp_path / "xdg" / "llmc_py"


def fake_sdist(path, data, member="whisper/assets/gpt2.tiktoken"):
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(f"openai_whisper-0/{member}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def tiny_is_gpt2(monkeypatch):
    """Makes the tiny vocabulary the one the fallback expects."""
    data = ranks_file_bytes(tiny_ranks())
    monkeypatch.setattr(tok, "GPT2_RANKS_SHA256", hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(tok, "GPT2_NUM_RANKS", len(tiny_ranks()))
    return data


def test_fallback_fetches_checks_and_caches(monkeypatch, tmp_path, capsys, tiny_is_gpt2):
    import tiktoken

    def offline(name):
        raise ConnectionError("no network")

    sdist = fake_sdist(tmp_path / "openai_whisper-0.tar.gz", tiny_is_gpt2)
    calls = []

    def fake_pip(spec, dest, **kwargs):
        calls.append(spec)
        return sdist

    monkeypatch.delenv(fetch.OFFLINE_ENV)
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    monkeypatch.setattr(fetch, "pip_download", fake_pip)
    enc = tok.get_encoding()
    assert calls == [tok.WHISPER_SDIST]
    assert tok.cached_ranks_path().read_bytes() == tiny_is_gpt2
    assert enc.decode(enc.encode_ordinary("hello world")) == "hello world"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tok.cached_ranks_path()) in err
    # the fallback working reads as information, not as an error
    assert "not reachable" in err and "(fine)" in err and "ConnectionError" not in err
    assert tok.get_encoding() is enc                       # cached per process

    tok.get_encoding.cache_clear()                         # a new process: the cache serves
    monkeypatch.setenv(fetch.OFFLINE_ENV, "1")
    assert tok.get_encoding().encode_ordinary("hello") == enc.encode_ordinary("hello")


def test_fallback_rejects_a_wrong_file(tmp_path, tiny_is_gpt2):
    sdist = fake_sdist(tmp_path / "w.tar.gz", tiny_is_gpt2 + b"IQ== 9999\n")
    with pytest.raises(CheckpointError, match="sha256"):
        tok.extract_ranks_from_sdist(sdist, tmp_path / "out.tiktoken")
    assert not (tmp_path / "out.tiktoken").exists()
    with pytest.raises(CheckpointError, match="has no file"):
        tok.extract_ranks_from_sdist(fake_sdist(tmp_path / "x.tar.gz", b"", member="other"),
                                     tmp_path / "out.tiktoken")


def test_unavailable_offline_says_what_to_do():
    with pytest.raises(tok.TokenizerUnavailableError) as e:
        tok.get_encoding()
    assert str(tok.cached_ranks_path()) in str(e.value) and tok.GPT2_RANKS_SHA256 in str(e.value)
    assert isinstance(e.value, RuntimeError)


def test_unavailable_when_every_source_fails(monkeypatch):
    import tiktoken

    def fail(*args, **kwargs):
        raise OSError("unreachable")

    monkeypatch.delenv(fetch.OFFLINE_ENV)
    monkeypatch.setattr(tiktoken, "get_encoding", fail)
    monkeypatch.setattr(fetch, "pip_download", fail)
    with pytest.raises(tok.TokenizerUnavailableError, match="Connect to the network once"):
        tok.get_encoding()


def test_real_cached_ranks_are_gpt2(tmp_path):
    require_real_ranks()
    ranks = tok.check_ranks(REAL_RANKS.read_bytes(), REAL_RANKS)
    enc = tok.encoding_from_ranks(ranks)
    assert enc.n_vocab == 50257 and enc.eot_token == tok.EOT
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    path = tmp_path / "gpt2_tokenizer.bin"
    tok.write_tokenizer_file(path, enc)
    t = tok.read_tokenizer_file(path)
    assert (t.vocab_size, t.eot) == (50257, 50256)
    assert t.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"


# ---- llm.c's tokenizer file ---------------------------------------------------------------

def test_tokenizer_file_round_trip(tmp_path):
    enc = tiny_encoding()
    path = tmp_path / "tok.bin"
    tok.write_tokenizer_file(path, enc)
    raw = np.fromfile(path, dtype="<i4", count=256)
    assert list(raw[:4]) == [20240328, 2, enc.n_vocab, enc.eot_token] and not raw[4:].any()
    t = tok.read_tokenizer_file(path)
    assert (t.vocab_size, t.eot) == (enc.n_vocab, enc.eot_token)
    assert t.token_bytes(t.eot) == b"<|endoftext|>"
    ids = enc.encode_ordinary("hello world, again")
    assert t.decode(ids) == "hello world, again"
    with pytest.raises(RangeError, match="999"):
        t.token_bytes(999)


def test_fake_vocabulary_and_partial_utf8(tmp_path):
    path = tmp_path / "tok.bin"
    e_acute = "é".encode()
    tokens = [b"a", b"bc", e_acute[:1], e_acute[1:], b"x" * 255, b"<eot>"]
    tok.write_token_table(path, tokens, eot=5)
    t = tok.read_tokenizer_file(path)
    assert [t.token_bytes(i) for i in range(6)] == tokens
    assert t.decode([0, 2, 3, 1]) == "aébc"
    assert t.decode([2, 0]) == "\ufffda"                 # a lone lead byte is replaced
    assert path.stat().st_size == HEADER_BYTES + sum(1 + len(x) for x in tokens)


@pytest.mark.parametrize("tokens, eot, match", [
    ([b"a", b""], 0, "token 1 is 0 bytes"),
    ([b"a", b"y" * 256], 0, "token 1 is 256 bytes"),
    ([b"a"], 1, "eot 1"),
    ([], 0, "no tokens"),
])
def test_write_rejects(tmp_path, tokens, eot, match):
    with pytest.raises(CheckpointError, match=match):
        tok.write_token_table(tmp_path / "t.bin", tokens, eot)
    assert not (tmp_path / "t.bin").exists()


def tokenizer_bytes(vocab=3, eot=2, version=2, magic=20240328, body=b"\x01a\x02bc\x01z"):
    h = np.zeros(256, dtype="<i4")
    h[:4] = (magic, version, vocab, eot)
    return h.tobytes() + body


MALFORMED_TOKENIZER = [
    (b"", "smaller than the 1024-byte"),
    (b"\x00" * 100, "smaller than the 1024-byte"),
    (tokenizer_bytes(magic=20240326), "magic is 20240326"),
    (tokenizer_bytes(version=3), "version is 3"),
    (tokenizer_bytes(vocab=0), "vocab_size is 0"),
    (tokenizer_bytes(vocab=1000), "vocab_size is 1000"),
    (tokenizer_bytes(eot=3), "eot is 3"),
    (tokenizer_bytes(eot=-1), "eot is -1"),
    (tokenizer_bytes(body=b"\x01a\x00bc\x01z"), "token 1 length is 0"),
    (tokenizer_bytes(body=b"\x01a\x02bc\x05z"), "token 2 of length 5"),
    (tokenizer_bytes(body=b"\x02ab\x02cd"), "token 2 length byte is past the end"),
    (tokenizer_bytes(body=b"\x01a\x02bc\x01zQ"), "1 trailing bytes"),
]


@pytest.mark.parametrize("data, match", MALFORMED_TOKENIZER,
                         ids=[m.split()[0] + "-" + m.split()[-1] for _, m in MALFORMED_TOKENIZER])
def test_malformed_tokenizer_file(tmp_path, data, match):
    path = tmp_path / "tok.bin"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=match) as e:
        tok.read_tokenizer_file(path)
    assert str(path) in str(e.value) and isinstance(e.value, ValueError)


def test_tokenizer_file_version_1_implies_gpt2_eot(tmp_path):
    path = tmp_path / "tok.bin"
    body = b"".join(b"\x01" + bytes([i % 256]) for i in range(tok.EOT + 1))
    path.write_bytes(tokenizer_bytes(vocab=tok.EOT + 1, eot=0, version=1, body=body))
    assert tok.read_tokenizer_file(path).eot == tok.EOT


def test_tokenizer_file_not_a_file(tmp_path):
    with pytest.raises(CheckpointError, match="directory"):
        tok.read_tokenizer_file(tmp_path)
    with pytest.raises(CheckpointError, match="cannot read") as e:
        tok.read_tokenizer_file(tmp_path / "missing.bin")
    assert "missing.bin" in str(e.value)
