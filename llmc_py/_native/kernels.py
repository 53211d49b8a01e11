"""One thin wrapper per C kernel: the same name and argument order as in
csrc/llmc_api.h, with sizes taken from the array shapes. Each wrapper checks
dtype, layout and shape before C sees a pointer, and raises the mapped
exception for any status C returns. Outputs are written in place.

Each wrapper is built from one declaration of its C arguments (declare.py
says how they read); a new kernel is its C function plus one _kernel line."""
import numpy as np

from .declare import bind
# the generated wrappers call check, ffi.NULL and the pointer adapters from here
from .lib import (aptr, bptr, called, check, dptr, dtype_code, ffi, fptr, hptr, iptr,  # noqa: F401
                  lib)
from .tokens import IGNORE_INDEX, first_out_of_vocab
from ..errors import RangeError, ShapeError


def _kernel(name, declaration, doc, **options):
    """The wrapper of C function ``name``, checked and called as ``declaration`` says."""
    return bind(globals(), lib, name, declaration, doc, **options)


# the packed q, k, v heads of a grouped-query attention row
_QKV = "(NH+2*NKV)*hs"

# ---- encoder.c ------------------------------------------------------------------

encoder_forward = _kernel(
    "encoder_forward",
    "out[B,T,C] written, inp[B,T] tokens<V, wte[V,C], wpe[>=T,C] or None | B T C V from inp, wte",
    """out[B,T,C] (written) = wte[inp[b,t]] + wpe[t]; inp int32 [B,T], wte [V,C], wpe [>=T,C].

    ``wpe=None``: no position embedding, out = wte[inp[b,t]].""")

encoder_backward = _kernel(
    "encoder_backward",
    "dwte[V,C] +=, dwpe[>=T,C] += or None, dout[B,T,C], inp[B,T] tokens<V"
    " | B T C V from inp, dwte",
    """dwte[V,C] (+=), dwpe[>=T,C] (+=; None when the forward had no wpe) <- dout[B,T,C], inp.""")

sinusoidal_forward = _kernel(
    "sinusoidal_forward",
    "out[B,T,C] written, inp[B,T,C], pos[B]=None | B T C from inp",
    """out[B,T,C] (written; may be inp) = inp + the sinusoidal position
    embedding at positions pos[b] + t (pos int32 [B] >= 0, or None: t).""")

# ---- norms.c --------------------------------------------------------------------

layernorm_forward = _kernel(
    "layernorm_forward",
    "out[B,T,C] written, mean[B,T] written, rstd[B,T] written, inp[B,T,C], weight[C], bias[C]"
    " | B T C from inp | eps=1e-5, dtype(out)",
    """out[B,T,C] (written), mean[B,T], rstd[B,T] (written) <- inp, weight[C], bias[C].
    out float32, or bf16 (uint16): the float32 result rounded to nearest even.""")

residual_layernorm_forward = _kernel(
    "residual_layernorm_forward",
    "residual[B,T,C] written, out[B,T,C] written, mean[B,T] written, rstd[B,T] written,"
    " inp1[B,T,C], inp2[B,T,C], weight[C], bias[C] | B T C from inp1 | eps=1e-5, dtype(out)",
    """residual[B,T,C] (written) = inp1 + inp2, then layernorm_forward of it into
    out (float32 or bf16), mean, rstd: bitwise residual_forward, then layernorm_forward.""")

layernorm_backward = _kernel(
    "layernorm_backward",
    "dinp[B,T,C] +=, dweight[C] += or None, dbias[C] += or None, dout[B,T,C], inp[B,T,C],"
    " weight[C], mean[B,T], rstd[B,T] | B T C from inp | written:flag=0",
    """dinp[B,T,C], dweight[C], dbias[C] (+=) <- dout, inp, weight, mean, rstd.
    dweight and dbias may be None (frozen): that sum is skipped. written=True:
    dinp written, not added into.""")

rmsnorm_forward = _kernel(
    "rmsnorm_forward",
    "out[B,T,C] written, rstd[B,T] written, inp[B,T,C], weight[C] | B T C from inp"
    " | eps=1e-5, dtype(out)",
    """out[B,T,C] (written) = inp * rstd * weight; rstd[B,T] (written) = 1/sqrt(mean(inp^2)+eps).
    out float32, or bf16 (uint16): the float32 result rounded to nearest even.""")

residual_rmsnorm_forward = _kernel(
    "residual_rmsnorm_forward",
    "residual[B,T,C] written, out[B,T,C] written, rstd[B,T] written, inp1[B,T,C], inp2[B,T,C],"
    " weight[C] | B T C from inp1 | eps=1e-5, dtype(out)",
    """residual[B,T,C] (written) = inp1 + inp2, then rmsnorm_forward of it into out
    (float32 or bf16) and rstd: bitwise residual_forward, then rmsnorm_forward.""")

rmsnorm_backward = _kernel(
    "rmsnorm_backward",
    "dinp[B,T,C] +=, dweight[C] += or None, dout[B,T,C], inp[B,T,C], weight[C], rstd[B,T]"
    " | B T C from inp | written:flag=0",
    """dinp[B,T,C] (+=), dweight[C] (+=; None: frozen, skipped) <- dout[B,T,C], inp,
    weight[C], rstd[B,T]. written=True: dinp written, not added into.""")

head_rmsnorm_forward = _kernel(
    "head_rmsnorm_forward",
    f"out[B,T,{_QKV}] written, rstd[B,T,NH+NKV] written, inp[B,T,{_QKV}], qweight[hs], kweight[hs]"
    " | B T NH NKV hs from heads(inp, NH, NKV) | eps=1e-6",
    """out[B,T,(NH+2NKV)hs] (written; may be inp): each q head of inp RMS-normed
    with qweight[hs], each k head with kweight[hs], v heads copied;
    rstd[B,T,NH+NKV] (written).""")

head_rmsnorm_backward = _kernel(
    "head_rmsnorm_backward",
    f"dinp[B,T,{_QKV}] +=, dqweight[hs] += or None, dkweight[hs] += or None, dout[B,T,{_QKV}],"
    f" inp[B,T,{_QKV}], qweight[hs], kweight[hs], rstd[B,T,NH+NKV]"
    " | B T NH NKV hs from heads(inp, NH, NKV) | written:flag=0",
    """dinp[B,T,(NH+2NKV)hs] (+=), dqweight[hs], dkweight[hs] (+=) <- dout, inp,
    the weights, rstd[B,T,NH+NKV] (the forward's). dqweight and dkweight may
    both be None (frozen): their sums are skipped. written=True: dinp written,
    not added into.""")

# ---- matmul.c, matmul_bf16.c, bf16.c: "naive" runs the plain reference loops ------

matmul_forward = _kernel(
    "matmul_forward",
    "out[B,T,OC] written, inp[B,T,C], weight[OC,C], bias[OC]=None | B T C OC from inp, weight",
    """out[B,T,OC] (written) = inp[B,T,C] . weight[OC,C]^T + bias[OC] (bias may be None).

    ``variant="naive"`` runs the plain reference loops.""", variants=("naive",))

# matmul_backward's ``written``: the outputs written instead of added into
WRITE_DINP, WRITE_DWEIGHT = lib.LLMC_WRITE_DINP, lib.LLMC_WRITE_DWEIGHT

matmul_backward = _kernel(
    "matmul_backward",
    "dinp[B,T,C] += or None, dweight[OC,C] += or None, dbias[OC] += or None, dout[B,T,OC],"
    " inp[B,T,C], weight[OC,C] | B T C OC from inp, weight | written:int=0",
    """dinp[B,T,C], dweight[OC,C], dbias[OC] (+=) <- dout[B,T,OC], inp, weight.
    Any of dinp, dweight and dbias may be None: that product is skipped.
    ``written`` WRITE_DINP | WRITE_DWEIGHT: those are written instead of
    added into (bitwise the sum into zeros; the caller need not zero them).""",
    variants=("naive",))

matmul_forward_bf16 = _kernel(
    "matmul_forward_bf16",
    "out[B,T,OC] written, inp[B,T,C], weight[OC,C], bias[OC]=None | B T C OC from inp, weight"
    " | dtype(inp)",
    """out[B,T,OC] (written) = bf16(inp[B,T,C]) . weight[OC,C]^T + bias[OC], with
    weight bf16 (uint16) and the products summed in float32 (bias may be None).
    inp float32, or bf16 (uint16), read as it is: bitwise as its float32 source.

    ``variant="naive"`` runs the plain reference loops.""", variants=("naive",))

matmul_gelu_forward_bf16 = _kernel(
    "matmul_gelu_forward_bf16",
    "out[B,T,OC] written, act_out[B,T,OC] written, inp[B,T,C], weight[OC,C], bias[OC]=None"
    " | B T C OC from inp, weight | dtype(inp), dtype(act_out)",
    """out[B,T,OC] (written) = matmul_forward_bf16(inp, weight, bias) and act_out
    (written; float32 or bf16) = gelu_forward(out): bitwise the two calls, the
    GELU applied to each tile of out as the GEMM completes it (avx512bf16).""")

matmul_backward_bf16 = _kernel(
    "matmul_backward_bf16",
    "dinp[B,T,C] += or None, dweight[OC,C] += or None, dbias[OC] += or None, dout[B,T,OC],"
    " inp[B,T,C], weight[OC,C] | B T C OC from inp, weight | dtype(inp), written:int=0",
    """dinp[B,T,C], dweight[OC,C], dbias[OC] (+=) <- dout[B,T,OC], inp, weight (bf16):
    matmul_backward with dout and inp rounded to bf16 in the products (inp
    float32, or bf16 as it is). Any of dinp, dweight and dbias may be None:
    that product is skipped. ``written`` as matmul_backward's.""", variants=("naive",))

float_to_bf16 = _kernel(
    "float_to_bf16", "out[...] written, inp[...] | N from inp",
    """out uint16 [N] (written) = inp float32 [N] rounded to bf16 (ties to even).""")

bf16_to_float = _kernel(
    "bf16_to_float", "out[...] written, inp[...] | N from inp",
    """out float32 [N] (written) = inp bf16 (uint16) [N], exactly.""")

# ---- activations.c ----------------------------------------------------------------

gelu_forward = _kernel(
    "gelu_forward", "out[...] written, inp[...] | N from inp | dtype(out)",
    """out (written) = gelu_tanh(inp), any shape.""")

gelu_backward = _kernel(
    "gelu_backward", "dinp[...] +=, dout[...], inp[...] | N from inp | written:flag=0",
    """dinp (+=) gelu'(inp) * dout, any shape (written=True: written, not added into).""")

relu_forward = _kernel(
    "relu_forward", "out[...] written, inp[...] | N from inp | dtype(out)",
    """out (written) = max(inp, 0), any shape.""")

relu_backward = _kernel(
    "relu_backward", "dinp[...] +=, dout[...], inp[...] | N from inp | written:flag=0",
    """dinp (+=) (inp > 0) * dout, any shape (written=True: written, not added into).""")

gelu_erf_forward = _kernel(
    "gelu_erf_forward", "out[...] written, inp[...] | N from inp | dtype(out)",
    """out (written) = inp * Phi(inp), the exact (erf) GELU, any shape.""")

gelu_erf_backward = _kernel(
    "gelu_erf_backward", "dinp[...] +=, dout[...], inp[...] | N from inp | written:flag=0",
    """dinp (+=) gelu_erf'(inp) * dout, any shape (written=True: written, not added into).""")

residual_forward = _kernel(
    "residual_forward", "out[...] written, inp1[...], inp2[...] | N from inp1",
    """out (written) = inp1 + inp2, any shape.""")

residual_backward = _kernel(
    "residual_backward", "dinp1[...] +=, dinp2[...] +=, dout[...] | N from dout",
    """dinp1, dinp2 (+=) dout, any shape.""")

swiglu_forward = _kernel(
    "swiglu_forward", "out[...,FF] written, inp[...,2*FF] | N FF from gated(inp) | dtype(out)",
    """out[...,FF] (written) = silu(inp[...,:FF]) * inp[...,FF:]; any leading dims (N rows).""")

swiglu_backward = _kernel(
    "swiglu_backward", "dinp[...,2*FF] +=, dout[...,FF], inp[...,2*FF] | N FF from gated(inp)"
    " | written:flag=0",
    """dinp[...,2FF] (+=) dgate, dup <- dout[...,FF], inp[...,2FF] (written=True: written).""")

geglu_forward = _kernel(
    "geglu_forward", "out[...,FF] written, inp[...,2*FF] | N FF from gated(inp) | dtype(out)",
    """out[...,FF] (written) = gelu(inp[...,:FF]) * inp[...,FF:] (gelu_forward's tanh form).""")

geglu_backward = _kernel(
    "geglu_backward", "dinp[...,2*FF] +=, dout[...,FF], inp[...,2*FF] | N FF from gated(inp)"
    " | written:flag=0",
    """dinp[...,2FF] (+=) dgate, dup <- dout[...,FF], inp[...,2FF] (written=True: written).""")

reglu_forward = _kernel(
    "reglu_forward", "out[...,FF] written, inp[...,2*FF] | N FF from gated(inp) | dtype(out)",
    """out[...,FF] (written) = relu(inp[...,:FF]) * inp[...,FF:].""")

reglu_backward = _kernel(
    "reglu_backward", "dinp[...,2*FF] +=, dout[...,FF], inp[...,2*FF] | N FF from gated(inp)"
    " | written:flag=0",
    """dinp[...,2FF] (+=) dgate, dup <- dout[...,FF], inp[...,2FF] (written=True: written).""")

# the activation of each MLP choice (config.mlp): forward (its out float32, or
# bf16: the float32 result rounded), backward (written=True: dinp written, not added into)
MLP_ACTIVATIONS = {"gelu": (gelu_forward, gelu_backward), "relu": (relu_forward, relu_backward),
                   "gelu_erf": (gelu_erf_forward, gelu_erf_backward),
                   "swiglu": (swiglu_forward, swiglu_backward),
                   "geglu": (geglu_forward, geglu_backward),
                   "reglu": (reglu_forward, reglu_backward)}

# ---- dropout.c ----------------------------------------------------------------------

# batch row b of a dropout kernel draws its mask from seed + b * DROPOUT_ROW_STEP
# (mod 2^64): rows b0 .. of a larger batch pass seed + b0 * DROPOUT_ROW_STEP
DROPOUT_ROW_STEP = 0x9E3779B97F4A7C15

dropout_forward = _kernel(
    "dropout_forward", "out[B,T,C] written, inp[B,T,C] | B T C from inp | p, seed:seed",
    """out[B,T,C] (written; may be inp) = inp * M / (1 - p): M[b,t,c] 1 with
    probability 1 - p, else 0, a hash of (seed, b, t, c), never stored. p in
    [0, 1) (else InvalidValueError); p = 0 is the identity. seed: an int in
    [0, 2^64).""")

dropout_backward = _kernel(
    "dropout_backward", "dinp[B,T,C] written, dout[B,T,C] | B T C from dout | p, seed:seed",
    """dinp[B,T,C] (written, not +=; may be dout) = dout * M / (1 - p), the
    mask of dropout_forward with the same p and seed.""")

# ---- softmax_xent.c -------------------------------------------------------------

softmax_forward = _kernel(
    "softmax_forward", "probs[B,T,Vp] written, logits[B,T,Vp] | B T V Vp from logits",
    """probs[B,T,Vp] (written) = softmax over the first V columns of logits[B,T,Vp], 0 past V.""")

softmax_crossentropy_forward = _kernel(
    "softmax_crossentropy_forward",
    "losses[B,T] written, stats[B,T,2] written, logits[B,T,Vp], targets[B,T] targets<V"
    " | B T V Vp from logits",
    """losses[B,T] (written) = -log softmax(logits[b,t,:V])[targets[b,t]], and
    stats[B,T,2] (written) = each row's (max, 1/normaliser) for the backward;
    logits[B,T,Vp] are only read; targets int32 in [0, V), or IGNORE_INDEX
    (-1): that row's loss is 0.""")

softmax_crossentropy_backward = _kernel(
    "softmax_crossentropy_backward",
    "dlogits[B,T,Vp] written, logits[B,T,Vp], stats[B,T,2], dlosses[B,T], targets[B,T] targets<V"
    " | B T V Vp from logits",
    """dlogits[B,T,Vp] (written) = (softmax - onehot(targets)) * dlosses over the
    first V columns, 0 past V, from the forward's stats; 0 in every column of a
    row whose target is IGNORE_INDEX; dlogits may be logits (the gradient
    then replaces the logits in place).""")

# ---- adamw.c --------------------------------------------------------------------

adamw_update = _kernel(
    "adamw_update",
    "params[N] updated, params_bf16[N]=None written, m[N] updated, v[N] updated, grads[N]"
    " | N from params | learning_rate, beta1, beta2, eps, weight_decay, t:int",
    """params, m, v [N] (updated in place) by one AdamW step with grads [N]; t >= 1.
    ``params_bf16`` uint16 [N] (written), if given: the new params in bf16.""",
    args="params m v grads learning_rate beta1 beta2 eps weight_decay t params_bf16")

scale_inplace = _kernel(
    "scale_inplace", "x[N] updated | N from x | scale",
    """x *= scale over a flat float32 array.""")

fill_zero = _kernel(
    "fill_zero", "x[N] written | N from x",
    """x = 0 over a flat float32 array (a large one with streaming stores).""")


def global_norm_squared(x):
    """sum(x**2) over a flat float32 array, as a Python float (summed in double)."""
    # written out: the C output is a one-element buffer this wrapper owns and returns
    _dims(x, "x")
    out = np.zeros(1, np.float64)
    check(lib.global_norm_squared(dptr(out, "out", (1,), out=True),
                                  fptr(x, "x", (x.size,)), x.size), "global_norm_squared")
    return float(out[0])


# ---- rope.c ---------------------------------------------------------------------

rope_forward = _kernel(
    "rope_forward",
    f"out[B,T,{_QKV}] written, inp[B,T,{_QKV}], pos[B] or None, inv_freq[hs//2]=None"
    " | B T NH NKV hs from rope_heads(inp, NH, NKV) | theta=10000.0, interleaved:flag=False",
    """out[B,T,(NH+2NKV)hs] (written; may be inp): q and k heads of inp rotated
    (half-split pairs i, i+hs/2; ``interleaved``: pairs 2i, 2i+1) by
    (pos[b]+t) * f_i, f_i = theta^(-2i/hs) or inv_freq[i] (float64 [hs/2], a
    scaled RoPE) when given; v heads copied; pos int32 [B] >= 0 or None.""",
    args="out inp pos NH NKV theta inv_freq interleaved")

rope_backward = _kernel(
    "rope_backward",
    f"dinp[B,T,{_QKV}] +=, dout[B,T,{_QKV}], pos[B] or None, inv_freq[hs//2]=None"
    " | B T NH NKV hs from rope_heads(dout, NH, NKV) | theta=10000.0, interleaved:flag=False,"
    " written:flag=0",
    """dinp[B,T,(NH+2NKV)hs] (+=) the inverse rotation of dout (v heads pass through;
    written=True: written, not added into).""",
    args="dinp dout pos NH NKV theta inv_freq interleaved written")

rope_table = _kernel(
    "rope_table",
    "cos_table[P,hs//2] written, sin_table[P,hs//2] written, inv_freq[hs//2]=None"
    " | P hs from rope_half(cos_table) | theta=10000.0",
    """cos_table, sin_table [P,hs/2] (written): the cos and sin of the angle
    rope_forward turns pair i by at position p < P, the same floats it
    computes (theta, inv_freq as there).""",
    args="cos_table sin_table theta inv_freq")

kv_cache_write = _kernel(
    "kv_cache_write",
    "q[B,NH*hs] written, k_cache[B,slots,NKV*hs] updated, v_cache[B,slots,NKV*hs] updated,"
    f" qkv[B,{_QKV}], pos[B], cos_table[P,hs//2] or None, sin_table[P,hs//2] or None"
    " | B NH NKV hs slots P from cache_heads(k_cache, NH, NKV, cos_table) | interleaved:flag=False",
    """One new position per row (KV-cache decoding): row b of qkv [B,(NH+2NKV)hs]
    at position pos[b] (int32 >= 0), its q and k heads turned by RoPE with row
    pos[b] of rope_table's cos_table, sin_table [P,hs/2] (bitwise
    rope_forward's; both None: copied), q heads into q [B,NH*hs], k and v heads
    into slot pos[b] % slots of row b of k_cache, v_cache [B,slots,NKV*hs].""")

# ---- quant.c: llama.cpp's blocks of 32 weights; qtype is GGML's type number --------

QUANT_TYPES = {"q8_0": lib.LLMC_QUANT_Q8_0, "q4_0": lib.LLMC_QUANT_Q4_0}
QUANT_BLOCK = 32
_BLOCK_BYTES = {lib.LLMC_QUANT_Q8_0: 34, lib.LLMC_QUANT_Q4_0: 18}

quantize_rows = _kernel(
    "quantize_rows",
    "out[R,IC//32*_block_bytes(qtype)] written, inp[R,IC] | R IC from quant_rows(inp, qtype)"
    " | qtype:int",
    """out[R, IC/32 * block bytes] (written, uint8) = inp[R, IC] in blocks of 32,
    qtype QUANT_TYPES["q8_0"] or ["q4_0"]: bytes equal to gguf.quants.quantize.""")

dequantize_rows = _kernel(
    "dequantize_rows",
    "out[R,IC] written, inp[R,IC//32*_block_bytes(qtype)] | R IC from quant_rows(out, qtype)"
    " | qtype:int",
    """out[R, IC] (written) = the weights of inp's blocks (= gguf.quants.dequantize).""")

quant_pack_rows = _kernel(
    "quant_pack_rows",
    "out[R,IC//32*_block_bytes(qtype)] written, blocks[R,IC//32*_block_bytes(qtype)]"
    " | R IC from blocks, packed_ic(blocks, qtype) | qtype:int",
    """out (written) = quantize_rows' blocks moved, within each row, to the
    layout matmul_forward_quant and the panel products read.""")

quant_unpack_rows = _kernel(
    "quant_unpack_rows",
    "out[R,IC//32*_block_bytes(qtype)] written, packed[R,IC//32*_block_bytes(qtype)]"
    " | R IC from packed, packed_ic(packed, qtype) | qtype:int",
    """out (written) = quant_pack_rows' inverse: GGUF's blocks again.""")

matmul_forward_quant = _kernel(
    "matmul_forward_quant",
    "out[N,OC] written, inp[N,IC], weight[OC,IC//32*_block_bytes(qtype)], bias[OC] or None"
    " | N IC OC from weight, quant_rows(inp, qtype) | qtype:int",
    """out[N,OC] (written) = inp[N,IC] . W^T + bias[OC] (or None), W [OC, IC] in
    quantize_rows' blocks, each row of inp quantized to Q8_0 on the fly.

    ``variant`` forces a path: "portable", "avx2", "avxvnni", "avx512vnni"
    (UnsupportedError where this CPU lacks it); every path gives the same bits.""",
    variants=("portable", "avx2", "avxvnni", "avx512vnni"))


matmul_forward_quant_panels = _kernel(
    "matmul_forward_quant_panels",
    "out[N,OC] written, inp[N,IC], weight[OC,IC//32*_block_bytes(qtype)], bias[OC] or None"
    " | N IC OC from weight, quant_rows(inp, qtype) | qtype:int",
    """out[N,OC] (written) = inp[N,IC] . W^T + bias[OC] (or None) for many rows:
    W dequantised to bf16 (d*q rounded to nearest even) a tile at a time and
    multiplied by the bf16 GEMM, bitwise matmul_forward_bf16 on bf16(W).""")

matmul_backward_quant_panels = _kernel(
    "matmul_backward_quant_panels",
    "dinp[N,IC] +=, dout[N,OC], weight[OC,IC//32*_block_bytes(qtype)]"
    " | N IC OC from weight, quant_rows(dinp, qtype) | qtype:int",
    """dinp[N,IC] (+=) <- dout[N,OC] . W, W as in matmul_forward_quant_panels:
    bitwise matmul_backward_bf16's dinp on bf16(W); no weight gradient.""")

moe_grouped_forward_quant = _kernel(
    "moe_grouped_forward_quant",
    "out[R,OC] written, inp[R,IC], weight[E*OC,IC//32*_block_bytes(qtype)], offsets[E+1]"
    " | R IC OC E from out, grouped_quant(offsets, inp, qtype)"
    " | qtype:int, few_rows:int",
    """out[R,OC] (written): rows offsets[e] .. offsets[e+1] = those rows of
    inp[R,IC] . W_e^T, W_e the OC rows of weight from e*OC (quant_pack_rows'
    layout): bitwise matmul_forward_quant on an expert of 1 .. few_rows rows
    (all such experts in one parallel loop), matmul_forward_quant_panels on
    one of more.

    ``variant`` forces the few-row path, as matmul_forward_quant's.""",
    variants=("portable", "avx2", "avxvnni", "avx512vnni"))

# ---- attention.c ----------------------------------------------------------------

attention_forward = _kernel(
    "attention_forward",
    "out[B,T,C] written, stats[B,NH,T,2] written, inp[B,T,3*C] | B T C NH from qkv(inp, NH)",
    """out[B,T,C] (written), stats[B,NH,T,2] (written: each query row's score max
    and 1/sum of exponentials, saved for backward) <- inp[B,T,3C] (q, k, v).""")

attention_backward = _kernel(
    "attention_backward",
    "dinp[B,T,3*C] +=, dout[B,T,C], inp[B,T,3*C], stats[B,NH,T,2] | B T C NH from qkv(inp, NH)"
    " | written:flag=0",
    """dinp[B,T,3C] (+=) <- dout[B,T,C], inp[B,T,3C], stats[B,NH,T,2]. written=True:
    dinp written instead (bitwise the sum into zeros; the caller need not zero it).""")

attention_gqa_forward = _kernel(
    "attention_gqa_forward",
    f"out[B,T,NH*hs] written, stats[B,NH,T,2] written, inp[B,T,{_QKV}], slopes[NH] or None"
    " | B T NH NKV hs from heads(inp, NH, NKV) | window:window=0, dropout=0.0, seed:seed=0",
    """out[B,T,NH*hs] (written), stats[B,NH,T,2] (written: each query row's score
    max and 1/sum of exponentials, saved for backward) <- inp[B,T,(NH+2*NKV)*hs]
    (NH q heads, NKV k heads, NKV v heads), slopes[NH] float32 ALiBi slopes or None.

    Query head h reads kv head h // (NH // NKV); NH % NKV must be 0. A
    ``window`` > 0 is a sliding window: query t attends to keys
    t - window + 1 .. t only (0: all keys up to t). ``dropout`` in [0, 1)
    drops probabilities: att[b,h,t,t2] takes the mask of element
    (b, h*T + t, t2) of dropout_forward on [B, NH*T, T] with ``seed``.""")

attention_gqa_backward = _kernel(
    "attention_gqa_backward",
    f"dinp[B,T,{_QKV}] +=, dout[B,T,NH*hs], inp[B,T,{_QKV}], stats[B,NH,T,2], slopes[NH] or None"
    " | B T NH NKV hs from heads(inp, NH, NKV)"
    " | window:window=0, dropout=0.0, seed:seed=0, written:flag=0",
    """dinp[B,T,(NH+2*NKV)*hs] (+=) <- dout[B,T,NH*hs], inp, stats[B,NH,T,2],
    slopes[NH] (the forward's) or None, window, dropout and seed (the forward's).
    written=True: dinp written instead (bitwise the sum into zeros).""")

attention_gqa_forward_bf16 = _kernel(
    "attention_gqa_forward_bf16",
    f"out[B,T,NH*hs] written, stats[B,NH,T,2] written, inp[B,T,{_QKV}], slopes[NH] or None"
    " | B T NH NKV hs from heads(inp, NH, NKV) | window:window=0, dropout=0.0, seed:seed=0",
    """attention_gqa_forward's contract with q, k, v and the probabilities rounded
    to bf16 in its two products (summed in float32; softmax and stats float32):
    the attention of bf16 models.""")

attention_gqa_backward_bf16 = _kernel(
    "attention_gqa_backward_bf16",
    f"dinp[B,T,{_QKV}] +=, dout[B,T,NH*hs], inp[B,T,{_QKV}], stats[B,NH,T,2], slopes[NH] or None"
    " | B T NH NKV hs from heads(inp, NH, NKV)"
    " | window:window=0, dropout=0.0, seed:seed=0, written:flag=0",
    """attention_gqa_backward's contract for attention_gqa_forward_bf16: every
    product's operands (dout, P, dS, q, k, v) rounded to bf16, sums, the
    softmax's backward and stats float32.""")

attention_gqa_probs = _kernel(
    "attention_gqa_probs",
    f"att[B,NH,T,T] written, inp[B,T,{_QKV}], stats[B,NH,T,2], slopes[NH] or None"
    " | B T NH NKV hs from heads(inp, NH, NKV) | window:window=0",
    """att[B,NH,T,T] (written: the forward's probabilities, 0 outside each row's
    window, bitwise those its out used) <- inp, stats[B,NH,T,2], slopes[NH] or
    None, window, as given to attention_gqa_forward.""")

attention_gqa_entropy = _kernel(
    "attention_gqa_entropy",
    f"entropy[B,NH,T] written, inp[B,T,{_QKV}], stats[B,NH,T,2], slopes[NH] or None"
    " | B T NH NKV hs from heads(inp, NH, NKV) | window:window=0",
    """entropy[B,NH,T] (written: -sum_t2 att ln att of each query row, natural
    log, without holding att) <- inp, stats[B,NH,T,2], slopes[NH] or None,
    window, as given to attention_gqa_forward.""")

attention_forward_naive = _kernel(
    "attention_forward_naive",
    f"out[B,T,NH*hs] written, att[B,NH,T,T] written, inp[B,T,{_QKV}], slopes[NH] or None"
    " | B T NH NKV hs from heads(inp, NH, NKV) | window:window=0, dropout=0.0, seed:seed=0",
    """attention_gqa_forward's contract, by plain loops (llm.c's): the reference.
    att[B,NH,T,T] (written) holds the probabilities before the dropout.""")

attention_backward_naive = _kernel(
    "attention_backward_naive",
    f"dinp[B,T,{_QKV}] +=, dout[B,T,NH*hs], inp[B,T,{_QKV}], att[B,NH,T,T]"
    " | B T NH NKV hs from heads(inp, NH, NKV)"
    " | window:window=0, dropout=0.0, seed:seed=0, written:flag=0",
    """attention_gqa_backward's contract, by plain loops (llm.c's): the reference.""")

attention_entropy_naive = _kernel(
    "attention_entropy_naive", "entropy[B,NH,T] written, att[B,NH,T,T] | B NH T from att",
    """attention_gqa_entropy's contract from the whole of att[B,NH,T,T], by plain
    loops: the reference.""")

attention_decode = _kernel(
    "attention_decode",
    "out[B,NH*hs] written, att[B,NH,maxT] written, q[B,NH*hs], k_cache[B,maxT,NKV*hs],"
    " v_cache[B,maxT,NKV*hs], lengths[B], slopes[NH] or None"
    " | B NH NKV hs maxT from kv_heads(k_cache, NH, NKV) | window:window=0",
    """One new position per row against a KV cache: out[B,NH*hs] (written),
    att[B,NH,maxT] (written: the probabilities of the row's window of keys,
    from [0]; the rest untouched) <- q[B,NH*hs], k_cache/v_cache[B,maxT,NKV*hs]
    (a ring: position t2 in slot t2 % maxT), lengths int32 [B] (positions so
    far, >= 1, the window's keys fitting in maxT slots, else RangeError),
    slopes[NH] float32 or None, window (0: every position).

    Row b's query sits at position lengths[b] - 1, as in attention_gqa_forward.""")


def alibi_slopes(n_heads):
    """The ALiBi paper's head slopes, float32 [n_heads].

    For a power of two n: 2^(-8i/n), i = 1..n. Otherwise, with m the largest
    power of two below n: the m slopes for m heads, then the first n - m of
    the odd-numbered slopes for 2m heads, 2^(-4i/m) for i = 1, 3, 5, ...
    (the slopes for 2m heads that the m-head sequence does not already hold)."""
    if isinstance(n_heads, bool) or not isinstance(n_heads, (int, np.integer)) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    n = int(n_heads)
    m = 1 << (n.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * i / m) for i in range(1, m + 1)]
    slopes += [2.0 ** (-4.0 * i / m) for i in range(1, 2 * (n - m), 2)]
    return np.array(slopes, dtype=np.float32)


# ---- moe.c: N tokens, E experts, k per token; R = N*k grouped rows -----------------

moe_route_forward = _kernel(
    "moe_route_forward",
    "probs[N,E] written, weights[N,k] written, experts[N,k] written, aux[2] written, logits[N,E]"
    " | N E k from logits, weights | norm_topk_prob:flag=True",
    """probs[N,E] (written) = softmax(logits[N,E]); experts int32 [N,k] (written) the
    top k per token, largest first, ties to the lower index; weights[N,k] (written)
    their probabilities, renormalised to sum 1 if ``norm_topk_prob``; aux[2]
    (written) = (load balancing E sum_e f_e P_e, f_e the fraction of the N*k
    assignments to e; z-loss mean logsumexp(logits)^2). 1 <= k <= E.""")

moe_route_backward = _kernel(
    "moe_route_backward",
    "dlogits[N,E] +=, dweights[N,k] or None, probs[N,E], logits[N,E], experts[N,k],"
    " fractions[E]=None | N E k from probs, experts"
    " | norm_topk_prob:flag=True, aux_coef=0.0, z_coef=0.0, written:flag=0",
    """dlogits[N,E] (+=) <- dweights[N,k] (or None) through the renormalisation and
    the softmax, plus the gradients of aux_coef * aux[0] + z_coef * aux[1]; probs,
    logits, experts the forward's. fractions float64 [E]: the balance loss's f_e
    of the whole batch these N rows are a rank's part of (None: these rows').
    written=True: dlogits written, not added into.""")

moe_permute = _kernel(
    "moe_permute",
    "offsets[E+1] written, positions[N,k] written, experts[N,k] | N E k from experts",
    """offsets int32 [E+1] (written): expert e's grouped rows start at offsets[e]
    (offsets[E] = N*k); positions int32 [N,k] (written): the grouped row of
    assignment (n, j), each expert's tokens in ascending order.""",
    args="offsets positions experts E")

moe_gather_forward = _kernel(
    "moe_gather_forward",
    "grouped[N*k,C] written, inp[N,C], positions[N,k] | N C k from inp, positions"
    " | dtype(grouped), dtype(inp)",
    """grouped[N*k,C] (written): row positions[n,j] = inp[n]; both float32 or both
    bf16 (uint16).""")

moe_gather_backward = _kernel(
    "moe_gather_backward",
    "dinp[N,C] +=, dgrouped[N*k,C], positions[N,k] | N C k from dinp, positions"
    " | written:flag=0",
    """dinp[N,C] (+=) sum_j dgrouped[positions[n,j]], in the order j = 0 .. k-1
    (written=True: written, not added into).""")

moe_combine_forward = _kernel(
    "moe_combine_forward",
    "out[N,C] written, expert_out[N*k,C], weights[N,k], positions[N,k]"
    " | N C k from out, weights",
    """out[N,C] (written) = sum_j weights[n,j] * expert_out[positions[n,j]], in order j.""")

moe_combine_backward = _kernel(
    "moe_combine_backward",
    "dexpert_out[N*k,C] written, dweights[N,k] written, dout[N,C], expert_out[N*k,C],"
    " weights[N,k], positions[N,k] | N C k from dout, weights",
    """dexpert_out[N*k,C] (written): row positions[n,j] = weights[n,j] * dout[n];
    dweights[N,k] (written) = dout[n] . expert_out[positions[n,j]].""")

moe_grouped_forward = _kernel(
    "moe_grouped_forward",
    "out[R,OC] written, inp[R,C], weight[E,OC,C], offsets[E+1] | R C OC E from inp, weight",
    """out[R,OC] (written): rows offsets[e] .. offsets[e+1] = those rows of inp[R,C]
    . weight[e]^T (weight [E,OC,C], no bias), bitwise matmul_forward's.""")

moe_grouped_backward = _kernel(
    "moe_grouped_backward",
    "dinp[R,C] += or None, dweight[E,OC,C] += or None, dout[R,OC], inp[R,C], weight[E,OC,C],"
    " offsets[E+1] | R C OC E from inp, weight | written:int=0",
    """dinp[R,C] (+=) dout . weight[e] on expert e's rows, dweight[E,OC,C] (+=)
    dout_e^T . inp_e; either may be None (skipped). ``written`` WRITE_DINP |
    WRITE_DWEIGHT: those written instead (bitwise the sum into zeros; an
    expert with no rows zeroed).""")

moe_grouped_forward_bf16 = _kernel(
    "moe_grouped_forward_bf16",
    "out[R,OC] written, inp[R,C], weight[E,OC,C], offsets[E+1] | R C OC E from inp, weight"
    " | dtype(inp)",
    """moe_grouped_forward with weight bf16 (uint16) and inp float32 or bf16: each
    row bitwise matmul_forward_bf16's.""")

moe_grouped_backward_bf16 = _kernel(
    "moe_grouped_backward_bf16",
    "dinp[R,C] += or None, dweight[E,OC,C] += or None, dout[R,OC], inp[R,C], weight[E,OC,C],"
    " offsets[E+1] | R C OC E from inp, weight | dtype(inp), written:int=0",
    """moe_grouped_backward with weight bf16 (uint16) and inp float32 or bf16:
    bitwise matmul_backward_bf16's (written as there).""")

# ---- lora_bf16.c -------------------------------------------------------------------

lora_up_forward_bf16 = _kernel(
    "lora_up_forward_bf16",
    "out[B,T,W] +=, h[B,T,n,r], up_t[n,r,W], rows[n,2] | B T W n r from out, h",
    """out[B,T,W] (+=) h_j . up_t[j] over adapter j's columns rows[j] (int32
    (start, stop), ascending, disjoint): n LoRA adapters' up products in bf16,
    up_t bf16 (uint16), each over its own columns only.""")

lora_up_backward_bf16 = _kernel(
    "lora_up_backward_bf16",
    "dh[B,T,n,r] written, dup_t[n,r,W] written, dout[B,T,W], h[B,T,n,r], up_t[n,r,W],"
    " rows[n,2] | B T W n r from dout, h",
    """dh[B,T,n,r] (written) = dout . up_t[j]^T over adapter j's columns, and
    dup_t[j] (written in adapter j's columns only) = h_j^T . dout there:
    lora_up_forward_bf16's gradients.""")

# ---- what the declarations call: checks of arguments and size rules ---------------

def _dims(arr, name, ndim=None):
    """arr's shape, after checking it is a numpy array of ``ndim`` dimensions."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if ndim is not None and arr.ndim != ndim:
        raise ShapeError(f"{name} has shape {arr.shape}, expected {ndim} dimensions")
    return arr.shape


def _check_tokens(status, where, tokens, name, V, allow_ignore=False):
    """check(), except that a token id outside [0, V) is reported with its
    position and value (C only says that one is); ``allow_ignore``: targets,
    which may also be IGNORE_INDEX."""
    if status == lib.LLMC_ERR_RANGE:
        pos = first_out_of_vocab(tokens, V, allow_ignore)
        if pos is not None:
            also = f" or {IGNORE_INDEX} (ignored)" if allow_ignore else ""
            err = RangeError(f"{where}: {name}[{', '.join(str(int(i)) for i in pos)}] = "
                             f"{int(tokens[pos])} is not a token id in [0, {V}){also}")
            err.status = status
            raise err
    check(status, where)


def _variant(table, variant):
    try:
        return table[variant]
    except KeyError:
        raise ValueError(f"unknown variant {variant!r}; known: {sorted(table)}") from None


def _first_rows(table, T, name):
    if not isinstance(table, np.ndarray) or table.ndim != 2 or table.shape[0] < T:
        shape = getattr(table, "shape", None)
        raise ShapeError(f"{name} has shape {shape}, needs at least {T} rows")
    return table[:T]


def _seed(seed):
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) \
            or not 0 <= seed < 2**64:
        raise ValueError(f"a dropout seed must be an int in [0, 2^64), got {seed!r}")
    return int(seed)


def _window(window):
    """A sliding window's size: an int >= 0 (0: none)."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no sliding window), got {window!r}")
    return int(window)


def _qkv(inp, name, NH):
    """B, T, C of inp [B, T, 3C] (q, k, v of NH heads each)."""
    B, T, C3 = _dims(inp, name, 3)
    if C3 % 3 != 0 or (C3 // 3) % NH != 0:
        raise ShapeError(f"{name} has {C3} channels: expected 3*C with C divisible by NH={NH}")
    return B, T, C3 // 3


def _heads(inp, name, NH, NKV):
    """B, T, hs of a packed GQA input [B, T, (NH + 2 NKV) hs], after checking the head counts."""
    B, T, width = _dims(inp, name, 3)
    _check_heads(NH, NKV)
    heads = NH + 2 * NKV
    if width % heads != 0:
        raise ShapeError(f"{name} has {width} channels: expected (NH + 2*NKV)*hs "
                         f"= {heads}*hs with NH={NH}, NKV={NKV}")
    return B, T, width // heads


def _block_bytes(qtype):
    return _BLOCK_BYTES[qtype]


def _quant_rows(arr, name, qtype):
    """rows, IC of a float [rows, IC] beside quantized blocks of qtype, after
    checking that qtype is known and IC a whole number of blocks."""
    if qtype not in _BLOCK_BYTES:
        known = ", ".join(f"{k} ({v})" for k, v in QUANT_TYPES.items())
        raise ValueError(f"unknown quantisation type {qtype!r}; known: {known}")
    rows, IC = _dims(arr, name, 2)
    if IC % QUANT_BLOCK != 0:
        raise ShapeError(f"{name} has shape {arr.shape}: its input dimension {IC} is not a "
                         f"multiple of {QUANT_BLOCK}, the quantisation block")
    return rows, IC


def _grouped_quant(offsets, name, inp, qtype):
    """(IC, E) of a grouped product on quantized experts: inp's [R, IC] (a
    whole number of blocks of a known qtype) and offsets' [E+1]."""
    _, IC = _quant_rows(inp, "inp", qtype)
    size = _dims(offsets, name, 1)[0]
    if size < 2:
        raise ShapeError(f"{name} has shape {offsets.shape}: expected [E+1] offsets, E >= 1")
    return IC, size - 1


def _packed_ic(arr, name, qtype):
    """(IC,): the input dimension of quantized rows [rows, bytes] of qtype,
    after checking that qtype is known and the rows whole blocks."""
    if qtype not in _BLOCK_BYTES:
        known = ", ".join(f"{k} ({v})" for k, v in QUANT_TYPES.items())
        raise ValueError(f"unknown quantisation type {qtype!r}; known: {known}")
    _, row_bytes = _dims(arr, name, 2)
    if row_bytes == 0 or row_bytes % _BLOCK_BYTES[qtype] != 0:
        raise ShapeError(f"{name} has shape {arr.shape}: its rows are not whole blocks of "
                         f"{_BLOCK_BYTES[qtype]} bytes")
    return (row_bytes // _BLOCK_BYTES[qtype] * QUANT_BLOCK,)


def _kv_heads(k_cache, name, NH, NKV):
    """B, hs, maxT of a KV cache [B, maxT, NKV hs], after checking the head counts."""
    B, maxT, kv_width = _dims(k_cache, name, 3)
    _check_heads(NH, NKV)
    if kv_width % NKV != 0:
        raise ShapeError(f"{name} has {kv_width} channels: expected NKV*hs with NKV={NKV}")
    return B, kv_width // NKV, maxT


def _check_heads(NH, NKV):
    for name, n in (("NH", NH), ("NKV", NKV)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ShapeError(f"{name} must be a positive int, got {n!r}")
    if NH % NKV != 0:
        raise ShapeError(f"NH={NH} is not a multiple of NKV={NKV}")


def _rope_heads(inp, name, NH, NKV):
    """B, T, hs of a packed row [B, T, (NH + 2 NKV) hs]; hs must be even (RoPE
    rotates pairs), and NH need not be a multiple of NKV."""
    B, T, CH = _dims(inp, name, 3)
    for size, value in (("NH", NH), ("NKV", NKV)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"{size} must be an int, got {type(value).__name__}")
        if value <= 0:
            raise ShapeError(f"{size}={value} must be positive")
    heads = NH + 2 * NKV
    if CH % heads != 0 or (CH // heads) % 2 != 0:
        raise ShapeError(f"{name} has {CH} channels: expected (NH + 2*NKV) * hs = {heads} * hs "
                         f"with an even head size hs")
    return B, T, CH // heads


def _rope_half(table, name):
    """P, hs of a RoPE table [P, hs/2]."""
    P, half = _dims(table, name, 2)
    return P, 2 * half


def _cache_heads(k_cache, name, NH, NKV, cos_table):
    """B, hs, slots, P of a KV cache [B, slots, NKV hs] beside RoPE tables
    [P, hs/2] (P 0 without them)."""
    B, hs, slots = _kv_heads(k_cache, name, NH, NKV)
    return B, hs, slots, 0 if cos_table is None else _dims(cos_table, "cos_table", 2)[0]


def _gated(inp, name):
    """(N, FF) for inp of shape (..., 2*FF): N is the product of the leading dims."""
    shape = _dims(inp, name)
    if len(shape) == 0 or shape[-1] % 2 != 0:
        raise ShapeError(f"{name} has shape {shape}: its last axis must be 2*FF (gate, up)")
    N = inp.size // shape[-1] if shape[-1] else 0   # a zero size is left to C to reject
    return N, shape[-1] // 2
