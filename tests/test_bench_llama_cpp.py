"""bench/llama_cpp.py, the optional llama.cpp peer of bench --generate
--weights, without llama-cpp-python: no rows and a line saying why when it
is absent; with a stand-in ``llama_cpp`` module (Llama's reset, eval,
n_vocab and ctx, and llama_get_logits_ith, as llama-cpp-python's) the job
decodes the GGUF file we write of the model, greedily, in a process of its
own."""
import importlib.util
import os
import textwrap

import gguf
import pytest

from llmc_py.bench import llama_cpp
from llmc_py.config import LlamaConfig
from llmc_py.errors import ShapeError
from llmc_py.model.presets import Llama

CONFIG = LlamaConfig(max_seq_len=32, vocab_size=300, padded_vocab_size=384, num_layers=1,
                     num_heads=2, num_kv_heads=2, channels=32)

# llama-cpp-python's Llama (reset, eval, n_vocab, ctx) and llama_get_logits_ith:
# the argmax of each step's logits is the token after the last one evaluated
STAND_IN = '''
import ctypes
import numpy as np
import gguf

class Llama:
    def __init__(self, model_path, n_ctx, n_batch, n_threads, n_threads_batch, verbose):
        reader = gguf.GGUFReader(model_path)
        self.vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        self.logits = np.zeros(self.vocab, np.float32)
        self.ctx = self
        assert n_batch >= 1 and n_threads == n_threads_batch >= 1 and not verbose

    def n_vocab(self):
        return self.vocab

    def reset(self):
        pass

    def eval(self, tokens):
        self.logits[:] = 0
        self.logits[(tokens[-1] + 1) % self.vocab] = 1

def llama_get_logits_ith(ctx, i):
    assert i == -1
    return ctx.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
'''


@pytest.fixture(autouse=True)
def fresh_answer():
    llama_cpp.missing.cache_clear()
    yield
    llama_cpp.missing.cache_clear()


def test_without_llama_cpp_python_there_are_no_rows_and_a_line_says_why(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert llama_cpp.missing() == ("llama.cpp peer: llama-cpp-python is not installed (pip "
                                   "install llama-cpp-python); no llama.cpp rows")
    assert llama_cpp.decode_gguf(Llama(CONFIG), "q8_0", [[1, 2, 3]], 4, 1) is None


def test_a_llama_cpp_that_does_not_import_is_named(tmp_path, monkeypatch):
    """As llama-cpp-python installed without its dependencies (diskcache)."""
    (tmp_path / "llama_cpp.py").write_text("import no_such_module_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert llama_cpp.missing() == ("llama.cpp peer: llama_cpp does not import "
                                   "(ModuleNotFoundError: No module named "
                                   "'no_such_module_here'); no llama.cpp rows")
    assert llama_cpp.decode_gguf(Llama(CONFIG), "q8_0", [[1, 2, 3]], 4, 1) is None


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A llama_cpp module on the path of this process and its jobs."""
    (tmp_path / "llama_cpp.py").write_text(textwrap.dedent(STAND_IN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))


@pytest.mark.parametrize("weights, stored", [("fp32", "F32"), ("bf16", "BF16"),
                                             ("q8_0", "Q8_0"), ("q4_0", "Q4_0")])
def test_the_job_decodes_the_gguf_file_of_the_model_greedily(stand_in, monkeypatch, weights,
                                                             stored):
    run_job, seen = llama_cpp.run_job, []

    def spy(module, job, what):   # the file the job reads, in the type asked for
        reader = gguf.GGUFReader(job["path"])
        seen.append(next(t.tensor_type.name for t in reader.tensors
                         if t.name == "blk.0.attn_q.weight"))
        return run_job(module, job, what)
    monkeypatch.setattr(llama_cpp, "run_job", spy)
    assert llama_cpp.missing() is None
    row = llama_cpp.decode_gguf(Llama(CONFIG), weights, [[7, 8, 299]], 4, 2)
    assert row["tokens"] == [[0, 1, 2, 3]] and seen == [stored]
    assert 0 < row["min"] <= row["median"] <= row["max"]


def test_only_batch_1_and_our_weight_types(stand_in):
    assert llama_cpp.decode_gguf(Llama(CONFIG), "q8_0", [[1], [2]], 4, 1) is None
    assert llama_cpp.decode_gguf(Llama(CONFIG), "q4_k", [[1]], 4, 1) is None


def test_placeholder_vocabulary_is_byte_level_with_one_merge(tmp_path):
    from llmc_py.io.gguf import placeholder_vocab, write_gguf
    path = tmp_path / "m.gguf"
    write_gguf(path, CONFIG, Llama(CONFIG).params.memory, tokenizer=placeholder_vocab(300))
    fields = gguf.GGUFReader(path).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 300 and tokens[0] == "Ā" and tokens[32] == "Ġ" and tokens[33] == "!"
    assert tokens[256:258] == ["Ġt", "<unused257>"]
    assert fields["tokenizer.ggml.merges"].contents() == ["Ġ t"]
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    with pytest.raises(ShapeError, match="placeholder_vocab: size is 256; at least 257"):
        placeholder_vocab(256)
