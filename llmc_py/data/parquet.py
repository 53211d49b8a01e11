"""Records of a Parquet file: one a row, read a batch of rows at a time with
pyarrow (``pip install pyarrow``, or the ``[parquet]`` extra). Rows are
numbered from 0, as pyarrow and pandas number them."""
from pathlib import Path

from ..errors import DataError
from .jsonl import wrong_kind

INSTALL_HINT = 'pip install pyarrow (or "llmc_py[parquet]")'
# rows converted to Python at once
BATCH_ROWS = 1024


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as e:
        raise DataError(f"reading Parquet needs pyarrow: {INSTALL_HINT} ({e})") from None
    return pyarrow


def parquet_field(path, field, kind):
    """Yields (row number, value, None) for each row of ``path`` whose
    column ``field`` holds a ``kind``, and (row number, None, the one-line
    reason) for each other row. A chat's messages (a list of structs) lose
    their null fields: Parquet gives every message each field any message
    of the column has. DataError if the file cannot be read or has no such
    column."""
    pa = _pyarrow()
    path = Path(path)
    try:
        f = pa.parquet.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    columns = f.schema_arrow.names
    if field not in columns:
        raise DataError(f'{path}: no column "{field}" (its columns: {", ".join(columns)})')
    number = 0
    try:
        for batch in f.iter_batches(columns=[field], batch_size=BATCH_ROWS):
            for value in batch.column(0).to_pylist():
                if value is None:
                    yield number, None, f'"{field}" is null'
                elif wrong_kind(value, field, kind):
                    yield number, None, wrong_kind(value, field, kind)
                else:
                    yield number, _without_nulls(value), None
                number += 1
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot read the rows from {number} on ({e})") from None


def _without_nulls(value):
    """A list of messages with each one's null fields dropped; other values as they are."""
    if not isinstance(value, list):
        return value
    return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
            for m in value]
