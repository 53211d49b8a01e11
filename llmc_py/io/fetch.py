"""Fetching files: the llmc_py cache folder, the offline switch, a URL into
a file, and ``pip download`` (PyPI is the one registry every user reaches)."""
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from .files import atomic_write

CACHE_ENV = "LLMC_CACHE_DIR"
OFFLINE_ENV = "LLMC_OFFLINE"
PIP_TIMEOUT_S = 300


def cache_dir():
    """$LLMC_CACHE_DIR, else $XDG_CACHE_HOME/llmc_py, else ~/.cache/llmc_py
    (not created here)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "llmc_py"


def offline():
    """True when LLMC_OFFLINE is set (to anything but 0): no downloads."""
    return os.environ.get(OFFLINE_ENV, "") not in ("", "0")


def download_url(url, dest, timeout):
    """Saves the utf-8 text at ``url`` to ``dest``, atomically."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        data = r.read()
    data.decode("utf-8")   # refuse a non-text answer
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dest, [data])


def pip_download(spec, dest, *, sdist=False, timeout=PIP_TIMEOUT_S):
    """``python -m pip download --no-deps spec -d dest`` (a source distribution
    if ``sdist``, else a wheel); returns the one file it saved. PyPI only."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", "-d", str(dest), spec]
    cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise OSError(f"pip download {spec} took longer than {timeout} s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"pip download {spec} failed (exit {proc.returncode}): {last}")
    files = sorted(p for p in Path(dest).iterdir() if p.is_file())
    if len(files) != 1:
        raise OSError(f"pip download {spec} saved {len(files)} files, expected 1")
    return files[0]
