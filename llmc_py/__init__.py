"""llmc_py: llm.c's CPU GPT-2 trainer, with C/OpenMP kernels under Python."""
import pkgutil

# Run from a source checkout after `pip install .`, Python imports this folder,
# which has no compiled module; let the package also search the installed
# copy (in site-packages) for it.
__path__ = pkgutil.extend_path(__path__, __name__)

from ._lib import (get_isa, get_num_threads, has_openmp, set_isa, set_num_threads,
                   supported_isas)
from .config import GPT2Config, LlamaConfig
from .errors import (CheckpointError, InvalidValueError, LlmcError, NullPointerError,
                     OutOfMemoryError, RangeError, ShapeError, UnsupportedError)
from .model import GPT2
from .llama import Llama, load_model

__version__ = "0.1.0"

__all__ = [
    "GPT2", "GPT2Config", "Llama", "LlamaConfig", "load_model",
    "LlmcError", "ShapeError", "RangeError", "CheckpointError", "OutOfMemoryError",
    "NullPointerError", "UnsupportedError", "InvalidValueError",
    "set_num_threads", "get_num_threads", "has_openmp", "set_isa", "get_isa", "supported_isas",
]
