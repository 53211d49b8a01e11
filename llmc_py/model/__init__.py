"""The model: one transformer (transformer.py) of blocks (blocks.py) over
named tensors carved from flat buffers (layout.py), its presets GPT-2 and
Llama (presets.py), LoRA adapters on a frozen base (lora.py), its memory
plan (planning.py) and the memory check every allocation passes
(memory.py), the AdamW step (adamw.py), and decoding with a KV cache
(kv_cache.py, sampling.py)."""
from .dropout import Dropout
from .presets import GPT2, Llama, load_model
from .planning import RECOMPUTE_LEVELS
from .transformer import MATRIX_PARAMS, PRECISIONS, Transformer

__all__ = ["Transformer", "GPT2", "Llama", "load_model", "MATRIX_PARAMS", "PRECISIONS",
           "RECOMPUTE_LEVELS", "Dropout"]
