"""A PyTorch decoder of the Llama family over llmc_py-layout parameters,
written out from the math (float64): the reference llmc_py.Llama is checked
against. Parameters are a dict of tensors named and shaped as in
llmc_py.model.layout.param_specs; the config is a LlamaConfig."""
import math

import numpy as np
import torch
import torch.nn.functional as F

import gpt2_reference
from llmc_py.model.layout import param_specs


def torch_params(flat, config, dtype=torch.float64):
    """Leaf tensors (requires_grad) named as in param_specs, from a flat array."""
    return gpt2_reference.torch_params(flat, config, dtype, specs=param_specs(config))


def rmsnorm(x, weight, eps):
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def norm(p, name, x, config):
    """The config's norm with parameters ``name``w / ``name``b."""
    if config.norm == "rmsnorm":
        return rmsnorm(x, p[name + "w"], config.norm_eps)
    return F.layer_norm(x, (config.channels,), p[name + "w"], p[name + "b"], config.norm_eps)


def rope(x, theta, start=0):
    """Hugging Face Llama's rotary embedding on (B, heads, T, hs): channel i
    pairs with i + hs/2 ("rotate half"); position start + t."""
    T, hs = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    angles = torch.outer(torch.arange(start, start + T, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)            # (T, hs)
    rotated = torch.cat((-x[..., hs // 2:], x[..., :hs // 2]), dim=-1)
    return x * torch.cos(angles) + rotated * torch.sin(angles)


def alibi_slopes(n_heads):
    """The ALiBi paper's head slopes: a geometric sequence from 2^(-8/n) for
    n a power of two; otherwise that of the nearest lower power of two m,
    then every other slope of the sequence for 2m."""
    def geometric(n):
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    m = 2 ** int(math.floor(math.log2(n_heads)))
    return torch.tensor(geometric(m) + geometric(2 * m)[0::2][:n_heads - m],
                        dtype=torch.float64)


def attention(qkv, config):
    """Causal grouped-query attention over packed rows (q heads, k heads, v
    heads), with the config's RoPE or ALiBi; (B, T, C)."""
    c = config
    B, T, _ = qkv.shape
    hs, NH, NKV = c.head_size, c.num_heads, c.num_kv_heads
    q, k, v = qkv.split([NH * hs, NKV * hs, NKV * hs], dim=-1)
    q = q.view(B, T, NH, hs).transpose(1, 2)
    k = k.view(B, T, NKV, hs).transpose(1, 2)
    v = v.view(B, T, NKV, hs).transpose(1, 2)
    if c.position == "rope":
        q, k = rope(q, c.rope_theta), rope(k, c.rope_theta)
    k = k.repeat_interleave(NH // NKV, dim=1)   # query head h reads kv head h // (NH/NKV)
    v = v.repeat_interleave(NH // NKV, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)
    if c.position == "alibi":
        t = torch.arange(T, dtype=torch.float64)
        distance = t[:, None] - t[None, :]                  # t - t2
        scores = scores - alibi_slopes(NH)[:, None, None] * distance
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    att = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return (att @ v).transpose(1, 2).reshape(B, T, NH * hs)


def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def linear(p, name, x, l):
    """x W^T (+ b when the model has biases) with layer l's weight ``name``w."""
    y = x @ p[name + "w"][l].T
    return y + p[name + "b"][l] if name + "b" in p else y


def forward(p, config, inputs, targets=None):
    """(logits (B, T, Vp), mean loss or None) for int token arrays (B, T)."""
    c = config
    inputs = torch.as_tensor(np.asarray(inputs, dtype=np.int64))
    T = inputs.shape[1]
    x = p["wte"][inputs]
    if c.position == "learned":
        x = x + p["wpe"][:T]
    for l in range(c.num_layers):
        h = norm({k: v[l] for k, v in p.items() if k.startswith("ln1")}, "ln1", x, c)
        x = x + linear(p, "attproj", attention(linear(p, "qkv", h, l), c), l)
        h = norm({k: v[l] for k, v in p.items() if k.startswith("ln2")}, "ln2", x, c)
        h = linear(p, "fc", h, l)
        if c.mlp == "swiglu":
            gate, up = h.split(c.ffn_hidden, dim=-1)
            h = F.silu(gate) * up
        else:
            h = gelu(h)
        x = x + linear(p, "fcproj", h, l)
    x = norm(p, "lnf", x, c)
    logits = x @ (p["wte"] if c.tied_embeddings else p["lm_head"]).T
    if targets is None:
        return logits, None
    targets = torch.as_tensor(np.asarray(targets, dtype=np.int64))
    V = c.vocab_size
    loss = F.cross_entropy(logits[..., :V].reshape(-1, V), targets.reshape(-1))
    return logits, loss
