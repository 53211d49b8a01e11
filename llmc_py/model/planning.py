"""A model's memory by part, from its config alone (memory_plan), and the
check a model runs before it allocates what it lacks (require_missing), so
that a step that cannot fit fails at once, saying what needs how much."""
import math

from .._native.lib import get_isa, get_num_threads
from .layout import (act_dtypes, act_specs, frozen_bf16_parameters, grad_act_specs,
                     num_parameters, param_specs, routed_rows, specs_bytes, specs_units)
from .memory import format_bytes, require
from .quantized import (QUANTIZED_EXPERTS, QUANTIZED_LINEARS, block_bytes, check_weights_type,
                        panel_scratch_bytes)

PRECISIONS = ("fp32", "bf16")
# rows of logits the classifier holds at once when it does not keep them all
# (forward_backward, forward(keep_logits=False)): 51 MB of GPT-2's. Even, so
# that the bf16 matmul's k pairs of the head weight's gradient (summed over
# rows) are the pairs of one whole product; 384 rows measured no faster
HEAD_ROWS = 256
# query rows of attention's backward blocks (its scratch: two such blocks of
# T scores per thread)
ATTENTION_BLOCK_ROWS = 64
# the matmuls' scratch arena per thread, at most: the bf16 GEMM's packed A
# block (3 MiB) and a dweight tile's B panels (768 columns x 384 k pairs);
# the float32 GEMM's panels take less
MATMUL_SCRATCH_PER_THREAD = (3 << 20) + 4 * 768 * 384
# lora_bf16.c's up backward on avx512bf16 (its scratch in the same arena):
# its units' most columns (CHUNK_COLS), fewest (256 unless the adapter is
# narrower) and rows a block (BLOCK_ROWS)
LORA_CHUNK_COLS, LORA_UNIT_COLS, LORA_BLOCK_ROWS = 1024, 256, 64
# matmul_bf16.c's widened path: a weight's rows widened at once, a multiple
# of WIDEN_ROWS of about WIDEN_FLOATS floats
WIDEN_ROWS, WIDEN_FLOATS = 384, 1 << 20


def head_rows(B, T, keep_logits):
    """Rows of logits held at once: all B * T, or a block of HEAD_ROWS."""
    return B * T if keep_logits else min(HEAD_ROWS, B * T)


# Transformer.recompute's levels: 0 keeps every activation, 1 recomputes the
# norm outputs and the MLP activation, 2 also the MLP's input projection
RECOMPUTE_LEVELS = (0, 1, 2)


def recomputes_fch(recompute, base_weights=None):
    """Whether recompute level ``recompute`` recomputes the MLP's input
    projection (fch): at 2, and at 1 on a quantized base (its activations
    are most of a QLoRA step's memory)."""
    return recompute == 2 or bool(recompute and base_weights)


def memory_plan(config, B, T, training=True, keep_logits=None, *, precision="fp32",
                recompute=False, moment_params=None, adapter_params=0, adapter_width=0,
                adapter_rank=0, frozen=False, base_weights=None, head_weights=None,
                keep_activations=None):
    """Bytes by part that a model of ``config`` in ``precision`` needs for a
    forward of (B, T), computed from the config alone (nothing is
    allocated); with ``training`` a whole step's: the parameter gradients,
    AdamW's moments (of ``moment_params`` parameters, default all; fewer for
    a ZeRO-1 shard) and backward's activation gradients. ``keep_logits``
    (default: not when training) counts all (B, T, Vp) logits, else a block
    of HEAD_ROWS rows of them; ``recompute`` a level as Transformer.recompute
    (False and True are 0 and 1). ``keep_activations`` (default: when
    training) counts the activations a backward reads, else a forward-only
    layout's: one layer's, reused by every layer (layout.act_specs
    forward_only; evaluation's and sampling's, and the forward of a model
    that cannot be trained).
    "scratch" is the kernels' temporary memory, estimated for this process's
    thread count and instruction set (see scratch_bytes). ``adapter_params``
    > 0: LoRA adapters of that many parameters (model.lora.adapter_parameters)
    on a frozen base, whose gradients and moments are then the adapters'
    alone; ``adapter_width``: the numbers of x A^T a layer's adapters have a
    row (Lora.width), which a step keeps from forward to backward ("LoRA
    activations"); ``adapter_rank``: their rank (a bf16 step's scratch). ``frozen`` (bf16): a frozen bf16 base, its matrices in bf16
    alone ("parameters (bf16)"), the rest float32; training it needs
    adapters. ``base_weights`` "q8_0" or "q4_0": a quantized base
    (Transformer.quantize), its linear layers in those blocks, the embedding
    and head in ``head_weights``' (default the same; quantized_parameters),
    the rest float32 (recompute 1
    then recomputes fch too, as 2 does). The
    activations are those a full step keeps: a LoRA step keeps the same
    (its adapters need the linear layers' inputs, as weight gradients
    would)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision is {precision!r}, expected one of {PRECISIONS}")
    c, f32 = config, 4
    n = num_parameters(c)
    trained = adapter_params or n
    moments = trained if moment_params is None else moment_params
    keep = not training if keep_logits is None else keep_logits
    forward_only = not (training or keep_activations)
    rows = head_rows(B, T, keep)
    adapters = {"LoRA adapters": f32 * adapter_params} if adapter_params else {}
    if adapter_width and not forward_only:
        adapters["LoRA activations"] = f32 * c.L * B * T * adapter_width
    if frozen:
        if precision != "bf16":
            raise ValueError(f"frozen is a base held in bf16 alone: precision must be 'bf16', "
                             f"got {precision!r}")
        in_bf16 = frozen_bf16_parameters(c)
        weights = {"parameters": f32 * (n - in_bf16), "parameters (bf16)": 2 * in_bf16}
    elif base_weights is not None:
        in_blocks = quantized_parameters(c, base_weights, head_weights)
        weights = {"parameters": f32 * (n - sum(count for count, _ in in_blocks.values()))}
        for kind, (_, nbytes) in in_blocks.items():
            weights[f"parameters ({kind})"] = nbytes
    else:
        weights = {"parameters": f32 * n,
                   "parameters (bf16 copy)": 2 * n if precision == "bf16" else 0}
    return {**weights,
            **adapters,
            "parameter gradients": f32 * trained if training else 0,
            "AdamW moments": 2 * f32 * moments if training else 0,
            "activations": specs_bytes(act_specs(c, recompute=bool(recompute), logits=False,
                                                 recompute_fch=recomputes_fch(recompute,
                                                                              base_weights),
                                                 forward_only=forward_only),
                                       c, B, T, dtypes=act_dtypes(c, bf16_activations(
                                           precision, base_weights))),
            "logits": f32 * rows * c.Vp,
            "activation gradients": specs_bytes(grad_act_specs(c), c, B, T) if training else 0,
            "scratch": scratch_bytes(c, B, T, rows, precision, base_weights,
                                     adapter_rank if training else 0, training)}


def bf16_activations(precision, base_weights=None):
    """Whether a model keeps the activations only its matmuls read in bf16
    (layout.act_dtypes): a bf16 model whose linear layers are the bf16 GEMM,
    not a quantized base's (its matmuls read float32)."""
    return precision == "bf16" and base_weights is None


def quantized_parameters(config, qtype, head=None):
    """{block type: (parameters, bytes)} a model quantized to ``qtype``
    holds in blocks: its linear layers (qkv, attention projection, MLP,
    the experts) in qtype, the embedding table and an untied head in
    ``head`` (default qtype; one table when tied); the routers stay float32."""
    check_weights_type(qtype)
    head = qtype if head is None else head
    check_weights_type(head)
    held = {}
    in_qtype = QUANTIZED_LINEARS + QUANTIZED_EXPERTS
    for name, fn in param_specs(config):
        if name in in_qtype or name in ("wte", "lm_head"):
            kind = qtype if name in in_qtype else head
            count = math.prod(fn(config))
            before = held.get(kind, (0, 0))
            held[kind] = (before[0] + count, before[1] + count // 32 * block_bytes(kind))
    return held


def scratch_bytes(config, B, T, head_rows, precision, base_weights=None, adapter_rank=0,
                  training=True):
    """An upper estimate of the kernels' temporary memory at (B, T): per
    thread, attention's panels and score blocks and the matmuls' packed
    panels (their arena, kept between calls: llmc_py.scratch_bytes), or the
    bf16 LoRA backward's (rank ``adapter_rank``) there if more; where
    the bf16 matmul widens its operands to float32 (no AVX512_BF16), those
    copies for its largest product (in the arena too); on a quantized base,
    the panel path's bf16 tile and output part (and their widened copies)."""
    c, f32 = config, 4
    threads = get_num_threads()
    hs = c.head_size
    attention = f32 * (2 * (T + 15) * hs + 2 * ATTENTION_BLOCK_ROWS * T)
    matmul = MATMUL_SCRATCH_PER_THREAD
    total = threads * (attention + matmul)
    if adapter_rank and precision == "bf16" and get_isa() == "avx512bf16":
        total = max(total, lora_backward_scratch(config, B, T, adapter_rank, threads))
    linears = ((c.qkv_channels, c.C), (c.C, c.attn_channels), (c.fc_channels, c.C),
               (c.C, c.FF), (c.Vp, c.C))   # (OC, IC), the head last
    if precision == "bf16" and get_isa() != "avx512bf16":
        # a backward's copies at once: dout and inp (rows x (OC + IC)), a
        # forward's inp alone, and a block of the weight's rows
        # (widened_block_rows of them); the experts' batch: each expert's
        # rows and weight
        rows = [B * T] * (len(linears) - 1) + [head_rows]
        total += f32 * max(max(n * ((OC if training else 0) + IC)
                               + min(OC, widened_block_rows(IC)) * IC
                               for n, (OC, IC) in zip(rows, linears)),
                           routed_rows(c, B, T) * (c.expert_fc_channels + c.C)
                           + c.num_experts * c.expert_fc_channels * c.C)
    if base_weights is not None:
        widened = get_isa() != "avx512bf16"
        products = [(B * T, OC, IC) for OC, IC in linears]
        if c.moe_layers:   # an expert's rows: at most all R routed rows
            R = routed_rows(c, B, T)
            products += [(R, c.expert_fc_channels, c.C), (R, c.C, c.expert_hidden)]
        total += max(panel_scratch_bytes(N, OC, IC, widened) for N, OC, IC in products)
    return total


def widened_block_rows(IC):
    """Rows of a weight of IC columns that the bf16 matmul without
    AVX512_BF16 widens to float32 at once (matmul_bf16.c's widen_rows): about
    4 MiB, at least WIDEN_ROWS rows and a multiple of them."""
    return max(WIDEN_ROWS, -(-(WIDEN_FLOATS // IC) // WIDEN_ROWS) * WIDEN_ROWS)


def lora_backward_scratch(config, B, T, rank, threads):
    """lora_up_backward_bf16's arena scratch on avx512bf16 (lora_bf16.c) at
    most, for rank-``rank`` adapters of a model of ``config``: each thread's
    unit scratch, and dh's parts of every unit of the widest linear layer
    (units of 256 columns or more, one more for each of its up to 3
    adapters), B T rows each."""
    lanes = -(-rank // 16) * 16
    words = (LORA_BLOCK_ROWS * LORA_CHUNK_COLS // 2 + LORA_CHUNK_COLS // 2 * lanes
             + LORA_BLOCK_ROWS // 2 * lanes)
    units = -(-max(config.qkv_channels, config.C, config.fc_channels) // LORA_UNIT_COLS) + 3
    return 4 * (threads * -(-words // 16) * 16 + units * -(-B * T // 16) * 16 * lanes
                + 3 * units)


def require_missing(model, B, T, training, keep_logits, keep_activations):
    """Raises OutOfMemoryError, naming each part, if the parts of
    model.memory_plan(B, T) it has not allocated yet do not fit, all at once."""
    plan = model.memory_plan(B, T, training=training, keep_logits=keep_logits,
                             keep_activations=keep_activations)
    lora = model.lora
    have = {"parameters": True, "parameters (bf16 copy)": True, "parameters (bf16)": True,
            "parameters (q8_0)": True, "parameters (q4_0)": True,
            "LoRA adapters": True,
            "LoRA activations": lora is not None and lora.keeps(B, T),
            # the adapters' are made with them
            "parameter gradients": model._grads is not None or lora is not None,
            # made by moments(); a shard of them, by its optimizer (ZeRO-1)
            "AdamW moments": (model.m_memory is not None
                              or model.moment_params < model.num_parameters
                              or (lora is not None and lora.m is not None)),
            "activations": _fits(model.acts, plan["activations"]),
            "logits": (model._logits_buffer is not None
                       and model._logits_buffer.nbytes >= plan["logits"]),
            "activation gradients": _fits(model.grads_acts, plan["activation gradients"]),
            "scratch": False}
    missing = {part: nbytes for part, nbytes in plan.items() if nbytes and not have[part]}
    if missing:
        parts = ", ".join(f"{part} {format_bytes(n)}" for part, n in missing.items())
        require(sum(missing.values()), f"{'training' if training else 'a forward'} at "
                                       f"B={B}, T={T} ({parts})")


def _fits(group, nbytes):
    return group is not None and group.buffer.nbytes >= nbytes


def reusable(group, specs, config, B, T, dtypes=None):
    """The flat buffer of ``group`` if the layout for (B, T) (its tensors in
    ``dtypes``, as TensorGroup's) fits in it, else None."""
    if group is None:
        return None
    needed = specs_units(specs, config, B, T, dtypes=dtypes)
    return group.buffer if needed <= group.buffer.size else None
