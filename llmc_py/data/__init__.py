"""Data: the loader over token shards (loader.py) and dataset preparation
(prepare.py, shakespeare.py; JSONL and Parquet texts and chats: jsonl.py,
parquet.py, chat.py);
``python -m llmc_py.data`` prepares a dataset.
The token-file format itself is io.tokens."""
from ..errors import DataError
from ..io.tokens import read_tokens, read_tokens_header, write_tokens
from .loader import DataLoader
from .prepare import (dataset_paths, prepare_dataset, prepare_jsonl, prepare_parquet,
                      prepare_text, tokenize_text)

__all__ = ["DataError", "DataLoader", "read_tokens", "read_tokens_header", "write_tokens",
           "dataset_paths", "prepare_dataset", "prepare_jsonl", "prepare_parquet",
           "prepare_text", "tokenize_text"]
