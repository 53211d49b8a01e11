"""Convert between a Hugging Face model folder, our model files and GGUF files:

    python -m llmc_py.convert HF_FOLDER model.bin     # -> llm.c's GPT-2 file, or our Llama file
    python -m llmc_py.convert model.bin HF_FOLDER     # -> config.json + model.safetensors
    python -m llmc_py.convert MODEL out.gguf --dtype q8_0   # -> llama.cpp's GGUF file

The direction follows SRC: a folder becomes a model file (llm.c's for a GPT-2,
our Llama-family file for Llama and Qwen3), a model file becomes a folder
that transformers' AutoModelForCausalLM.from_pretrained loads. --dtype bf16
stores the parameters rounded to bf16 (llm.c's version 5 file, our version 2
Llama file, or BF16 safetensors). Needs ``pip install "llmc_py[hf]"``.

A DST ending in .gguf is a GGUF file (io.gguf) of any SRC, with SRC's
tokenizer (a folder's tokenizer.json, else GPT-2's); --dtype fp32, f16, bf16,
q8_0 or q4_0 (norms, biases, position embeddings and the experts' routers
stay fp32), the head (or a tied embedding) as --head-dtype (default
--dtype's). Mixtral and Qwen3-MoE are written as llama.cpp's llama and
qwen3moe, their experts stacked per layer. A GGUF SRC (dequantised) converts
to a model file, as a folder does. Needs ``pip install "llmc_py[gguf]"``. A
sliding window (Mistral's, Mixtral's) is written, but llama.cpp's llama
architecture ignores it; a note says so.
"""
import argparse
import sys
from pathlib import Path

from .cli import DefaultsHelpFormatter, command
from .errors import UsageError
from .io.gguf import is_gguf, write_gguf
from .io.hf import write_hf
from .io.load import read_model_file, write_model_file
from .io.model_file import DTYPES
from .tokenizer import load_tokenizer

# --dtype's choices: every format's, and the GGUF ones (fp32 is GGUF's f32)
GGUF_DTYPES = {"fp32": "f32", "bf16": "bf16", "f16": "f16", "q8_0": "q8_0", "q4_0": "q4_0"}


def build_parser():
    p = argparse.ArgumentParser(prog="python -m llmc_py.convert",
                                description=__doc__.split("\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("src", help="a Hugging Face model folder, a model file or a GGUF file")
    p.add_argument("dst", help="the model file to write (from a folder), the folder "
                               "to write (from a model file), or a .gguf file")
    p.add_argument("--dtype", choices=list(GGUF_DTYPES), default="fp32",
                   help=f"parameters as stored ({', '.join(DTYPES)}; a .gguf file also f16, "
                        f"q8_0, q4_0)")
    p.add_argument("--head-dtype", choices=list(GGUF_DTYPES), default=None,
                   help="a .gguf file's head (output, or token_embd when tied) as this "
                        "instead of --dtype (e.g. --dtype q4_0 --head-dtype q8_0: a 4-bit "
                        "model with an 8-bit head)")
    return p


def convert(args):
    """Reads --src and writes --dst in the other format; the config and
    parameters converted."""
    config, params = read_model_file(args.src)
    if Path(args.dst).suffix == ".gguf":
        head = None if args.head_dtype is None else GGUF_DTYPES[args.head_dtype]
        write_gguf(args.dst, config, params, dtype=GGUF_DTYPES[args.dtype],
                   tokenizer=load_tokenizer(args.src), source=args.src, head_dtype=head)
        return config, params
    if args.head_dtype is not None:
        raise UsageError("--head-dtype: only a .gguf DST holds a head of its own type")
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype {args.dtype}: only a .gguf DST holds it; model files and "
                         f"folders hold {', '.join(DTYPES)}")
    if Path(args.src).is_dir() or is_gguf(args.src):
        if Path(args.dst).is_dir():
            raise UsageError(f"{args.dst} is a folder: from a Hugging Face folder or a GGUF "
                             f"file, give the model file to write")
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
    window = getattr(config, "sliding_window", 0)
    if Path(args.dst).suffix == ".gguf" and window and window < config.max_seq_len:
        print(f"note: llama.cpp runs this model (general.architecture llama) without its "
              f"sliding window of {window} positions: its output equals ours only while the "
              f"text fits in {window} positions")


if __name__ == "__main__":
    sys.exit(main())
