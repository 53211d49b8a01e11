"""The house rules for errors: C returns a status and never exits or prints;
Python maps the status to an exception class."""
import re
from pathlib import Path

import numpy as np
import pytest

import llmc_py
from llmc_py import kernels as K
from llmc_py._lib import check, ffi, lib

CSRC = Path(__file__).resolve().parent.parent / "csrc"
KERNELS = [name for name in re.findall(r"^int (\w+)\(", (CSRC / "llmc_api.h").read_text(), re.M)
           if not name.startswith("llmc_")]
# pointers a kernel accepts as NULL: (kernel, argument index)
OPTIONAL = {("matmul_forward", 3), ("matmul_forward_naive", 3),
            ("matmul_backward", 2), ("matmul_backward_naive", 2),
            ("encoder_forward", 3), ("encoder_backward", 1),
            ("rope_forward", 2), ("rope_backward", 2),
            ("attention_gqa_forward", 3), ("attention_decode", 6)}
# arguments for which the defaults of _raw_args (sizes 1, scalars 0.0) are
# invalid: (kernel, argument index) -> a valid value. RoPE needs an even head
# size and theta > 0.
VALID = {("rope_forward", 7): 2, ("rope_forward", 8): 10000.0,
         ("rope_backward", 7): 2, ("rope_backward", 8): 10000.0}
# int arrays a kernel needs filled with a valid non-zero value: (kernel, argument index)
INT_FILL = {("attention_decode", 5): 1}   # len[b] >= 1


@pytest.mark.parametrize("status,cls,builtin", [
    (lib.LLMC_ERR_SHAPE, llmc_py.ShapeError, ValueError),
    (lib.LLMC_ERR_RANGE, llmc_py.RangeError, IndexError),
    (lib.LLMC_ERR_NOMEM, llmc_py.OutOfMemoryError, MemoryError),
    (lib.LLMC_ERR_NULL, llmc_py.NullPointerError, ValueError),
    (lib.LLMC_ERR_UNSUPPORTED, llmc_py.UnsupportedError, ValueError),
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
             lib.LLMC_ERR_NULL, lib.LLMC_ERR_UNSUPPORTED, 99, -1]
    texts = [ffi.string(lib.llmc_status_string(c)).decode() for c in codes]
    assert all(texts) and len(set(texts)) == len(codes) - 1 and texts[-1] == texts[-2]


def test_raw_call_returns_status_and_process_survives():
    B, T, C = 1, 2, 4
    buf = ffi.new("float[]", B * T * C)
    stat = ffi.new("float[]", B * T)
    assert lib.layernorm_forward(buf, stat, stat, buf, buf, buf, 0, T, C, 1e-5) \
        == lib.LLMC_ERR_SHAPE
    assert lib.layernorm_forward(ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL,
                                 B, T, C, 1e-5) == lib.LLMC_ERR_NULL
    assert lib.attention_forward(buf, buf, buf, 1, 1, 3, 2) == lib.LLMC_ERR_SHAPE   # C % NH
    assert lib.softmax_forward(buf, buf, 1, 1, 5, 4) == lib.LLMC_ERR_SHAPE         # V > Vp
    tokens = ffi.new("int[]", [0, 7])
    assert lib.encoder_forward(buf, tokens, buf, buf, 1, 2, 1, 7) == lib.LLMC_ERR_RANGE
    # and the library still works
    x = np.arange(1, 9, dtype=np.float32).reshape(1, 2, 4)
    out, mean, rstd = np.empty_like(x), np.empty((1, 2), np.float32), np.empty((1, 2), np.float32)
    K.layernorm_forward(out, mean, rstd, x, np.ones(4, np.float32), np.zeros(4, np.float32))
    assert np.allclose(mean, [[2.5, 6.5]])


def _raw_args(name, null_at=None, zero_at=None):
    """Arguments for kernel ``name`` with every size 1 (or its VALID value) and a
    small zeroed buffer for every pointer; the pointer at ``null_at`` is NULL,
    the size at ``zero_at`` 0."""
    args = []
    for i, arg in enumerate(ffi.typeof(getattr(lib, name)).args):
        if arg.kind == "pointer":
            fill = [INT_FILL[name, i]] * 16 if (name, i) in INT_FILL else None
            args.append(ffi.NULL if i == null_at else ffi.new(f"{arg.item.cname}[16]", fill))
        elif arg.cname in ("int", "long"):
            args.append(0 if i == zero_at else VALID.get((name, i), 1))
        else:
            args.append(VALID.get((name, i), 0.0))   # the float scalars: eps, learning rate, ...
    return args


@pytest.mark.parametrize("name", KERNELS)
def test_every_kernel_checks_pointers_and_sizes(name):
    arg_types = ffi.typeof(getattr(lib, name)).args
    assert getattr(lib, name)(*_raw_args(name)) == lib.LLMC_OK
    for i, arg in enumerate(arg_types):
        if arg.kind == "pointer":
            want = lib.LLMC_OK if (name, i) in OPTIONAL else lib.LLMC_ERR_NULL
            got = getattr(lib, name)(*_raw_args(name, null_at=i))
            assert got == want, f"{name} with NULL argument {i}: status {got}, expected {want}"
        elif arg.cname in ("int", "long"):
            got = getattr(lib, name)(*_raw_args(name, zero_at=i))
            assert got == lib.LLMC_ERR_SHAPE, f"{name} with size argument {i} = 0: status {got}"


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
