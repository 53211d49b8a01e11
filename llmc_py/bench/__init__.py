"""Benchmarks: ``python -m llmc_py.bench`` (``--help`` for options).

1. matmul: each product of a linear layer at GPT-2 124M's shapes, on each
   instruction set of the kernel (--isa), verified against the naive kernel,
   then timed beside numpy's sgemm and torch's matmul for the same product;
   GFLOP/s. With --precision bf16, the bf16 products beside torch's bf16
   matmul as well.
2. attention (forward, backward) at GPT-2 124M's heads, on each instruction
   set, verified against the plain twin (attention_*_naive), then timed
   beside that twin.
3. the memory-bound kernels (GELU, residual, AdamW): GB/s beside a numpy copy
   of the same bytes.
4. the training step of GPT-2 124M (random init): forward + backward + AdamW,
   ms/step and tokens/s, in --precision (fp32, or bf16 mixed precision),
   beside PyTorch eager on the same model when torch is installed (in bf16:
   also under torch.autocast; with --compile: torch.compile'd too), and on 1
   thread with --scaling.
5. with --generate: greedy generation with GPT-2 124M after a prompt, batch 1
   and 4: tokens/s with the KV cache, without it (a full forward per token),
   and PyTorch with a KV cache of its own; the cache's size beside the model's.
   With --precision bf16: our bf16 decoding beside our fp32 and torch's bf16.
   With --weights fp32 bf16 q8_0 q4_0 instead: our greedy decoding of GPT-2
   (--layers) and of a Qwen3-0.6B-shaped model (random weights), batch 1 and
   8, tokens/s per weight type beside the bandwidth limit measured in the
   same run (a streaming read's GB/s over the bytes a step reads: the linear
   layers' and head's weights + the KV cache), and the ratio to bf16 against
   issue 31's floors (batch 1: Q8_0 >= 1.7x, Q4_0 >= 2.6x). A llama.cpp row
   joins when bench/llama_cpp.py and llama-cpp-python are there.
6. with --quality: the default training run (python -m llmc_py.train: d4 on
   Shakespeare, 500 steps) in fp32 and in bf16, each in a process of its
   own; the validation losses side by side.
7. with --lora: a LoRA training step (rank 16 on the seven projections) of a
   Qwen3-0.6B-shaped model on a frozen bf16 base, beside our full bf16 step
   of the same model and transformers + peft; ms/step, the ratios and each
   one's peak RSS.
8. with --lora-quality: LoRA against full fine-tuning of a d6 model on a
   held-out half of Shakespeare's plays; the val losses before and after.
9. with --moe: a training step of a Llama-style model with 8 experts, top-2,
   beside a dense model of the same active parameters (ours in fp32 and
   bf16) and transformers' MixtralForCausalLM and its dense twin (float32,
   autocast bf16); ms/step, the ratios against the floors; our two models'
   greedy decoding at batch 1 and 8.
10. with --profile: our training step (4) split into its kernel calls, each
   with its phase, ms, share of the step and GFLOP/s or GB/s beside this
   machine's peaks measured in the same run (our GEMM on a square problem,
   streaming: our residual add over large arrays); the time between the kernels; every GEMM call of the step
   replayed alone, and the step over their sum. With --lora: the LoRA step
   of 7 instead.
Every time is the median of several repeats (min and max shown too). Every
PyTorch measurement, and our training step, runs in a process of its own.

Modules: cli (flags, threads and instruction set, one mode), kernels (1-3),
step (4, 7, 9 and 10, ours), profile (10), pytorch (PyTorch's side of 1, 4,
5, 7 and 9), generate (5), lora (7), moe (9), quality (6 and 8), tables (the
printed tables), timing (repeats, peak memory and the jobs run in processes
of their own).
"""
