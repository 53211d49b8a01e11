"""The presets of the one transformer (transformer.Transformer).

GPT2: llm.c's GPT-2 (GPT2Config: layernorm, learned positions, GELU, biases,
a tied head, NKV = NH), whose model file is llm.c's. Llama: Llama 2's
choices by default (LlamaConfig: RMSNorm, RoPE, SwiGLU, grouped-query
attention, no biases), any of them changeable (ALiBi, a GELU MLP, an untied
head, ...), whose model file is ours (io.model_file).
"""
from ..config import GPT2Config, LlamaConfig
from ..errors import ShapeError
from ..io.load import read_model_file
from ..io.model_file import read_llama, read_model
from .transformer import Transformer


class GPT2(Transformer):
    """GPT-2 in llm.c's layout (layout.PARAM_SPECS)."""

    def __init__(self, config=None, seed=0, *, params=None, precision="fp32"):
        """A GPT-2 of ``config`` (default: GPT2Config(), 124M) with fresh GPT-2
        initialisation from ``seed``, or with the given flat float32 ``params``
        (in llm.c's order); ``precision`` "fp32" or "bf16" (Transformer)."""
        config = GPT2Config() if config is None else config
        if not isinstance(config, GPT2Config):
            raise ShapeError(f"GPT2 takes a GPT2Config, got {type(config).__name__}; "
                             f"use Transformer or Llama for other choices")
        super().__init__(config, seed, params=params, precision=precision)

    @classmethod
    def from_checkpoint(cls, path, precision="fp32"):
        """Loads an llm.c model file (version 3 fp32, or version 5 bf16), in
        either precision."""
        config, params = read_model(path)
        return cls(config, params=params, precision=precision)


class Llama(Transformer):
    """The Llama family: the transformer with LlamaConfig's choices."""

    def __init__(self, config=None, seed=0, *, params=None, precision="fp32"):
        """A model of ``config`` (default: LlamaConfig()) with GPT-2's
        initialisation from ``seed``, or with the given flat float32
        ``params`` (in layout.param_specs order); ``precision`` "fp32" or
        "bf16" (Transformer)."""
        super().__init__(LlamaConfig() if config is None else config, seed, params=params,
                         precision=precision)

    @classmethod
    def from_checkpoint(cls, path, precision="fp32"):
        """Loads a model file written by ``save_checkpoint`` (fp32 or bf16),
        in either precision."""
        config, params = read_llama(path)
        return cls(config, params=params, precision=precision)


def load_model(path, precision="fp32"):
    """A GPT2 or a Llama, whichever the model file at ``path`` holds (fp32
    or bf16 parameters), or the Hugging Face model folder at ``path``
    (GPT-2, Llama, Qwen3: io.hf), in ``precision`` "fp32" or "bf16"."""
    config, params = read_model_file(path)
    model = GPT2 if isinstance(config, GPT2Config) else Llama
    return model(config, params=params, precision=precision)
