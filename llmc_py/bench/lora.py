"""--lora: a LoRA training step of a Qwen3-0.6B-shaped model (random
weights) beside our full fine-tuning step of the same model and beside
transformers + peft, each in a process of its own (step.py, pytorch.py)."""
import functools
import statistics

from .pytorch import torch_job
from .step import own_step_job

# Qwen3-0.6B's config.json as LlamaConfig fields (num_layers from --layers)
QWEN3_0_6B = dict(vocab_size=151936, padded_vocab_size=151936, max_seq_len=40960,
                  channels=1024, num_heads=16, num_kv_heads=8, head_dim=128, ffn_hidden=3072,
                  qk_norm=True, tied_embeddings=True, rope_theta=1e6, norm_eps=1e-6)
QWEN3_0_6B_LAYERS = 28
RANK, ALPHA = 16, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# the model --profile --lora names
LORA_MODEL = (f"Qwen3-0.6B-shaped, LoRA rank {RANK} alpha {ALPHA} on {', '.join(TARGETS)} "
              f"(its base frozen in bf16)")
# the floors: LoRA's speed over each of the others, and peak memory
FLOORS = {"llmc_py_full_bf16": 1.4, "peft_bf16": 2.0}


def lora_step_job(args, config=None, recompute=0, profile=None):
    """Our LoRA step's timing (step.own_step_job's) at --batch, --layers and
    --repeats, with ``recompute``: rank RANK, alpha ALPHA on TARGETS, its base
    frozen in bf16; with ``profile`` (profile_step's keyword arguments) its
    profile instead. ``config``: as measure_lora's."""
    B, T = args.batch
    return own_step_job(args.layers, B, T, args.repeats, "bf16", recompute,
                        config=QWEN3_0_6B if config is None else config, arch="llama",
                        lora=dict(rank=RANK, alpha=ALPHA, targets=TARGETS), profile=profile)


def measure_lora(args, config=None):
    """{name: timing with peak_rss_mib} of the three steps at --batch and
    --layers: ours with LoRA on a frozen bf16 base ("llmc_py_lora"), ours
    fine-tuning every parameter in bf16 ("llmc_py_full_bf16"), and unless
    --skip-torch transformers + peft ("peft_bf16"; None when not installed).
    With --rounds N the three processes run N times in turn, each timing
    --repeats steps: a step's median, min and max are over all its repeats,
    its peak RSS the largest, and ours gain "rounds_over" {name: the other's
    median over ours, per round}. ``config``: LlamaConfig fields other than
    num_layers (default QWEN3_0_6B)."""
    config = QWEN3_0_6B if config is None else config
    B, T = args.batch
    own_step = functools.partial(own_step_job, args.layers, B, T, args.repeats, "bf16",
                                 config=config, arch="llama")
    jobs = {"llmc_py_lora": lambda: lora_step_job(args, config), "llmc_py_full_bf16": own_step}
    if not args.skip_torch:
        jobs["peft_bf16"] = lambda: torch_job("lora", config=dict(config, num_layers=args.layers),
                                              B=B, T=T, repeats=args.repeats, rank=RANK,
                                              alpha=ALPHA, targets=TARGETS)
    rounds = [{name: job() for name, job in jobs.items()}
              for _ in range(getattr(args, "rounds", 1))]
    steps = {name: _over_rounds([r[name] for r in rounds]) for name in jobs}
    ours = steps["llmc_py_lora"]
    ours["rounds_over"] = {name: [r[name]["median"] / r["llmc_py_lora"]["median"] for r in rounds]
                           for name in jobs if name != "llmc_py_lora" and steps[name]}
    return steps


def _over_rounds(results):
    """One step's results of every round as one: the first's fields, the
    timing over all repeats, the largest peak RSS (None when not installed)."""
    if results[0] is None:
        return None
    times = [t for result in results for t in result["times"]]
    return dict(results[0], times=times, median=statistics.median(times), min=min(times),
                max=max(times), peak_rss_mib=max(r["peak_rss_mib"] for r in results))
