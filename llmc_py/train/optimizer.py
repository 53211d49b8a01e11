"""AdamW over the model's flat parameter and gradient buffers (llm.c's
gpt2_update), as an object that keeps its moments m and v in the model's
(model.moments())."""
from .._native import kernels as K
from ..model.layout import aligned_zeros

DECAY_ON = ("matrices", "all")   # which parameters weight decay applies to


def adamw_step(params, grads, m, v, learning_rate, beta1, beta2, eps, weight_decay, t,
               decay=None, params_bf16=None, span=None):
    """One AdamW step over TensorGroups ``params`` and ``grads`` with flat
    moments ``m`` and ``v``; t >= 1 is the step number. Weight decay applies
    to every tensor unless ``decay`` names the ones to decay. The TensorGroup
    ``params_bf16``, if given, receives the new parameters rounded to bf16.
    ``span`` (start, stop) updates only those elements of the flat buffers,
    and m and v then hold that span's moments only (ZeRO-1's shard); each
    element's update is the same as in a whole step."""
    copy = None if params_bf16 is None else params_bf16.memory
    start, stop = (0, params.memory.size) if span is None else span
    if decay is None:
        runs = [(0, params.memory.size, weight_decay)]
    else:
        unknown = set(decay) - set(params.names)
        if unknown:
            raise ValueError(f"decay names unknown parameters: {sorted(unknown)}")
        # tensors lie back to back in layout order: each run of them has its decay
        runs, offset = [], 0
        for name in params.names:
            count = params[name].size
            runs.append((offset, offset + count, weight_decay if name in decay else 0.0))
            offset += count
    for a, b, run_decay in runs:
        a, b = max(a, start), min(b, stop)
        if a >= b:
            continue
        part, moments = slice(a, b), slice(a - start, b - start)
        K.adamw_update(params.memory[part], m[moments], v[moments], grads.memory[part],
                       learning_rate, beta1, beta2, eps, run_decay, t,
                       params_bf16=None if copy is None else copy[part])


class AdamW:
    """AdamW for one model. ``decay_on``: "matrices" decays the weight
    matrices only (model.matrix_params: wte, wpe, qkvw, attprojw, fcw,
    fcprojw, lm_head), not biases or norm weights; "all" decays every
    parameter, as llm.c's train_gpt2.c does."""

    def __init__(self, model, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                 decay_on="matrices", span=None):
        """``span`` (start, stop): keep moments for, and update, only those
        elements of the flat parameters (a ZeRO-1 shard; train.distributed)."""
        if decay_on not in DECAY_ON:
            raise ValueError(f"decay_on is {decay_on!r}, expected one of {DECAY_ON}")
        self.model = model
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.weight_decay, self.decay_on = weight_decay, decay_on
        self.decay = model.matrix_params if decay_on == "matrices" else None
        self.span = span
        if span is None:   # the model's moments (so its memory plan counts them), from zero
            self.m, self.v = model.moments()
            self.m[...] = 0.0
            self.v[...] = 0.0
        else:
            self.m, self.v = (aligned_zeros(span[1] - span[0], what=f"AdamW's {name} moments "
                                            f"of a shard") for name in ("first", "second"))

    def step(self, learning_rate, t):
        """Updates the model's parameters (its span's) from its gradients; t >= 1."""
        model = self.model
        adamw_step(model.params, model.grads, self.m, self.v, learning_rate, self.beta1,
                   self.beta2, self.eps, self.weight_decay, t, self.decay,
                   params_bf16=model.params_bf16, span=self.span)

    def load_moments(self, m, v):
        """Restores m and v (flat float32, one value per parameter)."""
        self.m[...] = m
        self.v[...] = v
