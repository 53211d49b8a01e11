"""LoRA adapters on a frozen model (Hu et al., 2021), as peft's LoraLayer has
them: a target linear layer's output gains scale * (drop(x) A^T) B^T, with
A (r, in) and B (out, r) trained and the layer's weight W frozen; scale is
alpha / r, or alpha / sqrt(r) with rsLoRA.

Targets are Hugging Face's module names (targets()), mapped onto our fused
weights: Llama's q_proj, k_proj and v_proj adapt row blocks of qkvw's
output, gate_proj and up_proj those of fcw; GPT-2's c_attn adapts all of
qkvw. A name matches as peft matches it, by its dotted suffix ("c_proj" is
GPT-2's attn.c_proj and mlp.c_proj).

Every adapter of every layer lives in one contiguous float32 buffer
(``params``; ``grads`` and AdamW's moments alike), laid out by target:
"<target>.A" (L, r, in), then "<target>.B" (L, out, r). In a float32 model
the adapters' matmuls are float32: x times A, then times scale * B, added
into the base layer's float32 output. In a bf16 model they are bf16 as its
base layers' are (``bf16``): the float32 A and scale * B rounded to bf16
where a product reads them, x, x A^T and the gradients rounded to bf16 in
the products, which sum in float32 (matmul_bf16.c); the gradients of A and
B stay float32. The adapters of one
linear layer (q, k and v; gate and up) run as one: x times their A's
stacked, then times their scaled B's laid side by side in one matrix (zero
where an adapter has no rows), so that a layer's input and output are each
read once, not once per adapter. In bf16 the products with that matrix
(forward, and backward's d(x A^T) and d(B)) read each adapter's block over
its own columns alone, all of a layer's in one call (lora_bf16.c), never
multiplying by its zeros. A training forward keeps every layer's x A^T
(``kept``: rank x targets floats a row and layer, memory_plan's "LoRA
activations") for backward, which would otherwise multiply again.

LoRA dropout drops an adapter's input in the training passes, the ones
given a Dropout (model.dropout): each adapter of each layer has its own
masks, from that pass's seed; backward regenerates them.
"""
import math
from dataclasses import dataclass

import numpy as np

from .._native import kernels as K
from ..io.files import to_bf16
from .dropout import NO_DROPOUT
from .layout import TensorGroup, float32_of


@dataclass(frozen=True)
class Target:
    """One adaptable linear layer, per layer of the model."""
    name: str           # Hugging Face's module name: "q_proj", "attn.c_proj"
    module: str         # its path in a layer, as peft names it: "self_attn.q_proj"
    linear: str         # our linear layer ("qkv" is qkvw and qkvb)
    rows: slice         # the rows of our weight's output it adapts
    in_features: int

    @property
    def out_features(self):
        return self.rows.stop - self.rows.start


def targets(config):
    """Every Target a model of ``config`` has, in layer order: GPT-2's for
    a GPT2LMHeadModel, Llama's names otherwise."""
    c = config
    if _is_gpt2(c):
        return (Target("c_attn", "attn.c_attn", "qkv", slice(0, c.qkv_channels), c.C),
                Target("attn.c_proj", "attn.c_proj", "attproj", slice(0, c.C), c.attn_channels),
                Target("c_fc", "mlp.c_fc", "fc", slice(0, c.fc_channels), c.C),
                Target("mlp.c_proj", "mlp.c_proj", "fcproj", slice(0, c.C), c.FF))
    q, kv = c.attn_channels, c.kv_dim
    if c.fc_channels == 2 * c.FF:   # gated: the gate's rows, then up's
        mlp = (Target("gate_proj", "mlp.gate_proj", "fc", slice(0, c.FF), c.C),
               Target("up_proj", "mlp.up_proj", "fc", slice(c.FF, 2 * c.FF), c.C))
    else:
        mlp = (Target("up_proj", "mlp.up_proj", "fc", slice(0, c.FF), c.C),)
    return (Target("q_proj", "self_attn.q_proj", "qkv", slice(0, q), c.C),
            Target("k_proj", "self_attn.k_proj", "qkv", slice(q, q + kv), c.C),
            Target("v_proj", "self_attn.v_proj", "qkv", slice(q + kv, q + 2 * kv), c.C),
            Target("o_proj", "self_attn.o_proj", "attproj", slice(0, c.C), c.attn_channels),
            *mlp,
            Target("down_proj", "mlp.down_proj", "fcproj", slice(0, c.C), c.FF))


def _is_gpt2(config):
    from ..errors import UnsupportedError
    from ..io.hf import architecture   # io.hf reads model.layout: imported when used
    try:
        return architecture(config) == "GPT2LMHeadModel"
    except UnsupportedError:
        return False


def layer_prefix(config):
    """peft's module path of layer {l} of a model of ``config``."""
    return "transformer.h.{l}." if _is_gpt2(config) else "model.layers.{l}."


def select(config, names):
    """The model's Targets that ``names`` match (peft's way: a name matches a
    module whose dotted path ends in it), in layer order. ValueError names a
    name that matches none, with the targets the model has."""
    every = targets(config)
    if isinstance(names, str):
        names = (names,)
    chosen = set()
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"targets: {name!r} is not a module name")
        matched = {t.name for t in every if ("." + t.module).endswith("." + name)}
        if not matched:
            raise ValueError(f"targets: this model has no module {name!r}; its targets are "
                             f"{', '.join(t.name for t in every)}")
        chosen |= matched
    if not chosen:
        raise ValueError("targets: at least one module name is needed")
    return tuple(t for t in every if t.name in chosen)


def adapter_parameters(config, rank, names=None):
    """The parameters of rank-``rank`` adapters on the targets ``names``
    (default: every one) of a model of ``config``, without making them."""
    chosen = targets(config) if names is None else select(config, names)
    return sum(config.L * rank * (t.in_features + t.out_features) for t in chosen)


def adapter_width(config, rank, names=None):
    """Lora.width of those adapters: the numbers of x A^T a layer has a row."""
    return rank * len(targets(config) if names is None else select(config, names))


class Lora:
    """A model's adapters: ``params`` and ``grads`` (TensorGroups of one
    float32 buffer each), AdamW's moments ``m`` and ``v`` (made by the
    model's moments()), and what they adapt: ``targets`` (Targets), ``rank``,
    ``alpha``, ``scale``, ``dropout`` (a probability), ``rslora``."""

    def __init__(self, config, rank, alpha, names, dropout, rslora):
        """Zeroed adapters of ``rank`` on the targets ``names`` (select();
        None: every one) of a model of ``config``; ValueError names a bad
        argument before anything is made."""
        self.config = config
        self.targets = targets(config) if names is None else select(config, names)
        self.rank = _checked_rank(rank, self.targets)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) \
                or not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"alpha must be a positive number, got {alpha!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
                or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout is a probability in [0, 1), got {dropout!r}")
        self.alpha, self.dropout, self.rslora = alpha, float(dropout), bool(rslora)
        self.scale = alpha / (math.sqrt(rank) if rslora else rank)
        r = self.rank
        specs = []
        for t in self.targets:
            specs.append((t.name + ".A", lambda c, t=t: (c.L, r, t.in_features)))
            specs.append((t.name + ".B", lambda c, t=t: (c.L, t.out_features, r)))
        self.params = TensorGroup(specs, config)
        self.grads = TensorGroup(specs, config)
        self.m = self.v = None
        self._by_linear = {}
        for index, t in enumerate(self.targets):
            self._by_linear.setdefault(t.linear, []).append((index, t))
        # each linear layer's output width (its adapters' rows are in it)
        self._width = {"qkv": config.qkv_channels, "attproj": config.C,
                       "fc": config.fc_channels, "fcproj": config.C}
        # each linear layer's adapters' output columns, (start, stop) a row
        self._columns = {linear: np.array([(t.rows.start, t.rows.stop) for _, t in group],
                                          np.int32)
                         for linear, group in self._by_linear.items()}
        self.bf16 = False   # bf16 products: a bf16 model's (set when it takes the adapters)
        # x A^T of every layer, by linear layer (L, B, T, n r), that a training
        # forward keeps for backward (keep()), in one buffer; None until the
        # model plans a step
        self.kept = self._kept_memory = None

    @property
    def width(self):
        """The numbers of x A^T a layer's adapters have a row (rank times targets)."""
        return self.rank * len(self.targets)

    def keeps(self, B, T):
        """Whether the buffer keep(B, T) needs is made already."""
        memory = self._kept_memory
        return memory is not None and memory.size >= self.config.L * B * T * self.width

    def keep(self, B, T):
        """Lays out ``kept`` for a training forward of (B, T), which writes
        x A^T there for its backward: width floats a row and layer
        (memory_plan's "LoRA activations"), in a buffer made anew only when
        it is outgrown."""
        L, r = self.config.L, self.rank
        if not self.keeps(B, T):
            self.kept = self._kept_memory = None
            self._kept_memory = np.empty(L * B * T * self.width, np.float32)
        self.kept, start = {}, 0
        for linear, group in self._by_linear.items():
            shape = (L, B, T, len(group) * r)
            self.kept[linear] = self._kept_memory[start:start + math.prod(shape)].reshape(shape)
            start += math.prod(shape)

    def initialize(self, seed):
        """peft's initialisation: A Kaiming-uniform as torch's nn.Linear
        (a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), drawn from ``seed``; B zero."""
        rng = np.random.default_rng(seed)
        for t in self.targets:
            bound = 1.0 / math.sqrt(t.in_features)
            A = self.params[t.name + ".A"]
            A[...] = rng.uniform(-bound, bound, A.shape).astype(np.float32)
            self.params[t.name + ".B"][...] = 0.0

    def _input(self, inp, dropout, l, index):
        """An adapter's input: ``inp`` (float32, or a bf16 model's bf16
        activation, which the bf16 products read as they are), or a dropped
        float32 copy of it in a training pass (of a bf16 one widened
        exactly); with the (p, seed) of its masks."""
        if dropout is NO_DROPOUT or not self.dropout:
            return inp, (0.0, 0)
        site = dropout.adapter_site(self.dropout, l, index)
        out = np.empty(inp.shape, np.float32)
        K.dropout_forward(out, float32_of(inp), *site)
        return out, site

    def _stacked_a(self, group, l):
        """Layer l's A of the adapters ``group`` (of one linear layer), one
        above the other: (n r, in)."""
        return np.concatenate([self.params[t.name + ".A"][l] for _, t in group])

    def _a(self, group, l):
        """Layer l's A of ``group`` stacked, as the products read it: float32,
        or rounded to bf16 (uint16) in a bf16 model."""
        A = self._stacked_a(group, l)
        return to_bf16(A) if self.bf16 else A

    def _up_t(self, group, l):
        """up^T (_up) as the products read it: float32, or bf16 (each scale * B
        rounded, then laid in, so that the zeros cost no rounding)."""
        if not self.bf16:
            return np.ascontiguousarray(self._up(group, l).T)
        r = self.rank
        up_t = np.zeros((len(group) * r, self._width[group[0][1].linear]), np.uint16)
        for j, (_, t) in enumerate(group):
            up_t[j * r:(j + 1) * r, t.rows] = to_bf16(
                self.params[t.name + ".B"][l] * np.float32(self.scale)).T
        return up_t

    def _by_adapter(self, x, group):
        """x (B, T, n r) of the adapters ``group`` as the bf16 up products
        (lora_up_forward_bf16) read it: (B, T, n, r)."""
        return x.reshape(x.shape[:-1] + (len(group), self.rank))

    def _up(self, group, l):
        """Layer l's scale * B of the adapters ``group`` (of one linear
        layer) as one (width, n r) matrix: adapter j's B in the rows it
        adapts of the layer's output and its own r columns, zero elsewhere,
        so that h (B, T, n r) times its transpose is every adapter's output."""
        r = self.rank
        up = np.zeros((self._width[group[0][1].linear], len(group) * r), np.float32)
        for j, (_, t) in enumerate(group):
            up[t.rows, j * r:(j + 1) * r] = self.params[t.name + ".B"][l] * np.float32(self.scale)
        return up

    def _down(self, inp, group, l, dropout, A, h=None):
        """x A^T of every adapter of ``group``, side by side: (B, T, n r), into
        ``h`` if given, with A their A's stacked (_a); with the adapters'
        inputs and the (p, seed) of their dropout (_input)."""
        r = self.rank
        if h is None:
            h = np.empty(inp.shape[:-1] + (len(group) * r,), np.float32)
        inputs = [self._input(inp, dropout, l, index) for index, _ in group]
        matmul = K.matmul_forward_bf16 if self.bf16 else K.matmul_forward
        if all(x is inp for x, _ in inputs):   # no dropout: one product for all
            matmul(h, inp, A, None)
            return h, inputs
        for j, (x, _) in enumerate(inputs):
            part = np.empty(inp.shape[:-1] + (r,), np.float32)
            matmul(part, x, A[j * r:(j + 1) * r], None)
            h[..., j * r:(j + 1) * r] = part
        return h, inputs

    def forward(self, out, inp, linear, l, dropout, keep=False):
        """Adds layer l's adapters of ``linear`` into its output ``out``
        (the base layer's, of ``inp``); with ``keep`` (a forward that keeps
        every layer's activations, after keep()) x A^T stays for backward."""
        group = self._by_linear.get(linear)
        if not group:
            return
        h, _ = self._down(inp, group, l, dropout, self._a(group, l), self._kept(linear, l, inp)
                          if keep else None)
        if self.bf16:   # each adapter's block of up^T over its own columns
            up_t = self._up_t(group, l)
            K.lora_up_forward_bf16(out, self._by_adapter(h, group),
                                   up_t.reshape(len(group), self.rank, -1), self._columns[linear])
            return
        # out += h up^T in one product, with no (B, T, out) temporary: the GEMM
        # that adds into its output is matmul_backward's input gradient
        # (``out`` stands in for the input it would read for a weight gradient)
        K.matmul_backward(out, None, None, h, out, self._up_t(group, l))

    def _kept(self, linear, l, inp):
        """Layer l's kept x A^T of ``linear`` (B, T, n r) for an input
        ``inp``, or None when keep() made none of its shape."""
        kept = None if self.kept is None else self.kept[linear]
        return kept[l] if kept is not None and kept.shape[1:3] == inp.shape[:2] else None

    def backward(self, dinp, dout, inp, linear, l, dropout):
        """Adds into A's and B's gradients and d(inp) (None: not wanted) from
        ``dout`` = d(the layer's output), with x A^T as forward kept it (else
        recomputed, bitwise the same: r numbers a row)."""
        group = self._by_linear.get(linear)
        if not group:
            return
        r = self.rank
        A = self._a(group, l)
        h = self._kept(linear, l, inp)
        if h is None:
            h, inputs = self._down(inp, group, l, dropout, A)
        else:
            inputs = [self._input(inp, dropout, l, index) for index, _ in group]
        if self.bf16:
            up_t = self._up_t(group, l)
            dh = np.empty_like(h)
            # d(up)^T = h^T dout, in each adapter's block (the rest is never read)
            dup_t = np.empty(up_t.shape, np.float32)
            n_r = (len(group), r, up_t.shape[1])
            K.lora_up_backward_bf16(self._by_adapter(dh, group), dup_t.reshape(n_r), dout,
                                    self._by_adapter(h, group), up_t.reshape(n_r),
                                    self._columns[linear])
            dup = dup_t.T
        else:
            up = self._up(group, l)
            dh, dup = np.zeros_like(h), np.zeros_like(up)
            K.matmul_backward(dh, dup, None, dout, h, up)
        for j, (_, t) in enumerate(group):
            self.grads[t.name + ".B"][l] += dup[t.rows, j * r:(j + 1) * r] * np.float32(
                self.scale)
        if all(x is inp for x, _ in inputs):   # no dropout: one product for all
            dA = np.zeros(A.shape, np.float32)
            self._down_backward(dinp, dA, dh, inp, A)
            for j, (_, t) in enumerate(group):
                self.grads[t.name + ".A"][l] += dA[j * r:(j + 1) * r]
            return
        for j, ((x, (p, seed)), (_, t)) in enumerate(zip(inputs, group)):
            dA = self.grads[t.name + ".A"][l]
            dh_t = np.ascontiguousarray(dh[..., j * r:(j + 1) * r])
            dx = dinp if not p or dinp is None else np.zeros_like(x)
            self._down_backward(dx, dA, dh_t, x, A[j * r:(j + 1) * r])
            if dx is not dinp:
                K.dropout_backward(dx, dx, p, seed)
                dinp += dx

    def _down_backward(self, dx, dA, dh, x, A):
        """dx += dh A (dx None: not wanted) and dA += dh^T x: matmul_backward's
        products. In bf16, dx's, a product of rank K = n r onto a wide
        output, is the up product's kernel (lora_up_forward_bf16, one block
        over every column), which walks dx in whole rows: bitwise
        matmul_backward_bf16's, 3x faster at Qwen3's down_proj."""
        if not self.bf16:
            K.matmul_backward(dx, dA, None, dh, x, A)
            return
        if dx is not None:
            K.lora_up_forward_bf16(dx, dh[..., None, :], A[None],
                                   np.array([(0, A.shape[1])], np.int32))
        K.matmul_backward_bf16(None, dA, None, dh, x, A)

    def delta(self, t, l):
        """scale * B A of target ``t`` in layer l: (out, in), float32."""
        A, B = self.params[t.name + ".A"][l], self.params[t.name + ".B"][l]
        product = np.empty((1, t.out_features, t.in_features), np.float32)
        K.matmul_forward(product, B[None], np.ascontiguousarray(A.T), None)
        return product[0] * np.float32(self.scale)


def _checked_rank(rank, chosen):
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise ValueError(f"rank must be an int, got {rank!r}")
    for t in chosen:
        top = min(t.in_features, t.out_features)
        if not 1 <= rank <= top:
            raise ValueError(f"rank {rank} is outside [1, {top}]: {t.name} is "
                             f"{t.out_features} x {t.in_features}")
    return int(rank)
