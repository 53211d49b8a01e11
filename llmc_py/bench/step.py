"""Our training step for the benchmark, in a process of its own as each
PyTorch configuration is (pytorch.py), so that its peak RSS is the step's
alone: the model, its gradients, AdamW's moments, the activations and the
kernels' scratch, and nothing the benchmark's other measurements held. Run
as ``python -m llmc_py.bench.step JOB``, JOB a JSON object {"layers", "B",
"T", "repeats", "precision", "recompute", "isa", "threads", "config"
(GPT2Config fields besides num_layers; with "arch": "llama", LlamaConfig
fields), "lora" (None, or add_lora's arguments: then a LoRA step on a
frozen bf16 base of random weights), "profile" (None, or profile_step's
keyword arguments: then the step's profile instead, profile.py)}; prints
the timing as JSON, with "peak_rss_mib" and "planned_mib" (the model's own
memory plan of the step, model.memory_plan).
"""
import functools
import json
import sys

import numpy as np

from .._native.lib import get_isa, get_num_threads, set_isa, set_num_threads
from ..config import GPT2Config, LlamaConfig
from ..io.files import to_bf16
from ..model.presets import preset_for
from ..model.transformer import NORM_WEIGHTS
from ..model.memory import return_freed_scratch
from .profile import profile_step
from .pytorch import torch_job
from .timing import peak_rss_mib, run_job, timed


CONFIGS = {"gpt2": GPT2Config, "llama": LlamaConfig}


def random_frozen_base(config, seed=0):
    """A frozen bf16 base (Transformer's frozen=True) of random weights: its
    matrices N(0, 0.02) rounded to bf16 a block of rows at a time (never the
    whole model in float32), its norm weights 1, the rest (biases, a
    learned position table) 0."""
    model = preset_for(config)(config, precision="bf16", frozen=True)
    rng = np.random.default_rng(seed)
    rows = 4096
    for name in model.params_bf16.names:
        tensor = model.params_bf16[name]
        matrix = tensor.reshape(-1, tensor.shape[-1])
        for r0 in range(0, len(matrix), rows):
            block = matrix[r0:r0 + rows]
            block[...] = to_bf16(rng.standard_normal(block.shape, np.float32) * np.float32(0.02))
    for name in model.params.names:
        model.params[name][...] = 1.0 if name in NORM_WEIGHTS else 0.0
    return model


def step_setup(config, B, T, rng, precision="fp32", recompute=False, lora=None):
    """(model, step) of bench_step: a fresh model of ``config`` (GPT-2
    initialisation), or with ``lora`` (add_lora's keyword arguments) the
    adapters on a frozen bf16 base of random weights, and step(), which runs
    zero_grad, forward_backward on random tokens and AdamW as the trainer
    does and returns the loss."""
    if lora is None:
        model = preset_for(config)(config, seed=0, precision=precision)
    else:
        model = random_frozen_base(config)
        model.add_lora(**lora)
    model.recompute = recompute
    tokens = rng.integers(0, config.vocab_size, size=(B, T + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    state = {"t": 0}

    def step():
        state["t"] += 1
        model.zero_grad()
        loss = model.forward_backward(x, y)
        model.update(1e-4, 0.9, 0.999, 1e-8, 0.0, state["t"])
        return loss
    return model, step


def bench_step(model, step, B, T, repeats):
    """Times ``step`` (step_setup's), with the model's memory plan of the
    step in MiB ("planned_mib")."""
    planned = sum(model.memory_plan(B, T, training=True).values()) / 2**20
    return dict(timed(step, repeats), planned_mib=planned)


def own_step_job(layers, B, T, repeats, precision="fp32", recompute=False, threads=None,
                 config=None, arch="gpt2", lora=None, profile=None):
    """bench_step in a fresh interpreter, on this process's instruction set
    and thread count unless ``threads`` is given: its timing, peak RSS and
    memory plan. ``config``: the fields other than num_layers of a
    GPT2Config (default: GPT-2 124M's) or with ``arch`` "llama" a
    LlamaConfig; ``lora``: step_setup's. ``profile`` (profile_step's
    keyword arguments, e.g. {}): the step's profile instead (profile.py)."""
    job = dict(layers=layers, B=B, T=T, repeats=repeats, precision=precision,
               recompute=recompute, isa=get_isa(),
               threads=get_num_threads() if threads is None else threads, config=config or {},
               arch=arch, lora=lora, profile=profile)
    return run_job("llmc_py.bench.step", job, "llmc_py step")


def measure_steps(args):
    """{name: timing} of the training step at --batch: ours in --precision
    (with --recompute, also with recompute on; in bf16, also in fp32), then
    PyTorch's unless --skip-torch (eager; in bf16 also under autocast; with
    --compile also compiled), and with --scaling ours on 1 thread."""
    B, T = args.batch
    bf16 = args.precision == "bf16"
    steps = {}
    own_step = functools.partial(own_step_job, args.layers, B, T, args.repeats)
    steps["llmc_py"] = own_step(args.precision)
    if args.recompute:
        steps["llmc_py_recompute"] = own_step(args.precision, recompute=args.recompute)
    if bf16:
        steps["llmc_py_fp32"] = own_step()
        if args.recompute:
            steps["llmc_py_fp32_recompute"] = own_step(recompute=args.recompute)
    if not args.skip_torch:
        torch_step = functools.partial(torch_job, "step", layers=args.layers, B=B, T=T,
                                       repeats=args.repeats)
        steps["torch_eager"] = torch_step()
        if bf16:
            steps["torch_eager_autocast_bf16"] = torch_step(autocast=True)
        if args.compile:
            steps["torch_compile"] = torch_step(compile=True)
            if bf16:
                steps["torch_compile_autocast_bf16"] = torch_step(compile=True, autocast=True)
    if args.scaling:
        steps["llmc_py_1_thread"] = own_step(args.precision, threads=1)
    return steps


def main(argv=None):
    job = json.loads((sys.argv[1:] if argv is None else argv)[0])
    return_freed_scratch()   # as the trainer does
    set_num_threads(job["threads"])
    set_isa(job["isa"])
    config = CONFIGS[job["arch"]](**dict(job["config"], num_layers=job["layers"]))
    B, T = job["B"], job["T"]
    model, step = step_setup(config, B, T, np.random.default_rng(0), job["precision"],
                             job["recompute"], job["lora"])
    if job.get("profile") is None:
        result = bench_step(model, step, B, T, job["repeats"])
        result["peak_rss_mib"] = peak_rss_mib()
    else:
        result = profile_step(model, step, job["repeats"], **job["profile"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
