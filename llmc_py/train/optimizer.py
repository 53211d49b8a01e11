"""AdamW over the model's flat parameter and gradient buffers (llm.c's
gpt2_update), as an object that keeps its moments m and v in the model's
(model.moments()); its step is model.adamw's."""
from ..model.adamw import adamw_step
from ..model.layout import aligned_zeros

DECAY_ON = ("matrices", "all")   # which parameters weight decay applies to


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
        # LoRA's adapters are all matrices: each decays
        self.decay = (model.matrix_params if decay_on == "matrices" and model.lora is None
                      else None)
        self.span = span
        if span is None:   # the model's moments (so its memory plan counts them), from zero
            self.m, self.v = model.moments()
            self.m[...] = 0.0
            self.v[...] = 0.0
        else:
            self.m, self.v = (aligned_zeros(span[1] - span[0], what=f"AdamW's {name} moments "
                                            f"of a shard") for name in ("first", "second"))

    def step(self, learning_rate, t):
        """Updates what the model trains (its span's) from its gradients; t >= 1."""
        model = self.model
        params, grads = model.trained   # the adapters' alone after add_lora
        adamw_step(params, grads, self.m, self.v, learning_rate, self.beta1,
                   self.beta2, self.eps, self.weight_decay, t, self.decay,
                   params_bf16=model.params_bf16 if model.lora is None else None,
                   span=self.span)

    def load_moments(self, m, v):
        """Restores m and v (flat float32, one value per parameter)."""
        self.m[...] = m
        self.v[...] = v
