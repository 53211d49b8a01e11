"""A PyTorch GPT-2 over llm.c-layout parameters, written out from the math:
the reference the whole model is checked against. Parameters are a dict of
tensors named and shaped as in llmc_py.model.layout.PARAM_SPECS."""
import math

import numpy as np
import torch
import torch.nn.functional as F

from llmc_py.model.layout import PARAM_SPECS

EPS = 1e-5


def torch_params(flat, config, dtype=torch.float64, specs=PARAM_SPECS):
    """Leaf tensors (requires_grad) named as in ``specs``, from a flat array."""
    out, offset = {}, 0
    for name, fn in specs:
        shape = fn(config)
        count = math.prod(shape)
        chunk = np.asarray(flat[offset:offset + count], dtype=np.float64).reshape(shape)
        out[name] = torch.tensor(chunk, dtype=dtype, requires_grad=True)
        offset += count
    return out


def flat_grads(params):
    """Every gradient, flattened in PARAM_SPECS order (float64 numpy)."""
    return np.concatenate([params[name].grad.detach().numpy().reshape(-1)
                           for name, _ in PARAM_SPECS])


def attention(qkv, NH):
    """Causal multi-head attention over packed q, k, v (B, T, 3C) -> (B, T, C)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    q, k, v = (z.view(B, T, NH, hs).transpose(1, 2) for z in qkv.split(C, dim=-1))
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    att = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return (att @ v).transpose(1, 2).reshape(B, T, C)


def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def forward(p, config, inputs, targets=None):
    """(logits (B, T, Vp), mean loss or None) for int token arrays (B, T)."""
    c = config
    inputs = torch.as_tensor(np.asarray(inputs, dtype=np.int64))
    B, T = inputs.shape
    x = p["wte"][inputs] + p["wpe"][:T]
    for l in range(c.num_layers):
        h = F.layer_norm(x, (c.channels,), p["ln1w"][l], p["ln1b"][l], EPS)
        h = attention(h @ p["qkvw"][l].T + p["qkvb"][l], c.num_heads)
        x = x + (h @ p["attprojw"][l].T + p["attprojb"][l])
        h = F.layer_norm(x, (c.channels,), p["ln2w"][l], p["ln2b"][l], EPS)
        h = gelu(h @ p["fcw"][l].T + p["fcb"][l])
        x = x + (h @ p["fcprojw"][l].T + p["fcprojb"][l])
    x = F.layer_norm(x, (c.channels,), p["lnfw"], p["lnfb"], EPS)
    logits = x @ p["wte"].T
    if targets is None:
        return logits, None
    targets = torch.as_tensor(np.asarray(targets, dtype=np.int64))
    V = c.vocab_size
    loss = F.cross_entropy(logits[..., :V].reshape(-1, V), targets.reshape(-1))
    return logits, loss


class AdamW:
    """llm.c's gpt2_update on a dict of tensors: bias-corrected moments and
    decoupled weight decay on every parameter."""

    def __init__(self, params, lr, beta1, beta2, eps, weight_decay):
        self.params = params
        self.lr, self.beta1, self.beta2 = lr, beta1, beta2
        self.eps, self.weight_decay = eps, weight_decay
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}

    @torch.no_grad()
    def step(self, t):
        c1 = 1.0 - self.beta1**t
        c2 = 1.0 - self.beta2**t
        for name, p in self.params.items():
            g = p.grad
            self.m[name].mul_(self.beta1).add_((1 - self.beta1) * g)
            self.v[name].mul_(self.beta2).add_((1 - self.beta2) * g * g)
            m_hat = self.m[name] / c1
            v_hat = self.v[name] / c2
            p -= self.lr * (m_hat / (v_hat.sqrt() + self.eps) + self.weight_decay * p)
            p.grad = None
