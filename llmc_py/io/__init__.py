"""Files: llm.c's model, debug-state and token files, our Llama-family model
file and training state, and the helpers they share (atomic writes, headers,
fetching into the cache)."""
from .debug_state import read_debug_state, write_debug_state
from .files import HEADER_BYTES, HEADER_INTS, atomic_write, read_header
from .model_file import (MAGIC_LLAMA, MAGIC_MODEL, VERSION_BF16, VERSION_FP32, model_header,
                         model_kind, read_llama, read_model, read_model_file, write_llama,
                         write_model, write_model_file)
from .state import read_state, write_state
from .tokens import read_tokens, read_tokens_header, write_tokens
from ..model.layout import num_parameters

__all__ = ["read_debug_state", "write_debug_state", "HEADER_BYTES", "HEADER_INTS", "atomic_write",
           "read_header", "MAGIC_LLAMA", "MAGIC_MODEL", "VERSION_BF16", "VERSION_FP32", "model_header",
           "model_kind", "read_llama", "read_model", "read_model_file", "write_llama",
           "write_model", "write_model_file", "read_state", "write_state", "read_tokens",
           "read_tokens_header", "write_tokens", "num_parameters"]
