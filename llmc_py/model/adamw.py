"""One AdamW step over a model's flat parameter and gradient buffers
(llm.c's gpt2_update): what model.update() runs, and train.optimizer's
AdamW, which keeps the moments, builds on."""
from .._native import kernels as K


def adamw_step(params, grads, m, v, learning_rate, beta1, beta2, eps, weight_decay, t,
               decay=None, params_bf16=None, span=None):
    """One AdamW step over TensorGroups ``params`` and ``grads`` with flat
    moments ``m`` and ``v``; t >= 1 is the step number. Weight decay applies
    to every tensor unless ``decay`` names the ones to decay. The TensorGroup
    ``params_bf16``, if given, receives the new parameters rounded to bf16.
    ``span`` (start, stop) updates only those elements of the flat buffers,
    and m and v then hold that span's moments only (ZeRO-1's shard); each
    element's update is the same as in a whole step."""
    copy = None if params_bf16 is None else params_bf16.memory
    start, stop = (0, params.memory.size) if span is None else span
    if decay is None:
        runs = [(0, params.memory.size, weight_decay)]
    else:
        unknown = set(decay) - set(params.names)
        if unknown:
            raise ValueError(f"decay names unknown parameters: {sorted(unknown)}")
        # tensors lie back to back in layout order: each run of them has its decay
        runs, offset = [], 0
        for name in params.names:
            count = params[name].size
            runs.append((offset, offset + count, weight_decay if name in decay else 0.0))
            offset += count
    for a, b, run_decay in runs:
        a, b = max(a, start), min(b, stop)
        if a >= b:
            continue
        part, moments = slice(a, b), slice(a - start, b - start)
        K.adamw_update(params.memory[part], m[moments], v[moments], grads.memory[part],
                       learning_rate, beta1, beta2, eps, run_decay, t,
                       params_bf16=None if copy is None else copy[part])
