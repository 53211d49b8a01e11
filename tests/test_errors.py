"""The house rules for errors: C returns a status and never exits or prints;
Python maps the status to an exception class."""
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from llmc_py._native.lib import check, ffi, lib

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# every kernel in the header, with its parameter names: {name: (param, ...)}
PROTOTYPES = {name: tuple(re.findall(r"(\w+)\s*(?:,|$)", params.strip()))
              for name, params in re.findall(r"^int (\w+)\(([^)]*)\);",
                                             (CSRC / "llmc_api.h").read_text(), re.M)
              if not name.startswith("llmc_")}
KERNELS = sorted(PROTOTYPES)
# the int32 arrays of token ids (other int arrays hold positions or lengths)
TOKEN_PARAMS = {"inp", "targets"}
# kernels that take token ids with their vocabulary V
TOKEN_KERNELS = [name for name in KERNELS
                 if any(arg.kind == "pointer" and arg.item.cname == "int" and param in TOKEN_PARAMS
                        for param, arg in zip(PROTOTYPES[name],
                                              ffi.typeof(getattr(lib, name)).args))]
INT_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1


@dataclass
class Row:
    """How to call one kernel with small valid arguments, where that differs
    from the default: every pointer a zeroed 16-element buffer, every int or
    int64_t argument a size set to 1, every float 0.0, every uint64_t (a
    seed) 0.

    optional:  pointers that may be NULL
    not_sizes: int arguments that are not sizes, so 0 may be valid (a position)
    valid:     {argument: value} where 1 is not valid
    fill:      {array: value} where zeroes are not valid (lengths >= 1, frequencies > 0);
               a tuple gives the leading values, zeroes after them
    bad:       extra ({argument: value, ...}, expected status name) cases
    elements:  the length of every buffer, where 16 elements are too few
    cpu_path:  a path forced onto an instruction set: LLMC_ERR_UNSUPPORTED
               instead of LLMC_OK where this CPU or build lacks it
    """
    optional: frozenset = frozenset()
    not_sizes: frozenset = frozenset()
    valid: dict = field(default_factory=dict)
    fill: dict = field(default_factory=dict)
    bad: tuple = ()
    elements: int = 16
    cpu_path: bool = False


_C_NOT_DIVISIBLE = (({"C": 3, "NH": 2}, "LLMC_ERR_SHAPE"),)
_V_ABOVE_VP = (({"V": 2}, "LLMC_ERR_SHAPE"),)
_NH_NOT_DIVISIBLE = (({"NH": 3, "NKV": 2}, "LLMC_ERR_SHAPE"),)


def _bad_probability(param):
    """A dropout probability outside [0, 1) (and one just inside)."""
    return (({param: 1.0}, "LLMC_ERR_VALUE"), ({param: -0.5}, "LLMC_ERR_VALUE"),
            ({param: float("nan")}, "LLMC_ERR_VALUE"), ({param: 0.999}, "LLMC_OK"))


_BAD_DROPOUT = _bad_probability("dropout")
_NEGATIVE_EPS = (({"eps": -1.0}, "LLMC_ERR_VALUE"), ({"eps": float("nan")}, "LLMC_ERR_VALUE"),
                 ({"eps": -1.0, "C": 0}, "LLMC_ERR_SHAPE"))   # a bad size is reported first
# RoPE: an even head size and a positive, finite theta
_ROPE = dict(optional=frozenset({"pos", "inv_freq"}), valid={"hs": 2, "theta": 10000.0},
             fill={"inv_freq": 1.0}, not_sizes=frozenset({"interleaved"}),
             bad=(({"hs": 3}, "LLMC_ERR_SHAPE"), ({"theta": 0.0}, "LLMC_ERR_VALUE"),
                  ({"theta": float("inf")}, "LLMC_ERR_VALUE"),
                  ({"interleaved": 2}, "LLMC_ERR_VALUE"), ({"interleaved": -1}, "LLMC_ERR_VALUE"),
                  ({"B": 2**30, "T": 2**30, "hs": 2}, "LLMC_ERR_SHAPE")))

# attention with a sliding window: the window may be 0 (none), not negative
_WINDOWED = dict(optional=frozenset({"slopes"}), not_sizes=frozenset({"window"}),
                 bad=_NH_NOT_DIVISIBLE + (({"window": -1}, "LLMC_ERR_SHAPE"),))
_WINDOWED_DROPPED = dict(_WINDOWED, bad=_WINDOWED["bad"] + _BAD_DROPOUT)

# quantized blocks: one block of 32 inputs (Q8_0's 34 bytes fit 64), a known type
# (Q4_0, 2, is valid too: tests/test_quant.py)
_QUANT = dict(valid={"IC": 32, "qtype": 8}, not_sizes=frozenset({"qtype"}), elements=64,
              bad=(({"IC": 33}, "LLMC_ERR_SHAPE"), ({"IC": 16}, "LLMC_ERR_SHAPE"),
                   ({"qtype": 3}, "LLMC_ERR_VALUE")))
_QUANT_MATMUL = dict(_QUANT, optional=frozenset({"bias"}))

# MoE: k <= E and norm_topk_prob 0 or 1; the grouped GEMM's offsets run from
# 0 to R (here [0, 1])
_ROUTE = dict(not_sizes=frozenset({"norm_topk_prob"}),
              bad=(({"k": 2}, "LLMC_ERR_SHAPE"), ({"norm_topk_prob": 2}, "LLMC_ERR_VALUE")))
_ROUTE_BACKWARD = dict(_ROUTE, optional=frozenset({"dweights", "fractions"}),
                       bad=_ROUTE["bad"] + (({"aux_coef": float("nan")}, "LLMC_ERR_VALUE"),
                                            ({"z_coef": float("inf")}, "LLMC_ERR_VALUE")))
_GROUPED = dict(fill={"offsets": (0, 1)}, bad=(({"R": 2}, "LLMC_ERR_RANGE"),))
# written: LLMC_WRITE_DINP | LLMC_WRITE_DWEIGHT (3) or less
_GROUPED_BACKWARD = dict(_GROUPED, optional=frozenset({"dinp", "dweight"}),
                         not_sizes=frozenset({"written"}),
                         bad=_GROUPED["bad"] + (({"written": 4}, "LLMC_ERR_VALUE"),
                                                ({"written": -1}, "LLMC_ERR_VALUE")))
# on quantized experts: few_rows is a threshold (0: every expert on the panel path)
_GROUPED_QUANT = dict(_QUANT, fill=_GROUPED["fill"],
                      not_sizes=frozenset({"qtype", "few_rows"}),
                      bad=_QUANT["bad"] + _GROUPED["bad"])
# one adapter's columns (0, 1); a second one, (0, 0), would be empty and overlap it
_ADAPTER_COLUMNS = dict(fill={"rows": (0, 1)}, bad=(({"n": 2}, "LLMC_ERR_RANGE"),))


def _bad_dtype(param):
    """An llmc_dtype argument that is neither float32 nor bf16."""
    return (({param: 2}, "LLMC_ERR_VALUE"), ({param: -1}, "LLMC_ERR_VALUE"))


# a backward's `written`: matmul_backward's mask of its outputs, an activation's 0 or 1
_WRITTEN_MASK = dict(not_sizes=frozenset({"written"}),
                     bad=(({"written": 4}, "LLMC_ERR_VALUE"), ({"written": -1}, "LLMC_ERR_VALUE")))
_WRITTEN_FLAG = dict(not_sizes=frozenset({"written"}),
                     bad=(({"written": 2}, "LLMC_ERR_VALUE"), ({"written": -1}, "LLMC_ERR_VALUE")))
# the attention backwards: windowed, dropped, and written 0 or 1
_WINDOWED_WRITTEN = dict(_WINDOWED_DROPPED,
                         not_sizes=_WINDOWED["not_sizes"] | _WRITTEN_FLAG["not_sizes"],
                         bad=_WINDOWED_DROPPED["bad"] + _WRITTEN_FLAG["bad"])


# One row per kernel in csrc/llmc_api.h; a kernel without a row fails
# test_every_kernel_has_a_row. Add yours here (usually just `Row()`).
ROWS = {
    "encoder_forward": Row(optional=frozenset({"wpe"})),
    "encoder_backward": Row(optional=frozenset({"dwpe"})),
    "sinusoidal_forward": Row(optional=frozenset({"pos"})),
    "layernorm_forward": Row(bad=_NEGATIVE_EPS + _bad_dtype("out_dtype")),
    "residual_layernorm_forward": Row(bad=_NEGATIVE_EPS + _bad_dtype("out_dtype")),
    "layernorm_backward": Row(optional=frozenset({"dweight", "dbias"}),   # frozen norms
                              **_WRITTEN_FLAG),
    "rmsnorm_forward": Row(bad=_NEGATIVE_EPS + _bad_dtype("out_dtype")),
    "residual_rmsnorm_forward": Row(bad=_NEGATIVE_EPS + _bad_dtype("out_dtype")),
    "rmsnorm_backward": Row(optional=frozenset({"dweight"}), **_WRITTEN_FLAG),
    "head_rmsnorm_forward": Row(bad=(({"eps": -1.0}, "LLMC_ERR_VALUE"),
                                     ({"eps": float("nan")}, "LLMC_ERR_VALUE"),
                                     ({"eps": -1.0, "hs": 0}, "LLMC_ERR_SHAPE"))),
    "head_rmsnorm_backward": Row(**_WRITTEN_FLAG),
    "matmul_forward": Row(optional=frozenset({"bias"})),
    "matmul_backward": Row(optional=frozenset({"dinp", "dweight", "dbias"}), **_WRITTEN_MASK),
    "matmul_forward_naive": Row(optional=frozenset({"bias"})),
    "matmul_backward_naive": Row(optional=frozenset({"dinp", "dweight", "dbias"}), **_WRITTEN_MASK),
    "float_to_bf16": Row(),
    "bf16_to_float": Row(),
    "matmul_forward_bf16": Row(optional=frozenset({"bias"}), bad=_bad_dtype("inp_dtype")),
    "matmul_backward_bf16": Row(optional=frozenset({"dinp", "dweight", "dbias"}),
                                not_sizes=_WRITTEN_MASK["not_sizes"],
                                bad=_bad_dtype("inp_dtype") + _WRITTEN_MASK["bad"]),
    "matmul_gelu_forward_bf16": Row(optional=frozenset({"bias"}),
                                    bad=_bad_dtype("inp_dtype") + _bad_dtype("act_dtype")),
    "matmul_forward_bf16_naive": Row(optional=frozenset({"bias"}), bad=_bad_dtype("inp_dtype")),
    "matmul_backward_bf16_naive": Row(optional=frozenset({"dinp", "dweight", "dbias"}),
                                      not_sizes=_WRITTEN_MASK["not_sizes"],
                                      bad=_bad_dtype("inp_dtype") + _WRITTEN_MASK["bad"]),
    "quantize_rows": Row(**_QUANT),
    "dequantize_rows": Row(**_QUANT),
    "quant_pack_rows": Row(**_QUANT),
    "quant_unpack_rows": Row(**_QUANT),
    "matmul_forward_quant": Row(**_QUANT_MATMUL),
    **{f"matmul_forward_quant_{path}": Row(**_QUANT_MATMUL, cpu_path=path != "portable")
       for path in ("portable", "avx2", "avxvnni", "avx512vnni")},
    "matmul_forward_quant_panels": Row(**_QUANT_MATMUL),
    "matmul_backward_quant_panels": Row(**_QUANT),
    "attention_forward": Row(bad=_C_NOT_DIVISIBLE),
    "attention_backward": Row(not_sizes=_WRITTEN_FLAG["not_sizes"],
                              bad=_C_NOT_DIVISIBLE + _WRITTEN_FLAG["bad"]),
    "attention_gqa_forward": Row(**_WINDOWED_DROPPED),
    "attention_gqa_backward": Row(**_WINDOWED_WRITTEN),
    "attention_gqa_forward_bf16": Row(**_WINDOWED_DROPPED),
    "attention_gqa_backward_bf16": Row(**_WINDOWED_WRITTEN),
    "attention_gqa_probs": Row(**_WINDOWED),
    "attention_forward_naive": Row(**_WINDOWED_DROPPED),
    "attention_backward_naive": Row(not_sizes=_WINDOWED_WRITTEN["not_sizes"],
                                    bad=_WINDOWED_WRITTEN["bad"]),
    "attention_gqa_entropy": Row(**_WINDOWED),
    "attention_entropy_naive": Row(),
    "attention_decode": Row(fill={"len": 1}, **_WINDOWED),
    "rope_forward": Row(**_ROPE),
    "rope_backward": Row(**dict(_ROPE, not_sizes=_ROPE["not_sizes"] | _WRITTEN_FLAG["not_sizes"],
                                bad=_ROPE["bad"] + _WRITTEN_FLAG["bad"])),
    "rope_table": Row(optional=frozenset({"inv_freq"}), valid={"hs": 2, "theta": 10000.0},
                      fill={"inv_freq": 1.0},
                      bad=(({"hs": 3}, "LLMC_ERR_SHAPE"), ({"theta": 0.0}, "LLMC_ERR_VALUE"),
                           ({"theta": float("nan")}, "LLMC_ERR_VALUE"))),
    # the tables go together (one alone is NULL); a position past them is out of range
    # (pos [0, 1]: row 1's position is past a table of P = 1; buffers hold 16 floats, so
    # an odd hs goes with B = 1)
    "kv_cache_write": Row(valid={"hs": 2}, not_sizes=frozenset({"interleaved"}),
                          fill={"pos": (0, 1)},
                          bad=(({"hs": 3}, "LLMC_ERR_SHAPE"),
                               ({"interleaved": 2}, "LLMC_ERR_VALUE"),
                               ({"B": 2}, "LLMC_ERR_RANGE"), ({"B": 2, "P": 2}, "LLMC_OK"),
                               ({"cos_table": ffi.NULL, "sin_table": ffi.NULL, "hs": 3},
                                "LLMC_OK"))),
    "swiglu_forward": Row(bad=_bad_dtype("out_dtype")),
    "swiglu_backward": Row(**_WRITTEN_FLAG),
    "gelu_forward": Row(bad=_bad_dtype("out_dtype")),
    "gelu_backward": Row(**_WRITTEN_FLAG),
    "gelu_erf_forward": Row(bad=_bad_dtype("out_dtype")),
    "gelu_erf_backward": Row(**_WRITTEN_FLAG),
    "relu_forward": Row(bad=_bad_dtype("out_dtype")),
    "relu_backward": Row(**_WRITTEN_FLAG),
    "geglu_forward": Row(bad=_bad_dtype("out_dtype")),
    "geglu_backward": Row(**_WRITTEN_FLAG),
    "reglu_forward": Row(bad=_bad_dtype("out_dtype")),
    "reglu_backward": Row(**_WRITTEN_FLAG),
    "residual_forward": Row(),
    "residual_backward": Row(),
    "dropout_forward": Row(bad=_bad_probability("p")),
    "dropout_backward": Row(bad=_bad_probability("p")),
    "softmax_forward": Row(bad=_V_ABOVE_VP),
    "softmax_crossentropy_forward": Row(bad=_V_ABOVE_VP),
    "softmax_crossentropy_backward": Row(bad=_V_ABOVE_VP),
    "adamw_update": Row(optional=frozenset({"params_bf16"}),   # fp32 training
                        not_sizes=frozenset({"t"}),   # the step number: a value, >= 1
                        bad=(({"t": 0}, "LLMC_ERR_VALUE"), ({"t": -1}, "LLMC_ERR_VALUE"))),
    "global_norm_squared": Row(),
    "scale_inplace": Row(),
    "fill_zero": Row(),
    "moe_route_forward": Row(**_ROUTE),
    "moe_route_backward": Row(**dict(_ROUTE_BACKWARD,
                                     not_sizes=_ROUTE["not_sizes"] | _WRITTEN_FLAG["not_sizes"],
                                     bad=_ROUTE_BACKWARD["bad"] + _WRITTEN_FLAG["bad"])),
    "moe_permute": Row(bad=(({"k": 2}, "LLMC_ERR_SHAPE"),)),
    # the grouped rows of the tokens' dtype: both float32 or both bf16
    "moe_gather_forward": Row(bad=_bad_dtype("inp_dtype")
                              + (({"grouped_dtype": 0}, "LLMC_ERR_VALUE"),)),
    "moe_gather_backward": Row(**_WRITTEN_FLAG),
    "moe_combine_forward": Row(),
    "moe_combine_backward": Row(),
    "moe_grouped_forward": Row(**_GROUPED),
    "moe_grouped_backward": Row(**_GROUPED_BACKWARD),
    "moe_grouped_forward_bf16": Row(**dict(_GROUPED, bad=_GROUPED["bad"]
                                           + _bad_dtype("inp_dtype"))),
    "moe_grouped_backward_bf16": Row(**dict(_GROUPED_BACKWARD, bad=_GROUPED_BACKWARD["bad"]
                                            + _bad_dtype("inp_dtype"))),
    "moe_grouped_forward_quant": Row(**_GROUPED_QUANT),
    **{f"moe_grouped_forward_quant_{path}": Row(**_GROUPED_QUANT, cpu_path=path != "portable")
       for path in ("portable", "avx2", "avxvnni", "avx512vnni")},
    "lora_up_forward_bf16": Row(**_ADAPTER_COLUMNS),
    "lora_up_backward_bf16": Row(**_ADAPTER_COLUMNS),
}

@pytest.mark.parametrize("status,cls,builtin", [
    (lib.LLMC_ERR_SHAPE, llmc_py.ShapeError, ValueError),
    (lib.LLMC_ERR_RANGE, llmc_py.RangeError, IndexError),
    (lib.LLMC_ERR_NOMEM, llmc_py.OutOfMemoryError, MemoryError),
    (lib.LLMC_ERR_NULL, llmc_py.NullPointerError, ValueError),
    (lib.LLMC_ERR_UNSUPPORTED, llmc_py.UnsupportedError, ValueError),
    (lib.LLMC_ERR_VALUE, llmc_py.InvalidValueError, ValueError),
])
def test_check_maps_status_to_class(status, cls, builtin):
    with pytest.raises(cls) as info:
        check(status, "some_kernel")
    assert isinstance(info.value, builtin) and isinstance(info.value, llmc_py.LlmcError)
    assert info.value.status == status
    text = ffi.string(lib.llmc_status_string(status)).decode()
    assert f"some_kernel: {text} (status {status})" == str(info.value)


def test_check_passes_ok_and_raises_base_class_for_unknown_status():
    assert check(lib.LLMC_OK, "k") is None
    with pytest.raises(llmc_py.LlmcError) as info:
        check(99, "k")
    assert type(info.value) is llmc_py.LlmcError and info.value.status == 99


def test_status_strings_are_distinct():
    codes = [lib.LLMC_OK, lib.LLMC_ERR_SHAPE, lib.LLMC_ERR_RANGE, lib.LLMC_ERR_NOMEM,
             lib.LLMC_ERR_NULL, lib.LLMC_ERR_UNSUPPORTED, lib.LLMC_ERR_VALUE, 99, -1]
    texts = [ffi.string(lib.llmc_status_string(c)).decode() for c in codes]
    assert all(texts) and len(set(texts)) == len(codes) - 1 and texts[-1] == texts[-2]


def test_raw_call_returns_status_and_process_survives():
    B, T, C = 1, 2, 4
    buf = ffi.new("float[]", B * T * C)
    stat = ffi.new("float[]", B * T)
    assert lib.layernorm_forward(buf, stat, stat, buf, buf, buf, 0, T, C, 1e-5, lib.LLMC_DTYPE_F32) \
        == lib.LLMC_ERR_SHAPE
    assert lib.layernorm_forward(ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL,
                                 B, T, C, 1e-5, lib.LLMC_DTYPE_F32) == lib.LLMC_ERR_NULL
    assert lib.attention_forward(buf, buf, buf, 1, 1, 3, 2) == lib.LLMC_ERR_SHAPE   # C % NH
    assert lib.softmax_forward(buf, buf, 1, 1, 5, 4) == lib.LLMC_ERR_SHAPE         # V > Vp
    tokens = ffi.new("int[]", [0, 7])
    assert lib.encoder_forward(buf, tokens, buf, buf, 1, 2, 1, 7) == lib.LLMC_ERR_RANGE
    # and the library still works
    x = np.arange(1, 9, dtype=np.float32).reshape(1, 2, 4)
    out, mean, rstd = np.empty_like(x), np.empty((1, 2), np.float32), np.empty((1, 2), np.float32)
    K.layernorm_forward(out, mean, rstd, x, np.ones(4, np.float32), np.zeros(4, np.float32))
    assert np.allclose(mean, [[2.5, 6.5]])


def test_header_parse_finds_the_kernels_and_their_parameters():
    assert {"encoder_forward", "matmul_backward_naive", "adamw_update"} <= set(KERNELS)
    assert PROTOTYPES["encoder_forward"] == ("out", "inp", "wte", "wpe", "B", "T", "C", "V")
    assert {"encoder_forward", "softmax_crossentropy_forward"} <= set(TOKEN_KERNELS)
    assert all("V" in PROTOTYPES[name] for name in TOKEN_KERNELS)
    for name in KERNELS:
        assert len(PROTOTYPES[name]) == len(ffi.typeof(getattr(lib, name)).args), name


def test_every_kernel_has_a_row():
    missing = sorted(set(KERNELS) - set(ROWS))
    assert not missing, f"add a row to ROWS in tests/test_errors.py for: {', '.join(missing)}"
    assert not set(ROWS) - set(KERNELS), f"rows for kernels not in the header: " \
                                         f"{sorted(set(ROWS) - set(KERNELS))}"


class Call:
    """One raw call of a kernel: ``args`` by parameter name, from its row's
    valid defaults; ``buffers`` keeps each pointer's memory alive."""

    def __init__(self, name):
        self.name, self.row = name, ROWS[name]
        self.params = PROTOTYPES[name]
        self.types = dict(zip(self.params, ffi.typeof(getattr(lib, name)).args))
        self.args, self.buffers = {}, {}
        for param, ctype in self.types.items():
            if ctype.kind == "pointer":
                fill = self.row.fill.get(param)
                if fill is not None:
                    fill = list(fill) if isinstance(fill, tuple) else [fill] * self.row.elements
                # a void* activation: float32 or bf16 (its *_dtype says), floats will do
                item = "float" if ctype.item.cname == "void" else ctype.item.cname
                self.buffers[param] = ffi.new(f"{item}[{self.row.elements}]", fill)
                self.args[param] = self.buffers[param]
            elif ctype.cname in ("int", "int64_t"):
                self.args[param] = self.row.valid.get(param, 1)
            elif ctype.cname == "uint64_t":
                self.args[param] = self.row.valid.get(param, 0)
            else:
                self.args[param] = self.row.valid.get(param, 0.0)

    def pointers(self):
        return [p for p, t in self.types.items() if t.kind == "pointer"]

    def sizes(self):
        # an llmc_dtype argument (*_dtype: 1, bf16, by default) is no size
        return [p for p, t in self.types.items() if t.cname in ("int", "int64_t")
                and p not in self.row.not_sizes and not p.endswith("_dtype")]

    def tokens(self):
        return [p for p, t in self.types.items()
                if t.kind == "pointer" and t.item.cname == "int" and p in TOKEN_PARAMS]

    def __call__(self, **changes):
        args = dict(self.args, **changes)
        return getattr(lib, self.name)(*(args[p] for p in self.params))


def _expect(call, status, changes, what):
    got = call(**changes)
    assert got == status, f"{call.name}({what}): status {got}, expected {status}"


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_accepts_its_small_valid_arguments(name):
    call = Call(name)
    if call.row.cpu_path and call() == lib.LLMC_ERR_UNSUPPORTED:
        pytest.skip(f"this CPU or build cannot run {name}")
    _expect(call, lib.LLMC_OK, {}, "valid arguments")


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_rejects_null_pointers(name):
    call = Call(name)
    # a path this CPU lacks checks its pointers, then says so where it would run
    runs = lib.LLMC_ERR_UNSUPPORTED if call.row.cpu_path and call() == \
        lib.LLMC_ERR_UNSUPPORTED else lib.LLMC_OK
    for param in call.pointers():
        want = runs if param in call.row.optional else lib.LLMC_ERR_NULL
        _expect(call, want, {param: ffi.NULL}, f"{param}=NULL")


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_rejects_zero_and_negative_sizes(name):
    call = Call(name)
    assert call.sizes(), f"{name} has no size argument"
    for param in call.sizes():
        for value in (0, -1, -INT_MAX - 1):
            _expect(call, lib.LLMC_ERR_SHAPE, {param: value}, f"{param}={value}")


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_rejects_sizes_no_array_could_have(name):
    """All sizes at their type's maximum: the element counts overflow, and the
    kernel must say so before it reads or writes its 16-element buffers."""
    call = Call(name)
    huge = {p: INT64_MAX if call.types[p].cname == "int64_t" else INT_MAX for p in call.sizes()}
    _expect(call, lib.LLMC_ERR_SHAPE, huge, "every size at its maximum")


@pytest.mark.parametrize("name", TOKEN_KERNELS)
def test_kernel_rejects_token_ids_out_of_range(name):
    call = Call(name)
    V = call.args["V"]
    for param in call.tokens():
        # targets may also be LLMC_IGNORE_INDEX (-1); inputs may not
        ignorable = param == "targets"
        for value in (-2 if ignorable else -1, V, INT_MAX, -INT_MAX - 1):
            call.buffers[param][0] = value
            _expect(call, lib.LLMC_ERR_RANGE, {}, f"{param}[0]={value}")
        if ignorable:
            call.buffers[param][0] = lib.LLMC_IGNORE_INDEX
            _expect(call, lib.LLMC_OK, {}, f"{param}[0]=LLMC_IGNORE_INDEX")
        call.buffers[param][0] = 0
    _expect(call, lib.LLMC_OK, {}, "tokens back in range")


@pytest.mark.parametrize("name", [n for n in KERNELS if ROWS.get(n, Row()).bad])
def test_kernel_rejects_its_own_bad_cases(name):
    call = Call(name)
    for changes, status in call.row.bad:
        _expect(call, getattr(lib, status), changes,
                ", ".join(f"{k}={v}" for k, v in changes.items()))


FORBIDDEN = re.compile(r"\b(exit|_exit|_Exit|quick_exit|abort|assert|printf|fprintf|puts|"
                       r"fputs|putchar|perror)\s*\(")


def test_forbidden_pattern_catches_what_it_should():
    for line in ["exit(1);", "abort ();", "assert(x);", 'fprintf(stderr, "x");', "puts(s);",
                 'printf("%d", n);', "_exit(2);"]:
        assert FORBIDDEN.search(line), line
    for line in ["snprintf(buf, n, s);", "never exits or prints", "llmc_exit_code(3);",
                 "static_assert_like(1);"]:
        assert not FORBIDDEN.search(line), line


def test_c_sources_never_exit_abort_assert_or_print():
    files = sorted(CSRC.glob("*.c")) + sorted(CSRC.glob("*.h"))
    assert len(files) >= 10
    hits = [f"{path.name}:{n}: {line.strip()}"
            for path in files
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if FORBIDDEN.search(line)]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("n", [0, -1])
def test_set_num_threads_rejects_non_positive(set_threads, n):
    before = llmc_py.get_num_threads()
    with pytest.raises(llmc_py.ShapeError):
        set_threads(n)
    assert llmc_py.get_num_threads() == before


def test_wrappers_check_rank_and_type_before_unpacking():
    x = np.zeros((3, 8), np.float32)   # 2-D where [B, T, C] is expected
    with pytest.raises(llmc_py.ShapeError, match="inp"):
        K.layernorm_forward(np.zeros_like(x), np.zeros(3, np.float32), np.zeros(3, np.float32),
                            x, np.ones(8, np.float32), np.zeros(8, np.float32))
    with pytest.raises(TypeError, match="inp"):
        K.matmul_forward(np.zeros((1, 3, 4), np.float32), x.tolist(), np.zeros((4, 8), np.float32))
    with pytest.raises(llmc_py.ShapeError, match="logits"):
        K.softmax_forward(np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float32), 3)
    with pytest.raises(TypeError, match="inp"):
        K.gelu_forward(np.zeros(3, np.float32), [1.0, 2.0, 3.0])


def test_a_declaration_that_disagrees_with_its_c_function_fails_when_built():
    from llmc_py._native.declare import bind
    with pytest.raises(TypeError, match="does not match its C arguments"):
        bind(vars(K), lib, "gelu_forward", "out[...] written | N from out", "")   # no inp
    with pytest.raises(TypeError, match="declared an array but C takes int64_t"):
        bind(vars(K), lib, "gelu_forward", "out[...] written, inp[...], n[3], d[1]", "")
    with pytest.raises(ValueError, match="unknown or repeated qualifiers"):
        bind(vars(K), lib, "gelu_forward", "out[...] writen, inp[...] | N from inp", "")
    wrapper = bind(vars(K), lib, "gelu_forward",
                   "out[...] written, inp[...] | N from inp | dtype(out)", "doc")
    x = np.array([0.0, 1.0], np.float32)
    out = np.empty_like(x)
    wrapper(out, x)
    assert wrapper.__name__ == "gelu_forward" and wrapper.__doc__ == "doc" and out[0] == 0.0
