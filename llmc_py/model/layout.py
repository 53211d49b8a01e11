"""Named tensors carved from one contiguous float32 buffer (some of them
bf16: act_dtypes).

Each spec is a tuple of (name, shape function), in the order the tensors lie
in memory. ``param_specs(config)`` follows llm.c's checkpoint order (for
GPT-2's choices it is exactly llm.c's layout, PARAM_SPECS); the same spec
lays out the gradients. ``act_specs(config)`` lays out the activations of a
forward pass that backward reads (or, forward_only, one layer's, which a
forward that no backward follows reuses layer after layer), and
``grad_act_specs(config)`` the gradients backward holds: the residual
stream's, and one layer's worth of the rest, reused by every layer.
"""
import math

import numpy as np

from .._native import kernels as K
from ..config import GPT2Config
from ..errors import ShapeError
from .memory import require

# buffers start on a 64-byte boundary (one cache line, one AVX-512 vector)
ALIGN_BYTES = 64


def _units(count, dtype, unit):
    """Elements of a ``unit`` buffer that hold ``count`` elements of ``dtype``."""
    return -(-count * np.dtype(dtype).itemsize // np.dtype(unit).itemsize)


def specs_units(specs, *shape_args, dtype=np.float32, dtypes=None):
    """Elements of a ``dtype`` buffer that hold the tensors of ``specs`` for the
    given shape arguments, each in its dtype (``dtypes``: {name: dtype}, others
    ``dtype``), as TensorGroup lays them out."""
    dtypes = dtypes or {}
    return sum(_units(math.prod(fn(*shape_args)), dtypes.get(name, dtype), dtype)
               for name, fn in specs)


def specs_bytes(specs, *shape_args, dtype=np.float32, dtypes=None):
    """Bytes of the tensors of ``specs`` for the given shape arguments (as specs_units)."""
    return np.dtype(dtype).itemsize * specs_units(specs, *shape_args, dtype=dtype, dtypes=dtypes)


def aligned_empty(count, dtype=np.float32, what=None):
    """A 1-D array of ``count`` elements whose data starts on ALIGN_BYTES.
    Raises OutOfMemoryError, naming ``what`` the buffer is for, if it cannot
    fit in the memory available."""
    itemsize = np.dtype(dtype).itemsize
    require(count * itemsize + ALIGN_BYTES, what or f"a buffer of {count} {np.dtype(dtype).name}")
    raw = np.empty(count * itemsize + ALIGN_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN_BYTES
    return raw[start:start + count * itemsize].view(dtype)


def aligned_zeros(count, dtype=np.float32, what=None):
    out = aligned_empty(count, dtype, what)
    out[...] = 0
    return out


class TensorGroup:
    """Named views into one flat buffer, ``memory`` (float32 unless ``dtype``
    says otherwise); ``dtypes`` {name: dtype} gives some tensors another
    element type (bf16 activations, uint16, in a float32 buffer), each in as
    many whole buffer elements as its bytes need.

    ``group["qkvw"]`` (or ``group.qkvw``) is a view of shape (L, 3C, C) and
    ``group.qkvw[l]`` is layer l. Views share memory with ``memory``: writing
    one writes the other. ``memory`` may be given (at least ``size`` floats,
    from a larger earlier layout); otherwise a zeroed aligned buffer is made,
    after checking that it fits in the memory available.

    ``layers`` {name: n} (a forward-only layout, act_specs(forward_only=True)):
    those tensors, laid out with a leading axis of 1, are seen as n layers
    that share that one memory (stride 0), so ``group.qkv[l]`` is the same
    buffer at every l and each layer overwrites the one before.
    """

    def __init__(self, specs, *shape_args, memory=None, dtype=np.float32, dtypes=None,
                 layers=None):
        self.shapes = {name: tuple(fn(*shape_args)) for name, fn in specs}
        self.names = tuple(self.shapes)
        self.dtypes = {name: np.dtype((dtypes or {}).get(name, dtype)) for name in self.names}
        units = {name: _units(math.prod(shape), self.dtypes[name], dtype)
                 for name, shape in self.shapes.items()}
        self.size = sum(units.values())
        if memory is None:
            names = ", ".join(self.names[:3]) + (", ..." if len(self.names) > 3 else "")
            memory = aligned_zeros(self.size, dtype, what=f"the tensors {names}")
        elif memory.dtype != dtype or memory.ndim != 1 or memory.size < self.size:
            raise ValueError(f"memory must be a 1-D {np.dtype(dtype).name} array of at least "
                             f"{self.size} elements, got {memory.dtype} {memory.shape}")
        self.buffer = memory               # the whole allocation, possibly larger
        self.memory = memory[:self.size]   # exactly this layout's tensors
        self._views = {}
        self._spans = {}   # name: (start, stop) in memory
        offset = 0
        for name, shape in self.shapes.items():
            self._spans[name] = (offset, offset + units[name])
            part = self.memory[offset:offset + units[name]]
            if self.dtypes[name] != part.dtype:
                part = part.view(self.dtypes[name])
            view = part[:math.prod(shape)].reshape(shape)
            if layers and name in layers:
                view = np.lib.stride_tricks.as_strided(
                    view, (layers[name],) + shape[1:], (0,) + view.strides[1:])
            self._views[name] = view
            offset += units[name]

    def __getitem__(self, name):
        return self._views[name]

    def __getattr__(self, name):
        views = self.__dict__.get("_views")
        if views is not None and name in views:
            return views[name]
        raise AttributeError(name)

    def __contains__(self, name):
        return name in self._views

    def __iter__(self):
        return iter(self.names)

    def items(self):
        return self._views.items()

    def zero(self, names=None):
        """Zeroes every tensor, or those ``names`` lists: each run of them that
        lies back to back in memory at once (float32: K.fill_zero, whose large
        fills do not read memory first)."""
        runs = []
        for name in self.names if names is None else sorted(names, key=self._spans.get):
            start, stop = self._spans[name]
            if runs and runs[-1][1] == start:
                runs[-1][1] = stop
            else:
                runs.append([start, stop])
        for start, stop in runs:
            if stop == start:
                continue
            if self.memory.dtype == np.float32:
                K.fill_zero(self.memory[start:stop])
            else:
                self.memory[start:stop] = 0


# ---- the layouts ---------------------------------------------------------------
#
# Which tensors exist depends on the config's choices; with GPT-2's (layernorm,
# learned positions, gelu, biases, tied embeddings, NKV = NH) the layout is
# exactly llm.c's.
#   qkvw [L, (NH + 2 NKV) hs, C]  rows: the q heads, then k heads, then v heads
#   qnormw, knormw [L, hs]        qk_norm's weights (Qwen3's q_norm, k_norm)
#   attprojw [L, C, NH hs]        NH hs = C unless head_dim says otherwise
#   fcw  [Ld, 2 FF, C] (gated: swiglu, geglu, reglu)  rows: W1 (the gate) then W3 (up)
#        [Ld, FF, C]   (gelu, gelu_erf, relu)
#   fcprojw [Ld, C, FF]
#        Ld: the layers with a dense MLP (config.dense_mlp_layers, in order;
#        all L of them without experts)
#   routerw [Lm, E, C]            the router of each MoE layer (config.moe_layers)
#   expertfcw [Lm, E, 2 EH, C]    each expert's fcw (gated: W1 then W3), EH = expert_hidden
#             [Lm, E, EH, C]      (plain MLPs)
#   expertprojw [Lm, E, C, EH]    each expert's fcprojw
#   lm_head [Vp, C]               only when the embeddings are untied

def param_specs(c):
    """(name, shape function of the config) per parameter tensor, in memory
    (and checkpoint) order."""
    layernorm, bias = c.norm == "layernorm", c.bias
    dense, moe = c.num_dense_mlp_layers > 0, c.num_moe_layers > 0
    specs = [
        ("wte", lambda c: (c.Vp, c.C), True),
        ("wpe", lambda c: (c.maxT, c.C), c.learned_positions),
        ("ln1w", lambda c: (c.L, c.C), True),
        ("ln1b", lambda c: (c.L, c.C), layernorm),
        ("qkvw", lambda c: (c.L, c.qkv_channels, c.C), True),
        ("qkvb", lambda c: (c.L, c.qkv_channels), bias),
        ("qnormw", lambda c: (c.L, c.head_size), c.qk_norm),
        ("knormw", lambda c: (c.L, c.head_size), c.qk_norm),
        ("attprojw", lambda c: (c.L, c.C, c.attn_channels), True),
        ("attprojb", lambda c: (c.L, c.C), bias),
        ("ln2w", lambda c: (c.L, c.C), c.second_norm),
        ("ln2b", lambda c: (c.L, c.C), layernorm and c.second_norm),
        ("fcw", lambda c: (c.num_dense_mlp_layers, c.fc_channels, c.C), dense),
        ("fcb", lambda c: (c.num_dense_mlp_layers, c.fc_channels), bias and dense),
        ("fcprojw", lambda c: (c.num_dense_mlp_layers, c.C, c.FF), dense),
        ("fcprojb", lambda c: (c.num_dense_mlp_layers, c.C), bias and dense),
        ("routerw", lambda c: (c.num_moe_layers, c.num_experts, c.C), moe),
        ("expertfcw", lambda c: (c.num_moe_layers, c.num_experts, c.expert_fc_channels, c.C),
         moe),
        ("expertprojw", lambda c: (c.num_moe_layers, c.num_experts, c.C, c.expert_hidden),
         moe),
        ("lnfw", lambda c: (c.C,), True),
        ("lnfb", lambda c: (c.C,), layernorm),
        ("lm_head", lambda c: (c.Vp, c.C), not c.tied_embeddings),
    ]
    return tuple((name, fn) for name, fn, present in specs if present)


# the parameters that are one tensor for the model; the others stack one per layer
WHOLE_PARAMS = ("wte", "wpe", "lnfw", "lnfb", "lm_head")


def routed_rows(c, B, T):
    """R: the rows an MoE layer's experts process, k per token."""
    return B * T * c.experts_per_token


def act_specs(c, recompute=False, logits=True, recompute_fch=False, forward_only=False):
    """(name, shape function of (config, B, T)) per activation of a forward.

    Per layer (a leading L), only what backward reads: the attention keeps
    its output and two numbers per query row (att_stats: the softmax's max
    and inverse normaliser), never its (T, T) probabilities; the two output
    projections share one (B, T, C) buffer (proj), which backward never
    reads. With ``recompute`` the norm outputs (ln1, ln2) and the MLP
    activation (fch_act) are held for one layer at a time, and backward
    recomputes them; ``recompute_fch`` (recompute level 2, or a quantized
    base's 1) holds the MLP's input projection (fch) for one layer too.
    ``logits=False`` leaves the (B, T, Vp) logits out (the model holds them,
    or a block of their rows, apart). Each is float32, except in a bf16
    model ln1, ln2 and fch_act (and their recompute slots), which only
    matmuls read: bf16 (act_dtypes says why, per tensor; not post-norm's ln1
    and ln2).

    By the block (config.block): "pre" as above; "post": residual2 and
    residual3 hold the sums that ln1 and ln2 normalise, and ln2 is the
    layer's output, the next layer's input (so kept for every layer, also
    with recompute); "parallel": residual2 = x + attention's output,
    residual3 = residual2 + the MLP's, and no ln2 (the MLP reads ln1).

    The MLP's activations are per layer of its kind: fch and fch_act for
    the dense MLP layers (config.dense_mlp_layers), and for the MoE layers
    (config.moe_layers) the router's logits and their softmax over the E experts, each
    token's k chosen experts (int32) and their weights, and per routed row
    (R = B T k of them, grouped by expert) the experts' first projection,
    its activation (recomputed like fch_act) and the expert's output before
    its router weight (that weight's gradient reads it): O(B T k
    expert_hidden) per MoE layer. expert_in holds one layer's rows
    gathered for the experts (backward gathers them again)."""
    layernorm, rope = c.norm == "layernorm", c.position == "rope"
    qk_norm, ln2 = c.qk_norm, c.second_norm
    L = (lambda c: 1) if recompute else (lambda c: c.L)   # layers held of the recomputed
    L2 = (lambda c: c.L) if c.block == "post" else L       # ln2: post-norm's layer output
    Lf = (lambda c: 1) if recompute_fch else (lambda c: c.L)
    dense, moe = c.num_dense_mlp_layers > 0, c.num_moe_layers > 0
    Ld, Lm = (lambda c: c.num_dense_mlp_layers), (lambda c: c.num_moe_layers)
    specs = [
        ("encoded", lambda c, B, T: (B, T, c.C), True),
        ("ln1", lambda c, B, T: (L(c), B, T, c.C), True),
        ("ln1_mean", lambda c, B, T: (c.L, B, T), layernorm),
        ("ln1_rstd", lambda c, B, T: (c.L, B, T), True),
        ("qkv", lambda c, B, T: (c.L, B, T, c.qkv_channels), True),
        # q, k, v as attention reads them: after qk_norm and RoPE
        ("qkvr", lambda c, B, T: (c.L, B, T, c.qkv_channels), rope or qk_norm),
        ("qk_rstd", lambda c, B, T: (c.L, B, T, c.NH + c.NKV), qk_norm),
        ("atty", lambda c, B, T: (c.L, B, T, c.attn_channels), True),
        ("att_stats", lambda c, B, T: (c.L, B, c.NH, T, 2), True),
        ("proj", lambda c, B, T: (B, T, c.C), True),          # attproj, then fcproj
        ("residual2", lambda c, B, T: (c.L, B, T, c.C), True),
        ("ln2", lambda c, B, T: (L2(c), B, T, c.C), ln2),
        ("ln2_mean", lambda c, B, T: (c.L, B, T), layernorm and ln2),
        ("ln2_rstd", lambda c, B, T: (c.L, B, T), ln2),
        ("fch", lambda c, B, T: (min(Lf(c), Ld(c)), B, T, c.fc_channels), dense),
        ("fch_act", lambda c, B, T: (min(L(c), Ld(c)), B, T, c.FF), dense),   # activated
        # the MoE layers' (R = B T k routed rows, grouped by expert)
        ("router_logits", lambda c, B, T: (Lm(c), B, T, c.num_experts), moe),
        ("router_probs", lambda c, B, T: (Lm(c), B, T, c.num_experts), moe),
        ("topk_index", lambda c, B, T: (Lm(c), B, T, c.experts_per_token), moe),   # int32
        ("topk_weight", lambda c, B, T: (Lm(c), B, T, c.experts_per_token), moe),
        ("expert_in", lambda c, B, T: (routed_rows(c, B, T), c.C), moe),   # one layer's
        ("expert_fch", lambda c, B, T: (Lm(c), routed_rows(c, B, T), c.expert_fc_channels),
         moe),
        ("expert_act", lambda c, B, T: (min(L(c), Lm(c)), routed_rows(c, B, T),
                                        c.expert_hidden), moe),
        ("expert_out", lambda c, B, T: (Lm(c), routed_rows(c, B, T), c.C), moe),
        ("residual3", lambda c, B, T: (c.L, B, T, c.C), True),
        ("lnf", lambda c, B, T: (B, T, c.C), True),
        ("lnf_mean", lambda c, B, T: (B, T), layernorm),
        ("lnf_rstd", lambda c, B, T: (B, T), True),
        ("logits", lambda c, B, T: (B, T, c.Vp), logits),
        ("xent_stats", lambda c, B, T: (B, T, 2), True),      # the loss's softmax: max, 1/sum
        ("losses", lambda c, B, T: (B, T), True),
    ]
    specs = tuple((name, fn) for name, fn, present in specs if present)
    if forward_only:
        specs = tuple((name, fn if name in WHOLE_ACTS else _one_layer(fn)) for name, fn in specs)
    return specs


# the activations that are one tensor for the model; the others have a
# leading axis of layers (all of them, or those of the MLP's kind)
WHOLE_ACTS = ("encoded", "proj", "expert_in", "lnf", "lnf_mean", "lnf_rstd", "logits",
              "xent_stats", "losses")


def _one_layer(fn):
    """A per-layer activation's shape function with its leading axis cut to 1."""
    return lambda c, B, T: (1,) + tuple(fn(c, B, T))[1:]


def layer_counts(c):
    """{name: layers} of the per-layer activations of act_specs(c): how many
    layers a forward-only layout's one slot of each serves (TensorGroup's
    ``layers``)."""
    return {name: fn(c, 1, 1)[0] for name, fn in act_specs(c) if name not in WHOLE_ACTS}


def forward_only_acts(c, B, T, logits=True, memory=None, dtypes=None):
    """The TensorGroup of a forward-only layout (act_specs forward_only): every
    per-layer tensor one layer's memory, seen at every layer."""
    return TensorGroup(act_specs(c, logits=logits, forward_only=True), c, B, T, memory=memory,
                       dtypes=dtypes, layers=layer_counts(c))


# the activations that only matmuls read (the bf16 GEMM, whose bf16 input is
# bitwise what it would round a float32 one to): a bf16 model keeps them in
# bf16 (act_dtypes)
BF16_ACTS = ("ln1", "ln2", "fch_act", "expert_in", "expert_act")


def act_dtypes(c, bf16):
    """{name: np.uint16} for the activations of act_specs(c) that a model
    keeps in bf16: with ``bf16`` (a bf16 model, its linear layers the bf16
    GEMM), those only a matmul reads (BF16_ACTS), for the pre-norm and
    parallel blocks; every other one is float32. Per tensor:
      ln1, ln2   bf16: read by qkv's and the MLP's matmuls (an MoE layer's
                 router matmul, and its gather into expert_in);
                 LoRA adapters read them as those matmuls do (their dropout
                 widens them exactly). Post-norm: float32, as ln1 and ln2
                 are its residual stream (added into residual3, the next
                 layer's input).
      fch_act    bf16: read by the MLP's output matmul alone (its backward
                 reads fch).
      expert_in, expert_act
                 bf16: the MoE layers' rows for the experts' first and
                 second grouped matmuls, which read nothing else of them
                 (the activation's backward reads expert_fch).
      float32    the residual stream (encoded, residual2, residual3), the
                 norms' statistics (mean, rstd), qkv and what attention
                 reads and writes, fch (the activation's backward reads
                 it), the MoE layers' other tensors, lnf, the logits, the loss's
                 statistics and the losses."""
    if not bf16 or c.block == "post":
        return {}
    return {name: np.uint16 for name, _ in act_specs(c) if name in BF16_ACTS}


def float32_of(x):
    """An activation's values in float32: x itself, or a bf16 one (act_dtypes)
    widened exactly, for a kernel that reads float32."""
    if x.dtype == np.float32:
        return x
    out = np.empty(x.shape, np.float32)
    K.bf16_to_float(out, np.ascontiguousarray(x))
    return out


def grad_act_specs(c):
    """(name, shape function of (config, B, T)) per activation gradient that
    backward holds. ``residual`` is the residual stream's, carried from layer
    to layer. The others hold one layer's at a time, each serving in turn
    gradients whose lifetimes do not overlap: ``narrow`` (B, T, C) that of
    lnf, then per layer ln2, atty and ln1; ``wide`` that of the MLP
    activation (FF), then of the attention projection's output before its
    dropout (C), then of qkv (or with qk_norm and RoPE, of qkv between the
    two); ``fch`` that of the MLP projection's output before its dropout
    (C), then of fch, then of qkvr (with RoPE or qk_norm), then of qkv (with
    both); ``losses`` d(loss)/d(losses). An MoE layer's, per routed row
    (R = B T k): ``expert_wide`` that of the experts' outputs (C), then of
    their first projection; ``expert_narrow`` that of their activation,
    then of their gathered inputs (C); ``router`` that of the router's
    logits."""
    qkvr = c.position == "rope" or c.qk_norm
    specs = [
        ("residual", lambda c, B, T: (B, T, c.C)),
        ("narrow", lambda c, B, T: (B, T, max(c.C, c.attn_channels))),
        ("wide", lambda c, B, T: (B, T, max(c.FF, c.qkv_channels, c.C))),
        ("fch", lambda c, B, T: (B, T, max(c.fc_channels, c.qkv_channels if qkvr else 0, c.C))),
        ("losses", lambda c, B, T: (B, T)),
    ]
    if c.moe_layers:
        specs += [
            ("expert_wide", lambda c, B, T: (routed_rows(c, B, T),
                                             max(c.expert_fc_channels, c.C))),
            ("expert_narrow", lambda c, B, T: (routed_rows(c, B, T),
                                               max(c.expert_hidden, c.C))),
            ("router", lambda c, B, T: (B, T, c.num_experts)),
        ]
    return tuple(specs)


# a frozen bf16 base's tensors held in bf16 alone (model.transformer): what
# the matmuls (and the embedding's gather) read
FROZEN_BF16 = ("wte", "qkvw", "attprojw", "fcw", "fcprojw", "routerw", "expertfcw",
               "expertprojw", "lm_head")


def frozen_bf16_parameters(config):
    """How many of a model's parameters a frozen bf16 base holds in bf16."""
    return sum(math.prod(fn(config)) for name, fn in param_specs(config)
               if name in FROZEN_BF16)


def num_parameters(config):
    """Total parameter count of a model of ``config``, as an exact Python int."""
    return sum(math.prod(fn(config)) for _, fn in param_specs(config))


def checked_params(config, params):
    """``params`` as a flat float32 array, after checking that it holds one
    value per parameter of a model of ``config``."""
    params = np.asarray(params)
    count = num_parameters(config)
    if params.dtype != np.float32 or params.size != count:
        raise ShapeError(f"params must be {count} float32 values, got {params.size} "
                         f"{params.dtype}")
    return params.reshape(-1)


# GPT-2's layouts (llm.c's train_gpt2.c): for any GPT2Config
_GPT2 = GPT2Config()
PARAM_SPECS = param_specs(_GPT2)
ACT_SPECS = act_specs(_GPT2)
GRAD_ACT_SPECS = grad_act_specs(_GPT2)
