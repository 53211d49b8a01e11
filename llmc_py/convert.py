"""Convert between a Hugging Face model folder and our model files:

    python -m llmc_py.convert HF_FOLDER model.bin     # -> llm.c's GPT-2 file, or our Llama file
    python -m llmc_py.convert model.bin HF_FOLDER     # -> config.json + model.safetensors

The direction follows SRC: a folder becomes a model file (llm.c's for a GPT-2,
our Llama-family file for Llama and Qwen3), a model file becomes a folder
that transformers' AutoModelForCausalLM.from_pretrained loads. --dtype bf16
stores the parameters rounded to bf16 (llm.c's version 5 file, our version 2
Llama file, or BF16 safetensors). Needs ``pip install "llmc_py[hf]"``.
"""
import argparse
import sys
from pathlib import Path

from .cli import DefaultsHelpFormatter, command
from .errors import UsageError
from .io.hf import write_hf
from .io.load import read_model_file, write_model_file
from .io.model_file import DTYPES


def build_parser():
    p = argparse.ArgumentParser(prog="python -m llmc_py.convert",
                                description=__doc__.split("\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("src", help="a Hugging Face model folder, or a model file")
    p.add_argument("dst", help="the model file to write (from a folder), or the folder "
                               "to write (from a model file)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="parameters as stored")
    return p


def convert(args):
    """Reads --src and writes --dst in the other format; the config and
    parameters converted."""
    config, params = read_model_file(args.src)
    if Path(args.src).is_dir():
        if Path(args.dst).is_dir():
            raise UsageError(f"{args.dst} is a folder: from a Hugging Face folder, give the "
                             f"model file to write")
        write_model_file(args.dst, config, params, dtype=args.dtype)
    else:
        write_hf(args.dst, config, params, dtype=args.dtype)
    return config, params


@command
def main(argv=None):
    args = build_parser().parse_args(argv)
    config, params = convert(args)
    print(f"{args.src} -> {args.dst}: {type(config).__name__}, {params.size:,} parameters "
          f"({args.dtype})")


if __name__ == "__main__":
    sys.exit(main())
