"""The cffi builder for llmc_py._native._llmc (out-of-line API mode).

setuptools runs this through ``cffi_modules`` from the project root. Every
compiler flag and environment switch lives here:

- ``LLMC_OPENMP=0`` builds without OpenMP (otherwise OpenMP is used when a
  probe compile with it succeeds; if none does, the build warns once and the
  kernels run on one thread).
- ``LLMC_NATIVE=0`` leaves out ``-march=native``, for a build that runs on
  any CPU of the architecture (a wheel to share); the default tunes the
  build for the CPU it is built on. Either way every kernel family's vector
  loops are also built for AVX2 and AVX-512 (per-function target attributes,
  csrc/isa.h) and chosen at run time.
- ``LLMC_SANITIZE=1`` builds with AddressSanitizer and UndefinedBehaviorSanitizer
  (``make sanitize``): a debugging build, never one to ship. Python must then
  run with libasan preloaded (the Makefile shows how).
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"

# explicit, never globbed, so scratch files are never compiled in; the
# slowest to compile first (gcc 12, Zen 1: 58, 42 and 34 s, the next 7 s),
# so that a parallel build (setup.py) starts them at once
SOURCES = [
    "attention_decode.c",
    "attention.c",
    "attention_bf16.c",
    "status.c",
    "scratch.c",
    "isa.c",
    "colsum.c",
    "encoder.c",
    "norms.c",
    "matmul.c",
    "bf16.c",
    "matmul_bf16.c",
    "quant.c",
    "attention_probs.c",
    "attention_naive.c",
    "rope.c",
    "activations.c",
    "dropout.c",
    "softmax_xent.c",
    "moe.c",
    "lora_bf16.c",
    "adamw.c",
]

# -ffp-contract=fast: fused multiply-adds (ISO C mode turns them off);
# -fno-math-errno: sqrtf and friends may then be vectorised. No -ffast-math.
# -Wno-psabi: a portable build warns that 64-byte vectors pass differently.
# -g0: no debugging information (Python's own flags ask for -g), which only
# slows the build: gcc 12 on Zen 1 took 109 s over attention_decode.c with
# -g against 33 s without (both with its gcse passes off); the sanitizer
# build asks for -g again.
BASE_FLAGS = ["-O3", "-std=c11", "-ffp-contract=fast", "-fno-math-errno", "-Wno-psabi", "-g0"]

# LLMC_SANITIZE=1: every ASan/UBSan report is fatal (no recovery), frames
# stay walkable for the report, and -O1 keeps the line numbers honest
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                  "-fno-sanitize-recover=undefined", "-g"]
SANITIZE_OPT = "-O1"

_PROBE_SOURCE = """
#include <omp.h>
int main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }
"""


def env_flag(name, default, environ=None):
    """Reads an on/off switch: 0/false/no/off are off, 1/true/yes/on are on."""
    value = (os.environ if environ is None else environ).get(name)
    if value is None or value.strip() == "":
        return default
    value = value.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: expected 0 or 1")


def compiler_command():
    """The C compiler setuptools will use, as an argument list."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return cc.split()


def try_compile(compile_args, link_args, source=_PROBE_SOURCE):
    """True if ``source`` compiles and links with the given flags."""
    cc = compiler_command()
    if shutil.which(cc[0]) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(source)
        cmd = cc + compile_args + [str(src), "-o", str(Path(tmp) / "probe")] + link_args
        try:
            result = subprocess.run(cmd, capture_output=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return result.returncode == 0


def openmp_flags(probe=try_compile):
    """(compile_args, link_args) for OpenMP, or None if no variant works.

    Tries plain -fopenmp (GCC, LLVM clang), then Apple clang with Homebrew's
    libomp, as llm.c's Makefile does.
    """
    candidates = [(["-fopenmp"], ["-fopenmp"])]
    for prefix in ("/opt/homebrew/opt/libomp", "/usr/local/opt/libomp"):
        if Path(prefix).is_dir():
            candidates.append((["-Xpreprocessor", "-fopenmp", f"-I{prefix}/include"],
                               [f"-L{prefix}/lib", "-lomp"]))
    for compile_args, link_args in candidates:
        if probe(compile_args, link_args):
            return compile_args, link_args
    return None


def build_flags(environ=None, probe=try_compile):
    """All compile and link flags, from the environment switches and probes."""
    compile_args, link_args = list(BASE_FLAGS), []
    if env_flag("LLMC_SANITIZE", False, environ):
        compile_args = [SANITIZE_OPT if f == "-O3" else f for f in compile_args]
        compile_args += SANITIZE_FLAGS
        link_args += SANITIZE_FLAGS
    if env_flag("LLMC_NATIVE", True, environ):
        if probe(["-march=native"], [], "int main(void) { return 0; }\n"):
            compile_args.append("-march=native")
    if env_flag("LLMC_OPENMP", True, environ):
        omp = openmp_flags(probe)
        if omp is None:
            print("llmc_py: warning: no OpenMP found for this compiler; "
                  "building single-threaded kernels", file=sys.stderr)
        else:
            compile_args += omp[0]
            link_args += omp[1]
    return compile_args, link_args


def make_builder():
    ffibuilder = FFI()
    # the same file the C compiler sees, so a drifting prototype is a build error
    ffibuilder.cdef((CSRC / "llmc_api.h").read_text())
    compile_args, link_args = build_flags()
    ffibuilder.set_source(
        "llmc_py._native._llmc",
        '#include "llmc.h"',
        sources=[f"csrc/{name}" for name in SOURCES],
        include_dirs=["csrc"],
        depends=[f"csrc/{name}" for name in ("llmc_api.h", "llmc.h", "common.h", "isa.h",
                                                 "gemm.h", "scratch.h", "matmul_micro.h", "matmul_skinny.h",
                                                 "matmul_bf16_micro.h", "bf16_round.h")],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
    return ffibuilder


ffibuilder = make_builder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
