from setuptools import find_packages, setup

setup(
    name="llmc_py",
    version="0.1.0",
    description="llm.c's CPU GPT-2 trainer as a Python package with C/OpenMP kernels",
    packages=find_packages(include=["llmc_py", "llmc_py.*"]),
    python_requires=">=3.9",
    setup_requires=["cffi>=1.15"],
    install_requires=["cffi>=1.15", "numpy>=1.22", "tiktoken>=0.5"],
    extras_require={"test": ["pytest>=7", "torch>=2.1,<=2.13.0", "matplotlib", "hypothesis>=6"],
                    "plot": ["matplotlib"]},
    cffi_modules=["llmc_py/_native/build.py:ffibuilder"],
    zip_safe=False,
)
