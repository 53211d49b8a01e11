"""llmc_py: llm.c's CPU GPT-2 trainer, with C/OpenMP kernels under Python.

The layout shows the architecture: _native (the C kernels and their
bindings), model (one transformer; GPT-2 and Llama are presets; its
decoding), generate (generation's public names), io (file formats), data (loader, dataset preparation),
train (optimizer, schedule, run folder, the loop, the CLI); bench, plot,
sample and tokenizer are command-line tools.
"""
import pkgutil

# Run from a source checkout after `pip install .`, Python imports this folder,
# which has no compiled module; let the package also search the installed
# copy (in site-packages) for it.
__path__ = pkgutil.extend_path(__path__, __name__)

from ._native import kernels
from ._native.lib import (get_isa, get_num_threads, has_openmp, release_scratch, scratch_bytes,
                          set_isa, set_num_threads, supported_isas)
from ._native.tokens import IGNORE_INDEX
from .config import GPT2Config, LlamaConfig, TransformerConfig
from .errors import (CheckpointError, ConcurrentUseError, DataError, InvalidValueError, LlmcError,
                     NullPointerError, OutOfMemoryError, RangeError, ShapeError,
                     TokenizerUnavailableError, UnsupportedError, UsageError, WriteError)
from .model import GPT2, Dropout, Llama, Transformer, load_model

__version__ = "0.1.0"

__all__ = [
    "Transformer", "GPT2", "Llama", "TransformerConfig", "GPT2Config", "LlamaConfig",
    "load_model", "Dropout", "kernels", "IGNORE_INDEX",
    "LlmcError", "ShapeError", "RangeError", "CheckpointError", "OutOfMemoryError",
    "NullPointerError", "UnsupportedError", "DataError", "TokenizerUnavailableError",
    "UsageError", "WriteError", "ConcurrentUseError", "InvalidValueError",
    "set_num_threads", "get_num_threads", "has_openmp", "set_isa", "get_isa", "supported_isas",
    "release_scratch", "scratch_bytes",
]
