"""Files: llm.c's model, debug-state and token files, our Llama-family model
file and training state, Hugging Face folders and PEFT's LoRA folders (hf,
peft; they need safetensors), the loader that tells them apart (load), and
the helpers they share (atomic writes, headers, bf16 numbers, fetching into
the cache)."""
from .debug_state import read_debug_state, write_debug_state
from .files import HEADER_BYTES, HEADER_INTS, atomic_write, read_header
from .load import model_kind, read_config, read_model_file, write_model_file
from .model_file import (MAGIC_LLAMA, MAGIC_MODEL, VERSION_BF16, VERSION_FP32, model_header,
                         read_llama, read_model, write_llama, write_model)
from .state import read_state, write_state
from .tokens import read_tokens, read_tokens_header, write_tokens

__all__ = ["read_debug_state", "write_debug_state", "HEADER_BYTES", "HEADER_INTS", "atomic_write",
           "read_header", "model_kind", "read_config", "read_model_file", "write_model_file",
           "MAGIC_LLAMA", "MAGIC_MODEL", "VERSION_BF16", "VERSION_FP32", "model_header",
           "read_llama", "read_model", "write_llama", "write_model", "read_state", "write_state",
           "read_tokens", "read_tokens_header", "write_tokens"]
