"""Float64 PyTorch references for the C kernels, one plain function per kernel
family, written from the math (not from llm.c). Each takes and returns torch
tensors, so autograd gives the backward pass the kernels are checked against.
Shapes use the letters of csrc/llmc_api.h."""
import math

import torch

LN_EPS = 1e-5
ROPE_THETA = 10000.0
GELU_SCALE = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715


def encoder(wte, wpe, inp):
    """out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]; inp a long tensor [B,T].
    wpe None: no position embedding."""
    T = inp.shape[1]
    return wte[inp] if wpe is None else wte[inp] + wpe[:T]


def sinusoidal(pos, T, C):
    """The original Transformer's positions [B, T, C] at pos[b] + t (pos a
    long tensor [B]): sin(p w_i) in channel 2i, cos(p w_i) in 2i + 1,
    w_i = 10000^(-2i/C)."""
    p = (pos[:, None] + torch.arange(T))[..., None].to(torch.float64)   # [B, T, 1]
    i = torch.arange(C)
    angle = p * 10000.0 ** (-(i - i % 2).to(torch.float64) / C)
    return torch.where(i % 2 == 0, torch.sin(angle), torch.cos(angle))


def layernorm(x, weight, bias, eps=LN_EPS):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis, with the
    biased variance. Returns out, mean [B,T] and rstd [B,T]."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    rstd = 1.0 / torch.sqrt(var + eps)
    return (x - mean) * rstd * weight + bias, mean.squeeze(-1), rstd.squeeze(-1)


def rmsnorm(x, weight, eps=LN_EPS):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (no mean removed,
    no bias). Returns out and rstd [B,T]."""
    rstd = 1.0 / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return x * rstd * weight, rstd.squeeze(-1)


def head_rmsnorm(x, qweight, kweight, NH, NKV, eps=LN_EPS):
    """RMSNorm of each q head (qweight [hs]) and k head (kweight [hs]) of
    packed rows x [B,T,(NH+2NKV)hs], v heads unchanged (Qwen3's q_norm and
    k_norm). Returns out and rstd [B,T,NH+NKV]."""
    B, T, CH = x.shape
    hs = CH // (NH + 2 * NKV)
    heads = x.reshape(B, T, NH + 2 * NKV, hs)
    q, rq = rmsnorm(heads[:, :, :NH], qweight, eps)
    k, rk = rmsnorm(heads[:, :, NH:NH + NKV], kweight, eps)
    out = torch.cat([q, k, heads[:, :, NH + NKV:]], dim=2).reshape(B, T, CH)
    return out, torch.cat([rq, rk], dim=2)


def matmul(x, weight, bias=None):
    """x [B,T,C] @ weight^T with weight stored [OC,C], plus bias [OC] if given."""
    out = x @ weight.T
    return out if bias is None else out + bias


def _softmax_last(scores):
    # softmax is shift-invariant, so the max is only a constant: detach it
    e = torch.exp(scores - scores.amax(-1, keepdim=True).detach())
    return e / e.sum(-1, keepdim=True)


def rope(x, pos, NH, NKV, theta=ROPE_THETA, inv_freq=None, interleaved=False):
    """Rotary embedding of packed rows x [B,T,(NH+2NKV)hs]: the NH q and NKV k
    heads turn, the NKV v heads stay. Half-split pairs: channel i of a head
    pairs with channel i + hs/2, turned by the angle p * theta^(-2i/hs) at
    position p = pos[b] + t (pos a long tensor [B], or None for all 0), or by
    p * inv_freq[i] when given (a scaled RoPE's frequencies):
      (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
    ``interleaved`` (Meta's original): channels 2i and 2i + 1 are the real and
    imaginary parts of a complex number, multiplied by exp(i angle)."""
    B, T, CH = x.shape
    hs = CH // (NH + 2 * NKV)
    half = hs // 2
    start = torch.zeros(B, dtype=torch.float64) if pos is None else pos.to(torch.float64)
    p = start[:, None] + torch.arange(T, dtype=torch.float64)                 # [B, T]
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / hs) \
        if inv_freq is None else torch.as_tensor(inv_freq, dtype=torch.float64)  # [half]
    angle = p[:, :, None, None] * freq                                        # [B, T, 1, half]
    cos, sin = torch.cos(angle), torch.sin(angle)
    nrot = (NH + NKV) * hs
    qk = x[..., :nrot].reshape(B, T, NH + NKV, hs)
    if interleaved:
        pairs = torch.view_as_complex(qk.to(torch.float64).reshape(B, T, NH + NKV, half, 2)
                                      .contiguous())
        turned = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle))
        return torch.cat([turned.reshape(B, T, nrot).to(x.dtype), x[..., nrot:]], dim=-1)
    x1, x2 = qk[..., :half], qk[..., half:]
    turned = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([turned.reshape(B, T, nrot), x[..., nrot:]], dim=-1)


def attention_gqa(qkv, NH, NKV, slopes=None, window=0, mask=None):
    """Causal grouped-query attention over packed rows [B,T,(NH+2*NKV)*hs]: NH q
    heads, then NKV k heads, then NKV v heads. Each kv head serves NH // NKV
    consecutive query heads (repeat_interleave). With slopes [NH], the ALiBi
    bias -slopes[h] * (t - t2) is added to the scores before the softmax.
    A window > 0 masks keys t2 <= t - window too (Mistral's sliding window).
    With a dropout mask [B,NH,T,T], the probabilities are dropout(att, mask)
    where they weigh the values.

    Returns out [B,T,NH*hs] and att [B,NH,T,T] (before any dropout), exactly
    0 where masked."""
    B, T, width = qkv.shape
    hs = width // (NH + 2 * NKV)
    scores, v = _attention_scores(qkv, NH, NKV, slopes, window)
    att = _softmax_last(scores)
    weights = att if mask is None else dropout(att, mask)
    out = (weights @ v).transpose(1, 2).reshape(B, T, NH * hs)
    return out, att


def attention_gqa_bf16(qkv, NH, NKV, slopes=None, window=0, mask=None):
    """attention_gqa_forward_bf16 and _backward_bf16 (bf16 models): attention_gqa
    with q, k, v and the (dropped) probabilities rounded to bf16 where its
    products read them, and a gradient by hand that rounds every product's
    operands too (dout, dS, P), the softmax's backward exact. Returns out
    [B,T,NH*hs] (differentiable in qkv) and att [B,NH,T,T] (not)."""
    return _Bf16Attention.apply(qkv, NH, NKV, slopes, window, mask)


class _Bf16Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, NH, NKV, slopes, window, mask):
        B, T, width = qkv.shape
        hs = width // (NH + 2 * NKV)
        rounded = _round_bf16(qkv)
        scores, v = _attention_scores(rounded, NH, NKV, slopes, window)
        att = _softmax_last(scores)
        weights = att if mask is None else dropout(att, mask)
        out = (_round_bf16(weights) @ v).transpose(1, 2).reshape(B, T, NH * hs)
        ctx.save_for_backward(rounded, att, v, mask)
        ctx.heads = NH, NKV
        ctx.mark_non_differentiable(att)
        return out, att

    @staticmethod
    def backward(ctx, dout, _):
        rounded, att, v, mask = ctx.saved_tensors
        NH, NKV = ctx.heads
        B, T, width = rounded.shape
        hs = width // (NH + 2 * NKV)
        q, k, _ = rounded.split([NH * hs, NKV * hs, NKV * hs], dim=-1)
        q = q.reshape(B, T, NH, hs).transpose(1, 2)
        k = k.reshape(B, T, NKV, hs).transpose(1, 2).repeat_interleave(NH // NKV, dim=1)
        do = _round_bf16(dout).reshape(B, T, NH, hs).transpose(1, 2)
        datt = do @ v.transpose(-2, -1)
        weights = att
        if mask is not None:
            datt, weights = dropout(datt, mask), dropout(att, mask)
        ds = _round_bf16(att * (datt - (att * datt).sum(-1, keepdim=True)) / math.sqrt(hs))
        dq, dk, dv = ds @ k, ds.transpose(-2, -1) @ q, _round_bf16(weights).transpose(-2, -1) @ do
        group = lambda x: x.reshape(B, NKV, NH // NKV, T, hs).sum(2)   # noqa: E731
        heads = lambda x, n: x.transpose(1, 2).reshape(B, T, n * hs)   # noqa: E731
        dqkv = torch.cat([heads(dq, NH), heads(group(dk), NKV), heads(group(dv), NKV)], dim=-1)
        return dqkv, None, None, None, None, None


def _round_bf16(x):
    """x rounded to bf16 via float32, ties to even (a float64 tensor)."""
    return x.to(torch.float32).to(torch.bfloat16).to(x.dtype)


def attention_gqa_stats(qkv, NH, NKV, slopes=None, window=0):
    """The softmax statistics of attention_gqa's rows, [B,NH,T,2]: [0] the max
    of the row's scores (over its unmasked keys), [1] 1 / sum_t2 exp(score - max)."""
    scores, _ = _attention_scores(qkv, NH, NKV, slopes, window)
    maxval = scores.max(dim=-1, keepdim=True).values
    inv = 1.0 / torch.exp(scores - maxval).sum(dim=-1, keepdim=True)
    return torch.cat([maxval, inv], dim=-1)


def attention_entropy(att):
    """-sum_t2 att ln att over the last axis (natural log; 0 ln 0 = 0): the
    entropy of each row of attention probabilities [B,NH,T,T]."""
    return -torch.special.xlogy(att, att).sum(dim=-1)


def _attention_scores(qkv, NH, NKV, slopes, window=0):
    """attention_gqa's scores [B,NH,T,T] (-inf above the diagonal and, with a
    window, at t2 <= t - window) and its v heads repeated for the query heads
    [B,NH,T,hs]."""
    B, T, width = qkv.shape
    hs = width // (NH + 2 * NKV)
    q, k, v = qkv.split([NH * hs, NKV * hs, NKV * hs], dim=-1)
    q = q.reshape(B, T, NH, hs).transpose(1, 2)
    k, v = (x.reshape(B, T, NKV, hs).transpose(1, 2).repeat_interleave(NH // NKV, dim=1)
            for x in (k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)
    if slopes is not None:
        pos = torch.arange(T, dtype=torch.float64)
        distance = pos[:, None] - pos[None, :]          # t - t2
        scores = scores - slopes.reshape(NH, 1, 1) * distance
    masked = torch.ones(T, T, dtype=torch.bool).triu(1)
    if window:
        masked |= torch.ones(T, T, dtype=torch.bool).tril(-window)
    return scores.masked_fill(masked, float("-inf")), v


def gelu(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the tanh approximation."""
    return 0.5 * x * (1.0 + torch.tanh(GELU_SCALE * (x + GELU_CUBIC * x ** 3)))


def swiglu(x):
    """silu(gate) * up with silu(g) = g / (1 + exp(-g)), for rows x [..., 2FF]
    holding the gate in the first FF columns and up in the last FF."""
    gate, up = x.chunk(2, dim=-1)
    return gate / (1.0 + torch.exp(-gate)) * up


def gelu_erf(x):
    """x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), the exact GELU; as erfc(-x / sqrt 2),
    which keeps the left tail (1 + erf cancels there, even in float64)."""
    return 0.5 * x * torch.erfc(-x / math.sqrt(2.0))


def relu(x):
    return torch.relu(x)


def geglu(x):
    """gelu(gate) * up (the tanh GELU), rows [..., 2FF] as in swiglu."""
    gate, up = x.chunk(2, dim=-1)
    return gelu(gate) * up


def reglu(x):
    """relu(gate) * up, rows [..., 2FF] as in swiglu."""
    gate, up = x.chunk(2, dim=-1)
    return torch.relu(gate) * up


# the MLP activations by config.mlp
MLP_ACTIVATIONS = {"gelu": gelu, "swiglu": swiglu, "relu": relu, "gelu_erf": gelu_erf,
                   "geglu": geglu, "reglu": reglu}


def dropout(x, mask):
    """Inverted dropout with a given mask: x * mask, where mask holds 0 (a
    dropped element) or 1 / (1 - p) (a kept one), as PyTorch's dropout
    multiplies by its own mask."""
    return x * mask


def residual(a, b):
    return a + b


def softmax(logits, V):
    """Softmax over the first V of the Vp columns; the padding columns are 0."""
    p = _softmax_last(logits[..., :V])
    pad = torch.zeros(*logits.shape[:-1], logits.shape[-1] - V, dtype=logits.dtype)
    return torch.cat([p, pad], dim=-1)


IGNORE_INDEX = -1   # a target that adds no loss (the kernels' LLMC_IGNORE_INDEX)


def crossentropy(probs, targets):
    """losses[b,t] = -log probs[b,t,targets[b,t]], 0 where the target is
    IGNORE_INDEX; targets a long tensor [B,T]."""
    kept = targets != IGNORE_INDEX
    picked = probs.gather(-1, torch.where(kept, targets, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(kept, -torch.log(picked), torch.zeros_like(picked))


def adamw_step(param, grad, m, v, learning_rate, beta1, beta2, eps, weight_decay, t):
    """One AdamW step as llm.c's gpt2_update; returns new (param, m, v).

    m = beta1 m + (1-beta1) g;  v = beta2 v + (1-beta2) g^2
    mhat = m / (1-beta1^t);     vhat = v / (1-beta2^t)
    param -= learning_rate * (mhat / (sqrt(vhat) + eps) + weight_decay * param)"""
    m = beta1 * m + (1.0 - beta1) * grad
    v = beta2 * v + (1.0 - beta2) * grad * grad
    mhat = m / (1.0 - beta1 ** t)
    vhat = v / (1.0 - beta2 ** t)
    param = param - learning_rate * (mhat / (torch.sqrt(vhat) + eps) + weight_decay * param)
    return param, m, v


def moe_route(logits, k, norm_topk_prob=True):
    """The router over logits [N,E]: probs [N,E] (softmax), experts [N,k] (the
    k largest probabilities, largest first, ties to the lower index: a stable
    descending sort), weights [N,k] (their probabilities, divided by their sum
    when norm_topk_prob), and the auxiliary losses: load balancing
    E sum_e f_e P_e (f_e = assignments to e / (N k), no gradient; P_e the
    mean probability of e) and the z-loss mean_n logsumexp(logits[n])^2."""
    N, E = logits.shape
    probs = torch.softmax(logits, dim=-1)
    experts = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    top = probs.gather(1, experts)
    weights = top / top.sum(-1, keepdim=True) if norm_topk_prob else top
    f = torch.bincount(experts.reshape(-1), minlength=E).to(probs.dtype) / (N * k)
    balance = E * (f * probs.mean(0)).sum()
    z = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    return probs, experts, weights, balance, z


def moe_positions(experts, E):
    """offsets [E+1] and positions [N,k] of the expert-grouped order: each
    expert's assignments together (expert 0 first), tokens ascending within."""
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices   # the assignment in each grouped row
    positions = torch.empty_like(flat)
    positions[order] = torch.arange(flat.numel())
    counts = torch.bincount(flat, minlength=E)
    offsets = torch.cat([torch.zeros(1, dtype=counts.dtype), torch.cumsum(counts, 0)])
    return offsets, positions.reshape(experts.shape)


def moe_grouped(x, weight, offsets):
    """Each expert's linear layer over its rows: rows offsets[e] .. offsets[e+1]
    of x [R,C] times weight[e]^T (weight [E,OC,C])."""
    rows = [x[offsets[e]:offsets[e + 1]] @ weight[e].T for e in range(weight.shape[0])]
    return torch.cat(rows, dim=0)


def moe_combine(expert_out, weights, positions):
    """out[n] = sum_j weights[n,j] expert_out[positions[n,j]]."""
    return (weights.unsqueeze(-1) * expert_out[positions]).sum(1)
