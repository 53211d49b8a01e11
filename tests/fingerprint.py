"""Bitwise fingerprints of the model's results, to show that a change which
should not move a bit (a restructuring) did not: logits, loss, every
gradient and the parameters after 3 AdamW steps, for GPT-2 at 124M width and
for every Llama-family choice set of test_llama_step.py, in fp32 and bf16,
with and without recompute and dropout, through forward + backward and
forward_backward.

    python tests/fingerprint.py record before.json
    python tests/fingerprint.py check before.json     # exit 1 on any change

Fingerprints hold for one machine and one build (the ISA paths round
differently), so record and check on the same one; this is a tool, not a
test."""
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from llmc_py import GPT2, GPT2Config, Llama, set_num_threads  # noqa: E402
from llmc_py.model.dropout import Dropout  # noqa: E402
from test_llama_step import BASE, CONFIGS  # noqa: E402

WIDE = GPT2Config(max_seq_len=1024, vocab_size=50257, padded_vocab_size=50304,
                  num_layers=2, num_heads=12, channels=768)
ADAMW = dict(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def randomised(model, seed):
    """Norm weights and biases off their initial values, so every parameter counts."""
    rng = np.random.default_rng(seed)
    for name in model.params.names:
        if name in model.matrix_params:
            continue
        view = model.params[name]
        view[...] += 0.1 * rng.standard_normal(view.shape).astype(np.float32)
    if model.precision == "bf16":
        model.refresh_bf16()
    return model


def run(cls, config, precision, recompute, dropout, fused, B, T):
    model = randomised(cls(config, seed=7, precision=precision), seed=8)
    model.recompute = recompute
    rng = np.random.default_rng(9)
    tokens = rng.integers(0, config.vocab_size, size=(B, T + 1), dtype=np.int32)
    x, y = tokens[:, :-1].copy(), tokens[:, 1:].copy()
    drop = Dropout(embedding=0.1, attention=0.1, residual=0.1, seed=3) if dropout else None
    out = {}
    for t in range(1, 4):
        model.zero_grad()
        if fused:
            loss = model.forward_backward(x, y, dropout=drop)
            logits = np.zeros(1, np.float32)
        else:
            loss = model.forward(x, y, dropout=drop)
            logits = model.logits.copy()
            model.backward()
        out[f"step{t}"] = {"loss": float(loss), "logits": digest(logits),
                           "grads": {n: digest(model.grads[n]) for n in model.params.names},
                           "norm": float(model.grad_norm())}
        model.update(t=t, **ADAMW)
    out["params"] = digest(model.params.memory)
    out["eval_loss"] = float(model.forward(x, y))
    out["eval_logits"] = digest(model.logits)
    return out


def cases():
    yield "gpt2-124M-width", GPT2, WIDE, 2, 24
    for name, choices in CONFIGS.items():
        yield name, Llama, BASE.__class__(**{**BASE.__dict__, **choices}), 2, 13


def record():
    set_num_threads(2)
    result = {}
    for name, cls, config, B, T in cases():
        for precision in ("fp32", "bf16"):
            for recompute, dropout, fused in ((False, False, False), (True, False, True),
                                              (False, True, True), (True, True, False)):
                key = f"{name}/{precision}/rc{int(recompute)}/do{int(dropout)}/fb{int(fused)}"
                result[key] = run(cls, config, precision, recompute, dropout, fused, B, T)
                print(key, result[key]["params"], flush=True)
    return result


def main(argv):
    mode, path = argv
    result = record()
    if mode == "record":
        Path(path).write_text(json.dumps(result, indent=1, sort_keys=True))
        return 0
    before = json.loads(Path(path).read_text())
    changed = [key for key in sorted(set(before) | set(result))
               if before.get(key) != result.get(key)]
    for key in changed:
        print("CHANGED:", key)
    print(f"{len(result) - len(changed)} of {len(result)} cases bitwise identical")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
