"""Fine-tuning from a Hugging Face folder, end to end: a tiny Qwen3 whose
tokenizer.json (a word-level vocabulary of 70,000 ids, made here) does not
fit in uint16, so `python -m llmc_py.data --tokenizer` writes llm.c's uint32
(Llama 3) token files; `train -e FOLDER --export-hf` trains on them and hands
back a folder that transformers loads with our logits; `sample -e` decodes
with the folder's tokenizer. Also the uint32 token file itself."""
import json

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from llmc_py import load_model
from llmc_py import sample as sample_mod
from llmc_py import train as train_mod
from llmc_py.data import DataLoader, read_tokens, write_tokens
from llmc_py.data.prepare import main as data_main
from llmc_py.errors import DataError
from llmc_py.io.tokens import MAGIC_TOKENS_32, read_tokens_header, token_dtype
from llmc_py.tokenizer import HFTokenizer, load_tokenizer

VOCAB = 70_000          # past uint16
WORDS = "the king queen a of and to my lord sweet love night day is".split()
EOS = 3


def word_tokenizer():
    """Word-level: [UNK] 0, then filler ids, and WORDS at the top ids."""
    vocab = {"[UNK]": 0, "<|endoftext|>": EOS}
    vocab.update({f"w{i}": i for i in range(1, VOCAB - len(WORDS)) if i != EOS})
    vocab.update({w: VOCAB - len(WORDS) + i for i, w in enumerate(WORDS)})
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return tokenizer


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=EOS, pad_token_id=None))
    model.save_pretrained(folder)
    word_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


def test_uint32_token_files_round_trip_and_load(tmp_path):
    tokens = np.array([0, 65535, 65536, 151_935, 7] * 20, dtype=np.int64)
    path = tmp_path / "t.bin"
    write_tokens(path, tokens, dtype=token_dtype(151_936))
    header = np.fromfile(path, dtype="<i4", count=3)
    assert header.tolist() == [MAGIC_TOKENS_32, 7, tokens.size]
    assert path.stat().st_size == 1024 + 4 * tokens.size
    back = read_tokens(path)
    assert back.dtype == np.uint32 and np.array_equal(back, tokens)
    x, y = DataLoader(str(path), 2, 8, vocab_size=151_936).next_batch()
    assert np.array_equal(x.reshape(-1), tokens[:16]) and np.array_equal(y.reshape(-1),
                                                                          tokens[1:17])
    with pytest.raises(DataError, match="151935, not below the model's vocab_size 100000"):
        DataLoader(str(path), 2, 8, vocab_size=100_000).next_batch()
    with pytest.raises(DataError, match=r"outside \[0, 65535\] \(uint16 token file\)"):
        write_tokens(tmp_path / "u16.bin", tokens)
    # a uint32 file cut short says so
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(DataError, match="truncated"):
        read_tokens_header(path)


def test_tokenizer_json_is_read_with_its_separator(qwen_folder):
    tokenizer = load_tokenizer(qwen_folder)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.n_vocab == VOCAB and tokenizer.eot_token == EOS
    ids = tokenizer.encode("the king of night")
    assert ids == [VOCAB - len(WORDS) + WORDS.index(w) for w in ("the", "king", "of", "night")]
    assert tokenizer.decode(ids) == "the king of night"


def test_fine_tune_a_folder_and_export_it(qwen_folder, tmp_path, capsys):
    text = tmp_path / "verse.txt"
    rng = np.random.default_rng(0)
    text.write_text("\n\n".join(" ".join(rng.choice(WORDS, 40)) for _ in range(60)))
    assert data_main(["--text", str(text), "--tokenizer", str(qwen_folder), "--out",
                      str(tmp_path / "data"), "--split-blank-lines"]) == 0
    train_bin = tmp_path / "data" / "verse" / "train.bin"
    assert np.fromfile(train_bin, dtype="<i4", count=1)[0] == MAGIC_TOKENS_32
    tokens = read_tokens(train_bin)
    assert tokens.max() >= VOCAB - len(WORDS) and (tokens == EOS).sum() > 10

    out, export = tmp_path / "out", tmp_path / "export"
    code = train_mod.main(["-e", str(qwen_folder), "-i", str(train_bin), "-j",
                           str(tmp_path / "data" / "verse" / "val.bin"), "-o", str(out),
                           "-b", "2", "-t", "16", "-x", "4", "-v", "2", "-m", "1", "-s", "4",
                           "-g", "5", "-n", "4", "-u", "0", "-l", "1e-2",
                           "--export-hf", str(export)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "qk_norm, head_dim 16" in printed and "exported" in printed
    losses = [float(line.split()[1][4:]) for line in (out / "main.log").read_text().splitlines()
              if " trl:" in line]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert (export / "tokenizer.json").read_bytes() == (qwen_folder / "tokenizer.json") \
        .read_bytes()
    assert json.loads((export / "config.json").read_text())["architectures"] == \
        ["Qwen3ForCausalLM"]

    ours = load_model(out / "model_00000004.bin")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        export, attn_implementation="eager").eval()
    x = tokens[:24].astype(np.int64)[None]
    ours.forward(x)
    with torch.no_grad():
        ref = back(torch.tensor(x)).logits.numpy()
    assert np.abs(ours.logits[..., :VOCAB] - ref).max() < 1e-5 * np.abs(ref).max()

    assert sample_mod.main(["-e", str(export), "--prompt", "the king", "-g", "6",
                            "--temperature", "0"]) == 0
    words = capsys.readouterr().out.split()
    assert words[:2] == ["the", "king"] and len(words) > 2


def test_a_tokenizer_larger_than_the_model_is_refused(qwen_folder, tmp_path, capsys):
    train = tmp_path / "t.bin"
    write_tokens(train, np.arange(200) % 50, dtype=np.uint32)
    code = train_mod.main(["-e", "d1", "--tokenizer", str(qwen_folder), "-i", str(train),
                           "-o", str(tmp_path / "o"), "-b", "1", "-t", "8", "-x", "1",
                           "-s", "0", "-v", "0"])
    assert code == 1
    assert "vocab_size is 50257, fewer than the 70000 tokens" in capsys.readouterr().err
