"""One decoder-only transformer on the C kernels, sequenced as in llm.c's
train_gpt2.c; its choices come from the config (config.TransformerConfig):

    x = embed(tokens) (+ wpe with learned positions)
    per layer:  x = x + attproj(attention(position(qkv(norm1(x)))))
                x = x + fcproj(act(fc(norm2(x))))
    logits = head(normf(x))

That is the pre-norm block (model.blocks has the three, each a forward and
a backward, chosen once by config.block); it may also place the norms after
each residual add (post-norm, the original Transformer's: x = norm1(x +
attn(x)), x = norm2(x + mlp(x))) or run the two sublayers side by side on
one norm (the parallel block of GPT-J and Falcon-7B: x = x + attn(norm1(x))
+ mlp(norm1(x)); it has no norm2). Every block keeps the final norm normf:
the original post-norm Transformer has none (its last norm2 is the last
step), but keeping it leaves one layout and one head for every block, and
a norm of a normed vector only re-weights its channels.

norm: layernorm | rmsnorm; position: a learned table, fixed sinusoids added
to the embedding, RoPE on q and k, or ALiBi biases in the attention; act:
GELU (tanh or erf) | ReLU, or gated: SwiGLU | GeGLU | ReGLU (act(gate) * up);
attention: grouped-query (NKV key/value heads; NKV = NH is GPT-2's
multi-head attention), over all earlier positions or a sliding window of
the last W (Mistral's); biases on or off; the head tied to wte or its own
lm_head. GPT-2 and Llama are presets (model.presets): their forward and
backward are these.

Mixture of experts (config.num_experts > 0): the MLP of every moe_every-th
layer is E expert MLPs of the model's kind, a router sending each token to
k of them (model.blocks); forward's loss then adds router_aux_loss times the
load-balancing loss and router_z_loss times the z-loss (aux_losses; the
cross-entropy alone is ce_loss), and backward their gradients. Inside
``balance_over(world)`` (a data-parallel training step) the load-balancing
loss is that of every rank's rows together.

Dropout (model.dropout) applies only to the training passes given one:
forward_backward(..., dropout=...) or forward(..., dropout=...) then
backward(); evaluation, sampling and KV-cache decoding never drop. It
drops the embedding's output in place, a branch's projection output (proj)
in place before its residual add, and the attention probabilities inside
the attention kernels; backward regenerates the masks from their seeds.

Precision: "fp32" runs every kernel in float32. "bf16" is mixed precision as
in llm.c's CUDA trainer: the parameters (the master copy), their gradients
and AdamW's moments stay float32, and ``params_bf16`` holds a bf16 copy of
the parameters (rounded to nearest even) that the linear layers read; each
linear layer multiplies bf16 numbers (its float32 input and, backward, its
float32 output gradient rounded to bf16) and sums in float32; so do
attention's two products (q k^T and P v, and backward their four, on q, k,
v, P, dout and dS rounded to bf16), around a float32 softmax and its
statistics. The activations only linear layers read (the norm outputs and
the MLP activation of pre-norm and parallel blocks: layout.act_dtypes) are
kept in bf16, the bits the matmuls would round them to. The residual
stream, norm statistics, the loss and the gradient norm stay float32.
KV-cache decoding runs attention_decode's float32 attention (close to the
full forward, not bitwise).
update() rewrites the bf16 copy as it updates the parameters.

A frozen bf16 base (``frozen=True``, load_model(path, precision="bf16",
frozen=True)) holds its matrices (FROZEN_BF16: the embedding, the head and
the linear layers' weights) in bf16 alone, in ``params_bf16``, with no
float32 master: 2 bytes a parameter. ``params`` holds the rest in float32
(norm weights, biases, a learned position table: small). It forwards,
generates and evaluates, and trains LoRA adapters (add_lora, load_lora),
which read the same bf16 weights as a bf16 model's; merge_lora rounds each
merged weight once to bf16, and save_pretrained writes it in bf16. What
needs the base's float32 weights (update or gradients without adapters, a
model file, a float32 save) is refused.

LoRA (model.lora): add_lora or load_lora freeze the parameters and add
adapters to the linear layers; the gradients, AdamW's moments and the
update are then the adapters' alone (``trained``), and backward skips the
frozen tensors' gradient products (base_grad is None), computing only the
input gradients the adapters below need.

Parameters, their gradients, the activations and the activation gradients
each live in one contiguous float32 buffer; ``params``, ``grads``, ``acts``
and ``grads_acts`` are TensorGroups of named views into them
(``model.params["qkvw"][l]`` is layer l's qkv weight), never copies. The
logits have a buffer of their own: all (B, T, Vp) of them after forward(),
or HEAD_ROWS rows at a time in forward_backward() and
forward(..., keep_logits=False).

Memory (layout.act_specs, grad_act_specs): attention keeps two numbers per
query row and head, not its probabilities; the classifier keeps no
probabilities (backward turns the logits into their gradient in place); the
activation gradients are one layer's, reused by every layer, plus the
residual stream's; with ``recompute`` the norm outputs and the MLP
activation (on a quantized base also the MLP's input projection) are one
layer's too, recomputed in backward. memory_plan()
(model.planning) sums it all, and every allocation is checked against the
memory available first.

A forward that no backward follows keeps one layer's activations, which
every layer overwrites in turn (layout.act_specs forward_only), plus the
head's and the loss's: forward(..., keep_activations=False), as evaluation
(train.loop.validation_loss), sampling and KV-cache decoding run it, and by
default the forward of a model that cannot be trained (``trainable``: a
frozen bf16 or quantized base without adapters), so that a model loaded to
generate or evaluate holds its weights and little else. Its results are
the ordinary forward's, to the bit; a backward after it is refused.

Activation buffers are planned for the (B, T) of the first forward. A later
forward with another (B, T), or keeping every layer's activations after one
that did not, re-plans them: it reuses the same memory when the new shapes
fit in it and allocates a larger buffer otherwise.
"""
import contextlib
import math
import os

import numpy as np

from .._native import kernels as K
from .._native.tokens import IGNORE_INDEX, first_out_of_vocab
from ..errors import RangeError, ShapeError, UnsupportedError
from ..io.files import from_bf16, to_bf16
from ..io.load import read_model_file, write_model_file
from . import kv_cache
from .adamw import adamw_step
from .blocks import BLOCKS, LayerGrads, apply_norm, apply_norm_backward, drop, optional
from .dropout import NO_DROPOUT, Dropout
from .guard import ThreadGuard, held
from .layout import (ALIGN_BYTES, FROZEN_BF16, WHOLE_PARAMS, TensorGroup, act_dtypes, act_specs,
                     aligned_empty, aligned_zeros, checked_params, forward_only_acts,
                     grad_act_specs, num_parameters, param_specs)
from .lora import Lora
from .quantized import (QUANTIZED_EXPERTS, QUANTIZED_LINEARS, QuantizedExperts, QuantizedLinear,
                        block_bytes, check_input_dim, check_weights_type)
from .planning import (HEAD_ROWS, PRECISIONS, RECOMPUTE_LEVELS, bf16_activations, head_rows,
                       memory_plan, recomputes_fch, require_missing, reusable)

INIT_STD = 0.02
# the weights whose gradient backward's first product into it writes (a dense
# linear layer's or an MoE layer's stack of experts' weight-gradient GEMM):
# zero_grad leaves zeroing them to it
FIRST_WRITTEN_GRADS = ("qkvw", "attprojw", "fcw", "fcprojw", "expertfcw", "expertprojw")
INIT_SCHEMES = ("gpt2", "xavier_normal", "xavier_uniform")   # see Transformer.initialize
# the weight matrices (2-D per layer): initialised from N(0, INIT_STD), and the
# tensors weight decay is meant for; the rest start at 1 (norm weights) or 0.
# A config that lacks one (wpe, lm_head) skips it.
MATRIX_PARAMS = ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw", "routerw", "expertfcw",
                 "expertprojw", "lm_head")
# output projections into the residual stream: std scaled by 1/sqrt(2 L)
_RESIDUAL_PROJECTIONS = ("attprojw", "fcprojw", "expertprojw")
NORM_WEIGHTS = ("ln1w", "ln2w", "lnfw", "qnormw", "knormw")


class Transformer:
    """The model of a TransformerConfig: forward, backward, zero_grad, the
    AdamW update, ``generate`` and the model file.

    What KV-cache decoding (model.kv_cache) needs from a model is public:
    ``config``, ``params``, ``slopes``, ``rope_inv_freq``, ``token_ids``,
    ``normed_qkv``, ``block_forward``, ``head_forward`` and ``prefill``.

    One model serves one thread at a time (its activations are shared state):
    forward, backward, zero_grad, update, reserve and generate called while
    another thread is inside one of them raise ConcurrentUseError at once,
    rather than compute a wrong result. Two models in two threads are fine."""

    def __init__(self, config, seed=0, *, params=None, precision="fp32", frozen=False,
                 weights=None, head_weights=None):
        """A model of ``config`` with GPT-2's initialisation from ``seed``, or
        with the given flat float32 ``params`` (in layout.param_specs order);
        ``precision`` "fp32" or "bf16" (mixed precision, see the module).
        ``frozen`` (bf16 only): a frozen bf16 base (see the module), its
        matrices ``params`` rounded to bf16, or zero without ``params`` (for
        a loader to fill, as load_model does). ``weights`` "q8_0" or "q4_0"
        (without ``params``): a quantized model (quantize(), ``head_weights``
        its ``head``) whose tensors a loader gives one by one to
        put_quantized, never whole in float32."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision is {precision!r}, expected one of {PRECISIONS}")
        if frozen and precision != "bf16":
            raise ValueError(f"frozen=True is a base held in bf16 alone: precision must be "
                             f"'bf16', got {precision!r}")
        if head_weights is not None and weights is None:
            raise ValueError(f"head_weights={head_weights!r} is a quantized model's head: "
                             f"give weights too")
        if weights is not None and (frozen or params is not None):
            raise ValueError(f"weights={weights!r} is a quantized model filled by "
                             f"put_quantized: give neither params nor frozen=True")
        self.config = config
        self.precision = precision
        self.frozen = frozen
        self.param_specs = param_specs(config)
        self.act_specs = act_specs(config, logits=False)
        # a forward that no backward follows: one layer's, reused layer after layer
        self.forward_act_specs = act_specs(config, logits=False, forward_only=True)
        self.grad_act_specs = grad_act_specs(config)
        # the tensors initialised from N(0, INIT_STD), and decayed by default
        self.matrix_params = tuple(name for name, _ in self.param_specs
                                   if name in MATRIX_PARAMS)
        self._recompute = 0
        # the ranks whose rows the load-balancing loss spans (balance_over), or None: this one's
        self.balance_world = None
        self._block = BLOCKS[config.block](self)
        self.slopes = K.alibi_slopes(config.num_heads) if config.position == "alibi" else None
        self.rope_inv_freq = config.rope_inv_freq()   # a scaled RoPE's frequencies, or None
        self._guard = ThreadGuard()
        if frozen:
            self._init_frozen(params)
        elif weights is not None:
            self.params = TensorGroup(_float32_when_quantized(self.param_specs), self.config)
        else:
            self.params = TensorGroup(self.param_specs, self.config)
            if params is None:
                self._init_params(seed, "gpt2", INIT_STD)
            else:
                self.params.memory[...] = checked_params(config, params)
        self.num_parameters = num_parameters(config)
        # what the linear layers read: the float32 parameters, or their bf16 copy
        if frozen:
            self._weights = self.params_bf16
            self._matmul_forward, self._matmul_backward = (K.matmul_forward_bf16,
                                                           K.matmul_backward_bf16)
        elif weights is not None:
            self.params_bf16 = None
        elif precision == "bf16":
            self.params_bf16 = TensorGroup(self.param_specs, self.config, dtype=np.uint16)
            self.refresh_bf16()
            self._weights = self.params_bf16
            self._matmul_forward, self._matmul_backward = (K.matmul_forward_bf16,
                                                           K.matmul_backward_bf16)
        else:
            self.params_bf16 = None
            self._weights = self.params
            self._matmul_forward, self._matmul_backward = K.matmul_forward, K.matmul_backward
        # attention's two products: bf16 operands in a bf16 model (attention_bf16.c)
        self._attention_forward, self._attention_backward = (
            (K.attention_gqa_forward_bf16, K.attention_gqa_backward_bf16) if precision == "bf16"
            else (K.attention_gqa_forward, K.attention_gqa_backward))
        self._grads = None
        # (name, layer or None) of the gradients zero_grad left for backward
        # to write (FIRST_WRITTEN_GRADS and the head's): not zero in memory yet
        self._unwritten = set()
        self.m_memory = None   # update()'s AdamW moments, made on its first call
        self.v_memory = None
        self.moment_params = self.num_parameters   # parameters whose moments we keep
        self.lora = None   # the LoRA adapters (model.lora) of a frozen base: add_lora, load_lora
        self.quantized = None   # "q8_0" or "q4_0" after quantize()
        self.quantized_head = None   # the embedding's and head's type after quantize()
        self.mean_loss = None   # the last forward's loss: cross-entropy + the auxiliary terms
        self.ce_loss = None     # its cross-entropy alone
        self.loss_scale = 1.0   # the last backward's (the auxiliary losses' gradients read it)
        self._drop_activations()   # made by the first forward, for its (B, T)
        if weights is not None:
            self._start_quantized(weights, head_weights)

    def initialize(self, seed=0, scheme="gpt2", std=INIT_STD):
        """Draws fresh parameters from ``seed`` (the constructor's: GPT-2's
        scheme, std 0.02). Norm weights start at 1, biases at 0; the weight
        matrices (matrix_params) by ``scheme``:
          "gpt2"            N(0, std), the output projections into the residual
                            stream (attprojw, fcprojw) N(0, std / sqrt(2 L));
          "xavier_normal"   N(0, sqrt(2 / (fan_in + fan_out)));
          "xavier_uniform"  U(-a, a), a = sqrt(6 / (fan_in + fan_out));
        fan_in and fan_out are a matrix's columns and rows (per layer)."""
        if scheme not in INIT_SCHEMES:
            raise ValueError(f"scheme is {scheme!r}, expected one of {INIT_SCHEMES}")
        if not std > 0:
            raise ValueError(f"std must be positive, got {std!r}")
        self._refuse_quantized("initialize")
        self._refuse_frozen("initialize")
        with self.exclusive("initialize"):
            self._init_params(seed, scheme, std)
            if self.params_bf16 is not None:
                self.refresh_bf16()

    def _init_frozen(self, params):
        """A frozen bf16 base's two groups: the FROZEN_BF16 tensors in bf16
        (``params_bf16``), the others in float32 (``params``), from flat
        float32 ``params`` or zero."""
        specs = self.param_specs
        self.params_bf16 = TensorGroup([s for s in specs if s[0] in FROZEN_BF16], self.config,
                                       dtype=np.uint16)
        self.params = TensorGroup([s for s in specs if s[0] not in FROZEN_BF16], self.config)
        if params is None:
            return
        whole = TensorGroup(specs, self.config, memory=checked_params(self.config, params))
        for name in whole.names:
            if name in FROZEN_BF16:
                self.params_bf16[name][...] = to_bf16(whole[name])
            else:
                self.params[name][...] = whole[name]

    def put_frozen(self, name, l, values):
        """Writes tensor ``name`` (of layer l; None: a whole one) of a frozen
        bf16 base from ``values`` (float32, float16 or bf16, e.g. read_hf_into's;
        fewer rows than the tensor for the unpadded vocabulary): bf16 as
        given, others rounded to nearest even."""
        if name not in FROZEN_BF16:
            view = self.params[name] if l is None else self.params[name][l]
            view[:len(values)] = values
            return
        view = self.params_bf16[name] if l is None else self.params_bf16[name][l]
        if values.dtype.name == "bfloat16":
            view[:len(values)] = values.view(np.uint16)
        else:
            view[:len(values)] = to_bf16(values)

    def embed(self, out, tokens, pos=None):
        """out (B, T, C) = the embedding of int32 ``tokens`` (B, T), plus the
        learned position table's rows (t, or pos[b] + t); a frozen bf16 base
        gathers its bf16 rows, widened exactly, a quantized one its blocks'
        rows, dequantised exactly."""
        c, p = self.config, self.params
        if self.frozen:
            out[...] = (self.params_bf16.wte[tokens].astype(np.uint32) << 16).view(np.float32)
        elif self.quantized is not None:
            self._weights.wte.rows(out, tokens)
        elif pos is None:
            K.encoder_forward(out, tokens, p.wte[:c.V], p.wpe if c.learned_positions else None)
            return
        else:
            np.take(p.wte, tokens, axis=0, out=out)
        if c.learned_positions:
            T = tokens.shape[1]
            out += p.wpe[np.arange(T) if pos is None else pos[:, None] + np.arange(T)]

    def _init_params(self, seed, scheme, std):
        c, p = self.config, self.params
        rng = np.random.default_rng(seed)
        for name in self.matrix_params:
            view = p[name]
            fan_out, fan_in = view.shape[-2:]
            if scheme == "xavier_uniform":
                bound = math.sqrt(6.0 / (fan_in + fan_out))
                view[...] = rng.uniform(-bound, bound, view.shape).astype(np.float32)
                continue
            if scheme == "xavier_normal":
                scale = math.sqrt(2.0 / (fan_in + fan_out))
            else:
                scale = std / math.sqrt(2 * c.L) if name in _RESIDUAL_PROJECTIONS else std
            view[...] = rng.standard_normal(view.shape, dtype=np.float32) * np.float32(scale)
        p.wte[c.V:] = 0.0   # the padding rows are never used
        for name in p.names:   # norm weights 1, biases 0
            if name not in self.matrix_params:
                p[name][...] = 1.0 if name in NORM_WEIGHTS else 0.0

    @held
    def refresh_bf16(self):
        """Rewrites ``params_bf16`` from ``params`` (bf16 models): update()
        does this itself; call it after writing to ``params`` by hand."""
        self._refuse_frozen("refresh_bf16")
        if self.params_bf16 is None:
            raise RuntimeError("refresh_bf16: this model's precision is fp32; it has no "
                               "bf16 copy of its parameters")
        K.float_to_bf16(self.params_bf16.memory, self.params.memory)

    def exclusive(self, what="use"):
        """Holds the model for this thread (re-entrant), or raises
        ConcurrentUseError if another thread holds it (model.guard)."""
        return self._guard.hold(what)

    @classmethod
    def from_checkpoint(cls, path, precision="fp32"):
        """The model in a model file (io.model_file: llm.c's GPT-2 file or
        ours, with fp32 or bf16 parameters), in ``precision``."""
        config, params = read_model_file(path)
        return cls(config, params=params, precision=precision)

    def save_checkpoint(self, path, dtype="fp32"):
        """Writes the model file, atomically: llm.c's file for a GPT2Config
        (version 3, fp32 parameters; ``dtype="bf16"``: version 5, each
        parameter rounded to the nearest bf16, as llm.c's train_gpt2.py
        writes it), our Llama-family file otherwise (fp32 or bf16 likewise)."""
        self._refuse_quantized("save_checkpoint")
        self._refuse_adapters("save_checkpoint")
        self._refuse_frozen("save_checkpoint")
        write_model_file(path, self.config, self.params.memory, dtype=dtype)

    def save_pretrained(self, folder, dtype="fp32", token_ids=None):
        """Writes a Hugging Face model folder (config.json, model.safetensors;
        io.hf) that transformers' AutoModelForCausalLM.from_pretrained loads:
        GPT2LMHeadModel, LlamaForCausalLM or Qwen3ForCausalLM by the config.
        ``token_ids`` adds config.json's bos/eos/pad ids (io.hf.token_ids).
        A frozen bf16 base writes its weights as they are: dtype "bf16"."""
        from ..io.hf import write_hf   # needs the optional safetensors package
        self._refuse_quantized("save_pretrained")
        self._refuse_adapters("save_pretrained")
        params = self.params.memory
        if self.frozen:
            if dtype != "bf16":
                self._refuse_frozen(f"save_pretrained(dtype={dtype!r})")
            params = dict(self.params.items()) | dict(self.params_bf16.items())
        write_hf(folder, self.config, params, dtype=dtype, token_ids=token_ids)

    def save_gguf(self, path, dtype="f32", tokenizer=None, head_dtype=None):
        """Writes a GGUF file (io.gguf) that llama.cpp loads: weights as
        ``dtype`` "f32", "f16", "bf16", "q8_0" or "q4_0" (norms, biases and
        position embeddings stay f32; the head, or a tied embedding, as
        ``head_dtype``, default dtype), with ``tokenizer``'s vocabulary: a Hugging
        Face folder or tokenizer.json path, a tokenizer from
        tokenizer.load_tokenizer, or None for GPT-2's (whose 50257 tokens must
        fit the embedding)."""
        self._refuse_quantized("save_gguf")
        from ..io.gguf import write_gguf   # needs the optional gguf package
        from ..tokenizer import load_tokenizer
        self._refuse_frozen("save_gguf")
        source = tokenizer
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)
        write_gguf(path, self.config, self.params.memory, dtype=dtype, tokenizer=tokenizer,
                   source=source, head_dtype=head_dtype)

    @property
    def grads(self):
        """Parameter gradients, same layout as params; zero until a backward.
        A frozen base (after add_lora) has none: ``trained`` gives the
        adapters' gradients."""
        if self.lora is not None:
            raise RuntimeError("model.grads: the base is frozen (LoRA) and has no gradients; "
                               "model.trained or model.lora.grads are the adapters'")
        self._refuse_frozen("gradients of the base")
        self._zero_unwritten()
        return self._grad_tensors()

    def _grad_tensors(self):
        """The gradients as they are in memory (the ones zero_grad left to
        backward not yet zero)."""
        if self._grads is None:
            self._grads = TensorGroup(self.param_specs, self.config)
        return self._grads

    def _zero_unwritten(self):
        """Zeroes the gradients zero_grad left to backward that it has not written."""
        for name, l in self._unwritten:
            tensor = self._grads[name]
            (tensor if l is None else tensor[l])[...] = 0.0
        self._unwritten = set()

    def grad_written(self, name, l=None):
        """For the product about to give parameter ``name``'s (layer l's)
        gradient: WRITE_DWEIGHT if zero_grad left that gradient to it (it
        then writes it, as into zeros), else 0 (it adds into it)."""
        if (name, l) not in self._unwritten:
            return 0
        self._unwritten.remove((name, l))
        return K.WRITE_DWEIGHT

    @property
    def trained(self):
        """(parameters, gradients) that training changes, as TensorGroups:
        the model's (params, grads), or after add_lora or load_lora the
        adapters' (lora.params, lora.grads)."""
        if self.lora is not None:
            return self.lora.params, self.lora.grads
        return self.params, self.grads

    def base_grad(self, name, l=None):
        """The gradient of parameter ``name`` (of layer l), where backward
        adds it; None where it has none: a frozen base (LoRA), whose
        weight-gradient products backward skips, or a tensor the config
        lacks."""
        if self.lora is not None or self.frozen or name not in self.params:
            return None
        grads = self._grad_tensors()   # backward writes those zero_grad left it
        return grads[name] if l is None else grads[name][l]

    @property
    def logits(self):
        """The (B, T, Vp) logits of the last forward (a view, not a copy).
        Only a forward that kept them has them: forward_backward and
        forward(..., keep_logits=False) run the classifier a block of rows
        at a time, and backward turns the logits into their gradient."""
        if self._logits_state is None:
            raise RuntimeError("no forward has run yet")
        if self._logits_state != "logits":
            raise RuntimeError(f"the logits are gone: {self._logits_state}; run "
                               f"model.forward(inputs) again to have them")
        return self._head_logits(self.B * self.T).reshape(self.B, self.T, self.config.Vp)

    @property
    def recompute(self):
        """0 (default; False) keeps every layer's activations; 1 (True): the
        norm outputs and the MLP activation are kept for one layer only and
        backward recomputes them; 2: the MLP's input projection (fch, its
        largest activation) too, at the cost of running that matmul again in
        backward. Less memory, the same results to the bit, a little more
        time. A quantized base's 1 is 2."""
        return self._recompute

    @recompute.setter
    def recompute(self, value):
        with self.exclusive("recompute"):
            if value not in RECOMPUTE_LEVELS:   # False and True are 0 and 1
                raise ValueError(f"recompute is {value!r}, expected one of {RECOMPUTE_LEVELS}")
            level = int(value)
            if level != self._recompute:
                self._lay_out(level)

    @property
    def act_dtypes(self):
        """The activations this model keeps in bf16, {name: np.uint16}
        (layout.act_dtypes): a bf16 model's, unless its base is quantized."""
        return act_dtypes(self.config, bf16_activations(self.precision, self.quantized))

    def _lay_out(self, recompute):
        """The block and activation layout for recompute level ``recompute``;
        the next forward plans anew."""
        self._recompute = recompute
        fch = recomputes_fch(recompute, self.quantized)
        self._block = BLOCKS[self.config.block](self, recompute=bool(recompute),
                                                recompute_fch=fch)
        self.act_specs = act_specs(self.config, recompute=bool(recompute), logits=False,
                                   recompute_fch=fch)
        self._drop_activations()

    def _drop_activations(self):
        """Forgets the activations (and their gradients): the next forward plans anew."""
        self.acts = self.grads_acts = self._logits_buffer = None
        # whether ``acts`` hold every layer's activations, as backward reads
        # them (False: a forward-only layout's one layer)
        self.kept_activations = False
        self.B = self.T = None
        self.inputs = self.targets = None
        self.counted = 0   # the last batch's targets that are not IGNORE_INDEX
        self._logits_state = None
        self._dropout = NO_DROPOUT   # the last forward's, which backward regenerates

    # ---- forward -----------------------------------------------------------

    def token_ids(self, tokens, name="tokens", allow_ignore=False):
        """``tokens`` (B, T) as checked contiguous int32 ids; RangeError names
        the first one outside the vocabulary. ``allow_ignore`` (targets):
        IGNORE_INDEX is allowed too."""
        arr = np.asarray(tokens)
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise ShapeError(f"{name} must have shape (B, T) with B, T >= 1, got {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integer token ids, got {arr.dtype}")
        V = self.config.vocab_size
        bad = first_out_of_vocab(arr, V, allow_ignore)
        if bad is not None:
            b, t = bad
            also = f" or {IGNORE_INDEX} (ignored)" if allow_ignore else ""
            raise RangeError(f"{name}[{b}, {t}] = {arr[b, t]} is not a token id in "
                             f"[0, {V}){also}")
        return np.ascontiguousarray(arr, dtype=np.int32)

    def _batch(self, inputs, targets, *, training=False, keep_logits=True,
               keep_activations=True):
        """Checked int32 (inputs, targets or None); plans the activations for
        their (B, T)."""
        c = self.config
        inputs = self.token_ids(inputs, "inputs")
        B, T = inputs.shape
        if c.learned_positions and T > c.max_seq_len:
            raise ShapeError(f"sequence length T={T} exceeds the model's max_seq_len="
                             f"{c.max_seq_len} (its learned position table has "
                             f"{c.max_seq_len} rows)")
        if targets is not None:
            targets = self.token_ids(targets, "targets", allow_ignore=True)
            if targets.shape != inputs.shape:
                raise ShapeError(f"targets have shape {targets.shape}, inputs {inputs.shape}")
        self._plan(B, T, training=training, keep_logits=keep_logits,
                   keep_activations=keep_activations)
        self.inputs, self.targets = inputs, targets
        # the targets the mean loss is over: all but the ignored ones
        self.counted = (0 if targets is None
                        else targets.size - int(np.count_nonzero(targets == IGNORE_INDEX)))
        return inputs, targets

    @property
    def trainable(self):
        """Whether a backward can follow this model's forward: not on a
        frozen bf16 or quantized base without LoRA adapters. forward()
        keeps every layer's activations by default only when it is."""
        frozen = self.frozen or self.quantized is not None
        return not frozen or self.lora is not None

    def _keeps_activations(self, keep_activations):
        """forward's keep_activations: by default, whether the model is trainable."""
        return self.trainable if keep_activations is None else bool(keep_activations)

    def memory_plan(self, B, T, training=True, keep_logits=None, keep_activations=None):
        """Bytes that a forward of (B, T) needs, by part; with ``training``
        a whole step's: backward's gradients and AdamW's moments too.
        ``keep_logits`` (default: not when training) counts all (B, T, Vp)
        logits, else a block of HEAD_ROWS rows of them; ``keep_activations``
        (a forward's, default as forward's) every layer's activations, else
        one layer's. "scratch" is the kernels' temporary memory, estimated.
        This model's memory_plan(): its precision, recompute, share of the
        moments and LoRA adapters."""
        return memory_plan(self.config, B, T, training=training, keep_logits=keep_logits,
                           keep_activations=self._keeps_activations(keep_activations),
                           precision=self.precision, recompute=self.recompute,
                           frozen=self.frozen,
                           moment_params=self.moment_params if self.lora is None else None,
                           adapter_params=0 if self.lora is None else self.lora.params.size,
                           adapter_width=0 if self.lora is None else self.lora.width,
                           adapter_rank=0 if self.lora is None else self.lora.rank,
                           base_weights=self.quantized, head_weights=self.quantized_head)

    @held
    def reserve(self, B, T, training=False, keep_logits=None, moment_params=None,
                keep_activations=None):
        """Allocates memory for batches up to (B, T) now, so that later
        forwards of any smaller shape reuse it (e.g. a growing context while
        sampling); with ``training``, for whole training steps (forward_backward
        and update): the gradients and AdamW's moments too. Raises
        OutOfMemoryError, saying what needs how much, if it cannot all fit.
        ``moment_params`` < num_parameters: this process keeps the moments of
        that many parameters only (a ZeRO-1 shard, which its optimizer makes).
        ``keep_activations`` as forward's (False: for forward-only passes)."""
        keep = not training if keep_logits is None else keep_logits
        if moment_params is not None:
            self.moment_params = moment_params
        self._plan(B, T, training=training, keep_logits=keep,
                   keep_activations=self._keeps_activations(keep_activations))
        if training:
            self.trained   # noqa: B018  (the gradients, made on first use)
            if self.moment_params == self.num_parameters:
                self.moments()

    def _plan(self, B, T, training=False, keep_logits=True, keep_activations=True):
        """Makes the buffers a forward of (B, T) (with ``training``, its
        backward and update too; without ``keep_activations``, a forward
        alone keeping one layer's activations) needs, reusing those that are
        large enough; first checks that what is missing fits, all at once."""
        c = self.config
        every_layer = training or keep_activations
        require_missing(self, B, T, training, keep_logits, every_layer)
        if ((B, T) != (self.B, self.T) or self.acts is None
                or every_layer != self.kept_activations):
            dtypes = self.act_dtypes
            specs = self.act_specs if every_layer else self.forward_act_specs
            memory = reusable(self.acts, specs, c, B, T, dtypes)
            self.acts = None   # an outgrown buffer is let go before its successor is made
            self.acts = (TensorGroup(specs, c, B, T, memory=memory, dtypes=dtypes) if every_layer
                         else forward_only_acts(c, B, T, logits=False, memory=memory,
                                                dtypes=dtypes))
            self.kept_activations = every_layer
            if self.grads_acts is not None:
                memory = reusable(self.grads_acts, self.grad_act_specs, c, B, T)
                self.grads_acts = None
                self.grads_acts = TensorGroup(self.grad_act_specs, c, B, T, memory=memory)
            self.B, self.T = B, T
        if training and self.grads_acts is None:
            self.grads_acts = TensorGroup(self.grad_act_specs, c, B, T)
        if every_layer and self.lora is not None:
            self.lora.keep(B, T)
        head = head_rows(B, T, keep_logits) * c.Vp
        if self._logits_buffer is None or self._logits_buffer.size < head:
            self._logits_buffer = None
            self._logits_buffer = aligned_empty(head, what=f"the logits ({head // c.Vp} rows)")

    def _head_logits(self, rows):
        """The head buffer as ``rows`` rows of logits, (rows, Vp)."""
        Vp = self.config.Vp
        return self._logits_buffer[:rows * Vp].reshape(rows, Vp)

    def _blocks_forward(self, inputs, dropout, attended=None):
        """The embedding and every block on ``inputs``, with ``dropout`` (a
        model.dropout.Dropout); the final residual stream. ``attended(l,
        qkv)``, if given, is called after layer l's attention with the packed
        q, k, v it read (prefill)."""
        c = self.config
        a = self.acts
        self._dropout = dropout

        def attend(l):
            self.position_qkv(a, l, None)
            qkv = self._attention_input(a, l)
            self._attention_forward(a.atty[l], a.att_stats[l], qkv, self.slopes, c.NH, c.NKV,
                                    c.sliding_window, *dropout.site("attention", l))
            if attended is not None:
                attended(l, qkv)

        self.embed(a.encoded, inputs)
        if c.position == "sinusoidal":
            K.sinusoidal_forward(a.encoded, a.encoded, None)
        drop(a.encoded, dropout.site("embedding"))
        residual = a.encoded
        for l in range(c.L):
            residual = self.block_forward(a, l, residual, attend, dropout)
        return residual

    def normed_qkv(self, a, l):
        """Layer l's a.qkv with each q and k head RMS-normed (qk_norm), into
        a.qkvr; without qk_norm, a.qkv itself. Returns it."""
        c, p = self.config, self.params
        if not c.qk_norm:
            return a.qkv[l]
        K.head_rmsnorm_forward(a.qkvr[l], a.qk_rstd[l], a.qkv[l], p.qnormw[l], p.knormw[l],
                               c.NH, c.NKV, c.norm_eps)
        return a.qkvr[l]

    def position_qkv(self, a, l, pos):
        """Layer l's a.qkv as attention reads it, into a.qkvr: each q and k
        head RMS-normed (qk_norm), then rotated (RoPE) at positions pos[b] + t
        (pos None: t). A model with neither reads a.qkv itself."""
        c = self.config
        qkv = self.normed_qkv(a, l)   # with qk_norm a.qkvr, which RoPE turns in place
        if c.position == "rope":
            K.rope_forward(a.qkvr[l], qkv, pos, c.NH, c.NKV, c.rope_theta, self.rope_inv_freq,
                           c.rope_interleaved)

    @staticmethod
    def _attention_input(a, l):
        """Layer l's packed q, k, v as attention reads them (after qk_norm, RoPE)."""
        return a.qkvr[l] if "qkvr" in a else a.qkv[l]

    @held
    def forward(self, inputs, targets=None, *, keep_logits=True, dropout=None,
                keep_activations=None):
        """Runs the model on int tokens (B, T). Returns the mean cross-entropy
        loss as a float when ``targets`` (B, T) are given, else None: the mean
        over the targets that are not IGNORE_INDEX (-1), 0.0 if all are. The
        logits are in ``model.logits`` unless ``keep_logits`` is False (then
        targets are needed, and the classifier runs HEAD_ROWS rows at a time,
        in less memory: evaluation's way). A learned position table limits T
        to max_seq_len; RoPE, ALiBi and sinusoidal positions extrapolate past it.
        ``dropout`` (model.dropout.Dropout) makes it a training pass that
        drops, and backward() then regenerates its masks; None never drops.
        ``keep_activations`` False: no backward will follow, so the forward
        keeps one layer's activations (reused by every layer; the same
        results) and backward() is refused; by default it keeps every
        layer's when the model is ``trainable``."""
        return self._forward(inputs, targets, keep_logits, dropout,
                             self._keeps_activations(keep_activations))

    @held
    def prefill(self, inputs, attended):
        """forward(inputs) keeping one layer's activations, with
        ``attended(l, qkv)`` called after each layer l's attention on the
        (B, T, qkv_channels) q, k, v it read (after qk_norm and RoPE): a
        KV cache's prefill copies the keys and values there. The logits are
        in model.logits."""
        self._forward(inputs, None, True, None, False, attended)

    def _forward(self, inputs, targets, keep_logits, dropout, keep_activations, attended=None):
        if not keep_logits and targets is None:
            raise ValueError("forward(..., keep_logits=False) needs targets: without "
                             "logits or a loss it would compute nothing")
        dropout = _checked_dropout(dropout)
        inputs, targets = self._batch(inputs, targets, keep_logits=keep_logits,
                                      keep_activations=keep_activations)
        c, a = self.config, self.acts
        residual = self._blocks_forward(inputs, dropout, attended)
        self._logits_state = "the last forward did not keep them (keep_logits=False)"
        if not keep_logits:
            self._final_norm(a, residual)
            for rows in self._head_blocks():
                self._classifier_rows(rows, targets)
            return self._mean_loss()
        logits = self._head_logits(self.B * self.T).reshape(self.B, self.T, c.Vp)
        self.head_forward(a, residual, logits)
        self._logits_state = "logits"
        if targets is None:
            self.mean_loss = None
            return None
        K.softmax_crossentropy_forward(a.losses, a.xent_stats, self.logits, targets, c.V)
        return self._mean_loss()

    def _mean_loss(self):
        """The mean of the losses over the counted targets (the ignored ones'
        losses are 0; 0.0 when every target is ignored), plus with experts
        the auxiliary losses times their coefficients (aux_losses)."""
        total = self.acts.losses.sum(dtype=np.float64)
        self.ce_loss = self.mean_loss = float(total / self.counted) if self.counted else 0.0
        if self.config.moe_layers:
            c, aux = self.config, self.aux_losses
            self.mean_loss += c.router_aux_loss * aux["balance"] + c.router_z_loss * aux["z"]
        return self.mean_loss

    @contextlib.contextmanager
    def balance_over(self, world):
        """Within: each MoE layer's load-balancing loss is that of the rows
        of every rank of ``world`` (train.distributed's) together, its
        fractions added over ranks inside the forward (a small collective per
        MoE layer, so every rank must run the same forwards), so N ranks of
        B rows train as one process of N B rows. One rank changes nothing."""
        self.balance_world = world if world.size > 1 and self.config.moe_layers else None
        try:
            yield
        finally:
            self.balance_world = None

    @property
    def aux_losses(self):
        """The last forward's auxiliary losses, each the mean over the MoE
        layers (unweighted; the loss adds them times router_aux_loss and
        router_z_loss): "balance", E sum_e f_e P_e (f_e the fraction of the
        layer's B T k assignments that went to expert e, P_e its mean router
        probability; 1 when both are even) and "z", the mean of
        logsumexp(router logits)^2. Empty without experts."""
        if not self.config.moe_layers:
            return {}
        balance, z = self._block.aux.astype(np.float64).mean(axis=0)
        return {"balance": float(balance), "z": float(z)}

    def _head_blocks(self):
        """Slices of HEAD_ROWS rows over the B * T rows."""
        BT = self.B * self.T
        return [slice(r0, min(r0 + HEAD_ROWS, BT)) for r0 in range(0, BT, HEAD_ROWS)]

    def _classifier_rows(self, rows, targets, d=None):
        """The head on rows ``rows`` of lnf (flattened (B*T, C)), a block at a
        time in the head buffer: logits, the losses; with ``d`` (backward's
        activation gradients) also their gradient, in place, and its matmul
        backward: d.narrow's rows and the head weight's gradient."""
        c, a = self.config, self.acts
        n = rows.stop - rows.start
        logits = self._head_logits(n)[None]                  # (1, n, Vp)
        lnf = a.lnf.reshape(1, -1, c.C)[:, rows]
        row_targets = targets.reshape(1, -1)[:, rows]
        stats = a.xent_stats.reshape(1, -1, 2)[:, rows]
        head = self._head(self._weights)
        self._matmul_forward(logits, lnf, head, None)
        K.softmax_crossentropy_forward(a.losses.reshape(1, -1)[:, rows], stats, logits,
                                       row_targets, c.V)
        if d is not None:
            K.softmax_crossentropy_backward(logits, logits, stats,
                                            d.losses.reshape(1, -1)[:, rows], row_targets, c.V)
            # the blocks' rows part d.narrow: each block writes its own
            self._head_backward(self._grads_as(d.narrow, c.C).reshape(1, -1, c.C)[:, rows],
                                logits, lnf)

    # the block and the head on activations ``a`` laid out by act_specs: the
    # forward above runs them on (B, T), KV-cache decoding on one position

    def _head(self, group):
        return group.wte if self.config.tied_embeddings else group.lm_head

    def _head_name(self):
        return "wte" if self.config.tied_embeddings else "lm_head"

    def _head_backward(self, dinp, dout, inp):
        """The head's matmul backward on rows: dinp (written) and the head
        weight's gradient."""
        name = self._head_name()
        grad = self.base_grad(name)
        written = K.WRITE_DINP | (self.grad_written(name) if grad is not None else 0)
        self._matmul_backward(dinp, grad, None, dout, inp, self._head(self._weights),
                              written=written)

    def _grads_as(self, buffer, width):
        """The first B * T * width floats of a gradient buffer, as (B, T, width)."""
        return buffer.reshape(-1)[:self.B * self.T * width].reshape(self.B, self.T, width)

    def block_forward(self, a, l, residual, attend, dropout=NO_DROPOUT):
        """Layer l on the residual stream ``residual`` (model.blocks, by
        config.block); ``attend(l)`` turns a.qkv[l] into a.atty[l];
        ``dropout`` drops each branch's output (training only). Returns the
        layer's output (layer_output)."""
        return self._block.forward(a, l, residual, attend, dropout)

    def layer_output(self, a, l):
        """Layer l's output, the next layer's input: a.ln2[l] post-norm,
        a.residual3[l] otherwise."""
        return self._block.output(a, l)

    def _final_norm(self, a, residual):
        p = self.params
        apply_norm(self.config, a.lnf, optional(a, "lnf_mean"), a.lnf_rstd, residual, p.lnfw,
                   optional(p, "lnfb"))

    def head_forward(self, a, residual, logits=None):
        """The final norm and the output head: ``logits`` (B, T, Vp), by
        default a.logits."""
        self._final_norm(a, residual)
        self._matmul_forward(a.logits if logits is None else logits, a.lnf,
                             self._head(self._weights), None)

    # ---- backward ----------------------------------------------------------

    @held
    def zero_grad(self):
        """Zeroes the gradients of what is trained (backward adds into them):
        the parameters', or the adapters' (trained). The dense linear layers',
        the stacks of experts' and the head's weight gradients are left to
        backward, whose first product into each writes it (grad_written);
        model.grads zeroes those it has not written when read before."""
        if self.lora is not None:
            self.lora.grads.zero()
            return
        grads = self.grads   # also refuses a frozen base
        unwritten = {(self._head_name(), None)}
        unwritten |= {(name, l) for name in FIRST_WRITTEN_GRADS if name in grads.names
                      for l in range(grads[name].shape[0])}
        grads.zero([name for name in grads.names
                    if (name, None) not in unwritten and name not in FIRST_WRITTEN_GRADS])
        self._unwritten = unwritten

    def _start_backward(self, loss_scale):
        """Backward's activation gradients, with d(scaled mean loss)/d(loss[b, t])
        in d.losses: loss_scale over the counted targets (the kernel gives
        ignored rows no gradient; with none counted, no row has any)."""
        B, T = self.B, self.T
        self.loss_scale = loss_scale
        if self.grads_acts is None:
            self._plan(B, T, training=True, keep_logits=self._logits_state == "logits")
        d = self.grads_acts
        d.losses[...] = loss_scale / self.counted if self.counted else 0.0
        return d

    @held
    def backward(self, loss_scale=1.0):
        """Adds the gradients of ``loss_scale`` times the last forward's mean
        loss into ``grads`` (a scale of 1/n averages n accumulated batches).
        The logits' gradient replaces the logits (model.logits is then gone)."""
        self._refuse_quantized_base("backward")
        if self.targets is None or self._logits_state != "logits":
            raise RuntimeError("backward needs a forward with targets that kept its logits "
                               "first: call model.forward(inputs, targets)")
        if not self.kept_activations:
            raise RuntimeError("backward: the last forward kept one layer's activations, not "
                               "every layer's as backward reads them (keep_activations=False, "
                               "the default of a model that is not trainable: a frozen or "
                               "quantized base without adapters); call model.forward(inputs, "
                               "targets, keep_activations=True) first")
        c, a = self.config, self.acts
        d = self._start_backward(loss_scale)
        logits = self.logits
        K.softmax_crossentropy_backward(logits, logits, a.xent_stats, d.losses, self.targets,
                                        c.V)
        self._logits_state = "backward replaced them by their gradient"
        self._head_backward(self._grads_as(d.narrow, c.C), logits, a.lnf)
        self._blocks_backward(d, self._dropout)

    @held
    def forward_backward(self, inputs, targets, loss_scale=1.0, *, dropout=None):
        """A training step's forward and backward in one: the mean loss of
        ``inputs`` against ``targets`` (over those not IGNORE_INDEX, as
        forward's), and its gradients (times
        ``loss_scale``) added into ``grads``, as forward then backward give
        them, to the bit. The classifier runs HEAD_ROWS rows at a time,
        each block's logits turned into their gradient and multiplied back
        at once, so the (B, T, Vp) logits are never held (model.logits is
        not kept). ``dropout``: a model.dropout.Dropout, or None (no dropout)."""
        self._refuse_quantized_base("forward_backward")
        if targets is None:
            raise ValueError("forward_backward needs targets")
        dropout = _checked_dropout(dropout)
        inputs, targets = self._batch(inputs, targets, training=True, keep_logits=False)
        a = self.acts
        residual = self._blocks_forward(inputs, dropout)
        self._logits_state = "forward_backward does not keep them"
        self._final_norm(a, residual)
        d = self._start_backward(loss_scale)
        for rows in self._head_blocks():
            self._classifier_rows(rows, targets, d)
        loss = self._mean_loss()
        self._blocks_backward(d, dropout)
        return loss

    def _blocks_backward(self, d, dropout):
        """Backward from d.narrow = d(lnf) through the final norm, every block
        and the embedding, with the forward's ``dropout``. d.residual carries
        the residual stream's gradient from layer to layer; the others hold
        one layer's (grad_act_specs)."""
        c, p, a = self.config, self.params, self.acts
        layer = LayerGrads(c, d, self.B, self.T)
        apply_norm_backward(c, d.residual, self.base_grad("lnfw"), self.base_grad("lnfb"),
                            layer.ln, self.layer_output(a, c.L - 1), p.lnfw,
                            optional(a, "lnf_mean"), a.lnf_rstd, written=True)
        for l in reversed(range(c.L)):
            # d.residual is d(layer l's output); after, d(its input)
            x = a.encoded if l == 0 else self.layer_output(a, l - 1)
            self._block.backward(a, layer, l, x, dropout)
        if self.lora is not None:
            return   # a frozen embedding: nothing below needs the input gradient
        g = self.grads   # (zeroes any gradient zero_grad left that no product wrote)
        p_embedding, seed = dropout.site("embedding")
        if p_embedding:   # now d(encoded before its dropout), in place
            K.dropout_backward(d.residual, d.residual, p_embedding, seed)
        K.encoder_backward(g.wte[:c.V], g.wpe if c.learned_positions else None, d.residual,
                           self.inputs)

    # ---- generation --------------------------------------------------------

    @held
    def generate(self, prompt_tokens, max_new_tokens, *, temperature=1.0, top_k=None,
                 top_p=None, repetition_penalty=None, seed=None, stop_token=None):
        """New token ids after ``prompt_tokens``, decoded with a KV cache
        (kv_cache.generate): a list of ids gives a list, a list of lists (a
        batch of any lengths) a list of lists. temperature 0 is greedy; the
        same seed gives the same tokens."""
        return kv_cache.generate(self, prompt_tokens, max_new_tokens, temperature=temperature,
                                 top_k=top_k, top_p=top_p,
                                 repetition_penalty=repetition_penalty, seed=seed,
                                 stop_token=stop_token)

    # ---- quantized weights -------------------------------------------------

    @held
    def quantize(self, qtype, blocks=None, head=None):
        """Replaces the linear layers' weights (qkv, attention projection,
        MLP) by llama.cpp's ``qtype`` blocks ("q8_0" or "q4_0"), and the
        embedding table and the output head by ``head``'s blocks (default
        qtype: every matrix in one type, as llama.cpp's quantizer makes it
        with --pure; "q8_0" keeps them at 8 bits, nearer llama.cpp's default
        Q6_K head; a tied head is the embedding's blocks themselves); their
        float32 copies are released.
        The embedding's gather dequantises its rows (exact: d * q); norms,
        biases and a learned position table stay float32. A mixture of
        experts' stacks of expert weights take ``qtype`` too (QuantizedExperts:
        decoding's few rows an expert by the decoding kernel, all experts in
        one parallel loop); their routers stay float32, as llama.cpp keeps them.
        ``blocks`` {name: [QuantizedLinear (or QuantizedExperts) per
        layer]} gives some of them already quantized (a GGUF file's bytes). Every linear layer then runs
        QuantizedLinear's kernels (few rows: decoding; many: the panel path):
        forward, evaluation, generate, and LoRA adapters on the frozen
        quantized base (add_lora, load_lora: QLoRA), whose backward takes
        the input gradients through the panel path; training the base and
        saving it are refused."""
        check_weights_type(qtype)
        self._refuse_adapters("quantize")
        self._refuse_frozen("quantize")
        if self.quantized is not None:
            raise RuntimeError(f"quantize: this model is quantized ({self.quantized}) already")
        blocks = blocks or {}
        whole = self.params
        self._start_quantized(qtype, head)
        self.params = TensorGroup(_float32_when_quantized(self.param_specs), self.config)
        self.params_bf16 = None
        for name in whole.names:
            for l in [None] if name in WHOLE_PARAMS else range(len(whole[name])):
                self.put_quantized(name, l, blocks[name][l] if name in blocks else
                                   whole[name] if l is None else whole[name][l])

    def _start_quantized(self, qtype, head=None):
        """Empty slots for the quantized weights (put_quantized fills them),
        and the quantized matmul; first, before anything changes, the types
        (``head``: the embedding's and head's, default qtype) and every
        weight's input dimension checked."""
        check_weights_type(qtype)
        head = qtype if head is None else head
        check_weights_type(head)
        shapes, tables = dict(self.param_specs), self._quantized_tables()
        # the linear layers and stacks of experts this config has (a model
        # whose every MLP has experts has no fcw)
        linears = [name for name in QUANTIZED_LINEARS + QUANTIZED_EXPERTS if name in shapes]
        for name in linears:
            check_input_dim(f"{name}[0]", shapes[name](self.config)[1:], qtype)
        for name in tables:
            check_input_dim(name, shapes[name](self.config), head)
        slots = {name: [None] * shapes[name](self.config)[0] for name in linears}
        slots.update(dict.fromkeys(tables))
        self._weights = QuantizedWeights(slots)
        self._lay_out_quantized(qtype, head, shapes, tables)
        self._matmul_forward = _quantized_matmul
        self._matmul_backward = _quantized_matmul_backward
        self.quantized, self.quantized_head = qtype, head
        # a quantized base's activations: float32 (act_dtypes), also fch with recompute
        self._lay_out(self.recompute)

    def _lay_out_quantized(self, qtype, head, shapes, tables):
        """One buffer for every quantized weight's packed blocks, in the order
        a decoding step reads them: like the float32 and bf16 parameters, an
        allocation numpy asks Linux to back with huge pages (those of 4 MiB
        or more), where a weight of its own is often smaller; ``_quantized_parts``
        {(name, l): its [OC, row bytes] part}, each starting on ALIGN_BYTES."""
        c, extents, total = self.config, {}, 0
        # (an MoE model's expert stacks have buffers of their own)
        layers = {name: shapes[name](c)[0] for name in QUANTIZED_LINEARS if name in shapes}
        order = [(name, l) for l in range(c.L) for name in layers if l < layers[name]]
        for name, l in order + [(name, None) for name in tables]:
            OC, IC = shapes[name](c)[-2:]
            # the embedding and an untied head at ``head``
            row_bytes = IC // K.QUANT_BLOCK * block_bytes(qtype if l is not None else head)
            extents[name, l] = (total, OC, row_bytes)
            total += -(-OC * row_bytes // ALIGN_BYTES) * ALIGN_BYTES
        memory = aligned_empty(total, np.uint8, what=f"the {qtype} weights")
        self._quantized_parts = {key: memory[start:start + OC * row_bytes].reshape(OC, row_bytes)
                                 for key, (start, OC, row_bytes) in extents.items()}

    def _quantized_tables(self):
        """The embedding and an untied head: whole tensors held at quantized_head."""
        return ("wte",) if self.config.tied_embeddings else ("wte", "lm_head")

    def put_quantized(self, name, l, values):
        """Writes tensor ``name`` (of layer l; None: a whole one) of a
        quantized model from ``values``: a linear layer's weight is quantized
        to the model's type, the embedding and an untied head to its head's
        (quantize), unless
        given as a QuantizedLinear (a GGUF file's blocks, kept as they are);
        the other tensors go into ``params`` in float32. ``values`` may be
        float32, float16 or bf16, with fewer rows than the tensor for the
        unpadded vocabulary (the padding rows stay zero). A stack of experts
        (expertfcw, expertprojw of MoE layer l) is given whole ([E, OC, IC],
        or a QuantizedExperts) or one expert at a time (l a pair (layer,
        expert), as loaders give it)."""
        c = self.config
        if name in self.params:
            view = self.params[name] if l is None else self.params[name][l]
            view[:len(values)] = values
            return
        if name in QUANTIZED_EXPERTS:
            self._put_experts(name, l, values)
            return
        if l is None and not isinstance(values, QuantizedLinear) and len(values) < c.Vp:
            padded = np.zeros((c.Vp, c.C), np.float32)
            padded[:len(values)] = values
            values = padded
        label = name if l is None else f"{name}[{l}]"
        qtype = self.quantized_head if l is None else self.quantized
        part = self._quantized_parts[name, l]
        if not isinstance(values, QuantizedLinear):
            values = QuantizedLinear.quantize(values, qtype, label, part)
        shape = dict(self.param_specs)[name](c)[0 if l is None else 1:]
        if values.shape != shape:
            raise ShapeError(f"{values.name}: quantized weight of shape {list(values.shape)}, "
                             f"expected {list(shape)} for {label}")
        if values.packed is not part and values.qtype == qtype:   # given: into the buffer
            values = QuantizedLinear(values.blocks, shape[1], values.qtype, values.name, part)
        self._weights.put(name, l, values)

    def _put_experts(self, name, l, values):
        """put_quantized's stack of experts ``name`` of MoE layer l (or of
        expert e of it, l = (layer, e))."""
        shape = dict(self.param_specs)[name](self.config)[1:]
        if isinstance(l, tuple):
            l, e = l
            stack = self._weights[name][l]
            if stack is None:
                stack = QuantizedExperts.zeros(shape, self.quantized, f"{name}[{l}]")
                self._weights.put(name, l, stack)
            stack.put_expert(e, values)
            return
        if not isinstance(values, QuantizedExperts):
            values = QuantizedExperts.quantize(values, self.quantized, f"{name}[{l}]")
        if values.shape != shape:
            raise ShapeError(f"{values.name}: quantized experts of shape {list(values.shape)} "
                             f"([experts, rows, columns]), expected {list(shape)} for "
                             f"{name}[{l}]")
        self._weights.put(name, l, values)

    def _refuse_quantized(self, what):
        if self.quantized is not None:
            raise RuntimeError(f"{what}: this model's weights are quantized ({self.quantized}), "
                               f"for generation, evaluation and LoRA adapters (add_lora) only; "
                               f"load the model unquantized to train or save it")

    def _refuse_quantized_base(self, what):
        """Training a quantized model is its adapters' alone."""
        if self.lora is None:
            self._refuse_quantized(what)

    # ---- LoRA --------------------------------------------------------------

    @held
    def add_lora(self, rank, alpha, targets=None, dropout=0.0, seed=0, rslora=False):
        """Freezes the base and adds LoRA adapters (model.lora) of ``rank``
        on the Hugging Face modules ``targets`` (default: every one the model
        has: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj;
        GPT-2's c_attn, attn.c_proj, c_fc, mlp.c_proj), scaled by alpha / rank
        (alpha / sqrt(rank) with ``rslora``), initialised as peft does from
        ``seed`` (A Kaiming-uniform, B zero). ``dropout`` drops each
        adapter's input in the passes given a Dropout. From then on
        zero_grad, backward, update, grad_norm and clip_grad_norm act on the
        adapters alone."""
        self._refuse_experts("add_lora")
        self._refuse_adapters("add_lora")
        lora = Lora(self.config, rank, alpha, targets, dropout, rslora)
        lora.initialize(seed)
        self._freeze(lora)

    def _freeze(self, lora):
        """Trains ``lora`` from now on; the base's gradients and moments go."""
        self.lora = lora
        lora.bf16 = self.precision == "bf16"   # its products as the base layers'
        self._grads = None
        self._unwritten = set()
        self.m_memory = self.v_memory = None

    @held
    def merge_lora(self):
        """Folds the adapters into the base, W += scale * B A (float32, as
        peft's merge_and_unload), and removes them: the model is a plain one
        again, which save_pretrained and save_checkpoint write. A frozen
        bf16 base's weights take the float32 sum rounded once to bf16 (it
        stays a frozen bf16 base, which save_pretrained writes in bf16)."""
        lora = self._adapters("merge_lora")
        self._refuse_quantized("merge_lora")
        for t in lora.targets:
            for l in range(self.config.L):
                if self.frozen:
                    weight = self.params_bf16[t.linear + "w"][l, t.rows]
                    weight[...] = to_bf16(from_bf16(weight) + lora.delta(t, l))
                else:
                    self.params[t.linear + "w"][l, t.rows] += lora.delta(t, l)
        self.lora = None
        if self.params_bf16 is not None and not self.frozen:
            self.refresh_bf16()

    def save_lora(self, folder):
        """Writes the adapters as a PEFT folder (io.peft: adapter_config.json,
        adapter_model.safetensors), which peft.PeftModel.from_pretrained
        loads onto the Hugging Face model of this base."""
        from ..io.peft import write_peft   # needs the optional safetensors package
        write_peft(folder, self._adapters("save_lora"))

    @held
    def load_lora(self, folder):
        """Freezes the base and adds the adapters of a PEFT folder (io.peft),
        as add_lora does; options we do not support are refused by name."""
        from ..io.peft import read_peft
        self._refuse_experts("load_lora")
        self._refuse_adapters("load_lora")
        self._freeze(read_peft(folder, self.config))

    def _adapters(self, what):
        if self.lora is None:
            raise RuntimeError(f"{what}: this model has no LoRA adapters; add_lora or "
                               f"load_lora first")
        return self.lora

    def _refuse_adapters(self, what):
        if self.lora is not None:
            names = ", ".join(t.name for t in self.lora.targets)
            raise RuntimeError(f"{what}: this model has LoRA adapters already (rank "
                               f"{self.lora.rank} on {names}); merge_lora() folds them into "
                               f"the base, save_lora() writes them")

    def _refuse_experts(self, what):
        if self.config.num_experts:
            raise UnsupportedError(f"{what}: this model has experts (num_experts="
                                   f"{self.config.num_experts}); LoRA adapters cover dense "
                                   f"MLPs only")

    def _refuse_frozen(self, what):
        if self.frozen:
            raise RuntimeError(f"{what}: this model is a frozen bf16 base (frozen=True): its "
                               f"weights are bf16 alone, with no float32 master to change or "
                               f"save; load it without frozen=True for that")

    # ---- update ------------------------------------------------------------

    def moments(self):
        """AdamW's moments (m, v), flat float32, one value per parameter
        trained (the adapters' after add_lora): made (zero) on first use, by
        this, update() or reserve(training=True)."""
        lora = self.lora
        if lora is not None:
            if lora.m is None:
                lora.m = aligned_zeros(lora.params.size, what="the adapters' first moments")
                lora.v = aligned_zeros(lora.params.size, what="the adapters' second moments")
            return lora.m, lora.v
        if self.m_memory is None:
            self.m_memory = aligned_zeros(self.num_parameters, what="AdamW's first moments")
            self.v_memory = aligned_zeros(self.num_parameters, what="AdamW's second moments")
        return self.m_memory, self.v_memory

    def grad_norm(self):
        """The global L2 norm of all gradients of what is trained (trained)."""
        return math.sqrt(K.global_norm_squared(self.trained[1].memory))

    def clip_grad_norm(self, max_norm):
        """Scales the gradients so their global norm is at most ``max_norm``;
        returns the norm before clipping."""
        norm = self.grad_norm()
        if max_norm > 0 and norm > max_norm:
            K.scale_inplace(self.trained[1].memory, max_norm / norm)
        return norm

    @held
    def update(self, learning_rate, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, t=1,
               decay=None):
        """One AdamW step (llm.c's gpt2_update); t >= 1 is the step number.

        Weight decay applies to every parameter (llm.c's CPU trainer) unless
        ``decay`` names the tensors to decay, e.g. model.matrix_params for
        weights only; the others then get none. After add_lora it updates
        the adapters alone (``decay`` then names adapter tensors, as
        lora.params does) and the base never changes."""
        self._refuse_quantized_base("update")
        m, v = self.moments()
        params, grads = self.trained
        adamw_step(params, grads, m, v, learning_rate, beta1, beta2, eps, weight_decay, t, decay,
                   params_bf16=None if self.lora is not None else self.params_bf16)


class QuantizedWeights:
    """A quantized model's ``_weights``: weights["qkvw"][l], the embedding
    (.wte) and an untied head (.lm_head) as QuantizedLinear blocks, an MoE
    layer's stacks of experts (weights["expertfcw"][m]) as QuantizedExperts."""

    def __init__(self, weights):
        self._weights = weights

    def __getitem__(self, name):
        return self._weights[name]

    def put(self, name, l, linear):
        """Sets layer l's QuantizedLinear of ``name`` (l None: the head's)."""
        if l is None:
            self._weights[name] = linear
        else:
            self._weights[name][l] = linear

    def __getattr__(self, name):
        weights = self.__dict__.get("_weights")
        if weights is not None and name in weights:
            return weights[name]
        raise AttributeError(name)


def _float32_when_quantized(specs):
    """The parameter specs a quantized model keeps in float32: all but the
    linear layers' weights, the experts', the embedding and an untied head."""
    return [(name, fn) for name, fn in specs
            if name not in QUANTIZED_LINEARS + QUANTIZED_EXPERTS + ("wte", "lm_head")]


def _quantized_matmul(out, inp, weight, bias):
    """matmul_forward's call on a QuantizedLinear weight, or on a float32
    one it keeps (an MoE layer's router)."""
    if isinstance(weight, np.ndarray):
        K.matmul_forward(out, inp, weight, bias)
    else:
        weight(out, inp, bias)


def _quantized_matmul_backward(dinp, dweight, dbias, dout, inp, weight, written=0):
    """matmul_backward's call on a frozen QuantizedLinear weight (LoRA):
    the input gradient alone (base_grad gives no weight or bias gradient)."""
    assert dweight is None and dbias is None, "a quantized base has no gradients"
    if written & K.WRITE_DINP:
        dinp[...] = 0.0
    weight.backward(dinp, dout)


def _checked_dropout(dropout):
    """A pass's Dropout: NO_DROPOUT for None."""
    if dropout is None:
        return NO_DROPOUT
    if not isinstance(dropout, Dropout):
        raise TypeError(f"dropout must be a llmc_py.Dropout (or None), got "
                        f"{type(dropout).__name__}")
    return dropout
