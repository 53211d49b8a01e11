from setuptools import find_packages, setup

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
    zip_safe=False,
)
