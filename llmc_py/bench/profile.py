"""--profile: one training step (step.py's: zero_grad, forward_backward,
AdamW) split into its kernel calls.

While a Profiler is installed on a model, every kernel of
llmc_py._native.kernels that the step calls is timed: those the model calls
through the module, and those it holds references to (its _matmul_forward
and _matmul_backward, _attention_forward and _attention_backward, its
block's activation). Each call goes to a phase
(forward, backward, update) and a row: a matmul by the weight it reads
(qkv, attproj, fc, fcproj, head; a LoRA adapter's as "lora <layer>") and
its product (fwd, dinp, dW, dbias; a bf16 model's adapters' up products,
one call for all of a layer's, "up" and "up dh+dB", and their d(input),
"dinp", by the up product's kernel), any other kernel by
its name. A matmul
backward runs its products as calls of their own, which give the same bits
as one call (in C each product is a loop of its own), so that each is
timed apart. The classifier runs forward and backward a block of rows at a
time: there a backward kernel counts to the backward. zero_grad's
fill_zero calls count to the update.

Rates: a GEMM's 2 M N K FLOP per product; attention's 2 hs FLOP per
(query, key) pair and product over the causal pairs (T (T + 1) / 2 per
batch row and head, fewer with a sliding window), 2 products forward (the
scores, P V) and 5 backward (the scores again, dP, dq, dk, dv); any other
kernel's bytes: each array argument's nbytes once, twice for an output it
adds into or updates (read and written). Each beside the peak measured in
the same process: our GEMM on a square problem (GFLOP/s), streaming
(residual_forward on large arrays, the kernels' threads; GB/s, bytes read +
written).

"Matmuls alone": every GEMM call of one step replayed alone on fresh
arrays of its shapes and dtypes, timed, and summed per step.
"""
import inspect
import statistics
import time
from typing import NamedTuple

import numpy as np

from .._native import kernels as K
from .._native.lib import get_isa, get_num_threads
from ..io.files import to_bf16
from .timing import peak_rss_mib, timed

PHASES = ("forward", "backward", "update")
GEMM_FORWARD = ("matmul_forward", "matmul_forward_bf16", "moe_grouped_forward",
                "moe_grouped_forward_bf16")
GEMM_BACKWARD = ("matmul_backward", "matmul_backward_bf16", "moe_grouped_backward",
                 "moe_grouped_backward_bf16")
# a GEMM with its activation in the epilogue: the GEMM and the activation it fuses
FUSED = {"matmul_gelu_forward_bf16": ("matmul_forward_bf16", "gelu_forward")}
# a GEMM backward's outputs, each a product of its own
PRODUCTS = {"dinp": "dinp", "dweight": "dW", "dbias": "dbias"}
# attention's products over the (query, key) pairs
ATTENTION_PRODUCTS = {"attention_gqa_forward": 2, "attention_gqa_backward": 5,
                      "attention_gqa_forward_bf16": 2, "attention_gqa_backward_bf16": 5}
# the bf16 LoRA adapters' up products (lora_bf16.c): their row's product, and
# the GEMM products each makes over the adapted columns (in backward the
# forward's kernel is the adapters' d(input), model/lora.py)
LORA_UP = {"lora_up_forward_bf16": ("up", 1), "lora_up_backward_bf16": ("up dh+dB", 2)}
# a weight's row name where it is not the tensor's name less its "w"
SITES = {"wte": "head", "lm_head": "head"}
PEAK_GEMM = 2048       # the square GEMM of the peak: n x n x n
PEAK_COPY_MIB = 256    # the copy of the peak: this many MiB read and as many written
ZERO_GRAD = "zero_grad besides its fill_zero"
_MISSING = object()


class Call(NamedTuple):
    """One timed call: its phase, row and kernel, kind ("gemm", "attention",
    "memory"; "numpy" for zero_grad's time besides its kernel calls), seconds,
    its work (FLOP, or bytes for "memory" and "numpy"), its shape label and, for a GEMM
    product, its replay key (_replay_key)."""
    phase: str
    row: str
    kernel: str
    kind: str
    seconds: float
    work: float
    shape: str = ""
    replay: tuple = None


def step_kernels():
    """{name: function} of every kernel wrapper in llmc_py._native.kernels."""
    return {name: fn for name, fn in vars(K).items()
            if inspect.isfunction(fn) and fn.__module__ == K.__name__
            and not name.startswith("_")}


class Profiler:
    """Installed on a model (``with Profiler(model) as p:``), times each
    kernel call of its training steps into ``p.calls`` (take() hands them
    over); the model and the kernels module are as they were afterwards.
    Results are unchanged: every kernel runs on the same arguments."""

    def __init__(self, model):
        self.model = model
        self.kernels = step_kernels()
        self.calls = []
        self.phase = PHASES[0]
        self.in_head = False    # inside the classifier's rows
        self.adapted = None     # the linear layer whose LoRA adapters are running
        self._sites = _weight_sites(model)
        self._undo = []

    def take(self):
        """The calls recorded since the last take()."""
        calls, self.calls = self.calls, []
        return calls

    def __enter__(self):
        model = self.model
        timed_kernels = {fn: self._timed_kernel(name, fn) for name, fn in self.kernels.items()}
        for name, fn in self.kernels.items():
            self._patch(K, name, timed_kernels[fn])
        for owner, attr in ((model, "_matmul_forward"), (model, "_matmul_backward"),
                            (model, "_attention_forward"), (model, "_attention_backward"),
                            (model._block, "act_forward"), (model._block, "act_backward")):
            fn = getattr(owner, attr)
            if fn in timed_kernels:
                self._patch(owner, attr, timed_kernels[fn])
        for method, phase in (("forward_backward", "forward"), ("_blocks_backward", "backward"),
                              ("update", "update")):
            self._patch(model, method, self._entering(phase, getattr(model, method)))
        self._patch(model, "_classifier_rows", self._in_head(model._classifier_rows))
        self._patch(model, "zero_grad", self._timed_zero_grad(model.zero_grad))
        if model.lora is not None:   # the argument naming the linear layer adapted
            self._patch(model.lora, "forward", self._adapting(model.lora.forward, 2))
            self._patch(model.lora, "backward", self._adapting(model.lora.backward, 3))
        return self

    def __exit__(self, *exc):
        for owner, attr, old in reversed(self._undo):
            if old is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)
        self._undo = []

    def _patch(self, owner, attr, value):
        self._undo.append((owner, attr, vars(owner).get(attr, _MISSING)))
        setattr(owner, attr, value)

    # ---- what the installed functions do ------------------------------------

    def _entering(self, phase, method):
        def entering(*args, **kwargs):
            self.phase = phase
            return method(*args, **kwargs)
        return entering

    def _in_head(self, method):
        def in_head(*args, **kwargs):
            self.in_head = True
            try:
                return method(*args, **kwargs)
            finally:
                self.in_head = False
        return in_head

    def _adapting(self, method, linear_at):
        def adapting(*args):
            self.adapted = args[linear_at]
            try:
                return method(*args)
            finally:
                self.adapted = None
        return adapting

    def _timed_zero_grad(self, zero_grad):
        def timed_zero_grad():
            # read before: model.grads would zero what zero_grad leaves to backward
            model, total = self.model, self.model.trained[1].memory.nbytes
            self.phase = "update"   # its fill_zero calls: rows of the update
            first = len(self.calls)
            start = time.perf_counter()
            zero_grad()
            seconds = time.perf_counter() - start
            kernels = self.calls[first:]
            left = sum(model.base_grad(name, l).nbytes for name, l in model._unwritten)
            self.calls.append(Call("step", ZERO_GRAD, "", "numpy",
                                   seconds - sum(c.seconds for c in kernels),
                                   total - left - sum(c.work for c in kernels)))
        return timed_zero_grad

    def _timed_kernel(self, name, kernel):
        params = list(inspect.signature(kernel).parameters)

        def timed_kernel(*args, **kwargs):
            arguments = dict(zip(params, args), **kwargs)
            if name in FUSED:   # run as its unfused twins (the same bits), each a row
                gemm, act = FUSED[name]
                product = {k: arguments.get(k) for k in ("out", "inp", "weight", "bias")}
                self._call(gemm, self.kernels[gemm], product, "fwd")
                return self._call(act, self.kernels[act],
                                  {"out": arguments["act_out"], "inp": arguments["out"]}, "")
            if name not in GEMM_BACKWARD:
                return self._call(name, kernel, arguments, "fwd" if name in GEMM_FORWARD else "")
            for output, product in PRODUCTS.items():
                if arguments.get(output) is not None:
                    others = {o: None for o in PRODUCTS if o != output and o in arguments}
                    self._call(name, kernel, dict(arguments, **others), product)
            return None
        return timed_kernel

    def _call(self, name, kernel, arguments, product):
        start = time.perf_counter()
        result = kernel(**arguments)
        seconds = time.perf_counter() - start
        self.calls.append(self._classify(name, kernel, arguments, product, seconds))
        return result

    def _classify(self, name, kernel, arguments, product, seconds):
        phase = "backward" if self.in_head and "backward" in name else self.phase
        if name in ATTENTION_PRODUCTS:
            return Call(phase, name, name, "attention", seconds, _attention_flop(name, arguments))
        if name in LORA_UP:
            product, products = LORA_UP[name]
            if phase == "backward" and name == "lora_up_forward_bf16":
                product = "dinp"
            h, rows = arguments["h"], arguments["rows"]
            BT, r = h.shape[0] * h.shape[1], h.shape[-1]
            columns = int(np.sum(rows[:, 1] - rows[:, 0]))
            return Call(phase, f"lora {self.adapted} {product}", name, "gemm", seconds,
                        2.0 * products * BT * r * columns, f"{BT}x{r}x{columns}",
                        (name, product, _replay_key(arguments)))
        if not product:
            return Call(phase, name, name, "memory", seconds, _bytes(kernel, arguments))
        site = self._site(arguments["weight"])
        if product == "dbias":   # a column sum of dout: reads neither inp nor weight
            moved = arguments["dout"].nbytes + 2 * arguments["dbias"].nbytes
            return Call(phase, f"{site} dbias", name, "memory", seconds, moved)
        rows, C, OC = _gemm_dims(product, arguments)
        return Call(phase, f"{site} {product}", name, "gemm", seconds, 2.0 * rows * C * OC,
                    f"{rows}x{C}x{OC}", (name, product, _replay_key(arguments)))

    def _site(self, weight):
        address = weight.__array_interface__["data"][0]
        for start, stop, site in self._sites:
            if start <= address < stop:
                return site
        return f"lora {self.adapted}" if self.adapted else "other"


def _weight_sites(model):
    """(start, stop, row name) of the address range of each weight tensor
    (all layers') that the model's matmuls read."""
    group, sites = model._weights, []
    for name in group.names:
        start = group[name].__array_interface__["data"][0]
        sites.append((start, start + group[name].nbytes, SITES.get(name, name.removesuffix("w"))))
    return sites


def _gemm_dims(product, arguments):
    """(rows, C, OC) of a GEMM call's layer: weight [..., OC, C], rows of inp
    (forward) or of dout (backward)."""
    OC, C = arguments["weight"].shape[-2:]
    rows = arguments["inp"].size // C if product == "fwd" else arguments["dout"].size // OC
    return rows, C, OC


def _attention_flop(name, arguments):
    """FLOP of an attention call over its causal (query, key) pairs."""
    B, T, width = arguments["inp"].shape
    NH, NKV, window = arguments["NH"], arguments["NKV"], arguments.get("window") or T
    hs = width // (NH + 2 * NKV)
    W = min(window, T)
    pairs = W * (W + 1) // 2 + (T - W) * W   # query t sees min(t + 1, W) keys
    return ATTENTION_PRODUCTS[name] * 2.0 * hs * B * NH * pairs


def _bytes(kernel, arguments):
    """Bytes a kernel call moves: each array argument's once, twice for an
    output added into or updated (the wrapper's roles, declare.py)."""
    roles = getattr(kernel, "roles", {})
    return sum(value.nbytes * (2 if roles.get(name) in ("+=", "updated") else 1)
               for name, value in arguments.items() if isinstance(value, np.ndarray))


def _replay_key(arguments):
    """A GEMM call's arguments as a hashable key: each array's shape and
    dtype (an int array's values too: the experts' offsets), the rest as
    given."""
    key = []
    for name, value in arguments.items():
        if not isinstance(value, np.ndarray):
            key.append((name, "value", value))
        elif value.dtype == np.int32:
            key.append((name, "ints", value.shape, value.tobytes()))
        else:
            key.append((name, "array", value.shape, value.dtype.str))
    return tuple(key)


def _call_kind(replay):
    """A replay key without its int arrays' values: the experts' offsets
    change from step to step (and layer to layer) as the routing does."""
    name, product, arguments = replay
    return name, product, tuple(a[:3] if a[1] == "ints" else a for a in arguments)


def _fresh_arguments(key, rng):
    """Arguments of _replay_key's ``key``: fresh random arrays of its shapes
    and dtypes (bf16 as uint16), its int arrays and other values as they were."""
    arguments = {}
    for name, kind, *rest in key:
        if kind == "value":
            arguments[name] = rest[0]
        elif kind == "ints":
            shape, data = rest
            arguments[name] = np.frombuffer(data, np.int32).reshape(shape).copy()
        else:
            shape, dtype = rest
            values = rng.standard_normal(shape, dtype=np.float32)
            arguments[name] = to_bf16(values * np.float32(0.02)) if dtype == "<u2" else values
    return arguments


# ---- a profile: the rows, the matmuls alone, the peaks ----------------------------

def profile_step(model, step, repeats, peak_gemm=PEAK_GEMM, peak_copy_mib=PEAK_COPY_MIB):
    """The profile of ``step`` (step.step_setup's, on ``model``): the step
    timed as it is (a warm-up, then ``repeats``), then ``repeats`` steps
    profiled; their rows, the matmuls alone and the peaks (sizes
    ``peak_gemm``, ``peak_copy_mib``) as profile_rows and matmuls_alone give
    them, with this process's peak RSS after the steps (before the replay)."""
    plain = timed(step, repeats)
    step_seconds, step_calls = [], []
    with Profiler(model) as profiler:
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            step_seconds.append(time.perf_counter() - start)
            step_calls.append(profiler.take())
        kernels = profiler.kernels
    rss = peak_rss_mib()
    peaks = measure_peaks(model.precision, peak_gemm, peak_copy_mib, repeats)
    result = dict(threads=get_num_threads(), isa=get_isa(), precision=model.precision,
                  layers=model.config.L, B=model.B, T=model.T, repeats=repeats, peaks=peaks,
                  unprofiled_ms={k: plain[k] * 1e3 for k in ("median", "min", "max")},
                  planned_mib=sum(model.memory_plan(model.B, model.T).values()) / 2**20,
                  step_peak_rss_mib=rss)
    result.update(profile_rows(step_calls, step_seconds, peaks))
    result["matmuls_alone"] = matmuls_alone(step_calls, kernels, repeats, plain["median"])
    return result


def measure_peaks(precision, n, copy_mib, repeats):
    """This machine's peaks, each the median of ``repeats``: our GEMM on an
    n x n x n product (matmul_forward_bf16 in bf16, else matmul_forward),
    GFLOP/s; streaming, our residual_forward (out = a + b, on the kernels'
    threads) over arrays of ``copy_mib`` MiB, GB/s counting the bytes read
    and written."""
    rng = np.random.default_rng(0)
    inp = rng.standard_normal((1, n, n), dtype=np.float32)
    weight = rng.standard_normal((n, n), dtype=np.float32) * np.float32(0.02)
    out = np.empty_like(inp)
    gemm = K.matmul_forward_bf16 if precision == "bf16" else K.matmul_forward
    if precision == "bf16":
        weight = to_bf16(weight)
    t_gemm = timed(lambda: gemm(out, inp, weight, None), repeats, warmup=2, settle=0)
    # both written first: a never-written page reads as the kernel's one zero page
    a, b, target = (np.ones(copy_mib * 2**20 // 4, np.float32) for _ in range(3))
    t_copy = timed(lambda: K.residual_forward(target, a, b), repeats, warmup=2, settle=0)
    return {"gemm": gemm.__name__, "gemm_n": n, "gemm_gflops": 2.0 * n**3 / t_gemm["median"] / 1e9,
            "copy_mib": copy_mib, "copy_gbps": 3 * a.nbytes / t_copy["median"] / 1e9}


def profile_rows(step_calls, step_seconds, peaks):
    """The rows of the profiled steps (``step_calls``, each step's Calls,
    beside ``step_seconds``): per (phase, row) its calls per step, ms per
    step (median over the steps), share of the step (the median step), its
    rate (GFLOP/s or GB/s) and that over its peak; forward, backward, update,
    each by time. With the step's, the kernels' and between the kernels' ms
    (medians over the steps) and zero_grad's row (not a kernel: between)."""
    times, first = {}, {}
    for s, calls in enumerate(step_calls):
        for call in calls:
            key = (call.phase, call.row)
            times.setdefault(key, [0.0] * len(step_calls))[s] += call.seconds
            if s == 0:
                first.setdefault(key, []).append(call)
    step_ms = statistics.median(step_seconds) * 1e3
    kernels = [sum(c.seconds for c in calls if c.kind != "numpy") for calls in step_calls]
    rows = []
    for key, calls in first.items():
        ms = statistics.median(times[key]) * 1e3
        kind = calls[0].kind
        gemm_like = kind in ("gemm", "attention")
        rate = sum(c.work for c in calls) / ms / 1e6 if ms > 0 else 0.0
        peak = peaks["gemm_gflops"] if gemm_like else peaks["copy_gbps"]
        shapes = sorted({c.shape for c in calls}, key=len)
        rows.append(dict(phase=key[0], row=key[1], kernel=calls[0].kernel, kind=kind,
                         calls=len(calls), ms=ms,
                         share=ms / step_ms, rate=rate, unit="GFLOP/s" if gemm_like else "GB/s",
                         of_peak=rate / peak, shape=shapes[0] if len(shapes) == 1 else "various"))
    order = {phase: i for i, phase in enumerate(PHASES + ("step",))}
    rows.sort(key=lambda r: (order[r["phase"]], -r["ms"]))
    between = [t - k for t, k in zip(step_seconds, kernels)]
    return {"step_ms": step_ms, "kernels_ms": statistics.median(kernels) * 1e3,
            "between_ms": statistics.median(between) * 1e3, "rows": rows}


def matmuls_alone(step_calls, kernels, repeats, step_seconds):
    """Every GEMM call of a step replayed alone: per distinct call (kernel,
    product, shapes, dtypes) its row, shape, calls per step, ms of one call
    alone (median of ``repeats`` on fresh arrays) and their ms per step
    alone and in the step (median over the profiled steps); the sum alone
    per step, and ``step_seconds`` (the unprofiled step) over it."""
    rng = np.random.default_rng(0)
    in_step, first = {}, {}
    for s, calls in enumerate(step_calls):
        for call in calls:
            if call.replay is None:
                continue
            key = _call_kind(call.replay)
            in_step.setdefault(key, [0.0] * len(step_calls))[s] += call.seconds
            if s == 0:
                first.setdefault(key, []).append(call)
    rows = []
    for key, calls in first.items():
        # replayed with the first call's int arrays (an MoE layer's offsets)
        name, product, arguments = calls[0].replay
        kernel, arguments = kernels[name], _fresh_arguments(arguments, rng)
        alone = timed(lambda: kernel(**arguments), repeats, settle=0)["median"] * 1e3
        rows.append(dict(row=calls[0].row, kernel=name, product=product, shape=calls[0].shape,
                         calls=len(calls), alone_ms=alone, alone_step_ms=alone * len(calls),
                         in_step_ms=statistics.median(in_step[key]) * 1e3))
    total = sum(r["alone_step_ms"] for r in rows)
    return {"rows": rows, "total_ms": total,
            "step_over_matmuls": step_seconds * 1e3 / total if total else None}
