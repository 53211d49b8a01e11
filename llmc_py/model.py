"""GPT-2 on the C kernels, sequenced as in llm.c's train_gpt2.c, and the
machinery every model here shares (``Transformer``).

Parameters, their gradients, the AdamW moments, the activations and the
activation gradients each live in one contiguous float32 buffer; ``params``,
``grads``, ``acts`` and ``grads_acts`` are TensorGroups of named views into
them (``model.params["qkvw"][l]`` is layer l's qkv weight), never copies.

Activation buffers are planned for the (B, T) of the first forward. A later
forward with another (B, T) re-plans them: it reuses the same memory when the
new shapes fit in it and allocates a larger buffer otherwise.
"""
import math

import numpy as np

from . import kernels as K
from . import kv_cache
from .checkpoint import read_model, write_model
from .config import GPT2Config, as_llama_config
from .errors import RangeError, ShapeError
from .layout import (ACT_SPECS, PARAM_SPECS, TensorGroup, aligned_zeros, grad_act_specs,
                     specs_bytes)
from .memory import require

LAYERNORM_EPS = 1e-5
INIT_STD = 0.02
# the weight matrices (2-D per layer): initialised from N(0, INIT_STD), and the
# tensors weight decay is meant for; the rest start at 1 (norm weights) or 0
MATRIX_PARAMS = ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw")
# output projections into the residual stream: std scaled by 1/sqrt(2 L)
_RESIDUAL_PROJECTIONS = ("attprojw", "fcprojw")
_NORM_WEIGHTS = ("ln1w", "ln2w", "lnfw")


class Transformer:
    """What GPT2 and Llama share: the flat buffers and their named views, the
    token checks, activation planning, the transformer block by the choices
    in ``arch`` (the Llama family's forward and KV-cache decoding run it),
    zero_grad, the AdamW update and ``generate``. A subclass sets
    ``param_specs`` and ``act_specs`` (layout.py's tables) and writes forward
    and backward."""

    param_specs = act_specs = None
    matrix_params = ()   # the tensors initialised from N(0, INIT_STD) and decayed

    def __init__(self, config, seed=0, *, params=None):
        self.config = config
        # the model's choices in the Llama family's terms (GPT-2 is layernorm,
        # learned positions, GELU, biases, a tied head, NKV = NH)
        self.arch = as_llama_config(config)
        self.slopes = K.alibi_slopes(config.num_heads) if self.arch.position == "alibi" else None
        self.grad_act_specs = grad_act_specs(self.act_specs)
        self.params = TensorGroup(self.param_specs, self.config)
        self.num_parameters = self.params.size
        if params is None:
            self._init_params(seed)
        else:
            params = np.asarray(params)
            if params.dtype != np.float32 or params.size != self.num_parameters:
                raise ShapeError(f"params must be {self.num_parameters} float32 values, "
                                 f"got {params.size} {params.dtype}")
            self.params.memory[...] = params.reshape(-1)
        self._grads = None
        self.m_memory = None   # AdamW moments, made on the first update
        self.v_memory = None
        self.acts = None       # made on the first forward, for its (B, T)
        self.grads_acts = None
        self.B = self.T = None
        self.inputs = self.targets = None
        self.mean_loss = None

    def _init_params(self, seed):
        """GPT-2's initialisation: matrices from N(0, INIT_STD), the output
        projections into the residual stream scaled by 1/sqrt(2 L), norm
        weights 1, everything else (biases) 0."""
        c, p = self.config, self.params
        rng = np.random.default_rng(seed)
        for name in self.matrix_params:
            std = INIT_STD / math.sqrt(2 * c.L) if name in _RESIDUAL_PROJECTIONS else INIT_STD
            view = p[name]
            view[...] = rng.standard_normal(view.shape, dtype=np.float32) * np.float32(std)
        p.wte[c.V:] = 0.0   # the padding rows are never used
        for name in _NORM_WEIGHTS:
            p[name][...] = 1.0

    @property
    def grads(self):
        """Parameter gradients, same layout as params; zero until a backward."""
        if self._grads is None:
            self._grads = TensorGroup(self.param_specs, self.config)
        return self._grads

    @property
    def logits(self):
        """The (B, T, Vp) logits of the last forward (a view, not a copy)."""
        if self.acts is None:
            raise RuntimeError("no forward has run yet")
        return self.acts.logits

    # ---- forward -----------------------------------------------------------

    def _tokens(self, tokens, name):
        arr = np.asarray(tokens)
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise ShapeError(f"{name} must have shape (B, T) with B, T >= 1, got {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integer token ids, got {arr.dtype}")
        V = self.config.vocab_size
        bad = np.flatnonzero((arr < 0) | (arr >= V))
        if bad.size:
            b, t = np.unravel_index(bad[0], arr.shape)
            raise RangeError(f"{name}[{b}, {t}] = {arr[b, t]} is not a token id in [0, {V})")
        return np.ascontiguousarray(arr, dtype=np.int32)

    def _batch(self, inputs, targets, max_T):
        """Checked int32 (inputs, targets or None); plans the activations for
        their (B, T). ``max_T`` is the longest sequence the model can take,
        or None for no limit."""
        inputs = self._tokens(inputs, "inputs")
        B, T = inputs.shape
        if max_T is not None and T > max_T:
            raise ShapeError(f"sequence length T={T} exceeds the model's max_seq_len="
                             f"{max_T} (its learned position table has {max_T} rows)")
        if targets is not None:
            targets = self._tokens(targets, "targets")
            if targets.shape != inputs.shape:
                raise ShapeError(f"targets have shape {targets.shape}, inputs {inputs.shape}")
        self._plan(B, T, training=targets is not None)
        self.inputs, self.targets = inputs, targets
        return inputs, targets

    def reserve(self, B, T, training=False):
        """Allocates activation memory for batches up to (B, T) now, so that
        later forwards of any smaller shape reuse it (e.g. a growing context
        while sampling). Raises OutOfMemoryError if the activations (and, with
        ``training``, their gradients) cannot fit."""
        self._plan(B, T, training=training)

    def _plan(self, B, T, training=True):
        if (B, T) == (self.B, self.T):
            return
        c = self.config
        acts_memory = _reuse(self.acts, self.act_specs, c, B, T)
        grads_memory = _reuse(self.grads_acts, self.grad_act_specs, c, B, T)
        # all that this (B, T) will allocate, checked before any of it is: the
        # activations and, for training, their gradients (made by backward)
        with_grads = training or self.grads_acts is not None
        needed = 0 if acts_memory is not None else specs_bytes(self.act_specs, c, B, T)
        if with_grads and grads_memory is None:
            needed += specs_bytes(self.grad_act_specs, c, B, T)
        what = "activations" + (" and their gradients" if with_grads else "")
        require(needed, f"{what} for B={B}, T={T}")
        self.acts = TensorGroup(self.act_specs, c, B, T, memory=acts_memory)
        self.grads_acts = None if self.grads_acts is None else TensorGroup(
            self.grad_act_specs, c, B, T, memory=grads_memory)
        self.B, self.T = B, T

    def _loss(self, targets):
        """The vocab softmax and cross-entropy after the logits; the mean loss."""
        c, a = self.config, self.acts
        if targets is None:
            self.mean_loss = None
            return None
        K.softmax_forward(a.probs, a.logits, c.V)
        K.crossentropy_forward(a.losses, a.probs, targets, c.V)
        self.mean_loss = float(a.losses.mean(dtype=np.float64))
        return self.mean_loss

    # the block by the choices in self.arch, on activations ``a`` laid out by
    # layout.llama_act_specs: the Llama family's forward and every model's
    # KV-cache decoding use it; GPT2.forward keeps llm.c's own sequence

    def _bias(self, group, name, l=None):
        """Layer l's bias (or the whole tensor) when the model has biases, else None."""
        if name not in group:
            return None
        return group[name] if l is None else group[name][l]

    def _head(self, group):
        return group.wte if self.arch.tied_embeddings else group.lm_head

    @staticmethod
    def _stat(a, name, l=None):
        """A saved norm statistic (the mean exists for layernorm only)."""
        if name not in a:
            return None
        return a[name] if l is None else a[name][l]

    def _norm_forward(self, out, mean, rstd, inp, weight, bias):
        if self.arch.norm == "rmsnorm":
            K.rmsnorm_forward(out, rstd, inp, weight, self.arch.norm_eps)
        else:
            K.layernorm_forward(out, mean, rstd, inp, weight, bias, self.arch.norm_eps)

    def _layer_forward(self, a, l, residual, attend):
        """Layer l on the residual stream ``residual``; ``attend(l)`` turns
        a.qkv[l] into a.atty[l]. Returns the layer's output, a.residual3[l]."""
        c, p = self.arch, self.params
        self._norm_forward(a.ln1[l], self._stat(a, "ln1_mean", l), a.ln1_rstd[l], residual,
                           p.ln1w[l], self._bias(p, "ln1b", l))
        K.matmul_forward(a.qkv[l], a.ln1[l], p.qkvw[l], self._bias(p, "qkvb", l))
        attend(l)
        K.matmul_forward(a.attproj[l], a.atty[l], p.attprojw[l], self._bias(p, "attprojb", l))
        K.residual_forward(a.residual2[l], residual, a.attproj[l])
        self._norm_forward(a.ln2[l], self._stat(a, "ln2_mean", l), a.ln2_rstd[l],
                           a.residual2[l], p.ln2w[l], self._bias(p, "ln2b", l))
        K.matmul_forward(a.fch[l], a.ln2[l], p.fcw[l], self._bias(p, "fcb", l))
        if c.mlp == "swiglu":
            K.swiglu_forward(a.fch_act[l], a.fch[l])
        else:
            K.gelu_forward(a.fch_act[l], a.fch[l])
        K.matmul_forward(a.fcproj[l], a.fch_act[l], p.fcprojw[l], self._bias(p, "fcprojb", l))
        K.residual_forward(a.residual3[l], a.residual2[l], a.fcproj[l])
        return a.residual3[l]

    def _output_forward(self, a, residual):
        """The final norm and the output head: a.logits."""
        p = self.params
        self._norm_forward(a.lnf, self._stat(a, "lnf_mean"), a.lnf_rstd, residual, p.lnfw,
                           self._bias(p, "lnfb"))
        K.matmul_forward(a.logits, a.lnf, self._head(p), None)

    # ---- backward ----------------------------------------------------------

    def zero_grad(self):
        """Zeroes the parameter gradients (backward adds into them)."""
        self.grads.zero()

    def _start_backward(self, loss_scale):
        """Zeroed activation gradients, with d(scaled mean loss)/d(loss[b, t])
        in place and the softmax/cross-entropy backward done."""
        if self.targets is None:
            raise RuntimeError("backward needs a forward with targets first: "
                               "call model.forward(inputs, targets)")
        c, B, T = self.config, self.B, self.T
        if self.grads_acts is None:
            self.grads_acts = TensorGroup(self.grad_act_specs, c, B, T)
        else:
            self.grads_acts.zero()
        d = self.grads_acts
        d.losses[...] = loss_scale / (B * T)
        K.crossentropy_softmax_backward(d.logits, d.losses, self.acts.probs, self.targets, c.V)
        return d

    # ---- generation --------------------------------------------------------

    def generate(self, prompt_tokens, max_new_tokens, *, temperature=1.0, top_k=None,
                 top_p=None, repetition_penalty=None, seed=None, stop_token=None):
        """New token ids after ``prompt_tokens``, decoded with a KV cache
        (kv_cache.generate): a list of ids gives a list, a list of lists (a
        batch of any lengths) a list of lists. temperature 0 is greedy; the
        same seed gives the same tokens."""
        return kv_cache.generate(self, prompt_tokens, max_new_tokens, temperature=temperature,
                                 top_k=top_k, top_p=top_p,
                                 repetition_penalty=repetition_penalty, seed=seed,
                                 stop_token=stop_token)

    # ---- update ------------------------------------------------------------

    def grad_norm(self):
        """The global L2 norm of all parameter gradients."""
        return math.sqrt(K.global_norm_squared(self.grads.memory))

    def clip_grad_norm(self, max_norm):
        """Scales the gradients so their global norm is at most ``max_norm``;
        returns the norm before clipping."""
        norm = self.grad_norm()
        if max_norm > 0 and norm > max_norm:
            K.scale_inplace(self.grads.memory, max_norm / norm)
        return norm

    def update(self, learning_rate, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, t=1,
               decay=None):
        """One AdamW step (llm.c's gpt2_update); t >= 1 is the step number.

        Weight decay applies to every parameter (llm.c's CPU trainer) unless
        ``decay`` names the tensors to decay, e.g. MATRIX_PARAMS for 2-D
        weights only; the others then get none."""
        if self.m_memory is None:
            self.m_memory = aligned_zeros(self.num_parameters)
            self.v_memory = aligned_zeros(self.num_parameters)
        if decay is None:
            K.adamw_update(self.params.memory, self.m_memory, self.v_memory, self.grads.memory,
                           learning_rate, beta1, beta2, eps, weight_decay, t)
            return
        unknown = set(decay) - set(self.params.names)
        if unknown:
            raise ValueError(f"decay names unknown parameters: {sorted(unknown)}")
        # tensors lie back to back in param_specs order: update each run of
        # them with its own decay
        offset = 0
        for name in self.params.names:
            count = self.params[name].size
            part = slice(offset, offset + count)
            K.adamw_update(self.params.memory[part], self.m_memory[part], self.v_memory[part],
                           self.grads.memory[part], learning_rate, beta1, beta2, eps,
                           weight_decay if name in decay else 0.0, t)
            offset += count


class GPT2(Transformer):
    """GPT-2 in llm.c's layout (layout.PARAM_SPECS / ACT_SPECS)."""

    param_specs = PARAM_SPECS
    act_specs = ACT_SPECS
    matrix_params = MATRIX_PARAMS

    def __init__(self, config=None, seed=0, *, params=None):
        """A GPT-2 with fresh GPT-2 initialisation from ``seed``, or with the
        given flat float32 ``params`` (in PARAM_SPECS order)."""
        super().__init__(config if config is not None else GPT2Config(), seed, params=params)

    @classmethod
    def from_checkpoint(cls, path):
        """Loads an llm.c model file (version 3 fp32, or version 5 bf16)."""
        config, params = read_model(path)
        return cls(config, params=params)

    def save_checkpoint(self, path):
        """Writes an llm.c version-3 model file, atomically."""
        write_model(path, self.config, self.params.memory)

    def forward(self, inputs, targets=None):
        """Runs the model on int tokens (B, T). Returns the mean cross-entropy
        loss as a float when ``targets`` (B, T) are given, else None; the
        logits are in ``model.logits`` either way."""
        c = self.config
        inputs, targets = self._batch(inputs, targets, c.max_seq_len)
        p, a = self.params, self.acts

        K.encoder_forward(a.encoded, inputs, p.wte[:c.V], p.wpe)
        residual = a.encoded
        for l in range(c.L):
            K.layernorm_forward(a.ln1[l], a.ln1_mean[l], a.ln1_rstd[l], residual,
                                p.ln1w[l], p.ln1b[l], LAYERNORM_EPS)
            K.matmul_forward(a.qkv[l], a.ln1[l], p.qkvw[l], p.qkvb[l])
            K.attention_forward(a.atty[l], a.att[l], a.qkv[l], c.NH)
            K.matmul_forward(a.attproj[l], a.atty[l], p.attprojw[l], p.attprojb[l])
            K.residual_forward(a.residual2[l], residual, a.attproj[l])
            K.layernorm_forward(a.ln2[l], a.ln2_mean[l], a.ln2_rstd[l], a.residual2[l],
                                p.ln2w[l], p.ln2b[l], LAYERNORM_EPS)
            K.matmul_forward(a.fch[l], a.ln2[l], p.fcw[l], p.fcb[l])
            K.gelu_forward(a.fch_gelu[l], a.fch[l])
            K.matmul_forward(a.fcproj[l], a.fch_gelu[l], p.fcprojw[l], p.fcprojb[l])
            K.residual_forward(a.residual3[l], a.residual2[l], a.fcproj[l])
            residual = a.residual3[l]
        K.layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, residual, p.lnfw, p.lnfb,
                            LAYERNORM_EPS)
        K.matmul_forward(a.logits, a.lnf, p.wte, None)
        return self._loss(targets)

    # ---- backward ----------------------------------------------------------

    def backward(self, loss_scale=1.0):
        """Adds the gradients of ``loss_scale`` times the last forward's mean
        loss into ``grads`` (a scale of 1/n averages n accumulated batches)."""
        c, p, a, g = self.config, self.params, self.acts, self.grads
        d = self._start_backward(loss_scale)
        K.matmul_backward(d.lnf, g.wte, None, d.logits, a.lnf, p.wte)
        residual = a.residual3[c.L - 1]
        dresidual = d.residual3[c.L - 1]
        K.layernorm_backward(dresidual, g.lnfw, g.lnfb, d.lnf, residual, p.lnfw,
                             a.lnf_mean, a.lnf_rstd)
        for l in reversed(range(c.L)):
            residual = a.encoded if l == 0 else a.residual3[l - 1]
            dresidual = d.encoded if l == 0 else d.residual3[l - 1]
            K.residual_backward(d.residual2[l], d.fcproj[l], d.residual3[l])
            K.matmul_backward(d.fch_gelu[l], g.fcprojw[l], g.fcprojb[l], d.fcproj[l],
                              a.fch_gelu[l], p.fcprojw[l])
            K.gelu_backward(d.fch[l], d.fch_gelu[l], a.fch[l])
            K.matmul_backward(d.ln2[l], g.fcw[l], g.fcb[l], d.fch[l], a.ln2[l], p.fcw[l])
            K.layernorm_backward(d.residual2[l], g.ln2w[l], g.ln2b[l], d.ln2[l],
                                 a.residual2[l], p.ln2w[l], a.ln2_mean[l], a.ln2_rstd[l])
            K.residual_backward(dresidual, d.attproj[l], d.residual2[l])
            K.matmul_backward(d.atty[l], g.attprojw[l], g.attprojb[l], d.attproj[l],
                              a.atty[l], p.attprojw[l])
            K.attention_backward(d.qkv[l], d.atty[l], a.qkv[l], a.att[l], c.NH)
            K.matmul_backward(d.ln1[l], g.qkvw[l], g.qkvb[l], d.qkv[l], a.ln1[l], p.qkvw[l])
            K.layernorm_backward(dresidual, g.ln1w[l], g.ln1b[l], d.ln1[l], residual,
                                 p.ln1w[l], a.ln1_mean[l], a.ln1_rstd[l])
        K.encoder_backward(g.wte[:c.V], g.wpe, d.encoded, self.inputs)


def _reuse(group, specs, config, B, T):
    """The flat buffer of ``group`` if the layout for (B, T) fits in it, else None."""
    if group is None:
        return None
    needed = sum(math.prod(fn(config, B, T)) for _, fn in specs)
    return group.buffer if needed <= group.buffer.size else None
