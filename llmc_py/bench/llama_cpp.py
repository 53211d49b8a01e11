"""llama.cpp as a peer of ``bench --generate --weights``: greedy decoding of
the GGUF file we write of the same model (io.gguf), at batch 1, through
llama-cpp-python (``pip install llama-cpp-python``, which compiles llama.cpp).
Optional and never a test dependency: without it there are no llama.cpp rows
and ``missing()`` gives the line saying so.

Like PyTorch's jobs it runs in a process of its own (``python -m
llmc_py.bench.llama_cpp JOB``), so that llama.cpp's threads and ours never
share one; on this process's thread count. It is timed as ours is: the
``new_tokens`` decoding steps alone (argmax, then one token evaluated with
the KV cache) after an untimed prefill of the prompt, over ``repeats`` runs
after one warm-up. The file's head follows io.gguf (Q8_0 with q4_0), as
ours does.
"""
import functools
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .._native.lib import get_num_threads
from .timing import run_job

# our --weights names -> the GGUF dtype written for llama.cpp
GGUF_DTYPES = {"fp32": "f32", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0"}


@functools.lru_cache(maxsize=1)
def missing():
    """The line saying why there are no llama.cpp rows; None when
    llama-cpp-python imports (tried in a process of its own, once)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama.cpp peer: llama-cpp-python is not installed (pip install "
                "llama-cpp-python); no llama.cpp rows")
    done = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True,
                          text=True)
    if done.returncode != 0:
        error = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"llama.cpp peer: llama_cpp does not import ({error}); no llama.cpp rows"
    return None


def decode_gguf(model, weights, prompts, new_tokens, repeats):
    """Tokens/s {"median", "min", "max"} of llama.cpp decoding ``model``'s
    GGUF file in ``weights`` ("fp32", "bf16", "q8_0", "q4_0") greedily after
    ``prompts`` (one list of token ids), and the tokens of the last run
    ("tokens", [[...]], as ours); None at another batch than 1, another
    type, or without llama-cpp-python."""
    if len(prompts) != 1 or weights not in GGUF_DTYPES or missing() is not None:
        return None
    from ..io.gguf import placeholder_vocab, write_gguf
    with tempfile.TemporaryDirectory(prefix="llmc_llama_cpp_") as folder:
        path = Path(folder) / f"model.{GGUF_DTYPES[weights]}.gguf"
        write_gguf(path, model.config, model.params.memory, dtype=GGUF_DTYPES[weights],
                   tokenizer=placeholder_vocab(model.config.vocab_size))
        result = run_job("llmc_py.bench.llama_cpp",
                         {"path": str(path), "prompt": [int(t) for t in prompts[0]],
                          "new_tokens": new_tokens, "repeats": repeats,
                          "threads": get_num_threads()}, "llama.cpp decoding")
    return None if result.get("missing") else result


def decode(path, prompt, new_tokens, repeats, threads):
    """The job: llama.cpp's greedy decoding of the GGUF file at ``path``."""
    import numpy as np
    import llama_cpp
    llm = llama_cpp.Llama(model_path=path, n_ctx=len(prompt) + new_tokens,
                          n_batch=max(len(prompt), 1), n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    V = llm.n_vocab()
    # Llama.eval keeps no logits (unless logits_all): the context's last row
    last = lambda: np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(V,))
    times = []
    for _ in range(repeats + 1):   # the first is a warm-up
        llm.reset()
        llm.eval(prompt)
        tokens = []
        start = time.perf_counter()
        for _ in range(new_tokens):
            new = int(np.argmax(last()))
            tokens.append(new)
            llm.eval([new])
        times.append(time.perf_counter() - start)
    rates = sorted(new_tokens / t for t in times[1:])
    return {"median": statistics.median(rates), "min": rates[0], "max": rates[-1],
            "tokens": [tokens]}


def main(argv=None):
    job = json.loads((sys.argv[1:] if argv is None else argv)[0])
    if missing() is not None:
        print(json.dumps({"missing": True}))
        return 0
    print(json.dumps(decode(**job)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
