"""Dropout for training passes: which probabilities, and which masks.

Three sites, as GPT-2's (Hugging Face's embd_pdrop, attn_pdrop, resid_pdrop):
the embedding's output (after wte + wpe, or the sinusoids), the attention
probabilities, and each residual branch's output (attention's projection,
the MLP's) before it joins the residual stream. Only a pass given a Dropout
drops (Transformer.forward_backward, or forward then backward, for
training); evaluation, sampling and KV-cache decoding never give one.

No mask is stored. The kernels hash an element's indices under a 64-bit
seed (csrc/dropout.h), so backward regenerates the forward's masks, and the
masks are the same for any thread count. Each site of each layer has its
own seed, drawn from the pass's ``seed``; the same seed gives the same
masks, bitwise. ``row0`` places the batch in a larger one: a batch that is
rows row0 .. of the step's (another rank's rows, another micro-batch's) gets
those rows' masks, so that how a step's rows are split over processes and
micro-batches does not change them.
"""
import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from .._native import kernels as K

# the fields of Dropout that hold probabilities
RATES = ("embedding", "attention", "residual")
# the probability of each site, by the field that holds it
SITE_RATES = {"embedding": "embedding", "attention": "attention",
              "attention_output": "residual", "mlp_output": "residual"}
# each site's place in its seed (new sites go at the end: the masks of the
# others then stay)
SITE_CODES = {"embedding": 0, "attention": 1, "attention_output": 2, "mlp_output": 3,
              "adapter_input": 4}
_MASK64 = 2**64 - 1


@functools.lru_cache(maxsize=4096)   # a pass's forward and backward ask for the same ones
def _seed_of(*words):
    """A 64-bit seed from non-negative ints, by numpy's SeedSequence hash."""
    return int(np.random.SeedSequence(list(words)).generate_state(1, np.uint64)[0])


@dataclass(frozen=True)
class Dropout:
    """A training pass's dropout: a probability per site, each in [0, 1)
    (0: that site never drops), and the pass's masks (``seed``, ``row0``)."""
    embedding: float = 0.0   # the embedding's output
    attention: float = 0.0   # the attention probabilities
    residual: float = 0.0    # each residual branch's output (attention's, the MLP's)
    seed: int = 0            # the masks: an int in [0, 2^64)
    row0: int = 0            # the batch's first row among the step's rows

    def __post_init__(self):
        for name in RATES:
            p = getattr(self, name)
            # held as the float32 the kernels take (0.99999999 rounds to 1)
            p32 = float(np.float32(p)) if isinstance(p, (int, float, np.floating)) else None
            if isinstance(p, bool) or p32 is None or not (math.isfinite(p32)
                                                          and 0.0 <= p32 < 1.0):
                raise ValueError(f"dropout.{name} is a probability in [0, 1), got {p!r}"
                                 + (" (1 in float32)" if p32 == 1.0 else ""))
            object.__setattr__(self, name, p32)
        for name, top in (("seed", 2**64), ("row0", 2**63)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                    or not 0 <= value < top:
                raise ValueError(f"dropout.{name} must be an int in [0, 2^{top.bit_length() - 1})"
                                 f", got {value!r}")
            object.__setattr__(self, name, int(value))

    @property
    def active(self):
        """True if some site drops."""
        return any(getattr(self, name) > 0 for name in RATES)

    def at_step(self, step, row0=0):
        """The pass of optimizer step ``step`` over the step's rows row0 ..
        of a run whose seed is ``seed`` (the Trainer's)."""
        return replace(self, seed=_seed_of(self.seed, step), row0=row0)

    def site(self, name, layer=0):
        """(p, seed) of site ``name`` (SITE_CODES) of ``layer``, as the
        kernels take them; p is 0.0 when the site does not drop."""
        p = getattr(self, SITE_RATES[name])
        if not p:
            return 0.0, 0
        return p, self._masks(SITE_CODES[name], layer)

    def adapter_site(self, p, layer, adapter):
        """(p, seed) of LoRA dropout ``p`` (model.lora) on the input of
        adapter number ``adapter`` of ``layer``."""
        return p, self._masks(SITE_CODES["adapter_input"], layer, adapter)

    def _masks(self, *where):
        """The seed of a site's masks: this pass's, placed at row0."""
        seed = _seed_of(self.seed, *where)
        return (seed + self.row0 * K.DROPOUT_ROW_STEP) & _MASK64


NO_DROPOUT = Dropout()
