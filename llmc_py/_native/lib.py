"""The only module that sees cffi: status checks, array-to-pointer adapters,
threads and the instruction set of the kernels; the record of a sequence
of kernel calls, to run again as it was (record_calls, replay)."""
import contextlib
import os
import threading

import numpy as np

try:
    from ._llmc import ffi, lib
except ImportError as e:   # a source checkout that was never built
    raise ImportError(
        "llmc_py's compiled kernels (llmc_py._native._llmc) are not built: run "
        "`pip install .` (or `pip install -e .` to work on the sources)") from e
from ..errors import (InvalidValueError, LlmcError, NullPointerError, OutOfMemoryError,
                      RangeError, ShapeError, UnsupportedError)

_ERROR_FOR_STATUS = {
    lib.LLMC_ERR_SHAPE: ShapeError,
    lib.LLMC_ERR_RANGE: RangeError,
    lib.LLMC_ERR_NOMEM: OutOfMemoryError,
    lib.LLMC_ERR_NULL: NullPointerError,
    lib.LLMC_ERR_UNSUPPORTED: UnsupportedError,
    lib.LLMC_ERR_VALUE: InvalidValueError,
}


def check(status, where):
    """Raises the exception mapped to a non-zero C status."""
    if status == lib.LLMC_OK:
        return
    text = ffi.string(lib.llmc_status_string(status)).decode("ascii")
    err = _ERROR_FOR_STATUS.get(status, LlmcError)(f"{where}: {text} (status {status})")
    err.status = status
    raise err


# the calls record_calls is recording in this thread (.calls), if any
_recording = threading.local()


def called(c_function, args):
    """c_function(*args), the C function's status; inside record_calls, the
    call is recorded too."""
    calls = getattr(_recording, "calls", None)
    if calls is not None:
        calls.append((c_function, args))
    return c_function(*args)


@contextlib.contextmanager
def record_calls():
    """Yields a list that gets (C function, arguments) of every kernel this
    thread calls inside the block, in order: the arguments as the wrappers
    made them (cffi pointers, which keep their arrays alive, and numbers),
    so that replay() makes the same calls on the same memory without the
    wrappers' Python."""
    calls = []
    _recording.calls = calls
    try:
        yield calls
    finally:
        _recording.calls = None


def replay(calls):
    """Makes the C calls of a record_calls list again, in order, each status checked
    (check called only on an error: a decoding step makes ~300 calls)."""
    ok = lib.LLMC_OK
    for c_function, args in calls:
        status = c_function(*args)
        if status != ok:
            check(status, c_function.__name__)


def _pointer(arr, name, shape, dtype, ctype, out):
    if not isinstance(arr, np.ndarray) or arr.dtype != dtype:
        got = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
        raise TypeError(f"{name} must be a {np.dtype(dtype).name} numpy array, got {got}")
    if not arr.flags.c_contiguous:
        raise ShapeError(f"{name} must be C-contiguous")
    if arr.shape != tuple(shape):
        raise ShapeError(f"{name} has shape {arr.shape}, expected {tuple(shape)}")
    if out and not arr.flags.writeable:
        raise ValueError(f"{name} is read-only but is written by the kernel")
    return ffi.from_buffer(ctype, arr, require_writable=out)


def fptr(arr, name, shape, *, out=False):
    """A float* into a float32 C-contiguous array of exactly ``shape`` (no copy)."""
    return _pointer(arr, name, shape, np.float32, "float[]", out)


def iptr(arr, name, shape, *, out=False):
    """An int* into an int32 C-contiguous array of exactly ``shape`` (no copy)."""
    return _pointer(arr, name, shape, np.int32, "int[]", out)


def hptr(arr, name, shape, *, out=False):
    """A uint16_t* into a uint16 C-contiguous array of exactly ``shape``: bf16
    numbers, each the upper half of a float32 (no copy)."""
    return _pointer(arr, name, shape, np.uint16, "uint16_t[]", out)


def aptr(arr, name, shape, *, out=False):
    """A void* into an activation of exactly ``shape``: float32, or bf16
    (uint16) numbers (no copy); dtype_code(arr) says which to C."""
    if isinstance(arr, np.ndarray) and arr.dtype == np.uint16:
        return _pointer(arr, name, shape, np.uint16, "uint16_t[]", out)
    if isinstance(arr, np.ndarray) and arr.dtype == np.float32:
        return _pointer(arr, name, shape, np.float32, "float[]", out)
    got = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
    raise TypeError(f"{name} must be a float32 or bf16 (uint16) numpy array, got {got}")


def dtype_code(arr):
    """The llmc_dtype of an activation aptr passes: LLMC_DTYPE_BF16 for uint16."""
    return lib.LLMC_DTYPE_BF16 if arr.dtype == np.uint16 else lib.LLMC_DTYPE_F32


def bptr(arr, name, shape, *, out=False):
    """A uint8_t* into a uint8 C-contiguous array of exactly ``shape``: quantized
    blocks (no copy)."""
    return _pointer(arr, name, shape, np.uint8, "uint8_t[]", out)


def dptr(arr, name, shape, *, out=False):
    """A double* into a float64 C-contiguous array of exactly ``shape`` (no copy)."""
    return _pointer(arr, name, shape, np.float64, "double[]", out)


def set_num_threads(n):
    """Sets the number of threads the kernels use."""
    check(lib.llmc_set_num_threads(int(n)), "set_num_threads")


def get_num_threads():
    return lib.llmc_get_num_threads()


def has_openmp():
    return bool(lib.llmc_has_openmp())


def release_scratch():
    """Frees the matmul and attention kernels' scratch arena (kept between
    calls, grown to the largest call's need); the next such call grows it
    again."""
    check(lib.llmc_scratch_release(), "release_scratch")


def scratch_bytes():
    """Bytes the matmul and attention kernels' scratch arena holds now."""
    return int(lib.llmc_scratch_bytes())


# instruction sets of the kernels, by name, slowest first
ISAS = {"portable": lib.LLMC_ISA_PORTABLE, "avx2": lib.LLMC_ISA_AVX2,
        "avx512": lib.LLMC_ISA_AVX512, "avx512bf16": lib.LLMC_ISA_AVX512BF16}


def set_isa(name):
    """Chooses the instruction set of every kernel: "avx512bf16" (AVX-512 with
    the bf16 dot product; only the bf16 matmul differs from "avx512"),
    "avx512", "avx2", "portable", or "auto" (the best the CPU supports, the
    default). The environment
    variable LLMC_ISA makes the same choice when llmc_py is imported. Raises
    UnsupportedError if this CPU or build cannot run it."""
    if name != "auto" and name not in ISAS:
        raise ValueError(f"unknown instruction set {name!r}; known: auto, {', '.join(ISAS)}")
    check(lib.llmc_set_isa(lib.LLMC_ISA_AUTO if name == "auto" else ISAS[name]),
          f"set_isa({name!r})")


def get_isa():
    """The instruction set the kernels run on (never "auto")."""
    isa = lib.llmc_get_isa()
    return next(name for name, value in ISAS.items() if value == isa)


def supported_isas():
    """The instruction sets this CPU and build can run, slowest first."""
    return [name for name, value in ISAS.items() if lib.llmc_isa_supported(value)]


if os.environ.get("LLMC_ISA", "").strip():
    set_isa(os.environ["LLMC_ISA"].strip().lower())
