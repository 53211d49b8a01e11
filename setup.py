import os
from concurrent.futures import ThreadPoolExecutor

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext


class ParallelBuildExt(build_ext):
    """build_ext that compiles an extension's C files in parallel, one job a
    core (LLMC_BUILD_JOBS=N sets the count): setuptools compiles them one by
    one, and csrc/'s attention files take a minute each on a slow core. Uses
    the compiler's own steps (distutils' CCompiler.compile, file by file);
    a compiler class without them compiles as setuptools does."""

    def build_extension(self, ext):
        compiler = self.compiler
        jobs = int(os.environ.get("LLMC_BUILD_JOBS") or os.cpu_count() or 1)
        steps = ("_setup_compile", "_get_cc_args", "_compile")
        if jobs > 1 and all(hasattr(compiler, step) for step in steps):
            def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=False,
                        extra_preargs=None, extra_postargs=None, depends=None):
                macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
                    output_dir, macros, include_dirs, sources, depends, extra_postargs)
                cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
                stale = [obj for obj in objects if obj in build]

                def compile_one(obj):
                    src, src_ext = build[obj]
                    compiler._compile(obj, src, src_ext, cc_args, extra_postargs, pp_opts)
                with ThreadPoolExecutor(jobs) as pool:
                    list(pool.map(compile_one, stale))   # re-raises a failed file's error
                return objects
            compiler.compile = compile
        super().build_extension(ext)


# Hugging Face folders (llmc_py.io.hf) and tokenizer.json files: safetensors
# reads and writes the weights, ml_dtypes gives numpy their bf16 type, jinja2 renders
# chat templates (llmc_py.data.chat)
HF = ["safetensors>=0.4", "ml_dtypes>=0.3", "tokenizers>=0.15", "jinja2>=3.1.6"]
# data-parallel training under mpiexec (llmc_py.train.distributed): mpi4py and
# an MPI runtime from PyPI (mpich's wheel brings mpiexec; a system MPI works too)
MPI = ["mpi4py>=4.0", "mpich"]
# GGUF files (llmc_py.io.gguf): llama.cpp's own reader, writer and quantizers
GGUF = ["gguf>=0.17"]
# Parquet datasets (llmc_py.data --parquet): pyarrow reads them
PARQUET = ["pyarrow>=14"]

setup(
    name="llmc_py",
    version="0.1.0",
    description="llm.c's CPU GPT-2 trainer as a Python package with C/OpenMP kernels",
    packages=find_packages(include=["llmc_py", "llmc_py.*"]),
    python_requires=">=3.9",
    setup_requires=["cffi>=1.15"],
    install_requires=["cffi>=1.15", "numpy>=1.22", "tiktoken>=0.5"],
    extras_require={"test": ["pytest>=7", "torch>=2.1,<=2.13.0", "matplotlib", "hypothesis>=6",
                             "transformers>=4.51", "peft>=0.13", *HF, *MPI, *GGUF,
                             *PARQUET],
                    "plot": ["matplotlib"],
                    "hf": HF,
                    "gguf": GGUF,
                    "parquet": PARQUET,
                    "mpi": MPI},
    cffi_modules=["llmc_py/_native/build.py:ffibuilder"],
    cmdclass={"build_ext": ParallelBuildExt},
    zip_safe=False,
)
