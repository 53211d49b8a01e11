"""PyTorch's side of the benchmark, always in a process of its own: two
OpenMP runtimes in one process (ours and torch's) each leave worker threads
spinning that slow the other, so torch_job runs each PyTorch configuration
as ``python -m llmc_py.bench.pytorch JOB`` and reads the JSON it prints.
JOB is a JSON object: {"kind": "matmul" | "step" | "generate" | "lora" |
"hf_step", "threads": N, ...the job's arguments}. A missing torch (or, for
"lora" and "hf_step", transformers or peft) prints {"missing": true}.

The models of "step" and "generate" are GPT-2 on our initialisation
(model.GPT2, seed 0), written as an nn.Module would run them: one leaf
tensor per layer's weight, scaled_dot_product_attention, fused AdamW.
"lora" is how people fine-tune with LoRA: transformers' model of the config
(random init, made in bf16) with peft's adapters, under autocast. "hf_step"
trains transformers' own model of a config (Mixtral for --moe).
"""
import json
import sys

import numpy as np

from .._native.lib import get_num_threads
from ..config import GPT2Config, LlamaConfig
from ..model import GPT2
from .timing import peak_rss_mib, run_job, timed


def torch_job(kind, **job):
    """The result of one PyTorch measurement run in a fresh interpreter on
    this process's thread count; None when torch is not installed. A failing
    job raises RuntimeError with its last error line."""
    result = run_job("llmc_py.bench.pytorch", dict(job, kind=kind, threads=get_num_threads()),
                     f"PyTorch {kind}")
    return None if result.get("missing") else result


def _dtype(torch, name):
    return torch.bfloat16 if name == "bf16" else torch.float32


def matmul(torch, shapes, repeats, dtype):
    """GFLOP/s of torch.matmul for each (BT, C, OC) in ``shapes`` and each
    product of a linear layer (fwd, dinp, dW), inputs and output in ``dtype``:
    {"gflops": {"BTxCxOC": {"fwd": ..., "dinp": ..., "dW": ...}}}."""
    dt = _dtype(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for BT, C, OC in shapes:
        x, w = torch.randn(BT, C, generator=gen).to(dt), torch.randn(OC, C, generator=gen).to(dt)
        dout = torch.randn(BT, OC, generator=gen).to(dt)
        y, dx, dw = torch.empty(BT, OC, dtype=dt), torch.empty(BT, C, dtype=dt), \
            torch.empty(OC, C, dtype=dt)
        cases = {"fwd": lambda: torch.matmul(x, w.T, out=y),
                 "dinp": lambda: torch.matmul(dout, w, out=dx),
                 "dW": lambda: torch.matmul(dout.T, x, out=dw)}
        flop = 2.0 * BT * C * OC
        out[f"{BT}x{C}x{OC}"] = {name: flop / timed(fn, repeats, warmup=3)["median"] / 1e9
                                 for name, fn in cases.items()}
    return {"gflops": out}


def _leaves(torch, model):
    """{name: leaf tensor, or a list of one leaf per layer}: an nn.Module's
    parameters (slicing one stacked (L, ...) leaf would make autograd build
    full-size gradients)."""
    c, params = model.config, {}
    for name in model.params.names:
        value = model.params[name]
        if value.ndim >= 2 and value.shape[0] == c.num_layers and name not in ("wte", "wpe"):
            params[name] = [torch.tensor(v, requires_grad=True) for v in value]
        else:
            params[name] = torch.tensor(value, requires_grad=True)
    return params


def step(torch, layers, B, T, repeats, compile=False, autocast=False, config=None):
    """ms of one training step (forward, backward, fused AdamW) of GPT-2 with
    ``layers`` layers: eager or torch.compile'd (the first, untimed, step
    compiles), in float32 or under torch.autocast("cpu", bfloat16)."""
    c = GPT2Config(**config) if config else GPT2Config(num_layers=layers)
    params = _leaves(torch, GPT2(c, seed=0))
    leaves = [t for v in params.values() for t in (v if isinstance(v, list) else [v])]
    opt = torch.optim.AdamW(leaves, lr=1e-4, weight_decay=0.0, fused=True)
    tokens = torch.as_tensor(np.random.default_rng(0).integers(0, c.vocab_size, (B, T + 1)))
    x, y = tokens[:, :-1], tokens[:, 1:]
    F = torch.nn.functional

    def forward():
        p = params
        h = p["wte"][x] + p["wpe"][:T]
        for l in range(c.num_layers):
            a = F.layer_norm(h, (c.channels,), p["ln1w"][l], p["ln1b"][l])
            q, k, v = F.linear(a, p["qkvw"][l], p["qkvb"][l]).split(c.channels, dim=-1)
            q, k, v = (z.view(B, T, c.num_heads, -1).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + F.linear(a.transpose(1, 2).reshape(B, T, c.channels),
                             p["attprojw"][l], p["attprojb"][l])
            a = F.layer_norm(h, (c.channels,), p["ln2w"][l], p["ln2b"][l])
            a = F.gelu(F.linear(a, p["fcw"][l], p["fcb"][l]), approximate="tanh")
            h = h + F.linear(a, p["fcprojw"][l], p["fcprojb"][l])
        h = F.layer_norm(h, (c.channels,), p["lnfw"], p["lnfb"])
        logits = F.linear(h, p["wte"])[..., :c.vocab_size]
        return F.cross_entropy(logits.reshape(-1, c.vocab_size).float(), y.reshape(-1))

    loss_fn = torch.compile(forward) if compile else forward

    def train_step():
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn()
        loss.backward()
        opt.step()
    return timed(train_step, repeats)


def generate(torch, layers, prompts, new_tokens, repeats, dtype="fp32"):
    """Seconds of greedy generation with a KV cache of its own, on GPT-2's
    parameters in ``dtype`` (weights and activations); the tokens too."""
    c = GPT2Config(num_layers=layers)
    model = GPT2(c, seed=0)
    dt = _dtype(torch, dtype)
    p = {name: torch.from_numpy(model.params[name]).to(dt) for name in model.params.names}
    prompts = np.asarray(prompts)
    B, T0 = prompts.shape
    C, NH = c.channels, c.num_heads
    hs = C // NH
    F = torch.nn.functional

    def run(tokens, start, k_cache, v_cache):
        t = tokens.shape[1]
        h = p["wte"][tokens] + p["wpe"][start:start + t]
        for l in range(c.num_layers):
            a = F.layer_norm(h, (C,), p["ln1w"][l], p["ln1b"][l])
            q, k, v = (z.view(B, t, NH, hs).transpose(1, 2) for z in
                       F.linear(a, p["qkvw"][l], p["qkvb"][l]).split(C, dim=-1))
            k_cache[l, :, :, start:start + t] = k
            v_cache[l, :, :, start:start + t] = v
            a = F.scaled_dot_product_attention(q, k_cache[l, :, :, :start + t],
                                               v_cache[l, :, :, :start + t], is_causal=t > 1)
            h = h + F.linear(a.transpose(1, 2).reshape(B, t, C), p["attprojw"][l],
                             p["attprojb"][l])
            a = F.layer_norm(h, (C,), p["ln2w"][l], p["ln2b"][l])
            a = F.gelu(F.linear(a, p["fcw"][l], p["fcb"][l]), approximate="tanh")
            h = h + F.linear(a, p["fcprojw"][l], p["fcprojb"][l])
        h = F.layer_norm(h[:, -1], (C,), p["lnfw"], p["lnfb"])
        return F.linear(h, p["wte"])[:, :c.vocab_size]

    result = {}

    @torch.no_grad()
    def greedy():
        shape = (c.num_layers, B, NH, T0 + new_tokens, hs)
        k_cache, v_cache = torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt)
        logits = run(torch.as_tensor(prompts), 0, k_cache, v_cache)
        out = []
        for i in range(new_tokens):
            new = logits.argmax(dim=-1)
            out.append(new)
            if i < new_tokens - 1:
                logits = run(new[:, None], T0 + i, k_cache, v_cache)
        result["tokens"] = torch.stack(out, dim=1).tolist()
    result.update(timed(greedy, repeats, warmup=0))
    return result


def lora(torch, config, B, T, repeats, rank, alpha, targets):
    """ms of one LoRA training step as transformers + peft run it: the
    Hugging Face model of LlamaConfig fields ``config`` (io.hf.hf_config:
    Qwen3ForCausalLM with qk_norm), random init made in bf16, peft's
    LoraConfig(rank, alpha, targets) on it (its adapters float32), forward
    under torch.autocast("cpu", bfloat16), the loss over all T targets,
    backward, fused AdamW over the trainable parameters."""
    try:
        import peft
        import transformers
    except ImportError:
        return {"missing": True}
    from ..io.hf import hf_config
    torch.manual_seed(0)
    hf = transformers.AutoConfig.for_model(**hf_config(LlamaConfig(**config)))
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=alpha,
                                                       target_modules=targets))
    model.train()
    trained = [t for t in model.parameters() if t.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4, weight_decay=0.0, fused=True)
    V = hf.vocab_size
    tokens = torch.as_tensor(np.random.default_rng(0).integers(0, V, (B, T + 1)))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def train_step():
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))
        loss.backward()
        opt.step()
    return dict(timed(train_step, repeats),
                trained_parameters=sum(t.numel() for t in trained))


def hf_step(torch, config, B, T, repeats, autocast=False):
    """ms of one training step of transformers' model of LlamaConfig fields
    ``config`` (io.hf.hf_config: MixtralForCausalLM with experts), random
    init in float32, eager: forward in float32 or under
    torch.autocast("cpu", bfloat16), the cross-entropy over all T targets
    plus, with experts, router_aux_loss_coef times its load-balancing loss
    (output_router_logits), backward, fused AdamW."""
    try:
        import transformers
    except ImportError:
        return {"missing": True}
    from ..io.hf import hf_config
    torch.manual_seed(0)
    hf = transformers.AutoConfig.for_model(**hf_config(LlamaConfig(**config)))
    model = transformers.AutoModelForCausalLM.from_config(hf)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    V = hf.vocab_size
    tokens = torch.as_tensor(np.random.default_rng(0).integers(0, V, (B, T + 1)))
    x, y = tokens[:, :-1], tokens[:, 1:]
    balance = getattr(hf, "output_router_logits", False)

    def train_step():
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=x)
        loss = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, V),
                                                 y.reshape(-1))
        if balance:
            loss = loss + hf.router_aux_loss_coef * out.aux_loss
        loss.backward()
        opt.step()
    return dict(timed(train_step, repeats), architecture=hf.architectures[0])


JOBS = {"matmul": matmul, "step": step, "generate": generate, "lora": lora,
        "hf_step": hf_step}


def main(argv=None):
    job = json.loads((sys.argv[1:] if argv is None else argv)[0])
    try:
        import torch
    except ImportError:
        print(json.dumps({"missing": True}))
        return 0
    torch.set_num_threads(job.pop("threads"))
    result = JOBS[job.pop("kind")](torch, **job)
    result["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
