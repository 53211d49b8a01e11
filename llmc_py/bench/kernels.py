"""The kernels, each verified against its plain twin before it is timed:
the matmul products beside numpy's and torch's, attention beside its naive
twin, the memory-bound kernels beside a numpy copy of the same bytes."""
import numpy as np

from .._native import kernels as K
from .._native.lib import get_isa, set_isa
from .pytorch import torch_job
from .timing import timed

# the linear layers' (C, OC) of GPT-2 124M: qkv, attention projection, fc,
# fc projection, the logits over the padded vocabulary
GPT2_LINEAR_SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50304))


def bench_matmul(BT, C, OC, repeats, rng, isas, torch_gflops=None, precision="fp32"):
    """GFLOP/s of each product of a linear layer at one (BT, C, OC): the
    forward (out = inp . weight^T), dinp (+= dout . weight) and dW (+= dout^T
    . inp), ours on each instruction set in ``isas`` (each verified against
    the naive kernel first), beside numpy's sgemm for the same product and
    ``torch_gflops`` ({product: GFLOP/s}, measured by torch_job). With
    ``precision="bf16"`` the weight is bf16 and ours are the bf16 kernels."""
    x = rng.standard_normal((1, BT, C), dtype=np.float32)
    w = rng.standard_normal((OC, C), dtype=np.float32) * 0.02
    dout = rng.standard_normal((1, BT, OC), dtype=np.float32)
    out, dinp, dw = np.empty((1, BT, OC), np.float32), np.zeros_like(x), np.zeros_like(w)
    ref = {"fwd": np.empty_like(out), "dinp": np.zeros_like(x), "dW": np.zeros_like(w)}
    if precision == "bf16":
        weight = np.empty(w.shape, np.uint16)
        K.float_to_bf16(weight, w)
        forward, backward = K.matmul_forward_bf16, K.matmul_backward_bf16
        tol = 1e-4   # the dot-product path sums pairs of k, the naive loop one k at a time
    else:
        weight, forward, backward, tol = w, K.matmul_forward, K.matmul_backward, 1e-5
    forward(ref["fwd"], x, weight, variant="naive")
    backward(ref["dinp"], ref["dW"], None, dout, x, weight, variant="naive")
    cases = [  # name, ours, numpy's, our result
        ("fwd", lambda: forward(out, x, weight), lambda: np.matmul(x[0], w.T, out=out[0]), out),
        ("dinp", lambda: backward(dinp, None, None, dout, x, weight),
         lambda: np.matmul(dout[0], w, out=dinp[0]), dinp),
        ("dW", lambda: backward(None, dw, None, dout, x, weight),
         lambda: np.matmul(dout[0].T, x[0], out=dw), dw),
    ]
    flop = 2.0 * BT * C * OC
    before = get_isa()
    rows = []
    try:
        for name, ours, numpys, result in cases:
            # a few untimed calls first: page faults, thread wake-up and clock ramp
            t_np = timed(numpys, repeats, warmup=3)
            for isa in isas:
                set_isa(isa)
                result[...] = 0.0   # verify before timing
                ours()
                err = float(np.abs(result - ref[name]).max() / np.abs(ref[name]).max())
                if err > tol:
                    raise AssertionError(f"matmul {name} ({isa}, {precision}) disagrees with "
                                         f"naive at {BT}x{C}x{OC}: {err:.2e}")
                t_ours = timed(ours, repeats, warmup=3)
                rows.append({"kernel": f"matmul {name}" + (" bf16" if precision == "bf16"
                                                           else ""),
                             "shape": f"{BT}x{C}x{OC}", "isa": isa,
                             "ms": t_ours["median"] * 1e3,
                             "gflops": flop / t_ours["median"] / 1e9,
                             "numpy_gflops": flop / t_np["median"] / 1e9,
                             "torch_gflops": torch_gflops[name] if torch_gflops else None})
    finally:
        set_isa(before)
    return rows


def bench_attention(B, T, NH, hs, repeats, rng, isas, window=0):
    """ms of attention's forward and backward (GPT-2's layout, NKV = NH;
    with ``window`` a sliding window of that many keys) on each instruction
    set in ``isas``, each verified against the plain twin first, beside
    that twin's ms. The forward keeps only row statistics, so its
    probabilities are checked as attention_gqa_probs recomputes them."""
    qkv = rng.standard_normal((B, T, 3 * NH * hs), dtype=np.float32)
    dout = rng.standard_normal((B, T, NH * hs), dtype=np.float32)
    out, stats = np.empty((B, T, NH * hs), np.float32), np.empty((B, NH, T, 2), np.float32)
    probs = np.empty((B, NH, T, T), np.float32)
    dinp = np.zeros_like(qkv)
    ref_out, ref_att, ref_dinp = np.empty_like(out), np.empty_like(probs), np.zeros_like(qkv)
    forward = lambda: K.attention_gqa_forward(out, stats, qkv, None, NH, NH, window)

    def recomputed_probs():
        K.attention_gqa_probs(probs, qkv, stats, None, NH, NH, window)
        return probs

    # name, ours, the naive twin, {what: (our result, the naive result)}; the
    # naive backward reads the naive forward's att, so "fwd" runs first
    cases = [
        ("fwd", forward,
         lambda: K.attention_forward_naive(ref_out, ref_att, qkv, None, NH, NH, window),
         {"out": (lambda: out, ref_out), "probs": (recomputed_probs, ref_att)}),
        ("bwd", lambda: K.attention_gqa_backward(dinp, dout, qkv, stats, None, NH, NH, window),
         lambda: K.attention_backward_naive(ref_dinp, dout, qkv, ref_att, NH, NH, window),
         {"dinp": (lambda: dinp, ref_dinp)}),
    ]
    before = get_isa()
    rows = []
    try:
        for name, ours, naive, results in cases:
            t_naive = timed(naive, repeats)
            for isa in isas:
                set_isa(isa)
                dinp[...] = 0.0   # verify before timing
                ref_dinp[...] = 0.0
                forward()         # the backward reads this instruction set's stats
                naive()
                ours()
                for what, (result, ref) in results.items():
                    err = float(np.abs(result() - ref).max() / np.abs(ref).max())
                    if err > 1e-5:
                        raise AssertionError(f"attention {name} ({isa}): {what} disagrees "
                                             f"with naive at B={B} T={T} NH={NH} hs={hs}: "
                                             f"{err:.2e}")
                t_ours = timed(ours, repeats)
                kernel = f"attention {name}" + (f" w{window}" if window else "")
                rows.append({"kernel": kernel, "shape": f"{B}x{T}x{NH}x{hs}",
                             "isa": isa, "ms": t_ours["median"] * 1e3,
                             "naive_ms": t_naive["median"] * 1e3})
    finally:
        set_isa(before)
    return rows


def bench_memory_bound(N, repeats, rng, C=768):
    """GB/s of the element-wise kernels, layernorm, dbias and AdamW beside a
    numpy copy of the same number of bytes (read + written); N elements,
    seen as rows of C for layernorm and of 4C for dbias."""
    x = rng.standard_normal(N, dtype=np.float32)
    y = rng.standard_normal(N, dtype=np.float32)
    out = np.empty_like(x)
    m, v = np.zeros_like(x), np.zeros_like(x)
    step = {"t": 0}
    rows_ = N // C
    x3, y3, out3 = (a[:rows_ * C].reshape(1, rows_, C) for a in (x, y, out))
    weight, bias = np.ones(C, np.float32), np.zeros(C, np.float32)
    dweight, dbias = np.zeros(C, np.float32), np.zeros(C, np.float32)
    mean, rstd = np.empty((1, rows_), np.float32), np.empty((1, rows_), np.float32)
    K.layernorm_forward(out3, mean, rstd, x3, weight, bias)
    wide = x[:N // (4 * C) * 4 * C].reshape(1, -1, 4 * C)
    # dbias alone: matmul_backward reads neither inp nor weight (shapes only)
    inp_1, weight_1 = np.empty(wide.shape[:2] + (1,), np.float32), np.empty((4 * C, 1), np.float32)
    db_wide = np.zeros(4 * C, np.float32)

    def adamw():
        step["t"] += 1
        K.adamw_update(out, m, v, x, 1e-4, 0.9, 0.999, 1e-8, 0.0, step["t"])
    cases = [  # name, fn, bytes moved per call (reads + writes)
        ("gelu_forward", lambda: K.gelu_forward(out, x), 8 * N),
        ("gelu_backward", lambda: K.gelu_backward(out, y, x), 16 * N),
        ("residual_forward", lambda: K.residual_forward(out, x, y), 12 * N),
        ("layernorm_forward", lambda: K.layernorm_forward(out3, mean, rstd, x3, weight, bias),
         8 * x3.size),
        ("layernorm_backward", lambda: K.layernorm_backward(
            out3, dweight, dbias, y3, x3, weight, mean, rstd), 16 * x3.size),
        ("matmul dbias", lambda: K.matmul_backward(
            None, None, db_wide, wide, inp_1, weight_1), 4 * wide.size),
        ("adamw_update", adamw, 28 * N),
    ]
    rows = []
    for name, fn, nbytes in cases:
        t = timed(fn, repeats, warmup=2)
        # written first: pages never written all map the kernel's one zero
        # page, which would make the copy's reads free
        copy_src = np.ones(nbytes // 8, np.float32)
        copy_dst = np.zeros_like(copy_src)
        t_copy = timed(lambda: np.copyto(copy_dst, copy_src), repeats, warmup=2)
        rows.append({"kernel": name, "elements": N, "ms": t["median"] * 1e3,
                     "gbps": nbytes / t["median"] / 1e9,
                     "copy_gbps": nbytes / t_copy["median"] / 1e9})
    return rows


def measure_kernels(args, isas, rng):
    """The matmul rows at --batch's B*T for each of GPT-2's linear layers (in
    bf16 also the bf16 products), beside torch's unless --skip-torch; the
    attention rows at GPT-2's 12 heads of 64 (with --attention-window also
    windowed, on the fastest instruction set); the memory-bound rows."""
    B, T = args.batch
    results = {"matmul": []}
    shapes = [(B * T, C, OC) for C, OC in GPT2_LINEAR_SHAPES]
    for precision in ("fp32", "bf16") if args.precision == "bf16" else ("fp32",):
        theirs = None if args.skip_torch else torch_job(
            "matmul", shapes=shapes, repeats=args.repeats, dtype=precision)
        for shape in shapes:
            key = "x".join(map(str, shape))
            results["matmul"] += bench_matmul(*shape, args.repeats, rng, isas,
                                              theirs["gflops"][key] if theirs else None,
                                              precision)
    results["attention"] = bench_attention(B, T, 12, 64, args.repeats, rng, isas)
    if args.attention_window:
        results["attention"] += bench_attention(B, T, 12, 64, args.repeats, rng, isas[:1],
                                                window=args.attention_window)
    results["memory_bound"] = bench_memory_bound(B * T * 3072 * 4, args.repeats, rng)
    return results
