"""Records of a JSONL file: one JSON object a line (blank lines are skipped)."""
import json
from pathlib import Path

from ..errors import DataError


def jsonl_field(path, field, kind):
    """Yields (line number, value, None) for each line of ``path`` whose
    object has ``field`` of type ``kind``, and (line number, None, the
    one-line reason) for each other non-blank line."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from e
    with f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield number, None, f"not utf-8 ({e.reason} at byte {e.start})"
                continue
            except ValueError as e:
                yield number, None, f"not JSON ({e})"
                continue
            value = record.get(field) if isinstance(record, dict) else None
            if not isinstance(record, dict):
                yield number, None, "not a JSON object"
            elif value is None:
                yield number, None, f'no "{field}" field'
            elif wrong_kind(value, field, kind):
                yield number, None, wrong_kind(value, field, kind)
            else:
                yield number, value, None


def wrong_kind(value, field, kind):
    """Why ``value`` of ``field`` cannot be used, if it is not a ``kind``; else None."""
    if not isinstance(value, kind):
        return f'"{field}" is a {type(value).__name__}, not a {kind.__name__}'
    return None
