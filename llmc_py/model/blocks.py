"""The transformer's three blocks, each a forward and a backward of plain
kernel calls, chosen once by config.block (BLOCKS):

  pre       r2 = x + attn(ln1(x));   r3 = r2 + mlp(ln2(r2));        out r3
  post      r2 = x + attn(x);        r3 = ln1(r2) + mlp(ln1(r2));   out ln2(r3)
  parallel  r2 = x + attn(ln1(x));   r3 = r2 + mlp(ln1(x));         out r3

Forward runs layer l on the activations ``a`` it is given (layout.act_specs):
the model's for a (B, T) batch, or KV-cache decoding's for one position,
with ``attend(l)`` turning a.qkv[l] into a.atty[l] either way. Backward
runs layer l back from d.residual = d(its output) to d(its input), adding
into the model's gradients.

A layer's MLP is dense or, in config.moe_layers, E experts (Block.experts):
a router picks each token's top k, the tokens' rows are grouped by expert
for the grouped GEMMs (moe.c) and summed back by the router's weights. The
grouping is computed again in backward from the kept top-k indices, and the
gathered rows gathered again.

What forward saves for backward is the block's ``saved``: every layer's norm
outputs and MLP (or experts') activation (EveryLayer), or, with recompute,
one layer's slot of each, which backward refills layer by layer (Recomputed); with
``recompute_fch`` (recompute level 2, or a quantized base's 1) the MLP's input projection fch too,
its largest activation, at the cost of running that matmul again.

In a bf16 model the pre-norm and parallel blocks keep their norm outputs
and MLP activation in bf16 (layout.act_dtypes), written rounded by their
kernels and read as they are by the bf16 matmuls; so do the MoE layers'
gathered rows and expert activations. A residual add followed by a norm runs as one kernel
(residual_norm), bitwise the two."""
import weakref

import numpy as np

from .._native import kernels as K


def optional(group, name, l=None):
    """Layer l's tensor ``name`` (or the whole tensor), None where the model
    has none: biases without config.bias, a norm's mean without layernorm."""
    if name not in group:
        return None
    return group[name] if l is None else group[name][l]


def apply_norm(config, out, mean, rstd, inp, weight, bias):
    if config.norm == "rmsnorm":
        K.rmsnorm_forward(out, rstd, inp, weight, config.norm_eps)
    else:
        K.layernorm_forward(out, mean, rstd, inp, weight, bias, config.norm_eps)


def apply_residual_norm(config, residual, out, mean, rstd, inp1, inp2, weight, bias):
    """residual = inp1 + inp2 and the norm of it into out, in one pass: bitwise
    residual_forward, then apply_norm."""
    if config.norm == "rmsnorm":
        K.residual_rmsnorm_forward(residual, out, rstd, inp1, inp2, weight, config.norm_eps)
    else:
        K.residual_layernorm_forward(residual, out, mean, rstd, inp1, inp2, weight, bias,
                                     config.norm_eps)


def apply_norm_backward(config, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                        written=False):
    if config.norm == "rmsnorm":
        K.rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, written=written)
    else:
        K.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                             written=written)


def drop(x, site):
    """Dropout in place on x (B, T, C) with a site's (p, seed)."""
    p, seed = site
    if p:
        K.dropout_forward(x, x, p, seed)


def undrop(dout, dinp, site):
    """d(before a dropout at ``site`` (p, seed)) from ``dout`` = d(after),
    written into ``dinp``; without dropout there, dout itself."""
    p, seed = site
    if not p:
        return dout
    K.dropout_backward(dinp, dout, p, seed)
    return dinp


def _slot(tensor, l):
    """Layer l's slot of a per-layer activation: its own, or the one slot
    of those that recompute holds for one layer at a time."""
    return tensor[l if tensor.shape[0] > 1 else 0]


def _rows(buffer, rows, width):
    """The first rows * width floats of a gradient buffer, as (rows, width)."""
    return buffer.reshape(-1)[:rows * width].reshape(rows, width)


def _grouping(experts, E):
    """(offsets [E+1], positions [N, k]) of the routed rows grouped by expert,
    for int32 ``experts`` [N, k] (moe_permute)."""
    offsets = np.empty(E + 1, np.int32)
    positions = np.empty(experts.shape, np.int32)
    K.moe_permute(offsets, positions, experts, E)
    return offsets, positions


def _grouped_forward(weight):
    """The grouped matmul for an MoE layer's experts' weights as the model
    holds them (bf16, float32 or QuantizedExperts)."""
    if not isinstance(weight, np.ndarray):
        return _quantized_grouped
    return K.moe_grouped_forward_bf16 if weight.dtype == np.uint16 else K.moe_grouped_forward


def _quantized_grouped(out, inp, weight, offsets):
    weight(out, inp, offsets)


def _grouped_backward(weight):
    return K.moe_grouped_backward_bf16 if weight.dtype == np.uint16 else K.moe_grouped_backward


class LayerGrads:
    """Backward's activation gradients (layout.grad_act_specs) seen as one
    layer's tensors, each (B, T, width). Those that share a buffer are used
    one after another, as grad_act_specs lists them."""

    def __init__(self, config, d, B, T):
        c = config
        rope, qk_norm = c.position == "rope", c.qk_norm

        def view(buffer, width):
            return buffer.reshape(-1)[:B * T * width].reshape(B, T, width)

        self.residual = d.residual       # the residual stream's, carried through the layers
        self.ln = view(d.narrow, c.C)    # of a norm's output
        self.atty = view(d.narrow, c.attn_channels)
        self.fch_act = view(d.wide, c.FF)
        self.fch = view(d.fch, c.fc_channels)
        # a branch's projection output before its dropout
        self.attention_output = view(d.wide, c.C)
        self.mlp_output = view(d.fch, c.C)
        # qkv's, and on the way back to it, qkvr's and (with both qk_norm
        # and RoPE) that of the normed q, k between them
        self.qkvr = view(d.fch, c.qkv_channels) if rope or qk_norm else None
        self.qkvn = view(d.wide, c.qkv_channels)
        self.qkv = self.qkvr if rope and qk_norm else self.qkvn
        # an MoE layer's, per routed row and of the router's logits
        if c.moe_layers:
            self.expert_wide, self.expert_narrow = d.expert_wide, d.expert_narrow
            self.router = d.router


class EveryLayer:
    """Forward keeps every layer's norm outputs and MLP activation; backward reads them."""

    @staticmethod
    def fch(a, i, inp, dropout):
        """Dense MLP layer i's fch, which forward kept."""

    @staticmethod
    def norm(a, name, l, inp):
        return a[name][l]

    @staticmethod
    def mlp_act(a, i):
        return a.fch_act[i]

    @staticmethod
    def expert_act(a, m):
        return a.expert_act[m]


class Recomputed:
    """Forward keeps one layer's norm outputs and MLP activation (act_specs'
    recompute layout); backward recomputes each layer's into that slot, the
    same bits."""

    def __init__(self, block, fch=False):
        self.norm, self.mlp_act, self.expert_act = block.norm, block.mlp_act, block.expert_act
        self._block = block if fch else None

    def fch(self, a, i, inp, dropout):
        """Dense MLP layer i's fch, recomputed from the MLP's input ``inp``
        into its one-layer slot, or kept by forward (without recompute_fch)."""
        if self._block is not None:
            self._block.linear(_slot(a.fch, i), inp, "fc", i, dropout)


class Block:
    """What the three blocks share: their sublayers' kernels on a model's
    parameters, and its matmuls (fp32 or bf16, read from the model at each
    call)."""

    def __init__(self, model, recompute=False, recompute_fch=False):
        # weak: the model holds its block, and a cycle would keep a dropped
        # model's buffers until the garbage collector runs
        self.model = weakref.proxy(model)
        self.config = model.config
        self.act_forward, self.act_backward = K.MLP_ACTIVATIONS[model.config.mlp]
        self.recompute = recompute
        self.recompute_fch = recompute_fch
        self.saved = Recomputed(self, recompute_fch) if recompute else EveryLayer()
        c = model.config
        # layer l's index among the layers of its MLP's kind: the dense ones
        # (fcw, fch, ...) or the MoE ones (routerw, the experts, ...)
        self.mlp_index = {l: i for i, l in enumerate(c.dense_mlp_layers)}
        self.mlp_index |= {l: m for m, l in enumerate(c.moe_layers)}
        # each MoE layer's auxiliary losses of the last forward: (load balancing, z-loss),
        # and its balance loss's f_e over every rank's rows (model.balance_over), or None
        self.aux = np.zeros((c.num_moe_layers, 2), np.float32)
        self.fractions = [None] * c.num_moe_layers

    def output(self, a, l):
        """Layer l's output, the next layer's input."""
        return a.residual3[l]

    # ---- forward pieces ----------------------------------------------------

    def linear(self, out, inp, name, l, dropout):
        """out = inp W^T + b with layer l's weight ``name``w and bias
        ``name``b, plus its LoRA adapters' output (model.lora), if any."""
        m = self.model
        m._matmul_forward(out, inp, m._weights[name + "w"][l], optional(m.params, name + "b", l))
        if m.lora is not None:
            m.lora.forward(out, inp, name, l, dropout, m.kept_activations)

    def norm(self, a, name, l, inp):
        """Layer l's norm ``name`` ("ln1", "ln2") of ``inp``, into its slot
        (every layer's, or one held for each in turn; float32 or bf16,
        layout.act_dtypes)."""
        p = self.model.params
        out = _slot(a[name], l)
        apply_norm(self.config, out, optional(a, name + "_mean", l), a[name + "_rstd"][l],
                   inp, p[name + "w"][l], optional(p, name + "b", l))
        return out

    def residual_norm(self, a, name, l, residual, x, branch):
        """residual = x + branch (a.residual2[l] or residual3[l]), then layer
        l's norm ``name`` of it as norm() does, in one pass over the rows."""
        p = self.model.params
        out = _slot(a[name], l)
        apply_residual_norm(self.config, residual, out, optional(a, name + "_mean", l),
                            a[name + "_rstd"][l], x, branch, p[name + "w"][l],
                            optional(p, name + "b", l))
        return out

    def mlp_in(self, a, i, inp, dropout):
        """Dense MLP layer i's input projection fch = linear "fc" of ``inp``
        and its activation, into their slots; returns the activation. A bf16
        model's GELU (without adapters) runs in the GEMM's epilogue: the same
        bits, without reading fch back."""
        m = self.model
        if self.config.mlp == "gelu" and m.lora is None \
                and m._matmul_forward is K.matmul_forward_bf16:
            out = _slot(a.fch_act, i)
            K.matmul_gelu_forward_bf16(_slot(a.fch, i), out, inp, m._weights.fcw[i],
                                       optional(m.params, "fcb", i))
            return out
        self.linear(_slot(a.fch, i), inp, "fc", i, dropout)
        return self.mlp_act(a, i)

    def mlp_act(self, a, i):
        """Dense MLP layer i's activation of a.fch[i], into its fch_act slot."""
        out = _slot(a.fch_act, i)
        self.act_forward(out, _slot(a.fch, i))
        return out

    def expert_act(self, a, m):
        """MoE layer m's expert activation of a.expert_fch[m], into its expert_act slot."""
        out = _slot(a.expert_act, m)
        self.act_forward(out, a.expert_fch[m])
        return out

    def attention(self, a, l, inp, attend, dropout):
        """a.proj = layer l's attention on ``inp``, projected, after its dropout."""
        self.linear(a.qkv[l], inp, "qkv", l, dropout)
        attend(l)
        self.linear(a.proj, a.atty[l], "attproj", l, dropout)
        drop(a.proj, dropout.site("attention_output", l))

    def mlp(self, a, l, inp, dropout):
        """a.proj = layer l's MLP (dense or experts) on ``inp``, after its dropout."""
        if self.config.is_moe_layer(l):
            self.experts(a, l, inp)
        else:
            i = self.mlp_index[l]
            self.linear(a.proj, self.mlp_in(a, i, inp, dropout), "fcproj", i, dropout)
        drop(a.proj, dropout.site("mlp_output", l))

    def experts(self, a, l, inp):
        """a.proj = MoE layer l's experts on ``inp`` (B, T, C): the router's
        softmax and top k per token (a.router_probs, topk_index,
        topk_weight), the tokens gathered by expert (a.expert_in), each
        expert's MLP over its rows (a.expert_fch, expert_act, expert_out)
        and their outputs summed back per token by the router's weights;
        the layer's auxiliary losses into self.aux."""
        c, model = self.config, self.model
        m = self.mlp_index[l]
        w = model._weights
        N, k, E = inp.shape[0] * inp.shape[1], c.experts_per_token, c.num_experts
        # a quantized model keeps its routers float32 (with its other float32 tensors)
        router = (model.params if model.quantized else w).routerw[m]
        model._matmul_forward(a.router_logits[m], inp, router, None)
        experts = a.topk_index[m].view(np.int32).reshape(N, k)
        K.moe_route_forward(a.router_probs[m].reshape(N, E), a.topk_weight[m].reshape(N, k),
                            experts, self.aux[m], a.router_logits[m].reshape(N, E),
                            norm_topk_prob=c.norm_topk_prob)
        self.fractions[m] = None
        if model.balance_world is not None:
            self.balance_over_ranks(m, model.balance_world, experts, a.router_probs[m].reshape(N, E))
        offsets, positions = _grouping(experts, E)
        K.moe_gather_forward(a.expert_in, inp.reshape(N, c.C), positions)
        grouped = _grouped_forward(w.expertfcw[m])
        grouped(a.expert_fch[m], a.expert_in, w.expertfcw[m], offsets)
        grouped(a.expert_out[m], self.expert_act(a, m), w.expertprojw[m], offsets)
        K.moe_combine_forward(a.proj.reshape(N, c.C), a.expert_out[m],
                              a.topk_weight[m].reshape(N, k), positions)

    def balance_over_ranks(self, m, world, experts, probs):
        """MoE layer m's load-balancing loss over the rows of every rank of
        ``world``: each rank's row count, assignments per expert and summed
        router probabilities, added over ranks in rank order, give
        self.aux[m, 0] = E sum_e f_e P_e of all the rows and self.fractions[m]
        = f_e, which the backward uses in place of this rank's."""
        E, k = self.config.num_experts, self.config.experts_per_token
        mine = np.concatenate([[len(probs)], np.bincount(experts.ravel(), minlength=E),
                               probs.sum(axis=0, dtype=np.float64)])
        total = world.sum_arrays(mine)
        rows, counts, prob_sums = total[0], total[1:E + 1], total[E + 1:]
        self.fractions[m] = counts / (rows * k)
        self.aux[m, 0] = E * np.dot(self.fractions[m], prob_sums / rows)

    # ---- backward pieces ---------------------------------------------------

    def linear_backward(self, dinp, dout, inp, name, l, dropout, write_dinp=False):
        """Adds into d(inp) (None: not wanted; with ``write_dinp`` written,
        as into zeros) and layer l's weight and bias gradients (none for a
        frozen base: those products are skipped) and its adapters' from
        ``dout``."""
        m = self.model
        dweight, dbias = m.base_grad(name + "w", l), m.base_grad(name + "b", l)
        if dinp is not None or dweight is not None or dbias is not None:
            written = K.WRITE_DINP if write_dinp else 0
            if dweight is not None:
                written |= m.grad_written(name + "w", l)
            m._matmul_backward(dinp, dweight, dbias, dout, inp, m._weights[name + "w"][l],
                               written=written)
        if m.lora is not None:
            m.lora.backward(dinp, dout, inp, name, l, dropout)

    def input_gradient(self, l):
        """Whether backward needs d(layer l's input): not layer 0's under
        LoRA, whose frozen embedding takes no gradient (the first layer's
        input-gradient products and its ln1's backward are skipped)."""
        return l > 0 or self.model.lora is None

    def norm_backward(self, a, dinp, dout, inp, name, l, written=False):
        m = self.model
        apply_norm_backward(self.config, dinp, m.base_grad(name + "w", l),
                            m.base_grad(name + "b", l), dout, inp, m.params[name + "w"][l],
                            optional(a, name + "_mean", l), a[name + "_rstd"][l], written)

    def mlp_backward(self, a, d, l, dinp, dout, inp, dropout, write_dinp=False):
        """Adds d(layer l's MLP input ``inp``) into ``dinp`` (``write_dinp``:
        writes it, as into zeros) from ``dout`` = d(the MLP's output after
        its dropout), and into the MLP's gradients; dout is spent before dinp
        changes (they may be one buffer)."""
        dout = undrop(dout, d.mlp_output, dropout.site("mlp_output", l))
        if self.config.is_moe_layer(l):
            self.experts_backward(a, d, l, dinp, dout, inp, write_dinp)
            return
        i = self.mlp_index[l]
        self.saved.fch(a, i, inp, dropout)
        fch_act = self.saved.mlp_act(a, i)
        self.linear_backward(d.fch_act, dout, fch_act, "fcproj", i, dropout, write_dinp=True)
        self.act_backward(d.fch, d.fch_act, _slot(a.fch, i), written=True)
        self.linear_backward(dinp, d.fch, inp, "fc", i, dropout, write_dinp)

    def _expert_grad(self, name, m):
        """MoE layer m's gradient of the stack of experts ``name`` (None: it
        has none) and the written flag its weight-gradient product takes."""
        grad = self.model.base_grad(name, m)
        return grad, (self.model.grad_written(name, m) if grad is not None else 0)

    def experts_backward(self, a, d, l, dinp, dout, inp, write_dinp=False):
        """experts() backward: from ``dout`` (B, T, C), d(inp) added into
        ``dinp`` (``write_dinp``: written, as into zeros) through the experts
        and the router, whose logits' gradient also carries the auxiliary
        losses' (their coefficients times the model's loss_scale, averaged
        over the MoE layers). The grouping is
        computed again from topk_index, the gathered rows gathered again, the
        expert activations recomputed with recompute (kept otherwise)."""
        c, model = self.config, self.model
        m = self.mlp_index[l]
        w = model._weights
        N, k, E, C = inp.shape[0] * inp.shape[1], c.experts_per_token, c.num_experts, c.C
        R = N * k
        experts = a.topk_index[m].view(np.int32).reshape(N, k)
        weights = a.topk_weight[m].reshape(N, k)
        offsets, positions = _grouping(experts, E)
        K.moe_gather_forward(a.expert_in, inp.reshape(N, C), positions)
        expert_act = self.saved.expert_act(a, m)
        grouped = _grouped_backward(w.expertfcw)
        dexpert_out = _rows(d.expert_wide, R, C)
        dweights = np.empty((N, k), np.float32)
        K.moe_combine_backward(dexpert_out, dweights, dout.reshape(N, C), a.expert_out[m],
                               weights, positions)
        dact = _rows(d.expert_narrow, R, c.expert_hidden)
        dweight, written = self._expert_grad("expertprojw", m)
        grouped(dact, dweight, dexpert_out, expert_act, w.expertprojw[m], offsets,
                written=K.WRITE_DINP | written)
        dfch = _rows(d.expert_wide, R, c.expert_fc_channels)
        self.act_backward(dfch, dact, a.expert_fch[m], written=True)
        dgathered = _rows(d.expert_narrow, R, C)
        dweight, written = self._expert_grad("expertfcw", m)
        grouped(dgathered, dweight, dfch, a.expert_in, w.expertfcw[m], offsets,
                written=K.WRITE_DINP | written)
        K.moe_gather_backward(dinp.reshape(N, C), dgathered, positions, written=write_dinp)
        scale = model.loss_scale / c.num_moe_layers
        K.moe_route_backward(d.router.reshape(N, E), dweights, a.router_probs[m].reshape(N, E),
                             a.router_logits[m].reshape(N, E), experts, self.fractions[m],
                             norm_topk_prob=c.norm_topk_prob,
                             aux_coef=c.router_aux_loss * scale, z_coef=c.router_z_loss * scale,
                             written=True)
        model._matmul_backward(dinp, model.base_grad("routerw", m), None, d.router, inp,
                               w.routerw[m])

    def attention_backward(self, a, d, l, dout, dropout):
        """d.qkv = d(layer l's qkv) from ``dout`` = d(the attention
        projection's output after its dropout): back through attproj,
        attention (with its dropout), RoPE and qk_norm (model.position_qkv's
        steps, undone in reverse); adds into their gradients (the attention's
        own d(qkv) written, not added into)."""
        c, m = self.config, self.model
        p = m.params
        dout = undrop(dout, d.attention_output, dropout.site("attention_output", l))
        self.linear_backward(d.atty, dout, a.atty[l], "attproj", l, dropout, write_dinp=True)
        site = dropout.site("attention", l)
        rope, qk_norm = c.position == "rope", c.qk_norm
        if not (rope or qk_norm):
            m._attention_backward(d.qkv, d.atty, a.qkv[l], a.att_stats[l], m.slopes,
                                  c.NH, c.NKV, c.sliding_window, *site, written=True)
            return d.qkv
        # with both steps d.qkv is d.qkvr's buffer, used again once RoPE's backward has read it
        m._attention_backward(d.qkvr, d.atty, a.qkvr[l], a.att_stats[l], m.slopes,
                              c.NH, c.NKV, c.sliding_window, *site, written=True)
        dnormed = d.qkvr
        if rope:
            K.rope_backward(d.qkvn, d.qkvr, None, c.NH, c.NKV, c.rope_theta, m.rope_inv_freq,
                            c.rope_interleaved, written=True)
            dnormed = d.qkvn
        if qk_norm:
            K.head_rmsnorm_backward(d.qkv, m.base_grad("qnormw", l), m.base_grad("knormw", l),
                                    dnormed, a.qkv[l], p.qnormw[l], p.knormw[l], a.qk_rstd[l],
                                    c.NH, c.NKV, written=True)
        return d.qkv


class PreNorm(Block):
    """GPT-2's and Llama's block, kernel by kernel as llm.c's gpt2_forward
    runs it (the other two blocks say it by sublayer)."""

    def forward(self, a, l, x, attend, dropout):
        ln1 = self.norm(a, "ln1", l, x)
        self.linear(a.qkv[l], ln1, "qkv", l, dropout)
        attend(l)
        self.linear(a.proj, a.atty[l], "attproj", l, dropout)
        drop(a.proj, dropout.site("attention_output", l))
        ln2 = self.residual_norm(a, "ln2", l, a.residual2[l], x, a.proj)
        if self.config.is_moe_layer(l):
            self.experts(a, l, ln2)
        else:
            i = self.mlp_index[l]
            self.linear(a.proj, self.mlp_in(a, i, ln2, dropout), "fcproj", i, dropout)
        drop(a.proj, dropout.site("mlp_output", l))
        K.residual_forward(a.residual3[l], a.residual2[l], a.proj)
        return a.residual3[l]

    def backward(self, a, d, l, x, dropout):
        ln1 = self.saved.norm(a, "ln1", l, x)
        ln2 = self.saved.norm(a, "ln2", l, a.residual2[l])
        self.mlp_backward(a, d, l, d.ln, d.residual, ln2, dropout, write_dinp=True)
        self.norm_backward(a, d.residual, d.ln, a.residual2[l], "ln2", l)
        # now d(residual2[l])
        dqkv = self.attention_backward(a, d, l, d.residual, dropout)
        if not self.input_gradient(l):
            self.linear_backward(None, dqkv, ln1, "qkv", l, dropout)
            return
        # d.ln written over d.atty, in the same buffer and spent
        self.linear_backward(d.ln, dqkv, ln1, "qkv", l, dropout, write_dinp=True)
        self.norm_backward(a, d.residual, d.ln, x, "ln1", l)


class Parallel(Block):
    """GPT-J's and Falcon-7B's block: attention and the MLP side by side on ln1(x)."""

    def forward(self, a, l, x, attend, dropout):
        ln1 = self.norm(a, "ln1", l, x)
        self.attention(a, l, ln1, attend, dropout)
        K.residual_forward(a.residual2[l], x, a.proj)
        self.mlp(a, l, ln1, dropout)
        K.residual_forward(a.residual3[l], a.residual2[l], a.proj)
        return a.residual3[l]

    def backward(self, a, d, l, x, dropout):
        ln1 = self.saved.norm(a, "ln1", l, x)
        # d.residual = d(residual3[l]) = d(residual2[l]): both branches' output's
        dqkv = self.attention_backward(a, d, l, d.residual, dropout)
        # d.ln written over d.atty, in the same buffer and spent
        self.linear_backward(d.ln, dqkv, ln1, "qkv", l, dropout, write_dinp=True)
        self.mlp_backward(a, d, l, d.ln, d.residual, ln1, dropout)
        self.norm_backward(a, d.residual, d.ln, x, "ln1", l)


class PostNorm(Block):
    """The original Transformer's block: each norm after its residual add;
    ln2 is the layer's output (kept for every layer, also with recompute)."""

    def forward(self, a, l, x, attend, dropout):
        self.attention(a, l, x, attend, dropout)
        ln1 = self.residual_norm(a, "ln1", l, a.residual2[l], x, a.proj)
        self.mlp(a, l, ln1, dropout)
        return self.residual_norm(a, "ln2", l, a.residual3[l], ln1, a.proj)

    def output(self, a, l):
        return a.ln2[l]

    def backward(self, a, d, l, x, dropout):
        ln1 = self.saved.norm(a, "ln1", l, a.residual2[l])
        self.norm_backward(a, d.ln, d.residual, a.residual3[l], "ln2", l, written=True)
        # now d(residual3[l]); the MLP's input gradient adds into it
        self.mlp_backward(a, d, l, d.ln, d.ln, ln1, dropout)
        # now d(ln1[l])
        self.norm_backward(a, d.residual, d.ln, a.residual2[l], "ln1", l, written=True)
        # now d(residual2[l]); attention's input gradient adds into it
        dqkv = self.attention_backward(a, d, l, d.residual, dropout)
        self.linear_backward(d.residual if self.input_gradient(l) else None, dqkv, x, "qkv", l,
                             dropout)


BLOCKS = {"pre": PreNorm, "parallel": Parallel, "post": PostNorm}
