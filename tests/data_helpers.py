"""Shared by test_data.py and test_tokenizer.py: a tiny BPE vocabulary (so no
test needs GPT-2's real ranks), and a guard that fails any test that tries
to download."""
import base64
import urllib.request

import pytest

import llmc_py.tokenizer as tok
from llmc_py.io import fetch

# the user's cache of GPT-2's ranks, read before no_network redirects the cache
REAL_RANKS = tok.cached_ranks_path()


def require_real_ranks():
    """Fails (not skips) a test that needs GPT-2's real ranks when they are not
    cached: tests never download them."""
    if not REAL_RANKS.is_file():
        pytest.fail(f"GPT-2's BPE ranks are not cached at {REAL_RANKS}: run "
                    f"`python -m llmc_py.tokenizer` once (it fetches them), then rerun")


# 256 byte tokens, then merges that spell "hello" and " world"
TINY_MERGES = (b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world")


def tiny_ranks():
    ranks = {bytes([b]): b for b in range(256)}
    for t in TINY_MERGES:
        ranks[t] = len(ranks)
    return ranks


def ranks_file_bytes(ranks):
    """A .tiktoken file's text: ``base64(token) rank`` per line."""
    return b"".join(base64.b64encode(t) + b" " + str(r).encode() + b"\n"
                    for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))


def tiny_encoding():
    return tok.encoding_from_ranks(tiny_ranks(), name="tiny")


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path):
    """Every test runs with an empty llmc_py cache in tmp_path, LLMC_OFFLINE
    set, and downloads replaced by failures; get_encoding's per-process
    cache is cleared around the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a test tried to reach the network")

    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(fetch.OFFLINE_ENV, "1")
    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    monkeypatch.setattr(fetch, "pip_download", refuse)
    get_encoding = tok.get_encoding     # a test may monkeypatch it away
    get_encoding.cache_clear()
    yield
    get_encoding.cache_clear()
