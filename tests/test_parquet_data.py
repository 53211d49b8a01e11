"""Parquet records (data.parquet, prepare_parquet, ``--parquet``): a text
column or chat messages give the tokens and loss mask the same records give
from JSONL; an unusable row is said with its number (from 0) and the rest is
written; a file without the column, a file that is not Parquet, and a
missing pyarrow are one clear error each."""
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import llmc_py.data.prepare as P
from llmc_py.data.parquet import parquet_field
from llmc_py.errors import DataError
from test_chat_data import (CHATML, CHATS, chat_lines, folders, make_tokenizer_folder,  # noqa: F401
                            prepared, write_jsonl)


def write_parquet(path, columns, row_group_size=None):
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def test_chats_give_the_jsonl_files_tokens_and_mask(folders, tmp_path, capsys):  # noqa: F811
    chats = chat_lines(12)
    # row groups of 5: the records cross batches and groups
    src = write_parquet(tmp_path / "chats.parquet",
                        {"messages": [c["messages"] for c in chats],
                         "id": list(range(12))}, row_group_size=5)
    tokenizer = str(folders["chatml"])
    assert P.main(["--parquet", str(src), "--tokenizer", tokenizer, "--chat",
                   "--out", str(tmp_path / "pq")]) == 0
    assert "12 records, 0 rows skipped" in capsys.readouterr().out
    P.prepare_jsonl(write_jsonl(tmp_path / "chats.jsonl", chats), tmp_path / "js",
                    tokenizer=tokenizer, chat=True, quiet=True)
    (tokens, mask), (expected, expected_mask) = prepared(tmp_path / "pq"), \
        prepared(tmp_path / "js")
    assert tokens.tolist() == expected.tolist() and mask.tolist() == expected_mask.tolist()
    assert 0 < mask.sum() < mask.size


def test_texts_give_the_jsonl_files_tokens(tmp_path):
    folder = make_tokenizer_folder(tmp_path / "tok", CHATML, config={"bos_token_id": 3})
    texts = ["hello world", "the quick brown fox\n", "how are you?"] * 10
    src = write_parquet(tmp_path / "data.parquet", {"text": pa.array(texts, pa.large_string())})
    assert P.main(["--parquet", str(src), "--tokenizer", str(folder),
                   "--out", str(tmp_path / "pq")]) == 0
    P.prepare_jsonl(write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in texts]),
                    tmp_path / "js", tokenizer=folder, quiet=True)
    (tokens, mask), (expected, _) = prepared(tmp_path / "pq", "data"), \
        prepared(tmp_path / "js", "data")
    assert mask is None and tokens.tolist() == expected.tolist()


def test_bad_rows_are_said_with_their_numbers_and_the_rest_is_written(folders, tmp_path,  # noqa: F811
                                                                      capsys):
    good = [c["messages"] for c in chat_lines(3)]
    rows = [good[0],
            None,                                                         # 1
            [{"role": "user", "content": "hello"}],                       # 2
            [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}],  # 3
            good[1],
            [{"role": "user", "content": "a", "name": "ann"},             # 5: a field
             {"role": "assistant", "content": "b"}],                      # others lack
            [],                                                           # 6
            good[2]]
    src = write_parquet(tmp_path / "mixed.parquet", {"messages": rows})
    out = tmp_path / "out"
    assert P.main(["--parquet", str(src), "--tokenizer", str(folders["chatml"]), "--chat",
                   "--out", str(out), "--name", "chats"]) == 0
    captured = capsys.readouterr()
    said = captured.err.splitlines()
    assert [line.split(": skipped: ")[0] for line in said] == \
        [f"{src}: row {n}" for n in (1, 2, 3, 6)]
    assert '"messages" is null' in said[0] and "no assistant turn" in said[1]
    assert "Unknown role: robot" in said[2]
    assert "4 records, 4 rows skipped" in captured.out
    from llmc_py.data.chat import ChatEncoder
    encoder = ChatEncoder(folders["chatml"])
    tokens, _ = prepared(out)
    kept = [good[0], good[1], [{"role": "user", "content": "a", "name": "ann"},
                               {"role": "assistant", "content": "b"}], good[2]]
    assert tokens.tolist() == np.concatenate([encoder.encode(m)[0] for m in kept]).tolist()


def test_null_fields_of_messages_are_dropped(tmp_path):
    """Parquet gives every message each field any message has: the absent
    ones come back null and are dropped, as the JSONL record lacks them."""
    rows = [[{"role": "user", "content": "a", "name": "ann"}],
            [{"role": "user", "content": "b"}]]
    src = write_parquet(tmp_path / "m.parquet", {"messages": rows})
    values = [value for _, value, _ in parquet_field(src, "messages", list)]
    assert values == rows


def test_a_text_column_of_another_type_and_null_texts_are_said(tmp_path, capsys):
    src = write_parquet(tmp_path / "n.parquet", {"text": ["a", None, "b"]})
    assert [(n, reason) for n, _, reason in parquet_field(src, "text", str)] == \
        [(0, None), (1, '"text" is null'), (2, None)]
    src = write_parquet(tmp_path / "i.parquet", {"text": [1, 2]})
    assert [reason for _, _, reason in parquet_field(src, "text", str)] == \
        ['"text" is a int, not a str'] * 2
    assert P.main(["--parquet", str(src), "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"llmc_py.data: error: {src}: no record to prepare (2 rows skipped)"


def test_a_missing_column_or_a_file_that_is_not_parquet_is_one_error(tmp_path, capsys):
    src = write_parquet(tmp_path / "t.parquet", {"prompt": ["a"], "answer": ["b"]})
    with pytest.raises(DataError, match=r'no column "text" \(its columns: prompt, answer\)'):
        list(parquet_field(src, "text", str))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not a parquet file at all")
    assert P.main(["--parquet", str(bad), "--out", str(tmp_path / "out")]) == 1
    assert "bad.parquet: not a readable Parquet file" in capsys.readouterr().err
    with pytest.raises(DataError, match="not a readable Parquet file"):
        list(parquet_field(tmp_path / "absent.parquet", "text", str))
    # a file cut short: its footer names more bytes than there are
    raw = src.read_bytes()
    (tmp_path / "cut.parquet").write_bytes(raw[:20] + raw[-100:])
    with pytest.raises(DataError, match="cut.parquet: not a readable Parquet file"):
        list(parquet_field(tmp_path / "cut.parquet", "text", str))
    assert not (tmp_path / "out").exists()


def test_without_pyarrow_the_error_names_it(tmp_path, monkeypatch, capsys):
    src = write_parquet(tmp_path / "t.parquet", {"text": ["a"]})
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)   # import fails
    assert P.main(["--parquet", str(src), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "reading Parquet needs pyarrow: pip install pyarrow" in err
    assert not (tmp_path / "out").exists()


def test_the_command_line_takes_one_source(tmp_path, capsys):
    with pytest.raises(SystemExit):
        P.parse(["--parquet", "a.parquet", "--jsonl", "b.jsonl"])
    with pytest.raises(SystemExit):
        P.parse(["--parquet", "a.parquet", "--chat"])   # no tokenizer
    assert "--chat goes with --jsonl FILE or --parquet FILE" in capsys.readouterr().err
    args = P.parse(["--parquet", "a.parquet", "--chat", "--tokenizer", "t", "--name", "x"])
    assert args.parquet == "a.parquet" and args.chat and args.name == "x"
