"""The presets of the one transformer (transformer.Transformer).

GPT2: llm.c's GPT-2 (GPT2Config: layernorm, learned positions, GELU, biases,
a tied head, NKV = NH), whose model file is llm.c's. Llama: Llama 2's
choices by default (LlamaConfig: RMSNorm, RoPE, SwiGLU, grouped-query
attention, no biases), any of them changeable (ALiBi, a GELU MLP, an untied
head, ...), whose model file is ours (io.model_file).
"""
import re

from ..config import MODEL_FIELDS, MODEL_FLAGS, GPT2Config, LlamaConfig, padded_vocab
from ..errors import ShapeError, UsageError
from ..io.load import (read_config, read_model_file, read_model_file_into,
                       read_quantized_blocks)
from ..io.model_file import read_llama, read_model
from .quantized import check_weights_type
from .transformer import Transformer


class GPT2(Transformer):
    """GPT-2 in llm.c's layout (layout.PARAM_SPECS)."""

    def __init__(self, config=None, seed=0, *, params=None, precision="fp32", frozen=False,
                 weights=None, head_weights=None):
        """A GPT-2 of ``config`` (default: GPT2Config(), 124M) with fresh GPT-2
        initialisation from ``seed``, or with the given flat float32 ``params``
        (in llm.c's order); ``precision`` "fp32" or "bf16", ``frozen``,
        ``weights`` (Transformer)."""
        config = GPT2Config() if config is None else config
        if not isinstance(config, GPT2Config):
            raise ShapeError(f"GPT2 takes a GPT2Config, got {type(config).__name__}; "
                             f"use Transformer or Llama for other choices")
        super().__init__(config, seed, params=params, precision=precision, frozen=frozen,
                         weights=weights, head_weights=head_weights)

    @classmethod
    def from_checkpoint(cls, path, precision="fp32"):
        """Loads an llm.c model file (version 3 fp32, or version 5 bf16), in
        either precision."""
        config, params = read_model(path)
        return cls(config, params=params, precision=precision)


class Llama(Transformer):
    """The Llama family: the transformer with LlamaConfig's choices."""

    def __init__(self, config=None, seed=0, *, params=None, precision="fp32", frozen=False,
                 weights=None, head_weights=None):
        """A model of ``config`` (default: LlamaConfig()) with GPT-2's
        initialisation from ``seed``, or with the given flat float32
        ``params`` (in layout.param_specs order); ``precision`` "fp32" or
        "bf16", ``frozen``, ``weights``, ``head_weights`` (Transformer)."""
        super().__init__(LlamaConfig() if config is None else config, seed, params=params,
                         precision=precision, frozen=frozen, weights=weights,
                         head_weights=head_weights)

    @classmethod
    def from_checkpoint(cls, path, precision="fp32"):
        """Loads a model file written by ``save_checkpoint`` (fp32 or bf16),
        in either precision."""
        config, params = read_llama(path)
        return cls(config, params=params, precision=precision)


def load_model(path, precision="fp32", weights=None, frozen=False, head_weights=None):
    """A GPT2 or a Llama, whichever the model file at ``path`` holds (fp32
    or bf16 parameters), or the Hugging Face model folder or GGUF file at
    ``path`` (io.hf, io.gguf), in ``precision`` "fp32" or "bf16".
    ``weights`` "q8_0" or "q4_0": quantized (Transformer.quantize) for
    generation, the embedding and head in ``head_weights`` (default
    ``weights``); a GGUF file's tensors stored in that type keep their bytes.
    ``frozen`` (bf16): a frozen bf16 base (Transformer), its matrices in
    bf16 alone (bf16 tensors as they are, others rounded to nearest even).
    Either way the file is read into the model tensor by tensor, never whole
    in float32: the loading peak is the model's own size and one tensor."""
    if head_weights is not None and weights is None:
        raise UsageError(f"load_model: head_weights={head_weights!r} is a quantized model's "
                         f"head: give weights too")
    if weights is not None:
        check_weights_type(weights)
        if frozen:
            raise UsageError(f"load_model: weights={weights!r} and frozen=True are two ways of "
                             f"holding the weights; give one")
        config = read_config(path)
        model = preset_for(config)(config, precision=precision, weights=weights,
                                   head_weights=head_weights)
        blocks = read_quantized_blocks(path, weights)

        def put(name, l, values):
            if name in blocks:   # the file's blocks; a stack of experts whole, at each expert
                l = l[0] if isinstance(l, tuple) else l
                values = blocks[name][l]
            model.put_quantized(name, l, values)

        read_model_file_into(path, config, put)
        return model
    if frozen:
        config = read_config(path)
        model = preset_for(config)(config, precision=precision, frozen=True)
        read_model_file_into(path, config, model.put_frozen)
        return model
    config, params = read_model_file(path)
    return preset_for(config)(config, params=params, precision=precision, frozen=frozen)


def preset_for(config):
    """The class of a model of ``config``: GPT2 for a GPT2Config, else Llama."""
    return GPT2 if isinstance(config, GPT2Config) else Llama


GPT2_VOCAB = 50257
# the sizes of GPT-2 by depth; other depths get 64 channels per layer, heads of 64
GPT2_DEPTHS = {12: (768, 12), 24: (1024, 16), 36: (1280, 20), 48: (1600, 25)}


def config_from_depth(depth, max_seq_len=1024, vocab_size=GPT2_VOCAB, family=None):
    """A GPT2Config from a descriptor like "d6"; None if it is not one. With
    ``family`` {"arch": "llama", ...} (the model-family flags by dest, e.g.
    train's parsed flags; a flag left out takes its default), a LlamaConfig
    of those choices."""
    match = re.fullmatch(r"d(\d+)", depth)
    if not match:
        return None
    L = int(match.group(1))
    if L <= 0:
        raise UsageError(f"-e {depth}: the depth must be positive")
    C, NH = GPT2_DEPTHS.get(L, (64 * L, L))
    sizes = dict(max_seq_len=max_seq_len, vocab_size=vocab_size,
                 padded_vocab_size=padded_vocab(vocab_size), num_layers=L, num_heads=NH,
                 channels=C)
    if family is None or family.get("arch", "gpt2") == "gpt2":
        return GPT2Config(**sizes)
    choices = {f.name: f.from_flag(family.get(dest, f.flag_default))
               for dest, f in MODEL_FLAGS.items()}
    try:
        return LlamaConfig(**sizes, **choices)
    except ShapeError as e:
        raise UsageError(f"-e {depth} --arch llama: {e}") from None


def describe(config):
    """One line naming the model's sizes and, for the Llama family, its choices."""
    c = config
    text = f"{c.num_layers} layers, {c.channels} channels, {c.num_heads} heads"
    if isinstance(c, LlamaConfig):
        text += "".join(f.shown.format(c=c) for f in MODEL_FIELDS.values() if f.shown and (
            f.always_shown or getattr(c, f.name) != f.default))
    return text
