"""Generate text from a model file:

    python -m llmc_py.sample -e out/model_00000500.bin --prompt "ROMEO:" -g 200 \\
        --temperature 0.8 --top-k 40 --top-p 0.95 --seed 1337

Text streams to stdout as it is produced, decoded with a KV cache;
temperature 0 is greedy decoding. GPT-2 and Llama-family model files both work,
and Hugging Face model folders (GPT-2, Llama, Qwen3), whose tokenizer.json is
used when they have one (``pip install "llmc_py[hf]"``); otherwise GPT-2's.
"""
import argparse
import sys

from .cli import DefaultsHelpFormatter, command
from .flags import NON_NEGATIVE, POSITIVE, SEED, Range, check_flags
from ._native.kernels import QUANT_TYPES
from .model import PRECISIONS, load_model
from .generate import stream


FLAG_RANGES = {"gen_tokens": POSITIVE, "temperature": NON_NEGATIVE, "top_k": POSITIVE,
               "top_p": Range(lo=0, hi=1, lo_open=True, text="in (0, 1]"),
               "repetition_penalty": POSITIVE, "seed": SEED}


def build_parser():
    p = argparse.ArgumentParser(prog="python -m llmc_py.sample",
                                description="Sample text from an llm.c model file.",
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("-e", "--checkpoint", required=True,
                   help="a model file, or a Hugging Face model folder")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json or a folder holding one (default: -e's, if a "
                        "folder with one, else GPT-2's)")
    p.add_argument("--prompt", default="", help="text to continue (empty: start of a document)")
    p.add_argument("-g", "--gen-tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=None, help="keep only the k likeliest tokens")
    p.add_argument("--top-p", type=float, default=None,
                   help="keep the likeliest tokens up to this total probability")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 1 makes tokens already in the text less likely (e.g. 1.2)")
    p.add_argument("--seed", type=int, default=1337,
                   help="the sampling's random seed: the same seed, the same text")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="bf16: decode with the weights in bf16 alone (a frozen bf16 base, "
                        "no float32 copy: half the memory and bytes per token)")
    p.add_argument("--weights", choices=tuple(QUANT_TYPES), default=None,
                   help="decode on llama.cpp's 8-bit or 4-bit blocks of the linear layers' "
                        "and experts' weights (the embedding and head too, unless "
                        "--head-weights; routers float32; a GGUF file's blocks of that type "
                        "are used as they are)")
    p.add_argument("--head-weights", choices=tuple(QUANT_TYPES), default=None,
                   help="with --weights: the embedding and head in these blocks instead "
                        "(e.g. --weights q4_0 --head-weights q8_0)")
    p.add_argument("--lora", metavar="FOLDER", default=None,
                   help="a PEFT LoRA adapter folder (adapter_config.json, "
                        "adapter_model.safetensors) to load onto the model -e")
    p.add_argument("--stop-at-eot", type=int, choices=(0, 1), default=1,
                   help="1: stop at the end-of-text token (a line on stderr says after how many)")
    return p


def check_vocab(config, encoding, source):
    """A tokenizer fits a model whose vocabulary holds all its ids (a model
    may have more rows, as Qwen3's 151,936 for 151,669 tokens)."""
    if encoding.n_vocab > config.vocab_size:
        raise ValueError(f"{source}: vocab_size {config.vocab_size} is smaller than the "
                         f"tokenizer's {encoding.n_vocab} tokens ({encoding.name}); give the "
                         f"model's tokenizer with --tokenizer")


def parse(argv):
    args = build_parser().parse_args(argv)
    check_flags(args, FLAG_RANGES)
    return args


def load(args):
    """The model and its tokenizer: --tokenizer's, else the model folder's
    own or GPT-2's."""
    from .tokenizer import load_tokenizer
    model = load_model(args.checkpoint, precision=args.precision, weights=args.weights,
                       head_weights=args.head_weights,
                       frozen=args.precision == "bf16" and args.weights is None)
    if args.lora:
        model.load_lora(args.lora)
    encoding = load_tokenizer(args.tokenizer or args.checkpoint)
    check_vocab(model.config, encoding, args.checkpoint)
    return model, encoding


def write_sample(args, model, encoding, out):
    """Writes the prompt, then each piece of text as it is sampled."""
    EOT = encoding.eot_token
    prompt = [EOT] + encoding.encode(args.prompt, allowed_special="all")
    out.write(args.prompt)
    ids = prompt[1:]
    shown = encoding.decode(ids)   # the text so far; each new token shows what it adds
    tokens = stream(model, [prompt], args.gen_tokens, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p,
                    repetition_penalty=args.repetition_penalty, seed=args.seed,
                    stop_token=EOT if args.stop_at_eot else None)
    stopped_after = None   # tokens sampled, the end-of-text one included, if it stopped early
    for n, new in enumerate(tokens, 1):
        token = int(new[0])
        if token == EOT and args.stop_at_eot:
            stopped_after = n
            break
        ids.append(token)
        text = encoding.decode(ids)
        if text.endswith("\ufffd"):   # a character's bytes are not all out yet
            continue
        out.write(text[len(shown):] if text.startswith(shown) else text)
        out.flush()
        shown = text
    text = encoding.decode(ids)
    if text != shown:
        out.write(text[len(shown):] if text.startswith(shown) else text)
    out.write("\n")
    out.flush()
    if stopped_after is not None:
        print(f"(stopped at the end-of-text token after {stopped_after} of the -g "
              f"{args.gen_tokens} tokens; --stop-at-eot 0 goes on past it)", file=sys.stderr)


@command(interrupted="\ninterrupted")
def main(argv=None, out=None):
    args = parse(argv)
    model, encoding = load(args)
    write_sample(args, model, encoding, sys.stdout if out is None else out)


if __name__ == "__main__":
    sys.exit(main())
