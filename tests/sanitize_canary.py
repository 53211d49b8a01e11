"""Run by `make sanitize` only (not a test module): reads one float past the
end of a 16-float buffer through a raw kernel call. Under the sanitized
build this must die with AddressSanitizer's heap-buffer-overflow report; if
it does not, the sanitizers are not active and `make sanitize` fails rather
than pass without checking anything."""
import sys

import numpy as np

from llmc_py._native.lib import ffi, lib

x = np.ones(16, np.float32)
out = np.zeros(1, np.float64)
lib.global_norm_squared(ffi.from_buffer("double[]", out), ffi.from_buffer("float[]", x), 17)
print("sanitize_canary: an out-of-bounds read went unnoticed", file=sys.stderr)
sys.exit(0)
