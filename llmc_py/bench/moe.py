"""--moe: a training step of an 8-expert top-2 Llama-style model beside a
dense model of the same active parameters (a SwiGLU as wide as the two
experts a token passes through) and beside transformers' MixtralForCausalLM
(and its dense twin) at the same shapes, each in a process of its own
(step.py, pytorch.py); then greedy decoding of our MoE and dense models at
batch 1 and 8."""
import functools

import numpy as np

from ..config import LlamaConfig
from ..model import Llama
from .pytorch import torch_job
from .step import own_step_job
from .timing import timed

# the measurement: C=512, 8 experts of 1024, top-2, against a dense
# SwiGLU of 2048; Mixtral's vocabulary and its balancing loss (transformers'
# router_aux_loss_coef 0.02, ours k times that: config.py)
SHAPES = dict(vocab_size=32000, padded_vocab_size=32000, max_seq_len=4096, channels=512,
              num_heads=8, num_kv_heads=8, tied_embeddings=False)
MOE_MLP = dict(num_experts=8, experts_per_token=2, expert_hidden=1024, router_aux_loss=2 * 0.02)
DENSE_MLP = dict(ffn_hidden=2048)
MOE_LAYERS = 4
MOE_BATCH = (4, 256)
DECODE_BATCHES = (1, 8)
# the floors: ours MoE over ours dense at most 1.3x the time;
# transformers' MoE over ours at least 2x (fp32) and 3x (bf16)
DENSE_CEILING = 1.3
FLOORS = {"fp32": 2.0, "bf16": 3.0}


def moe_config(shapes=None):
    """The LlamaConfig fields (but num_layers) of the MoE model measured."""
    return dict(SHAPES if shapes is None else shapes, **MOE_MLP)


def measure_moe(args, shapes=None):
    """{"step": {name: timing}, "decode": {B: {name: timing}}}: our MoE and
    dense steps in fp32 and bf16 at --batch and --layers, transformers'
    MoE and dense steps in float32 and under autocast bf16 (unless
    --skip-torch; None when not installed), and our fp32 models' greedy
    decoding of --gen's tokens at batch 1 and 8. ``shapes``: LlamaConfig
    fields other than the MLP's and num_layers (default SHAPES)."""
    shapes = SHAPES if shapes is None else shapes
    moe, dense = moe_config(shapes), dict(shapes, **DENSE_MLP)
    B, T = args.batch
    own_step = functools.partial(own_step_job, args.layers, B, T, args.repeats, arch="llama")
    steps = {}
    for precision in ("fp32", "bf16"):
        steps[f"llmc_py_moe_{precision}"] = own_step(precision, config=moe)
        steps[f"llmc_py_dense_{precision}"] = own_step(precision, config=dense)
    if not args.skip_torch:
        hf_step = functools.partial(torch_job, "hf_step", B=B, T=T, repeats=args.repeats)
        for autocast, precision in ((False, "fp32"), (True, "autocast_bf16")):
            steps[f"transformers_moe_{precision}"] = hf_step(
                config=dict(moe, num_layers=args.layers), autocast=autocast)
            steps[f"transformers_dense_{precision}"] = hf_step(
                config=dict(dense, num_layers=args.layers), autocast=autocast)
    prompt_len, new_tokens = args.gen
    rng = np.random.default_rng(0)
    decode = {}
    for batch in DECODE_BATCHES:
        prompts = rng.integers(0, shapes["vocab_size"], (batch, prompt_len)).tolist()
        decode[batch] = {name: bench_decode(LlamaConfig(**config, num_layers=args.layers),
                                            prompts, new_tokens, args.repeats)
                         for name, config in (("llmc_py_moe", moe), ("llmc_py_dense", dense))}
    return {"step": steps, "decode": decode}


def bench_decode(config, prompts, new_tokens, repeats):
    """Seconds of greedy generation (KV cache, fp32) of ``new_tokens`` after
    ``prompts`` with a fresh model of ``config``."""
    model = Llama(config, seed=0)
    return timed(lambda: model.generate(prompts, new_tokens, temperature=0), repeats, warmup=0)
