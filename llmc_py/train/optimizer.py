"""AdamW over the model's flat parameter and gradient buffers (llm.c's
gpt2_update), as an object that keeps its moments m and v in the model's
(model.moments())."""
from .._native import kernels as K

DECAY_ON = ("matrices", "all")   # which parameters weight decay applies to


def adamw_step(params, grads, m, v, learning_rate, beta1, beta2, eps, weight_decay, t,
               decay=None, params_bf16=None):
    """One AdamW step over TensorGroups ``params`` and ``grads`` with flat
    moments ``m`` and ``v``; t >= 1 is the step number. Weight decay applies
    to every tensor unless ``decay`` names the ones to decay. The TensorGroup
    ``params_bf16``, if given, receives the new parameters rounded to bf16."""
    copy = None if params_bf16 is None else params_bf16.memory
    if decay is None:
        K.adamw_update(params.memory, m, v, grads.memory, learning_rate, beta1, beta2, eps,
                       weight_decay, t, params_bf16=copy)
        return
    unknown = set(decay) - set(params.names)
    if unknown:
        raise ValueError(f"decay names unknown parameters: {sorted(unknown)}")
    # tensors lie back to back in layout order: update each run of them with
    # its own decay
    offset = 0
    for name in params.names:
        count = params[name].size
        part = slice(offset, offset + count)
        K.adamw_update(params.memory[part], m[part], v[part], grads.memory[part], learning_rate,
                       beta1, beta2, eps, weight_decay if name in decay else 0.0, t,
                       params_bf16=None if copy is None else copy[part])
        offset += count


class AdamW:
    """AdamW for one model. ``decay_on``: "matrices" decays the weight
    matrices only (model.matrix_params: wte, wpe, qkvw, attprojw, fcw,
    fcprojw, lm_head), not biases or norm weights; "all" decays every
    parameter, as llm.c's train_gpt2.c does."""

    def __init__(self, model, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                 decay_on="matrices"):
        if decay_on not in DECAY_ON:
            raise ValueError(f"decay_on is {decay_on!r}, expected one of {DECAY_ON}")
        self.model = model
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.weight_decay, self.decay_on = weight_decay, decay_on
        self.decay = model.matrix_params if decay_on == "matrices" else None
        # the model's moments (so its memory plan counts them), from zero
        self.m, self.v = model.moments()
        self.m[...] = 0.0
        self.v[...] = 0.0

    def step(self, learning_rate, t):
        """Updates the model's parameters from its gradients; t >= 1."""
        model = self.model
        adamw_step(model.params, model.grads, self.m, self.v, learning_rate, self.beta1,
                   self.beta2, self.eps, self.weight_decay, t, self.decay,
                   params_bf16=model.params_bf16)

    def load_moments(self, m, v):
        """Restores m and v (flat float32, one value per parameter)."""
        self.m[...] = m
        self.v[...] = v
