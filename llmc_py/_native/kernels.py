"""One thin wrapper per C kernel: the same name and argument order as in
csrc/llmc_api.h, with sizes taken from the array shapes. Each wrapper checks
dtype, layout and shape before C sees a pointer, and raises the mapped
exception for any status C returns. Outputs are written in place."""
import numpy as np

from .lib import check, dptr, ffi, fptr, hptr, iptr, lib
from .tokens import IGNORE_INDEX, first_out_of_vocab
from ..errors import RangeError, ShapeError


def encoder_forward(out, inp, wte, wpe):
    """out[B,T,C] (written) = wte[inp[b,t]] + wpe[t]; inp int32 [B,T], wte [V,C], wpe [>=T,C].

    ``wpe=None``: no position embedding, out = wte[inp[b,t]]."""
    B, T = _dims(inp, "inp", 2)
    V, C = _dims(wte, "wte", 2)
    _check_tokens(lib.encoder_forward(
        fptr(out, "out", (B, T, C), out=True),
        iptr(inp, "inp", (B, T)),
        fptr(wte, "wte", (V, C)),
        _optional(None if wpe is None else _first_rows(wpe, T, "wpe"), "wpe", (T, C)),
        B, T, C, V), "encoder_forward", inp, "inp", V)


def sinusoidal_forward(out, inp, pos=None):
    """out[B,T,C] (written; may be inp) = inp + the sinusoidal position
    embedding at positions pos[b] + t (pos int32 [B] >= 0, or None: t)."""
    B, T, C = _dims(inp, "inp", 3)
    check(lib.sinusoidal_forward(
        fptr(out, "out", (B, T, C), out=True),
        fptr(inp, "inp", (B, T, C)),
        ffi.NULL if pos is None else iptr(pos, "pos", (B,)),
        B, T, C), "sinusoidal_forward")


def encoder_backward(dwte, dwpe, dout, inp):
    """dwte[V,C] (+=), dwpe[>=T,C] (+=; None when the forward had no wpe) <- dout[B,T,C], inp."""
    B, T = _dims(inp, "inp", 2)
    V, C = _dims(dwte, "dwte", 2)
    _check_tokens(lib.encoder_backward(
        fptr(dwte, "dwte", (V, C), out=True),
        _optional(None if dwpe is None else _first_rows(dwpe, T, "dwpe"), "dwpe", (T, C),
                  out=True),
        fptr(dout, "dout", (B, T, C)),
        iptr(inp, "inp", (B, T)),
        B, T, C, V), "encoder_backward", inp, "inp", V)


def layernorm_forward(out, mean, rstd, inp, weight, bias, eps=1e-5):
    """out[B,T,C] (written), mean[B,T], rstd[B,T] (written) <- inp, weight[C], bias[C]."""
    B, T, C = _dims(inp, "inp", 3)
    check(lib.layernorm_forward(
        fptr(out, "out", (B, T, C), out=True),
        fptr(mean, "mean", (B, T), out=True),
        fptr(rstd, "rstd", (B, T), out=True),
        fptr(inp, "inp", (B, T, C)),
        fptr(weight, "weight", (C,)),
        fptr(bias, "bias", (C,)),
        B, T, C, eps), "layernorm_forward")


def layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
    """dinp[B,T,C], dweight[C], dbias[C] (+=) <- dout, inp, weight, mean, rstd."""
    B, T, C = _dims(inp, "inp", 3)
    check(lib.layernorm_backward(
        fptr(dinp, "dinp", (B, T, C), out=True),
        fptr(dweight, "dweight", (C,), out=True),
        fptr(dbias, "dbias", (C,), out=True),
        fptr(dout, "dout", (B, T, C)),
        fptr(inp, "inp", (B, T, C)),
        fptr(weight, "weight", (C,)),
        fptr(mean, "mean", (B, T)),
        fptr(rstd, "rstd", (B, T)),
        B, T, C), "layernorm_backward")


def matmul_forward(out, inp, weight, bias=None, variant=""):
    """out[B,T,OC] (written) = inp[B,T,C] . weight[OC,C]^T + bias[OC] (bias may be None).

    ``variant="naive"`` runs the plain reference loops."""
    B, T, C = _dims(inp, "inp", 3)
    OC = _dims(weight, "weight", 2)[0]
    fn = _variant(MATMUL_FORWARD, variant)
    check(fn(
        fptr(out, "out", (B, T, OC), out=True),
        fptr(inp, "inp", (B, T, C)),
        fptr(weight, "weight", (OC, C)),
        _optional(bias, "bias", (OC,)),
        B, T, C, OC), "matmul_forward" + (f"_{variant}" if variant else ""))


def matmul_backward(dinp, dweight, dbias, dout, inp, weight, variant=""):
    """dinp[B,T,C], dweight[OC,C], dbias[OC] (+=) <- dout[B,T,OC], inp, weight.
    Any of dinp, dweight and dbias may be None: that product is skipped."""
    B, T, C = _dims(inp, "inp", 3)
    OC = _dims(weight, "weight", 2)[0]
    fn = _variant(MATMUL_BACKWARD, variant)
    check(fn(
        _optional(dinp, "dinp", (B, T, C), out=True),
        _optional(dweight, "dweight", (OC, C), out=True),
        _optional(dbias, "dbias", (OC,), out=True),
        fptr(dout, "dout", (B, T, OC)),
        fptr(inp, "inp", (B, T, C)),
        fptr(weight, "weight", (OC, C)),
        B, T, C, OC), "matmul_backward" + (f"_{variant}" if variant else ""))


def float_to_bf16(out, inp):
    """out uint16 [N] (written) = inp float32 [N] rounded to bf16 (ties to even)."""
    _dims(inp, "inp")
    check(lib.float_to_bf16(hptr(out, "out", inp.shape, out=True), fptr(inp, "inp", inp.shape),
                            inp.size), "float_to_bf16")


def bf16_to_float(out, inp):
    """out float32 [N] (written) = inp bf16 (uint16) [N], exactly."""
    _dims(inp, "inp")
    check(lib.bf16_to_float(fptr(out, "out", inp.shape, out=True), hptr(inp, "inp", inp.shape),
                            inp.size), "bf16_to_float")


def matmul_forward_bf16(out, inp, weight, bias=None, variant=""):
    """out[B,T,OC] (written) = bf16(inp[B,T,C]) . weight[OC,C]^T + bias[OC], with
    weight bf16 (uint16) and the products summed in float32 (bias may be None).

    ``variant="naive"`` runs the plain reference loops."""
    B, T, C = _dims(inp, "inp", 3)
    OC = _dims(weight, "weight", 2)[0]
    fn = _variant(MATMUL_FORWARD_BF16, variant)
    check(fn(
        fptr(out, "out", (B, T, OC), out=True),
        fptr(inp, "inp", (B, T, C)),
        hptr(weight, "weight", (OC, C)),
        _optional(bias, "bias", (OC,)),
        B, T, C, OC), "matmul_forward_bf16" + (f"_{variant}" if variant else ""))


def matmul_backward_bf16(dinp, dweight, dbias, dout, inp, weight, variant=""):
    """dinp[B,T,C], dweight[OC,C], dbias[OC] (+=) <- dout[B,T,OC], inp, weight (bf16):
    matmul_backward with dout and inp rounded to bf16 in the products. Any of
    dinp, dweight and dbias may be None: that product is skipped."""
    B, T, C = _dims(inp, "inp", 3)
    OC = _dims(weight, "weight", 2)[0]
    fn = _variant(MATMUL_BACKWARD_BF16, variant)
    check(fn(
        _optional(dinp, "dinp", (B, T, C), out=True),
        _optional(dweight, "dweight", (OC, C), out=True),
        _optional(dbias, "dbias", (OC,), out=True),
        fptr(dout, "dout", (B, T, OC)),
        fptr(inp, "inp", (B, T, C)),
        hptr(weight, "weight", (OC, C)),
        B, T, C, OC), "matmul_backward_bf16" + (f"_{variant}" if variant else ""))


def attention_forward(out, stats, inp, NH):
    """out[B,T,C] (written), stats[B,NH,T,2] (written: each query row's score max
    and 1/sum of exponentials, saved for backward) <- inp[B,T,3C] (q, k, v)."""
    B, T, C3 = _dims(inp, "inp", 3)
    C = _qkv_channels(C3, NH)
    check(lib.attention_forward(
        fptr(out, "out", (B, T, C), out=True),
        fptr(stats, "stats", (B, NH, T, 2), out=True),
        fptr(inp, "inp", (B, T, C3)),
        B, T, C, NH), "attention_forward")


def attention_backward(dinp, dout, inp, stats, NH):
    """dinp[B,T,3C] (+=) <- dout[B,T,C], inp[B,T,3C], stats[B,NH,T,2]."""
    B, T, C3 = _dims(inp, "inp", 3)
    C = _qkv_channels(C3, NH)
    check(lib.attention_backward(
        fptr(dinp, "dinp", (B, T, C3), out=True),
        fptr(dout, "dout", (B, T, C)),
        fptr(inp, "inp", (B, T, C3)),
        fptr(stats, "stats", (B, NH, T, 2)),
        B, T, C, NH), "attention_backward")


def gelu_forward(out, inp):
    """out (written) = gelu_tanh(inp), any shape."""
    _dims(inp, "inp")
    check(lib.gelu_forward(fptr(out, "out", inp.shape, out=True), fptr(inp, "inp", inp.shape),
                           inp.size), "gelu_forward")


def gelu_backward(dinp, dout, inp):
    """dinp (+=) gelu'(inp) * dout, any shape."""
    _dims(inp, "inp")
    check(lib.gelu_backward(fptr(dinp, "dinp", inp.shape, out=True),
                            fptr(dout, "dout", inp.shape), fptr(inp, "inp", inp.shape),
                            inp.size), "gelu_backward")


def relu_forward(out, inp):
    """out (written) = max(inp, 0), any shape."""
    _dims(inp, "inp")
    check(lib.relu_forward(fptr(out, "out", inp.shape, out=True), fptr(inp, "inp", inp.shape),
                           inp.size), "relu_forward")


def relu_backward(dinp, dout, inp):
    """dinp (+=) (inp > 0) * dout, any shape."""
    _dims(inp, "inp")
    check(lib.relu_backward(fptr(dinp, "dinp", inp.shape, out=True),
                            fptr(dout, "dout", inp.shape), fptr(inp, "inp", inp.shape),
                            inp.size), "relu_backward")


def gelu_erf_forward(out, inp):
    """out (written) = inp * Phi(inp), the exact (erf) GELU, any shape."""
    _dims(inp, "inp")
    check(lib.gelu_erf_forward(fptr(out, "out", inp.shape, out=True),
                               fptr(inp, "inp", inp.shape), inp.size), "gelu_erf_forward")


def gelu_erf_backward(dinp, dout, inp):
    """dinp (+=) gelu_erf'(inp) * dout, any shape."""
    _dims(inp, "inp")
    check(lib.gelu_erf_backward(fptr(dinp, "dinp", inp.shape, out=True),
                                fptr(dout, "dout", inp.shape), fptr(inp, "inp", inp.shape),
                                inp.size), "gelu_erf_backward")


def residual_forward(out, inp1, inp2):
    """out (written) = inp1 + inp2, any shape."""
    _dims(inp1, "inp1")
    check(lib.residual_forward(fptr(out, "out", inp1.shape, out=True),
                               fptr(inp1, "inp1", inp1.shape), fptr(inp2, "inp2", inp1.shape),
                               inp1.size), "residual_forward")


def residual_backward(dinp1, dinp2, dout):
    """dinp1, dinp2 (+=) dout, any shape."""
    _dims(dout, "dout")
    check(lib.residual_backward(fptr(dinp1, "dinp1", dout.shape, out=True),
                                fptr(dinp2, "dinp2", dout.shape, out=True),
                                fptr(dout, "dout", dout.shape),
                                dout.size), "residual_backward")


# ---- dropout (dropout.c) ------------------------------------------------------

# batch row b of a dropout kernel draws its mask from seed + b * DROPOUT_ROW_STEP
# (mod 2^64): rows b0 .. of a larger batch pass seed + b0 * DROPOUT_ROW_STEP
DROPOUT_ROW_STEP = 0x9E3779B97F4A7C15


def dropout_forward(out, inp, p, seed):
    """out[B,T,C] (written; may be inp) = inp * M / (1 - p): M[b,t,c] 1 with
    probability 1 - p, else 0, a hash of (seed, b, t, c), never stored. p in
    [0, 1) (else InvalidValueError); p = 0 is the identity. seed: an int in
    [0, 2^64)."""
    B, T, C = _dims(inp, "inp", 3)
    check(lib.dropout_forward(fptr(out, "out", (B, T, C), out=True),
                              fptr(inp, "inp", (B, T, C)), B, T, C, p, _seed(seed)),
          "dropout_forward")


def dropout_backward(dinp, dout, p, seed):
    """dinp[B,T,C] (written, not +=; may be dout) = dout * M / (1 - p), the
    mask of dropout_forward with the same p and seed."""
    B, T, C = _dims(dout, "dout", 3)
    check(lib.dropout_backward(fptr(dinp, "dinp", (B, T, C), out=True),
                               fptr(dout, "dout", (B, T, C)), B, T, C, p, _seed(seed)),
          "dropout_backward")


def _seed(seed):
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) \
            or not 0 <= seed < 2**64:
        raise ValueError(f"a dropout seed must be an int in [0, 2^64), got {seed!r}")
    return int(seed)


def softmax_forward(probs, logits, V):
    """probs[B,T,Vp] (written) = softmax over the first V columns of logits[B,T,Vp], 0 past V."""
    B, T, Vp = _dims(logits, "logits", 3)
    check(lib.softmax_forward(fptr(probs, "probs", (B, T, Vp), out=True),
                              fptr(logits, "logits", (B, T, Vp)),
                              B, T, V, Vp), "softmax_forward")


def softmax_crossentropy_forward(losses, stats, logits, targets, V):
    """losses[B,T] (written) = -log softmax(logits[b,t,:V])[targets[b,t]], and
    stats[B,T,2] (written) = each row's (max, 1/normaliser) for the backward;
    logits[B,T,Vp] are only read; targets int32 in [0, V), or IGNORE_INDEX
    (-1): that row's loss is 0."""
    B, T, Vp = _dims(logits, "logits", 3)
    _check_tokens(lib.softmax_crossentropy_forward(
        fptr(losses, "losses", (B, T), out=True),
        fptr(stats, "stats", (B, T, 2), out=True),
        fptr(logits, "logits", (B, T, Vp)),
        iptr(targets, "targets", (B, T)),
        B, T, V, Vp), "softmax_crossentropy_forward", targets, "targets", V, allow_ignore=True)


def softmax_crossentropy_backward(dlogits, logits, stats, dlosses, targets, V):
    """dlogits[B,T,Vp] (written) = (softmax - onehot(targets)) * dlosses over the
    first V columns, 0 past V, from the forward's stats; 0 in every column of a
    row whose target is IGNORE_INDEX; dlogits may be logits (the gradient
    then replaces the logits in place)."""
    B, T, Vp = _dims(logits, "logits", 3)
    _check_tokens(lib.softmax_crossentropy_backward(
        fptr(dlogits, "dlogits", (B, T, Vp), out=True),
        fptr(logits, "logits", (B, T, Vp)),
        fptr(stats, "stats", (B, T, 2)),
        fptr(dlosses, "dlosses", (B, T)),
        iptr(targets, "targets", (B, T)),
        B, T, V, Vp), "softmax_crossentropy_backward", targets, "targets", V, allow_ignore=True)


def adamw_update(params, m, v, grads, learning_rate, beta1, beta2, eps, weight_decay, t,
                 params_bf16=None):
    """params, m, v [N] (updated in place) by one AdamW step with grads [N]; t >= 1.
    ``params_bf16`` uint16 [N] (written), if given: the new params in bf16."""
    _dims(params, "params")
    N = params.size
    check(lib.adamw_update(fptr(params, "params", (N,), out=True),
                           ffi.NULL if params_bf16 is None else hptr(
                               params_bf16, "params_bf16", (N,), out=True),
                           fptr(m, "m", (N,), out=True),
                           fptr(v, "v", (N,), out=True),
                           fptr(grads, "grads", (N,)),
                           N, learning_rate, beta1, beta2, eps, weight_decay, int(t)),
          "adamw_update")


def global_norm_squared(x):
    """sum(x**2) over a flat float32 array, as a Python float (summed in double)."""
    _dims(x, "x")
    out = np.zeros(1, np.float64)
    check(lib.global_norm_squared(dptr(out, "out", (1,), out=True),
                                  fptr(x, "x", (x.size,)), x.size), "global_norm_squared")
    return float(out[0])


def scale_inplace(x, scale):
    """x *= scale over a flat float32 array."""
    _dims(x, "x")
    check(lib.scale_inplace(fptr(x, "x", (x.size,), out=True), x.size, scale), "scale_inplace")


MATMUL_FORWARD = {"": lib.matmul_forward, "naive": lib.matmul_forward_naive}
MATMUL_BACKWARD = {"": lib.matmul_backward, "naive": lib.matmul_backward_naive}
MATMUL_FORWARD_BF16 = {"": lib.matmul_forward_bf16, "naive": lib.matmul_forward_bf16_naive}
MATMUL_BACKWARD_BF16 = {"": lib.matmul_backward_bf16, "naive": lib.matmul_backward_bf16_naive}


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


def _optional(arr, name, shape, out=False):
    return ffi.NULL if arr is None else fptr(arr, name, shape, out=out)


def _first_rows(table, T, name):
    if not isinstance(table, np.ndarray) or table.ndim != 2 or table.shape[0] < T:
        shape = getattr(table, "shape", None)
        raise ShapeError(f"{name} has shape {shape}, needs at least {T} rows")
    return table[:T]


def _qkv_channels(C3, NH):
    if C3 % 3 != 0 or (C3 // 3) % NH != 0:
        raise ShapeError(f"inp has {C3} channels: expected 3*C with C divisible by NH={NH}")
    return C3 // 3


def _dims(arr, name, ndim=None):
    """arr's shape, after checking it is a numpy array of ``ndim`` dimensions."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if ndim is not None and arr.ndim != ndim:
        raise ShapeError(f"{name} has shape {arr.shape}, expected {ndim} dimensions")
    return arr.shape


# ---- Llama kernels: RMSNorm (norms.c), RoPE (rope.c), SwiGLU (activations.c) ----

def rmsnorm_forward(out, rstd, inp, weight, eps=1e-5):
    """out[B,T,C] (written) = inp * rstd * weight; rstd[B,T] (written) = 1/sqrt(mean(inp^2)+eps)."""
    B, T, C = _dims(inp, "inp", 3)
    check(lib.rmsnorm_forward(
        fptr(out, "out", (B, T, C), out=True),
        fptr(rstd, "rstd", (B, T), out=True),
        fptr(inp, "inp", (B, T, C)),
        fptr(weight, "weight", (C,)),
        B, T, C, eps), "rmsnorm_forward")


def rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd):
    """dinp[B,T,C] (+=), dweight[C] (+=) <- dout[B,T,C], inp, weight[C], rstd[B,T]."""
    B, T, C = _dims(inp, "inp", 3)
    check(lib.rmsnorm_backward(
        fptr(dinp, "dinp", (B, T, C), out=True),
        fptr(dweight, "dweight", (C,), out=True),
        fptr(dout, "dout", (B, T, C)),
        fptr(inp, "inp", (B, T, C)),
        fptr(weight, "weight", (C,)),
        fptr(rstd, "rstd", (B, T)),
        B, T, C), "rmsnorm_backward")


def head_rmsnorm_forward(out, rstd, inp, qweight, kweight, NH, NKV, eps=1e-6):
    """out[B,T,(NH+2NKV)hs] (written; may be inp): each q head of inp RMS-normed
    with qweight[hs], each k head with kweight[hs], v heads copied;
    rstd[B,T,NH+NKV] (written)."""
    B, T, hs = _gqa_dims(inp, NH, NKV)
    CH = (NH + 2 * NKV) * hs
    check(lib.head_rmsnorm_forward(
        fptr(out, "out", (B, T, CH), out=True),
        fptr(rstd, "rstd", (B, T, NH + NKV), out=True),
        fptr(inp, "inp", (B, T, CH)),
        fptr(qweight, "qweight", (hs,)),
        fptr(kweight, "kweight", (hs,)),
        B, T, NH, NKV, hs, eps), "head_rmsnorm_forward")


def head_rmsnorm_backward(dinp, dqweight, dkweight, dout, inp, qweight, kweight, rstd, NH, NKV):
    """dinp[B,T,(NH+2NKV)hs] (+=), dqweight[hs], dkweight[hs] (+=) <- dout, inp,
    the weights, rstd[B,T,NH+NKV] (the forward's)."""
    B, T, hs = _gqa_dims(inp, NH, NKV)
    CH = (NH + 2 * NKV) * hs
    check(lib.head_rmsnorm_backward(
        fptr(dinp, "dinp", (B, T, CH), out=True),
        fptr(dqweight, "dqweight", (hs,), out=True),
        fptr(dkweight, "dkweight", (hs,), out=True),
        fptr(dout, "dout", (B, T, CH)),
        fptr(inp, "inp", (B, T, CH)),
        fptr(qweight, "qweight", (hs,)),
        fptr(kweight, "kweight", (hs,)),
        fptr(rstd, "rstd", (B, T, NH + NKV)),
        B, T, NH, NKV, hs), "head_rmsnorm_backward")


def rope_forward(out, inp, pos, NH, NKV, theta=10000.0, inv_freq=None, interleaved=False):
    """out[B,T,(NH+2NKV)hs] (written; may be inp): q and k heads of inp rotated
    (half-split pairs i, i+hs/2; ``interleaved``: pairs 2i, 2i+1) by
    (pos[b]+t) * f_i, f_i = theta^(-2i/hs) or inv_freq[i] (float64 [hs/2], a
    scaled RoPE) when given; v heads copied; pos int32 [B] >= 0 or None."""
    B, T, CH = _dims(inp, "inp", 3)
    hs = _rope_head_size(CH, NH, NKV)
    check(lib.rope_forward(
        fptr(out, "out", (B, T, CH), out=True),
        fptr(inp, "inp", (B, T, CH)),
        ffi.NULL if pos is None else iptr(pos, "pos", (B,)),
        ffi.NULL if inv_freq is None else dptr(inv_freq, "inv_freq", (hs // 2,)),
        B, T, NH, NKV, hs, theta, int(bool(interleaved))), "rope_forward")


def rope_backward(dinp, dout, pos, NH, NKV, theta=10000.0, inv_freq=None, interleaved=False):
    """dinp[B,T,(NH+2NKV)hs] (+=) the inverse rotation of dout (v heads pass through)."""
    B, T, CH = _dims(dout, "dout", 3)
    hs = _rope_head_size(CH, NH, NKV)
    check(lib.rope_backward(
        fptr(dinp, "dinp", (B, T, CH), out=True),
        fptr(dout, "dout", (B, T, CH)),
        ffi.NULL if pos is None else iptr(pos, "pos", (B,)),
        ffi.NULL if inv_freq is None else dptr(inv_freq, "inv_freq", (hs // 2,)),
        B, T, NH, NKV, hs, theta, int(bool(interleaved))), "rope_backward")


def swiglu_forward(out, inp):
    """out[...,FF] (written) = silu(inp[...,:FF]) * inp[...,FF:]; any leading dims (N rows)."""
    N, FF = _swiglu_dims(inp)
    check(lib.swiglu_forward(
        fptr(out, "out", inp.shape[:-1] + (FF,), out=True),
        fptr(inp, "inp", inp.shape),
        N, FF), "swiglu_forward")


def swiglu_backward(dinp, dout, inp):
    """dinp[...,2FF] (+=) dgate, dup <- dout[...,FF], inp[...,2FF]."""
    N, FF = _swiglu_dims(inp)
    check(lib.swiglu_backward(
        fptr(dinp, "dinp", inp.shape, out=True),
        fptr(dout, "dout", inp.shape[:-1] + (FF,)),
        fptr(inp, "inp", inp.shape),
        N, FF), "swiglu_backward")


def geglu_forward(out, inp):
    """out[...,FF] (written) = gelu(inp[...,:FF]) * inp[...,FF:] (gelu_forward's tanh form)."""
    _gated_forward(lib.geglu_forward, "geglu_forward", out, inp)


def geglu_backward(dinp, dout, inp):
    """dinp[...,2FF] (+=) dgate, dup <- dout[...,FF], inp[...,2FF]."""
    _gated_backward(lib.geglu_backward, "geglu_backward", dinp, dout, inp)


def reglu_forward(out, inp):
    """out[...,FF] (written) = relu(inp[...,:FF]) * inp[...,FF:]."""
    _gated_forward(lib.reglu_forward, "reglu_forward", out, inp)


def reglu_backward(dinp, dout, inp):
    """dinp[...,2FF] (+=) dgate, dup <- dout[...,FF], inp[...,2FF]."""
    _gated_backward(lib.reglu_backward, "reglu_backward", dinp, dout, inp)


def _gated_forward(kernel, name, out, inp):
    N, FF = _swiglu_dims(inp)
    check(kernel(fptr(out, "out", inp.shape[:-1] + (FF,), out=True), fptr(inp, "inp", inp.shape),
                 N, FF), name)


def _gated_backward(kernel, name, dinp, dout, inp):
    N, FF = _swiglu_dims(inp)
    check(kernel(fptr(dinp, "dinp", inp.shape, out=True),
                 fptr(dout, "dout", inp.shape[:-1] + (FF,)), fptr(inp, "inp", inp.shape),
                 N, FF), name)


def _rope_head_size(CH, NH, NKV):
    """hs from a packed row of CH = (NH + 2 NKV) hs channels; hs must be even."""
    for name, value in (("NH", NH), ("NKV", NKV)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value <= 0:
            raise ShapeError(f"{name}={value} must be positive")
    heads = NH + 2 * NKV
    if CH % heads != 0 or (CH // heads) % 2 != 0:
        raise ShapeError(f"inp has {CH} channels: expected (NH + 2*NKV) * hs = {heads} * hs "
                         f"with an even head size hs")
    return CH // heads


def _swiglu_dims(inp):
    """(N, FF) for inp of shape (..., 2*FF): N is the product of the leading dims."""
    shape = _dims(inp, "inp")
    if len(shape) == 0 or shape[-1] % 2 != 0:
        raise ShapeError(f"inp has shape {shape}: its last axis must be 2*FF (gate, up)")
    N = inp.size // shape[-1] if shape[-1] else 0   # a zero size is left to C to reject
    return N, shape[-1] // 2

# ---- grouped-query attention (attention.c) ----------------------------------

def attention_gqa_forward(out, stats, inp, slopes, NH, NKV, window=0, dropout=0.0, seed=0):
    """out[B,T,NH*hs] (written), stats[B,NH,T,2] (written: each query row's score
    max and 1/sum of exponentials, saved for backward) <- inp[B,T,(NH+2*NKV)*hs]
    (NH q heads, NKV k heads, NKV v heads), slopes[NH] float32 ALiBi slopes or None.

    Query head h reads kv head h // (NH // NKV); NH % NKV must be 0. A
    ``window`` > 0 is a sliding window: query t attends to keys
    t - window + 1 .. t only (0: all keys up to t). ``dropout`` in [0, 1)
    drops probabilities: att[b,h,t,t2] takes the mask of element
    (b, h*T + t, t2) of dropout_forward on [B, NH*T, T] with ``seed``."""
    B, T, hs = _gqa_dims(inp, NH, NKV)
    check(lib.attention_gqa_forward(
        fptr(out, "out", (B, T, NH * hs), out=True),
        fptr(stats, "stats", (B, NH, T, 2), out=True),
        fptr(inp, "inp", (B, T, (NH + 2 * NKV) * hs)),
        _optional(slopes, "slopes", (NH,)),
        B, T, NH, NKV, hs, _window(window), dropout, _seed(seed)), "attention_gqa_forward")


def attention_gqa_backward(dinp, dout, inp, stats, slopes, NH, NKV, window=0, dropout=0.0,
                           seed=0):
    """dinp[B,T,(NH+2*NKV)*hs] (+=) <- dout[B,T,NH*hs], inp, stats[B,NH,T,2],
    slopes[NH] (the forward's) or None, window, dropout and seed (the forward's)."""
    B, T, hs = _gqa_dims(inp, NH, NKV)
    check(lib.attention_gqa_backward(
        fptr(dinp, "dinp", (B, T, (NH + 2 * NKV) * hs), out=True),
        fptr(dout, "dout", (B, T, NH * hs)),
        fptr(inp, "inp", (B, T, (NH + 2 * NKV) * hs)),
        fptr(stats, "stats", (B, NH, T, 2)),
        _optional(slopes, "slopes", (NH,)),
        B, T, NH, NKV, hs, _window(window), dropout, _seed(seed)), "attention_gqa_backward")


def attention_gqa_probs(att, inp, stats, slopes, NH, NKV, window=0):
    """att[B,NH,T,T] (written: the forward's probabilities, 0 outside each row's
    window, bitwise those its out used) <- inp, stats[B,NH,T,2], slopes[NH] or
    None, window, as given to attention_gqa_forward."""
    B, T, hs = _gqa_dims(inp, NH, NKV)
    check(lib.attention_gqa_probs(
        fptr(att, "att", (B, NH, T, T), out=True),
        fptr(inp, "inp", (B, T, (NH + 2 * NKV) * hs)),
        fptr(stats, "stats", (B, NH, T, 2)),
        _optional(slopes, "slopes", (NH,)),
        B, T, NH, NKV, hs, _window(window)), "attention_gqa_probs")


def attention_gqa_entropy(entropy, inp, stats, slopes, NH, NKV, window=0):
    """entropy[B,NH,T] (written: -sum_t2 att ln att of each query row, natural
    log, without holding att) <- inp, stats[B,NH,T,2], slopes[NH] or None,
    window, as given to attention_gqa_forward."""
    B, T, hs = _gqa_dims(inp, NH, NKV)
    check(lib.attention_gqa_entropy(
        fptr(entropy, "entropy", (B, NH, T), out=True),
        fptr(inp, "inp", (B, T, (NH + 2 * NKV) * hs)),
        fptr(stats, "stats", (B, NH, T, 2)),
        _optional(slopes, "slopes", (NH,)),
        B, T, NH, NKV, hs, _window(window)), "attention_gqa_entropy")


def attention_forward_naive(out, att, inp, slopes, NH, NKV, window=0, dropout=0.0, seed=0):
    """attention_gqa_forward's contract, by plain loops (llm.c's): the reference.
    att[B,NH,T,T] (written) holds the probabilities before the dropout."""
    B, T, hs = _gqa_dims(inp, NH, NKV)
    check(lib.attention_forward_naive(
        fptr(out, "out", (B, T, NH * hs), out=True),
        fptr(att, "att", (B, NH, T, T), out=True),
        fptr(inp, "inp", (B, T, (NH + 2 * NKV) * hs)),
        _optional(slopes, "slopes", (NH,)),
        B, T, NH, NKV, hs, _window(window), dropout, _seed(seed)), "attention_forward_naive")


def attention_backward_naive(dinp, dout, inp, att, NH, NKV, window=0, dropout=0.0, seed=0):
    """attention_gqa_backward's contract, by plain loops (llm.c's): the reference."""
    B, T, hs = _gqa_dims(inp, NH, NKV)
    check(lib.attention_backward_naive(
        fptr(dinp, "dinp", (B, T, (NH + 2 * NKV) * hs), out=True),
        fptr(dout, "dout", (B, T, NH * hs)),
        fptr(inp, "inp", (B, T, (NH + 2 * NKV) * hs)),
        fptr(att, "att", (B, NH, T, T)),
        B, T, NH, NKV, hs, _window(window), dropout, _seed(seed)),
        "attention_backward_naive")


def attention_entropy_naive(entropy, att):
    """attention_gqa_entropy's contract from the whole of att[B,NH,T,T], by plain
    loops: the reference."""
    B, NH, T, _ = _dims(att, "att", 4)
    check(lib.attention_entropy_naive(
        fptr(entropy, "entropy", (B, NH, T), out=True),
        fptr(att, "att", (B, NH, T, T)),
        B, NH, T), "attention_entropy_naive")


def attention_decode(out, att, q, k_cache, v_cache, lengths, slopes, NH, NKV, window=0):
    """One new position per row against a KV cache: out[B,NH*hs] (written),
    att[B,NH,maxT] (written: the probabilities of the row's window of keys,
    from [0]; the rest untouched) <- q[B,NH*hs], k_cache/v_cache[B,maxT,NKV*hs]
    (a ring: position t2 in slot t2 % maxT), lengths int32 [B] (positions so
    far, >= 1, the window's keys fitting in maxT slots, else RangeError),
    slopes[NH] float32 or None, window (0: every position).

    Row b's query sits at position lengths[b] - 1, as in attention_gqa_forward."""
    B, maxT, kv_width = _dims(k_cache, "k_cache", 3)
    _check_heads(NH, NKV)
    if kv_width % NKV != 0:
        raise ShapeError(f"k_cache has {kv_width} channels: expected NKV*hs with NKV={NKV}")
    hs = kv_width // NKV
    check(lib.attention_decode(
        fptr(out, "out", (B, NH * hs), out=True),
        fptr(att, "att", (B, NH, maxT), out=True),
        fptr(q, "q", (B, NH * hs)),
        fptr(k_cache, "k_cache", (B, maxT, NKV * hs)),
        fptr(v_cache, "v_cache", (B, maxT, NKV * hs)),
        iptr(lengths, "lengths", (B,)),
        _optional(slopes, "slopes", (NH,)),
        B, NH, NKV, hs, maxT, _window(window)), "attention_decode")


def _window(window):
    """A sliding window's size: an int >= 0 (0: none)."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no sliding window), got {window!r}")
    return int(window)


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


def _gqa_dims(inp, NH, NKV):
    """B, T, hs of a packed GQA input, after checking the head counts."""
    B, T, width = _dims(inp, "inp", 3)
    _check_heads(NH, NKV)
    heads = NH + 2 * NKV
    if width % heads != 0:
        raise ShapeError(f"inp has {width} channels: expected (NH + 2*NKV)*hs "
                         f"= {heads}*hs with NH={NH}, NKV={NKV}")
    return B, T, width // heads


def _check_heads(NH, NKV):
    for name, n in (("NH", NH), ("NKV", NKV)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ShapeError(f"{name} must be a positive int, got {n!r}")
    if NH % NKV != 0:
        raise ShapeError(f"NH={NH} is not a multiple of NKV={NKV}")

