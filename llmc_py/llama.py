"""The Llama family on the same kernels: one decoder with choices.

``Llama(LlamaConfig(...))`` composes, per the config: RMSNorm or LayerNorm;
RoPE, ALiBi or a learned position table; a SwiGLU or GELU MLP; grouped-query
attention (num_kv_heads query-head groups; 1 is multi-query); biases on or
off; the output head tied to wte or its own ``lm_head``. Llama 2 is the
default (rmsnorm, rope, swiglu, no bias); BLOOM is alibi + layernorm + gelu
with biases. The GPT-2 choices (layernorm, learned, gelu, bias, tied,
num_kv_heads = num_heads, ffn_hidden = 4C) give GPT-2's layout and results.

The block, as in Llama (pre-norm, two residual branches):
    x = x + attproj(attention(rope(qkv(norm1(x)))))
    x = x + fcproj(swiglu(fc(norm2(x))))
then normf and the output head. RoPE and ALiBi models take sequences longer
than max_seq_len (they extrapolate); a learned position table does not.
"""

from . import kernels as K
from .checkpoint import model_kind, read_llama, write_llama
from .config import LlamaConfig
from .layout import llama_act_specs, llama_param_specs
from .model import GPT2, Transformer

# the weight matrices, as GPT-2's MATRIX_PARAMS; the ones a config lacks are skipped
_MATRICES = ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw", "lm_head")


class Llama(Transformer):
    def __init__(self, config=None, seed=0, *, params=None):
        """A model of ``config`` (default: LlamaConfig()) with GPT-2's
        initialisation from ``seed``, or with the given flat float32
        ``params`` (in layout.llama_param_specs order)."""
        config = config if config is not None else LlamaConfig()
        self.param_specs = llama_param_specs(config)
        self.act_specs = llama_act_specs(config)
        names = {name for name, _ in self.param_specs}
        self.matrix_params = tuple(name for name in _MATRICES if name in names)
        super().__init__(config, seed, params=params)

    @classmethod
    def from_checkpoint(cls, path):
        """Loads a model file written by ``save_checkpoint``."""
        config, params = read_llama(path)
        return cls(config, params=params)

    def save_checkpoint(self, path):
        """Writes the model file (checkpoint.py's Llama format), atomically."""
        write_llama(path, self.config, self.params.memory)

    # ---- forward -----------------------------------------------------------

    def forward(self, inputs, targets=None):
        """Runs the model on int tokens (B, T). Returns the mean cross-entropy
        loss as a float when ``targets`` (B, T) are given, else None; the
        logits are in ``model.logits`` either way."""
        c = self.config
        max_T = c.max_seq_len if c.learned_positions else None
        inputs, targets = self._batch(inputs, targets, max_T)
        p, a = self.params, self.acts

        def attend(l):
            if c.position == "rope":
                K.rope_forward(a.qkvr[l], a.qkv[l], None, c.NH, c.NKV, c.rope_theta)
            K.attention_gqa_forward(a.atty[l], a.att[l], a.qkvr[l] if "qkvr" in a else a.qkv[l],
                                    self.slopes, c.NH, c.NKV)

        K.encoder_forward(a.encoded, inputs, p.wte[:c.V], p.wpe if c.learned_positions else None)
        residual = a.encoded
        for l in range(c.L):
            residual = self._layer_forward(a, l, residual, attend)
        self._output_forward(a, residual)
        return self._loss(targets)

    def _norm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd):
        if self.config.norm == "rmsnorm":
            K.rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd)
        else:
            K.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd)

    # ---- backward ----------------------------------------------------------

    def backward(self, loss_scale=1.0):
        """Adds the gradients of ``loss_scale`` times the last forward's mean
        loss into ``grads`` (a scale of 1/n averages n accumulated batches)."""
        c, p, a, g = self.config, self.params, self.acts, self.grads
        d = self._start_backward(loss_scale)
        rope = c.position == "rope"

        K.matmul_backward(d.lnf, self._head(g), None, d.logits, a.lnf, self._head(p))
        self._norm_backward(d.residual3[c.L - 1], g.lnfw, self._bias(g, "lnfb"), d.lnf,
                            a.residual3[c.L - 1], p.lnfw, self._stat(a, "lnf_mean"), a.lnf_rstd)
        for l in reversed(range(c.L)):
            residual = a.encoded if l == 0 else a.residual3[l - 1]
            dresidual = d.encoded if l == 0 else d.residual3[l - 1]
            K.residual_backward(d.residual2[l], d.fcproj[l], d.residual3[l])
            K.matmul_backward(d.fch_act[l], g.fcprojw[l], self._bias(g, "fcprojb", l),
                              d.fcproj[l], a.fch_act[l], p.fcprojw[l])
            if c.mlp == "swiglu":
                K.swiglu_backward(d.fch[l], d.fch_act[l], a.fch[l])
            else:
                K.gelu_backward(d.fch[l], d.fch_act[l], a.fch[l])
            K.matmul_backward(d.ln2[l], g.fcw[l], self._bias(g, "fcb", l), d.fch[l], a.ln2[l],
                              p.fcw[l])
            self._norm_backward(d.residual2[l], g.ln2w[l], self._bias(g, "ln2b", l), d.ln2[l],
                                a.residual2[l], p.ln2w[l], self._stat(a, "ln2_mean", l),
                                a.ln2_rstd[l])
            K.residual_backward(dresidual, d.attproj[l], d.residual2[l])
            K.matmul_backward(d.atty[l], g.attprojw[l], self._bias(g, "attprojb", l),
                              d.attproj[l], a.atty[l], p.attprojw[l])
            if rope:
                K.attention_gqa_backward(d.qkvr[l], d.atty[l], a.qkvr[l], a.att[l], c.NH, c.NKV)
                K.rope_backward(d.qkv[l], d.qkvr[l], None, c.NH, c.NKV, c.rope_theta)
            else:
                K.attention_gqa_backward(d.qkv[l], d.atty[l], a.qkv[l], a.att[l], c.NH, c.NKV)
            K.matmul_backward(d.ln1[l], g.qkvw[l], self._bias(g, "qkvb", l), d.qkv[l], a.ln1[l],
                              p.qkvw[l])
            self._norm_backward(dresidual, g.ln1w[l], self._bias(g, "ln1b", l), d.ln1[l],
                                residual, p.ln1w[l], self._stat(a, "ln1_mean", l), a.ln1_rstd[l])
        K.encoder_backward(g.wte[:c.V], g.wpe if c.learned_positions else None, d.encoded,
                           self.inputs)


def load_model(path):
    """A GPT2 or a Llama, whichever the model file at ``path`` holds."""
    return (Llama if model_kind(path) == "llama" else GPT2).from_checkpoint(path)
