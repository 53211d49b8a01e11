"""A PyTorch reference for the whole model family (float64), assembled from
the per-kernel references in reference.py: the model the C model is checked
against. GPT-2 is the config with GPT-2's choices. Parameters are a dict of
tensors named and shaped as in llmc_py.model.layout.param_specs.

precision="bf16" is the mixed precision of llmc_py's bf16 models: every
linear layer multiplies bf16-rounded operands (its input and weight forward,
its output gradient and weight or input backward) and sums exactly (float64
here), and so do attention's products (reference.attention_gqa_bf16);
everything else stays float64."""
import math

import numpy as np
import torch

import reference as R
from llmc_py import kernels as K
from llmc_py.model.layout import param_specs


def torch_params(flat, config, dtype=torch.float64):
    """Leaf tensors (requires_grad) named as in param_specs, from a flat array."""
    out, offset = {}, 0
    for name, fn in param_specs(config):
        shape = fn(config)
        count = math.prod(shape)
        chunk = np.asarray(flat[offset:offset + count], dtype=np.float64).reshape(shape)
        out[name] = torch.tensor(chunk, dtype=dtype, requires_grad=True)
        offset += count
    return out


def flat_grads(params):
    """Every gradient, flattened in param_specs order (float64 numpy); the
    dict keeps that order."""
    return np.concatenate([p.grad.detach().numpy().reshape(-1) for p in params.values()])


def alibi_slopes(n_heads):
    """The ALiBi paper's head slopes: a geometric sequence from 2^(-8/n) for
    n a power of two; otherwise that of the nearest lower power of two m,
    then every other slope of the sequence for 2m."""
    def geometric(n):
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    m = 2 ** int(math.floor(math.log2(n_heads)))
    return torch.tensor(geometric(m) + geometric(2 * m)[0::2][:n_heads - m],
                        dtype=torch.float64)


def round_bf16(x):
    """x (float64) rounded to the nearest bf16 via float32, ties to even: the
    rounding our float32 values get, up to the float32 step itself."""
    return x.to(torch.float32).to(torch.bfloat16).to(x.dtype)


class Bf16Linear(torch.autograd.Function):
    """x [B,T,C] . weight^T (+ bias) with x and weight rounded to bf16; the
    backward rounds dout to bf16 for dx and dweight (not for dbias)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        xr, wr = round_bf16(x), round_bf16(weight)
        ctx.save_for_backward(xr, wr)
        ctx.has_bias = bias is not None
        return R.matmul(xr, wr, bias)

    @staticmethod
    def backward(ctx, dout):
        xr, wr = ctx.saved_tensors
        dr = round_bf16(dout)
        dx = dr @ wr
        dweight = dr.reshape(-1, dr.shape[-1]).T @ xr.reshape(-1, xr.shape[-1])
        dbias = dout.reshape(-1, dout.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dweight, dbias


def bf16_matmul(x, weight, bias=None):
    return Bf16Linear.apply(x, weight, bias)


def norm(x, weight, bias, config):
    if config.norm == "rmsnorm":
        return R.rmsnorm(x, weight, config.norm_eps)[0]
    return R.layernorm(x, weight, bias, config.norm_eps)[0]


def dropout_masks(dropout, config, B, T):
    """masks(site, layer) for forward: the masks our kernels draw for a
    model.dropout.Dropout (materialised by dropout_forward on ones: 0 or
    1 / (1 - p)), float64, [B, T, C] or [B, NH, T, T] (the attention's); None
    where the site does not drop. The reference then drops what we drop."""
    def masks(site, layer=0):
        p, seed = dropout.site(site, layer)
        if not p:
            return None
        attention = site == "attention"
        ones = np.ones((B, config.num_heads * T, T) if attention else (B, T, config.channels),
                       np.float32)
        K.dropout_forward(ones, ones, p, seed)
        mask = torch.tensor(ones, dtype=torch.float64)
        return mask.reshape(B, config.num_heads, T, T) if attention else mask
    return masks


def forward(p, config, inputs, targets=None, precision="fp32", trace=None, masks=None):
    """(logits (B, T, Vp), mean loss or None) for int token arrays (B, T); with
    experts the loss adds the auxiliary losses times their coefficients.
    A dict ``trace`` receives "hidden": the residual stream after the
    embedding and after each block, and "att": each layer's attention
    probabilities [B, NH, T, T]. ``masks`` (dropout_masks) drops the
    embedding's output, the attention probabilities and each branch's
    output, as a training pass with dropout does."""
    c = config
    matmul = bf16_matmul if precision == "bf16" else R.matmul
    attention_gqa = R.attention_gqa_bf16 if precision == "bf16" else R.attention_gqa
    inputs = torch.as_tensor(np.asarray(inputs, dtype=np.int64))
    slopes = alibi_slopes(c.num_heads) if c.position == "alibi" else None

    def param(name, l=None):
        if name not in p:
            return None
        return p[name] if l is None else p[name][l]

    def mask(site, l=0):
        return None if masks is None else masks(site, l)

    def dropped(x, site, l=0):
        m = mask(site, l)
        return x if m is None else R.dropout(x, m)

    aux = []   # each MoE layer's (load balancing, z-loss)

    def experts(h, m):
        """MoE layer m on h (B, T, C): route, each expert's MLP over its
        tokens (in the grouped order), the weighted sum back."""
        k, E = c.experts_per_token, c.num_experts
        x = h.reshape(-1, c.channels)
        _, chosen, weights, balance, z = R.moe_route(matmul(x, p["routerw"][m]), k,
                                                     c.norm_topk_prob)
        aux.append((balance, z))
        offsets, positions = R.moe_positions(chosen, E)
        grouped = x[torch.argsort(positions.reshape(-1)) // k]
        bounds = offsets.tolist()
        out = []
        for e in range(E):
            rows = grouped[bounds[e]:bounds[e + 1]]
            act = R.MLP_ACTIVATIONS[c.mlp](matmul(rows, p["expertfcw"][m, e]))
            out.append(matmul(act, p["expertprojw"][m, e]))
        return R.moe_combine(torch.cat(out), weights, positions).reshape(h.shape)

    x = R.encoder(p["wte"], param("wpe"), inputs)
    if c.position == "sinusoidal":
        x = x + R.sinusoidal(torch.zeros(inputs.shape[0], dtype=torch.long), inputs.shape[1],
                             c.channels)
    x = dropped(x, "embedding")
    if trace is not None:
        trace["hidden"], trace["att"] = [x], []
    for l in range(c.num_layers):
        def attention(h):
            qkv = matmul(h, param("qkvw", l), param("qkvb", l))
            if c.qk_norm:
                qkv = R.head_rmsnorm(qkv, param("qnormw", l), param("knormw", l), c.num_heads,
                                     c.num_kv_heads, c.norm_eps)[0]
            if c.position == "rope":
                qkv = R.rope(qkv, None, c.num_heads, c.num_kv_heads, c.rope_theta,
                             c.rope_inv_freq(), c.rope_interleaved)
            h, att = attention_gqa(qkv, c.num_heads, c.num_kv_heads, slopes,
                                   c.sliding_window, mask("attention", l))
            h = matmul(h, param("attprojw", l), param("attprojb", l))
            return dropped(h, "attention_output", l), att

        def mlp(h):
            if c.is_moe_layer(l):
                return dropped(experts(h, c.moe_layers.index(l)), "mlp_output", l)
            i = c.dense_mlp_layers.index(l)
            h = R.MLP_ACTIVATIONS[c.mlp](matmul(h, param("fcw", i), param("fcb", i)))
            return dropped(matmul(h, param("fcprojw", i), param("fcprojb", i)), "mlp_output", l)

        def norm1(h):
            return norm(h, param("ln1w", l), param("ln1b", l), c)

        def norm2(h):
            return norm(h, param("ln2w", l), param("ln2b", l), c)

        if c.block == "pre":         # x + f(norm(x))
            h, att = attention(norm1(x))
            x = R.residual(x, h)
            x = R.residual(x, mlp(norm2(x)))
        elif c.block == "post":      # norm(x + f(x))
            h, att = attention(x)
            x = norm1(R.residual(x, h))
            x = norm2(R.residual(x, mlp(x)))
        else:                        # parallel: x + attn(n) + mlp(n), n = norm1(x)
            n = norm1(x)
            h, att = attention(n)
            x = R.residual(R.residual(x, h), mlp(n))
        if trace is not None:
            trace["hidden"].append(x)
            trace["att"].append(att)
    x = norm(x, p["lnfw"], param("lnfb"), c)
    logits = matmul(x, p["wte"] if c.tied_embeddings else p["lm_head"])
    if targets is None:
        return logits, None
    targets = torch.as_tensor(np.asarray(targets, dtype=np.int64))
    losses = R.crossentropy(R.softmax(logits, c.vocab_size), targets)
    # the mean over the targets that count; with none, 0 (and no gradient)
    counted = int((targets != R.IGNORE_INDEX).sum())
    loss = losses.sum() / counted if counted else losses.sum()
    if aux:   # the auxiliary losses, each averaged over the MoE layers
        loss = loss + (c.router_aux_loss * sum(b for b, _ in aux)
                       + c.router_z_loss * sum(z for _, z in aux)) / len(aux)
    return logits, loss


class AdamW:
    """reference.adamw_step over a dict of tensors, decay on every parameter
    (llm.c's gpt2_update)."""

    def __init__(self, params, lr, beta1, beta2, eps, weight_decay):
        self.params = params
        self.settings = (lr, beta1, beta2, eps, weight_decay)
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}

    @torch.no_grad()
    def step(self, t):
        for name, p in self.params.items():
            new, self.m[name], self.v[name] = R.adamw_step(p, p.grad, self.m[name],
                                                           self.v[name], *self.settings, t)
            p.copy_(new)
            p.grad = None
