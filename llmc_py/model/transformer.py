"""One decoder-only transformer on the C kernels, sequenced as in llm.c's
train_gpt2.c; its choices come from the config (config.TransformerConfig):

    x = embed(tokens) (+ wpe with learned positions)
    per layer:  x = x + attproj(attention(position(qkv(norm1(x)))))
                x = x + fcproj(act(fc(norm2(x))))
    logits = head(normf(x))

norm: layernorm | rmsnorm; position: a learned table, RoPE on q and k, or
ALiBi biases in the attention; act: GELU | SwiGLU; attention: grouped-query
(NKV key/value heads; NKV = NH is GPT-2's multi-head attention); biases on
or off; the head tied to wte or its own lm_head. GPT-2 and Llama are presets
(model.presets): their forward and backward are these.

Precision: "fp32" runs every kernel in float32. "bf16" is mixed precision as
in llm.c's CUDA trainer: the parameters (the master copy), their gradients
and AdamW's moments stay float32, and ``params_bf16`` holds a bf16 copy of
the parameters (rounded to nearest even) that the linear layers read; each
linear layer multiplies bf16 numbers (its float32 input and, backward, its
float32 output gradient rounded to bf16) and sums in float32. Norm
statistics, attention, softmax, the loss and the gradient norm stay float32.
update() rewrites the bf16 copy as it updates the parameters.

Parameters, their gradients, the activations and the activation gradients
each live in one contiguous float32 buffer; ``params``, ``grads``, ``acts``
and ``grads_acts`` are TensorGroups of named views into them
(``model.params["qkvw"][l]`` is layer l's qkv weight), never copies.

Activation buffers are planned for the (B, T) of the first forward. A later
forward with another (B, T) re-plans them: it reuses the same memory when the
new shapes fit in it and allocates a larger buffer otherwise.
"""
import contextlib
import functools
import math
import threading

import numpy as np

from .._native import kernels as K
from ..errors import ConcurrentUseError, RangeError, ShapeError
from ..generate import kv_cache
from ..io.model_file import write_model_file
from ..io.tokens import first_out_of_vocab
from .layout import (TensorGroup, act_specs, aligned_zeros, checked_params, grad_act_specs,
                     param_specs, specs_bytes)
from .memory import require

PRECISIONS = ("fp32", "bf16")
INIT_STD = 0.02
# the weight matrices (2-D per layer): initialised from N(0, INIT_STD), and the
# tensors weight decay is meant for; the rest start at 1 (norm weights) or 0.
# A config that lacks one (wpe, lm_head) skips it.
MATRIX_PARAMS = ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw", "lm_head")
# output projections into the residual stream: std scaled by 1/sqrt(2 L)
_RESIDUAL_PROJECTIONS = ("attprojw", "fcprojw")
_NORM_WEIGHTS = ("ln1w", "ln2w", "lnfw")


def _held(method):
    """Runs ``method`` holding the model (Transformer.exclusive)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.exclusive(method.__name__):
            return method(self, *args, **kwargs)
    return wrapper


class Transformer:
    """The model of a TransformerConfig: forward, backward, zero_grad, the
    AdamW update, ``generate`` and the model file.

    What KV-cache decoding (generate.kv_cache) needs from a model is public:
    ``config``, ``params``, ``slopes``, ``token_ids``, ``block_forward`` and
    ``head_forward``.

    One model serves one thread at a time (its activations are shared state):
    forward, backward, zero_grad, update, reserve and generate called while
    another thread is inside one of them raise ConcurrentUseError at once,
    rather than compute a wrong result. Two models in two threads are fine."""

    def __init__(self, config, seed=0, *, params=None, precision="fp32"):
        """A model of ``config`` with GPT-2's initialisation from ``seed``, or
        with the given flat float32 ``params`` (in layout.param_specs order);
        ``precision`` "fp32" or "bf16" (mixed precision, see the module)."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision is {precision!r}, expected one of {PRECISIONS}")
        self.config = config
        self.precision = precision
        self.param_specs = param_specs(config)
        self.act_specs = act_specs(config)
        self.grad_act_specs = grad_act_specs(self.act_specs)
        # the tensors initialised from N(0, INIT_STD), and decayed by default
        self.matrix_params = tuple(name for name, _ in self.param_specs
                                   if name in MATRIX_PARAMS)
        self.slopes = K.alibi_slopes(config.num_heads) if config.position == "alibi" else None
        self._user = threading.RLock()   # held by the thread inside an entry point
        self.params = TensorGroup(self.param_specs, self.config)
        self.num_parameters = self.params.size
        if params is None:
            self._init_params(seed)
        else:
            self.params.memory[...] = checked_params(config, params)
        # what the linear layers read: the float32 parameters, or their bf16 copy
        if precision == "bf16":
            self.params_bf16 = TensorGroup(self.param_specs, self.config, dtype=np.uint16)
            self.refresh_bf16()
            self._weights = self.params_bf16
            self._matmul_forward, self._matmul_backward = (K.matmul_forward_bf16,
                                                           K.matmul_backward_bf16)
        else:
            self.params_bf16 = None
            self._weights = self.params
            self._matmul_forward, self._matmul_backward = K.matmul_forward, K.matmul_backward
        self._grads = None
        self.m_memory = None   # update()'s AdamW moments, made on its first call
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

    @_held
    def refresh_bf16(self):
        """Rewrites ``params_bf16`` from ``params`` (bf16 models): update()
        does this itself; call it after writing to ``params`` by hand."""
        if self.params_bf16 is None:
            raise RuntimeError("refresh_bf16: this model's precision is fp32; it has no "
                               "bf16 copy of its parameters")
        K.float_to_bf16(self.params_bf16.memory, self.params.memory)

    @contextlib.contextmanager
    def exclusive(self, what="use"):
        """Holds the model for this thread (re-entrant), or raises
        ConcurrentUseError if another thread holds it."""
        if not self._user.acquire(blocking=False):
            raise ConcurrentUseError(f"model.{what}: the model is in use by another thread; "
                                     f"a model serves one thread at a time (give each thread "
                                     f"its own model)")
        try:
            yield
        finally:
            self._user.release()

    @classmethod
    def from_checkpoint(cls, path, precision="fp32"):
        """The model in a model file (io.model_file: llm.c's GPT-2 file or
        ours, with fp32 or bf16 parameters), in ``precision``."""
        from ..io.model_file import read_model_file
        config, params = read_model_file(path)
        return cls(config, params=params, precision=precision)

    def save_checkpoint(self, path, dtype="fp32"):
        """Writes the model file, atomically: llm.c's file for a GPT2Config
        (version 3, fp32 parameters; ``dtype="bf16"``: version 5, each
        parameter rounded to the nearest bf16, as llm.c's train_gpt2.py
        writes it), our Llama-family file otherwise (fp32 or bf16 likewise)."""
        write_model_file(path, self.config, self.params.memory, dtype=dtype)

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

    def token_ids(self, tokens, name="tokens"):
        """``tokens`` (B, T) as checked contiguous int32 ids; RangeError names
        the first one outside the vocabulary."""
        arr = np.asarray(tokens)
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise ShapeError(f"{name} must have shape (B, T) with B, T >= 1, got {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integer token ids, got {arr.dtype}")
        V = self.config.vocab_size
        bad = first_out_of_vocab(arr, V)
        if bad is not None:
            b, t = bad
            raise RangeError(f"{name}[{b}, {t}] = {arr[b, t]} is not a token id in [0, {V})")
        return np.ascontiguousarray(arr, dtype=np.int32)

    def _batch(self, inputs, targets, max_T):
        """Checked int32 (inputs, targets or None); plans the activations for
        their (B, T). ``max_T`` is the longest sequence the model can take,
        or None for no limit."""
        inputs = self.token_ids(inputs, "inputs")
        B, T = inputs.shape
        if max_T is not None and T > max_T:
            raise ShapeError(f"sequence length T={T} exceeds the model's max_seq_len="
                             f"{max_T} (its learned position table has {max_T} rows)")
        if targets is not None:
            targets = self.token_ids(targets, "targets")
            if targets.shape != inputs.shape:
                raise ShapeError(f"targets have shape {targets.shape}, inputs {inputs.shape}")
        self._plan(B, T, training=targets is not None)
        self.inputs, self.targets = inputs, targets
        return inputs, targets

    @_held
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

    @_held
    def forward(self, inputs, targets=None):
        """Runs the model on int tokens (B, T). Returns the mean cross-entropy
        loss as a float when ``targets`` (B, T) are given, else None; the
        logits are in ``model.logits`` either way. A learned position table
        limits T to max_seq_len; RoPE and ALiBi extrapolate past it."""
        c = self.config
        max_T = c.max_seq_len if c.learned_positions else None
        inputs, targets = self._batch(inputs, targets, max_T)
        p, a = self.params, self.acts

        def attend(l):
            if c.position == "rope":
                K.rope_forward(a.qkvr[l], a.qkv[l], None, c.NH, c.NKV, c.rope_theta)
            K.attention_gqa_forward(a.atty[l], a.att_stats[l],
                                    a.qkvr[l] if "qkvr" in a else a.qkv[l], self.slopes, c.NH,
                                    c.NKV)

        K.encoder_forward(a.encoded, inputs, p.wte[:c.V], p.wpe if c.learned_positions else None)
        residual = a.encoded
        for l in range(c.L):
            residual = self.block_forward(a, l, residual, attend)
        self.head_forward(a, residual)
        return self._loss(targets)

    # the block and the head on activations ``a`` laid out by act_specs: the
    # forward above runs them on (B, T), KV-cache decoding on one position

    def _bias(self, group, name, l=None):
        """Layer l's bias (or the whole tensor) when the model has biases, else None."""
        if name not in group:
            return None
        return group[name] if l is None else group[name][l]

    def _head(self, group):
        return group.wte if self.config.tied_embeddings else group.lm_head

    @staticmethod
    def _stat(a, name, l=None):
        """A saved norm statistic (the mean exists for layernorm only)."""
        if name not in a:
            return None
        return a[name] if l is None else a[name][l]

    def _norm_forward(self, out, mean, rstd, inp, weight, bias):
        if self.config.norm == "rmsnorm":
            K.rmsnorm_forward(out, rstd, inp, weight, self.config.norm_eps)
        else:
            K.layernorm_forward(out, mean, rstd, inp, weight, bias, self.config.norm_eps)

    def _norm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd):
        if self.config.norm == "rmsnorm":
            K.rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd)
        else:
            K.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd)

    def block_forward(self, a, l, residual, attend):
        """Layer l on the residual stream ``residual``; ``attend(l)`` turns
        a.qkv[l] into a.atty[l]. Returns the layer's output, a.residual3[l]."""
        c, p = self.config, self.params
        self._norm_forward(a.ln1[l], self._stat(a, "ln1_mean", l), a.ln1_rstd[l], residual,
                           p.ln1w[l], self._bias(p, "ln1b", l))
        w, matmul = self._weights, self._matmul_forward
        matmul(a.qkv[l], a.ln1[l], w.qkvw[l], self._bias(p, "qkvb", l))
        attend(l)
        matmul(a.attproj[l], a.atty[l], w.attprojw[l], self._bias(p, "attprojb", l))
        K.residual_forward(a.residual2[l], residual, a.attproj[l])
        self._norm_forward(a.ln2[l], self._stat(a, "ln2_mean", l), a.ln2_rstd[l],
                           a.residual2[l], p.ln2w[l], self._bias(p, "ln2b", l))
        matmul(a.fch[l], a.ln2[l], w.fcw[l], self._bias(p, "fcb", l))
        if c.mlp == "swiglu":
            K.swiglu_forward(a.fch_act[l], a.fch[l])
        else:
            K.gelu_forward(a.fch_act[l], a.fch[l])
        matmul(a.fcproj[l], a.fch_act[l], w.fcprojw[l], self._bias(p, "fcprojb", l))
        K.residual_forward(a.residual3[l], a.residual2[l], a.fcproj[l])
        return a.residual3[l]

    def head_forward(self, a, residual):
        """The final norm and the output head: a.logits."""
        p = self.params
        self._norm_forward(a.lnf, self._stat(a, "lnf_mean"), a.lnf_rstd, residual, p.lnfw,
                           self._bias(p, "lnfb"))
        self._matmul_forward(a.logits, a.lnf, self._head(self._weights), None)

    # ---- backward ----------------------------------------------------------

    @_held
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

    @_held
    def backward(self, loss_scale=1.0):
        """Adds the gradients of ``loss_scale`` times the last forward's mean
        loss into ``grads`` (a scale of 1/n averages n accumulated batches)."""
        c, p, a, g = self.config, self.params, self.acts, self.grads
        w, matmul_backward = self._weights, self._matmul_backward
        d = self._start_backward(loss_scale)
        rope = c.position == "rope"

        matmul_backward(d.lnf, self._head(g), None, d.logits, a.lnf, self._head(w))
        self._norm_backward(d.residual3[c.L - 1], g.lnfw, self._bias(g, "lnfb"), d.lnf,
                            a.residual3[c.L - 1], p.lnfw, self._stat(a, "lnf_mean"), a.lnf_rstd)
        for l in reversed(range(c.L)):
            residual = a.encoded if l == 0 else a.residual3[l - 1]
            dresidual = d.encoded if l == 0 else d.residual3[l - 1]
            K.residual_backward(d.residual2[l], d.fcproj[l], d.residual3[l])
            matmul_backward(d.fch_act[l], g.fcprojw[l], self._bias(g, "fcprojb", l),
                            d.fcproj[l], a.fch_act[l], w.fcprojw[l])
            if c.mlp == "swiglu":
                K.swiglu_backward(d.fch[l], d.fch_act[l], a.fch[l])
            else:
                K.gelu_backward(d.fch[l], d.fch_act[l], a.fch[l])
            matmul_backward(d.ln2[l], g.fcw[l], self._bias(g, "fcb", l), d.fch[l], a.ln2[l],
                            w.fcw[l])
            self._norm_backward(d.residual2[l], g.ln2w[l], self._bias(g, "ln2b", l), d.ln2[l],
                                a.residual2[l], p.ln2w[l], self._stat(a, "ln2_mean", l),
                                a.ln2_rstd[l])
            K.residual_backward(dresidual, d.attproj[l], d.residual2[l])
            matmul_backward(d.atty[l], g.attprojw[l], self._bias(g, "attprojb", l),
                            d.attproj[l], a.atty[l], w.attprojw[l])
            if rope:
                K.attention_gqa_backward(d.qkvr[l], d.atty[l], a.qkvr[l], a.att_stats[l],
                                         self.slopes, c.NH, c.NKV)
                K.rope_backward(d.qkv[l], d.qkvr[l], None, c.NH, c.NKV, c.rope_theta)
            else:
                K.attention_gqa_backward(d.qkv[l], d.atty[l], a.qkv[l], a.att_stats[l],
                                         self.slopes, c.NH, c.NKV)
            matmul_backward(d.ln1[l], g.qkvw[l], self._bias(g, "qkvb", l), d.qkv[l], a.ln1[l],
                            w.qkvw[l])
            self._norm_backward(dresidual, g.ln1w[l], self._bias(g, "ln1b", l), d.ln1[l],
                                residual, p.ln1w[l], self._stat(a, "ln1_mean", l), a.ln1_rstd[l])
        K.encoder_backward(g.wte[:c.V], g.wpe if c.learned_positions else None, d.encoded,
                           self.inputs)

    # ---- generation --------------------------------------------------------

    @_held
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

    @_held
    def update(self, learning_rate, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, t=1,
               decay=None):
        """One AdamW step (llm.c's gpt2_update); t >= 1 is the step number.

        Weight decay applies to every parameter (llm.c's CPU trainer) unless
        ``decay`` names the tensors to decay, e.g. model.matrix_params for
        weights only; the others then get none."""
        from ..train.optimizer import adamw_step   # train builds on the model, not back
        if self.m_memory is None:
            self.m_memory = aligned_zeros(self.num_parameters)
            self.v_memory = aligned_zeros(self.num_parameters)
        adamw_step(self.params, self.grads, self.m_memory, self.v_memory, learning_rate, beta1,
                   beta2, eps, weight_decay, t, decay, params_bf16=self.params_bf16)


def _reuse(group, specs, config, B, T):
    """The flat buffer of ``group`` if the layout for (B, T) fits in it, else None."""
    if group is None:
        return None
    needed = sum(math.prod(fn(config, B, T)) for _, fn in specs)
    return group.buffer if needed <= group.buffer.size else None
