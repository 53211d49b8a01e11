"""A model from any path: the one place that tells an llm.c GPT-2 file, our
Llama-family file (io.model_file), a Hugging Face folder (io.hf) and a GGUF
file (io.gguf) apart and hands the path to its reader; the readers never
import each other (io.gguf builds on io.hf's Hugging Face names)."""
from pathlib import Path

from ..config import GPT2Config
from ..errors import CheckpointError
from .files import read_header
from .gguf import is_gguf, read_gguf, read_gguf_blocks, read_gguf_config, read_gguf_into
from .hf import read_hf, read_hf_config, read_hf_into
from .model_file import (MAGIC_LLAMA, MAGIC_MODEL, read_llama, read_llama_header,
                         read_llama_into, read_model, read_model_header, read_model_into,
                         write_llama, write_model)


def model_kind(path):
    """"gpt2" or "llama", from a model file's magic number."""
    header, _ = read_header(path, "model")
    if header[0] == MAGIC_LLAMA:
        return "llama"
    if header[0] == MAGIC_MODEL:
        return "gpt2"
    raise CheckpointError(f"{path}: header field magic is {header[0]}, expected {MAGIC_MODEL} "
                          f"(llm.c GPT-2) or {MAGIC_LLAMA} (llmc_py Llama): not a model file")


def read_model_file(path):
    """(config, params) from either model file, a GPT2Config from llm.c's,
    a LlamaConfig from ours; from a Hugging Face model folder (needs the
    optional safetensors package); or from a GGUF file (needs the optional
    gguf package), dequantised."""
    if Path(path).is_dir():
        return read_hf(path)
    if is_gguf(path):
        return read_gguf(path)
    return (read_llama if model_kind(path) == "llama" else read_model)(path)


def read_model_file_into(path, config, put):
    """Reads any model path as read_model_file does, tensor by tensor:
    put(name, l, array) gets each of our tensors (layer l, None for a whole
    one; float32, or a folder's float16 or bf16), without the vocabulary's
    padding rows; nothing else of the model is held at once. ``config`` is
    read_config's."""
    if Path(path).is_dir():
        read_hf_into(path, config, put)
    elif is_gguf(path):
        read_gguf_into(path, put)
    else:
        (read_llama_into if model_kind(path) == "llama" else read_model_into)(path, put)


def read_quantized_blocks(path, qtype):
    """The linear layers a GGUF file stores as ``qtype``, as its blocks
    (io.gguf.read_gguf_blocks); {} for every other model file."""
    return read_gguf_blocks(path, qtype) if is_gguf(path) else {}


def read_config(path):
    """The config of a model file (from its header only), of a Hugging Face
    folder or of its config.json, or of a GGUF file (its metadata)."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".json":
        return read_hf_config(path)[1]
    if is_gguf(path):
        return read_gguf_config(path)
    read_header_of = read_llama_header if model_kind(path) == "llama" else read_model_header
    return read_header_of(path)[0]


def write_model_file(path, config, params, dtype="fp32"):
    """Writes llm.c's file for a GPT2Config, ours for any other config, with
    fp32 or bf16 parameters (``dtype``)."""
    write = write_model if isinstance(config, GPT2Config) else write_llama
    write(path, config, params, dtype)
