"""Our training step for the benchmark (bench.py), in a process of its own
as each PyTorch configuration is (bench_torch.py), so that its peak RSS is
the step's alone: the model, its gradients, AdamW's moments, the
activations and the kernels' scratch, and nothing the benchmark's other
measurements held. Run as ``python -m llmc_py.bench_step JOB``, JOB a JSON
object {"layers", "B", "T", "repeats", "precision", "recompute", "isa",
"threads", "config" (GPT2Config fields besides num_layers)}; prints the timing as JSON, with "peak_rss_mib" and
"planned_mib" (the model's own memory plan of the step, model.memory_plan).
"""
import json
import sys

import numpy as np

from ._native.lib import set_isa, set_num_threads
from .bench import bench_step
from .bench_torch import peak_rss_mib
from .config import GPT2Config
from .model.memory import return_freed_scratch


def main(argv=None):
    job = json.loads((sys.argv[1:] if argv is None else argv)[0])
    return_freed_scratch()   # as the trainer does
    set_num_threads(job["threads"])
    set_isa(job["isa"])
    config = GPT2Config(**dict(job["config"], num_layers=job["layers"]))
    result = bench_step(config, job["B"], job["T"],
                        job["repeats"], np.random.default_rng(0), job["precision"],
                        job["recompute"])
    result["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
