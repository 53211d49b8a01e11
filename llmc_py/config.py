"""Model configuration. Defaults are GPT-2 124M, as llm.c's checkpoint has it."""
from dataclasses import dataclass

from .errors import ShapeError

# GPT-2's vocabulary padded up to a multiple of this many columns (50257 -> 50304),
# so the output matmul splits evenly
VOCAB_PAD_MULTIPLE = 128


def padded_vocab(vocab_size, multiple=VOCAB_PAD_MULTIPLE):
    return (vocab_size + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class GPT2Config:
    max_seq_len: int = 1024          # maxT: rows of the position table wpe
    vocab_size: int = 50257          # V: real tokens (GPT-2 BPE)
    padded_vocab_size: int = 50304   # Vp >= V: rows of wte; padded logits get probability 0
    num_layers: int = 12             # L
    num_heads: int = 12              # NH: must divide channels
    channels: int = 768              # C

    def __post_init__(self):
        self.validate()

    def validate(self):
        """Raises ShapeError naming the first field that cannot describe a model."""
        for name in ("max_seq_len", "vocab_size", "padded_vocab_size",
                     "num_layers", "num_heads", "channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ShapeError(f"GPT2Config.{name} must be a positive int, got {value!r}")
        if self.channels % self.num_heads != 0:
            raise ShapeError(f"GPT2Config.channels={self.channels} is not divisible by "
                             f"num_heads={self.num_heads}")
        if self.padded_vocab_size < self.vocab_size:
            raise ShapeError(f"GPT2Config.padded_vocab_size={self.padded_vocab_size} is "
                             f"smaller than vocab_size={self.vocab_size}")

    @property
    def head_size(self):
        return self.channels // self.num_heads

    # llm.c's short names, so the model code reads like train_gpt2.c
    @property
    def C(self):
        return self.channels

    @property
    def L(self):
        return self.num_layers

    @property
    def NH(self):
        return self.num_heads

    @property
    def V(self):
        return self.vocab_size

    @property
    def Vp(self):
        return self.padded_vocab_size

    @property
    def maxT(self):
        return self.max_seq_len
