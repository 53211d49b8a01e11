"""Model configuration. Defaults are GPT-2 124M, as llm.c's checkpoint has it."""
from dataclasses import dataclass, field, fields

import numpy as np

from .errors import ShapeError
from .flags import NON_NEGATIVE, POSITIVE, Range

# GPT-2's vocabulary padded up to a multiple of this many columns (50257 -> 50304),
# so the output matmul splits evenly
VOCAB_PAD_MULTIPLE = 128


def padded_vocab(vocab_size, multiple=VOCAB_PAD_MULTIPLE):
    return (vocab_size + multiple - 1) // multiple * multiple


# the Llama family's choices; each is a string in the config and a small int
# code in the checkpoint header (the index in these tuples)
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope", "alibi", "sinusoidal")
# (new names go at the end: a model file holds the index)
MLPS = ("gelu", "swiglu", "relu", "gelu_erf", "geglu", "reglu")
# where the norms sit in a block (see model.transformer): "pre" x + f(norm(x));
# "post" norm(x + f(x)) (the original Transformer); "parallel" one norm read
# by attention and the MLP side by side, x + attn(n) + mlp(n), n = norm1(x)
# (GPT-J, Falcon-7B)
BLOCKS = ("pre", "post", "parallel")
# the gated MLPs: W2(act(x W1) * x W3), fcw holding W1 (the gate) then W3
GATED_MLPS = ("swiglu", "geglu", "reglu")
# RoPE for contexts past the trained length: "linear" divides every frequency
# by rope_factor (position interpolation); "ntk" raises the base to theta *
# factor^(hs/(hs-2)) (NTK-aware); "llama3" is Llama 3.1's rule (Hugging Face's
# rope_type "llama3": long wavelengths divided by the factor, short ones kept,
# a smooth blend between, set by rope_original_max and the two freq factors)
ROPE_SCALINGS = ("none", "linear", "ntk", "llama3")
# a gated MLP's hidden size by the Llama rule is rounded up to a multiple of
# this by default (Llama's multiple_of is 256; 32 suits our small models)
FFN_MULTIPLE = 32


def llama_ffn_hidden(channels, multiple_of=FFN_MULTIPLE, ffn_dim_multiplier=1.0):
    """Llama's rule (its FeedForward): 2/3 of 4C, times ffn_dim_multiplier,
    rounded up to a multiple of multiple_of (so a gated MLP's three matrices
    hold about as many weights as GPT-2's two of 4C)."""
    hidden = int(ffn_dim_multiplier * (8 * channels // 3))
    return (hidden + multiple_of - 1) // multiple_of * multiple_of


# ---- how a field is declared -------------------------------------------------
#
# Each field of TransformerConfig declares, beside its default, what the rest
# of the package needs of it; the flags (train.cli), the range checks, describe
# and config_from_depth (model.presets), our model file's header (io.model_file),
# Hugging Face's config.json (io.hf) and the resume check (train.resume) are
# derived from MODEL_FIELDS below. A field without a flag (a size) is set by
# the depth or read from a file; every flag is fixed on resume (the model comes
# from the checkpoint).

@dataclass(frozen=True)
class Flag:
    """A field's flag in train's "model family" group."""
    name: str                # "--kv-heads"; the dest (saved in checkpoints) follows from it
    help: str
    range: Range = None      # a number's allowed values (flags.check_flags)
    default: object = None   # the flag's default when not the field's
    inverted: bool = False   # a 0/1 flag that sets the field to its negation (--untied)

    @property
    def dest(self):
        return self.name[2:].replace("-", "_")


@dataclass(frozen=True)
class Slot:
    """A field's header slot in our model file (io.model_file): an int32
    slot, or a float32 one for a float field; a choice is held as its index
    in the choices, a bool as 0 or 1."""
    index: int
    range: Range = None          # what a reader accepts (else the config checks it)
    zero_reads_as: object = None  # a slot that came later: a file from before holds 0
    only_with: str = None        # read only when that field is not its default


REQUIRED = object()


@dataclass(frozen=True)
class HFKey:
    """A field's key in a Hugging Face config.json."""
    names: tuple             # read from the first, written to all
    missing: object = REQUIRED   # the value when absent: a constant, or a function
                                 # of the fields read before it
    null_is_missing: bool = False
    written_as: str = None   # the config attribute written (default: the field)
    also_read: tuple = ()    # read when the first name is absent, never written
                             # (a name transformers itself writes instead)


@dataclass(frozen=True)
class GGUFKey:
    """A field's metadata keys in a GGUF file (io.gguf), as gguf.Keys spells
    them ({arch} is general.architecture)."""
    names: tuple             # read from the first, written to all
    missing: object = REQUIRED   # the value when absent (a constant)
    written_as: str = None   # the config attribute written (default: the field)


def declared(default, *, choices=None, flag=None, slot=None, hf=None, gguf=None, shown=None,
             always_shown=False):
    """A TransformerConfig field: ``choices`` (a str field's allowed values),
    its ``flag``, header ``slot``, ``hf`` keys ({family: HFKey}, families as
    io.hf.FAMILIES), ``gguf`` keys ({family: GGUFKey}, the same families) and
    ``shown``, describe's text for it (str.format'ed with c, the config), when
    it is not the default or ``always_shown``."""
    return field(default=default, metadata=dict(
        choices=choices, flag=flag, slot=slot, hf=hf or {}, gguf=gguf or {}, shown=shown,
        always_shown=always_shown))


def same_key(name):
    """A required config.json key, the same in every family."""
    return {"gpt2": HFKey((name,)), "llama": HFKey((name,))}


def same_gguf_key(*names):
    """Required GGUF keys, the same in every family."""
    return {"gpt2": GGUFKey(names), "llama": GGUFKey(names)}


def moe_gguf_key(name):
    """A required GGUF key of both families of experts (Mixtral's, Qwen3-MoE's)."""
    return {"mixtral": GGUFKey((name,)), "qwen3_moe": GGUFKey((name,))}


@dataclass(frozen=True)
class TransformerConfig:
    """One decoder-only transformer, by its sizes and choices. The presets
    below (LlamaConfig, GPT2Config) are this with other defaults. Each field
    is declared with its flag, header slot, Hugging Face keys and describe
    text (see declared)."""
    # maxT: rows of wpe (learned positions); for RoPE, ALiBi and sinusoidal
    # only the length trained at, not a limit
    max_seq_len: int = declared(
        1024, slot=Slot(2, POSITIVE),
        hf={"gpt2": HFKey(("n_positions", "n_ctx")),
            "llama": HFKey(("max_position_embeddings",))},
        gguf=same_gguf_key("{arch}.context_length"))
    # V
    vocab_size: int = declared(50257, slot=Slot(3, POSITIVE), hf=same_key("vocab_size"))
    # Vp >= V: rows of wte (and of lm_head when untied)
    padded_vocab_size: int = declared(50304, slot=Slot(7, POSITIVE))
    # L
    num_layers: int = declared(
        12, slot=Slot(4, POSITIVE),
        hf={"gpt2": HFKey(("n_layer",)), "llama": HFKey(("num_hidden_layers",))},
        gguf=same_gguf_key("{arch}.block_count"))
    # NH: query heads; must divide channels unless head_dim is given
    num_heads: int = declared(
        12, slot=Slot(5, POSITIVE),
        hf={"gpt2": HFKey(("n_head",)), "llama": HFKey(("num_attention_heads",))},
        gguf=same_gguf_key("{arch}.attention.head_count"))
    # NKV: key/value heads; divides NH (1: MQA, NH: MHA; 0 picks NH)
    num_kv_heads: int = declared(
        4, slot=Slot(8, POSITIVE),
        hf={"llama": HFKey(("num_key_value_heads",), lambda fields: fields["num_heads"])},
        gguf={"llama": GGUFKey(("{arch}.attention.head_count_kv",))},
        shown=" ({c.num_kv_heads} kv)", always_shown=True,
        flag=Flag("--kv-heads", "llama: key/value heads, dividing the query heads (1: "
                  "multi-query; 0: as many as query heads)", NON_NEGATIVE, default=0))
    # C
    channels: int = declared(
        768, slot=Slot(6, POSITIVE),
        hf={"gpt2": HFKey(("n_embd",)), "llama": HFKey(("hidden_size",))},
        gguf=same_gguf_key("{arch}.embedding_length"))
    # FF: MLP hidden size; 0 picks the default (the Llama rule for a gated
    # MLP, 4C for the others)
    ffn_hidden: int = declared(
        0, slot=Slot(9, POSITIVE),
        hf={"gpt2": HFKey(("n_inner",), lambda fields: 4 * fields["channels"],
                          null_is_missing=True),
            "llama": HFKey(("intermediate_size",))},
        gguf=same_gguf_key("{arch}.feed_forward_length"),
        flag=Flag("--ffn-hidden", "llama: MLP hidden size (0: Llama's rule for a gated MLP, "
                  "2/3 of 4C times --ffn-dim-multiplier rounded up to --ffn-multiple-of; 4C "
                  "for the others)", NON_NEGATIVE))
    # the Llama rule rounds FF up to a multiple of this
    ffn_multiple_of: int = declared(
        FFN_MULTIPLE, slot=Slot(17, zero_reads_as=FFN_MULTIPLE),
        flag=Flag("--ffn-multiple-of", "llama: Llama's multiple_of, the hidden-size rule's "
                  "rounding", POSITIVE))
    # the Llama rule scales 2/3 of 4C by this first (Llama 3 70B: 1.3)
    ffn_dim_multiplier: float = declared(
        1.0, slot=Slot(8, zero_reads_as=1.0),
        flag=Flag("--ffn-dim-multiplier", "llama: Llama's ffn_dim_multiplier, the "
                  "hidden-size rule's factor", POSITIVE))
    # "rmsnorm" (weight only) | "layernorm" (weight, bias)
    norm: str = declared(
        "rmsnorm", choices=NORMS, slot=Slot(10), shown=", {c.norm}", always_shown=True,
        flag=Flag("--norm", "llama: the norm"))
    # "rope" | "alibi" | "learned" (a wpe table, as GPT-2) | "sinusoidal"
    # (fixed sin/cos added to the embedding)
    position: str = declared(
        "rope", choices=POSITIONS, slot=Slot(11), shown=", {c.position}", always_shown=True,
        flag=Flag("--position", "llama: rotary (rope), ALiBi biases (alibi), a learned table "
                  "or fixed sinusoids added to the embedding (sinusoidal)"))
    # gated: "swiglu" W2(silu(x W1) * x W3), "geglu" (gelu, tanh form),
    # "reglu" (relu); plain: W2 act(x W1), "gelu" (GPT-2's tanh form),
    # "gelu_erf", "relu"
    mlp: str = declared(
        "swiglu", choices=MLPS, slot=Slot(12), shown=", {c.mlp} {c.ffn_hidden}",
        always_shown=True,
        flag=Flag("--mlp", "llama: the MLP; gated (act(x W1) * x W3): swiglu, geglu, reglu; "
                  "plain: gelu (tanh form), gelu_erf (exact), relu"))
    # the norms' places: "pre" | "post" | "parallel"
    block: str = declared(
        "pre", choices=BLOCKS, slot=Slot(18), shown=", {c.block} block",
        flag=Flag("--block", "llama: the norms' places: pre (x + f(norm(x))), post "
                  "(norm(x + f(x)), the original Transformer's) or parallel (x + attn(n) + "
                  "mlp(n), n = norm(x): GPT-J)"))
    # biases on the linear layers
    bias: bool = declared(
        False, slot=Slot(13), shown=", bias",
        flag=Flag("--bias", "llama: biases on the linear layers"))
    # the output head is wte; False adds lm_head [Vp, C]
    tied_embeddings: bool = declared(
        True, slot=Slot(14), shown=", untied",
        hf={"gpt2": HFKey(("tie_word_embeddings",), True),
            "llama": HFKey(("tie_word_embeddings",), False)},
        flag=Flag("--untied", "llama: 1 gives the output head its own matrix instead of "
                  "sharing wte", inverted=True))
    # RoPE base
    rope_theta: float = declared(
        10000.0, slot=Slot(0), gguf={"llama": GGUFKey(("{arch}.rope.freq_base",), 10000.0)},
        flag=Flag("--rope-theta", "llama: the RoPE base", POSITIVE))
    # epsilon inside the norms
    norm_eps: float = declared(
        1e-5, slot=Slot(1),
        hf={"gpt2": HFKey(("layer_norm_epsilon",), 1e-5),
            "llama": HFKey(("rms_norm_eps",), 1e-6)},
        gguf={"gpt2": GGUFKey(("{arch}.attention.layer_norm_epsilon",)),
              "llama": GGUFKey(("{arch}.attention.layer_norm_rms_epsilon",))})
    # hs: channels per attention head; 0 means C / NH (Qwen3 sets its own:
    # attention is NH * hs wide); held as 0 whenever it equals C / NH
    head_dim: int = declared(
        0, slot=Slot(15, Range(lo=0, text=">= 0 (0: channels / num_heads)")),
        hf={"llama": HFKey(("head_dim",), 0, null_is_missing=True, written_as="head_size")},
        gguf={"llama": GGUFKey(("{arch}.attention.key_length", "{arch}.attention.value_length",
                                "{arch}.rope.dimension_count"), 0, written_as="head_size")},
        flag=Flag("--head-dim", "llama: channels per attention head (0: channels / heads; "
                  "Qwen3 sets its own)", NON_NEGATIVE))
    # RMSNorm on each q and k head before RoPE (Qwen3's q_norm, k_norm:
    # weights of hs, norm_eps)
    qk_norm: bool = declared(
        False, slot=Slot(16), shown=", qk_norm, head_dim {c.head_size}",
        flag=Flag("--qk-norm", "llama: 1 RMS-normalises each q and k head before RoPE "
                  "(Qwen3)"))
    # W > 0: each query attends to its last W positions, itself included
    # (Mistral's); 0: to all before it
    sliding_window: int = declared(
        0, slot=Slot(19), shown=", window {c.sliding_window}",
        hf={"mistral": HFKey(("sliding_window",), 0, null_is_missing=True)},
        gguf={"mistral": GGUFKey(("{arch}.attention.sliding_window",), 0)},
        flag=Flag("--sliding-window", "llama: each query attends to its last W positions only "
                  "(Mistral's sliding window; the KV cache keeps W); 0: to every position "
                  "before it", NON_NEGATIVE))
    # ROPE_SCALINGS
    rope_scaling: str = declared(
        "none", choices=ROPE_SCALINGS, slot=Slot(24),
        shown=", rope {c.rope_scaling} x{c.rope_factor:g}",
        flag=Flag("--rope-scaling", "llama: RoPE's frequencies for a context --rope-factor "
                  "times longer: linear (position interpolation), ntk (a larger base) or llama3 "
                  "(Llama 3.1's rule, with --rope-original-max)"))
    # how much longer a context it is scaled for
    rope_factor: float = declared(
        1.0, slot=Slot(2, only_with="rope_scaling"),
        flag=Flag("--rope-factor", "llama: --rope-scaling's factor", POSITIVE))
    # llama3: the context it was trained at (8192)
    rope_original_max: int = declared(
        0, slot=Slot(25, only_with="rope_scaling"),
        flag=Flag("--rope-original-max", "llama: --rope-scaling llama3's original context "
                  "(Llama 3.1: 8192)", NON_NEGATIVE))
    # llama3: wavelengths above original_max / low are divided by the factor
    rope_low_freq_factor: float = declared(1.0, slot=Slot(3, only_with="rope_scaling"))
    # llama3: ... below original_max / high kept
    rope_high_freq_factor: float = declared(4.0, slot=Slot(4, only_with="rope_scaling"))
    # RoPE pairs channels 2i, 2i+1 (Meta's original layout) instead of i,
    # i + hs/2 (Hugging Face's)
    rope_interleaved: bool = declared(
        False, slot=Slot(20), shown=", interleaved rope",
        flag=Flag("--rope-interleaved", "llama: 1 turns RoPE's pairs of neighbouring channels "
                  "(2i, 2i+1: Meta's original layout) instead of i and i + hs/2 (Hugging "
                  "Face's)"))
    # E > 0: the MLP of each MoE layer (moe_layers) is E experts, each an MLP
    # of `mlp`'s kind and expert_hidden wide, a router sending each token to
    # experts_per_token of them (Mixtral, Qwen3-MoE); 0: one dense MLP per layer
    num_experts: int = declared(
        0, slot=Slot(21, NON_NEGATIVE),
        shown=", {c.num_experts} experts top-{c.experts_per_token} of {c.expert_hidden}",
        hf={"mixtral": HFKey(("num_local_experts",)),
            "qwen3_moe": HFKey(("num_experts",), also_read=("num_local_experts",))},
        gguf=moe_gguf_key("{arch}.expert_count"),
        flag=Flag("--experts", "llama: E > 0 makes the MLP of every --moe-every-th layer a "
                  "mixture of E experts, a router sending each token to --experts-per-token "
                  "of them (Mixtral, Qwen3-MoE); 0: one dense MLP per layer", NON_NEGATIVE))
    # k: the experts each token is routed to, 1 <= k <= E
    experts_per_token: int = declared(
        0, slot=Slot(22, NON_NEGATIVE, only_with="num_experts"),
        hf={"mixtral": HFKey(("num_experts_per_tok",)),
            "qwen3_moe": HFKey(("num_experts_per_tok",))},
        gguf=moe_gguf_key("{arch}.expert_used_count"),
        flag=Flag("--experts-per-token", "llama: k, the experts each token is routed to "
                  "(1 <= k <= --experts)", NON_NEGATIVE))
    # each expert's MLP hidden size (Mixtral's intermediate_size, Qwen3-MoE's
    # moe_intermediate_size)
    expert_hidden: int = declared(
        0, slot=Slot(23, NON_NEGATIVE, only_with="num_experts"),
        hf={"mixtral": HFKey(("intermediate_size",)),
            "qwen3_moe": HFKey(("moe_intermediate_size",))},
        gguf={"mixtral": GGUFKey(("{arch}.feed_forward_length",)),
              "qwen3_moe": GGUFKey(("{arch}.expert_feed_forward_length",))},
        flag=Flag("--expert-hidden", "llama: each expert's MLP hidden size", NON_NEGATIVE))
    # n: layers n-1, 2n-1, ... are MoE, the others dense (Qwen3-MoE's
    # decoder_sparse_step: layer l when (l + 1) % n == 0); 1: every layer
    moe_every: int = declared(
        1, slot=Slot(26, POSITIVE, only_with="num_experts"), shown=", MoE every {c.moe_every}",
        hf={"qwen3_moe": HFKey(("decoder_sparse_step",), 1)},
        flag=Flag("--moe-every", "llama: with --experts, layers n-1, 2n-1, ... have the "
                  "experts and the others a dense MLP (Qwen3-MoE's decoder_sparse_step); 1: "
                  "every layer", POSITIVE))
    # the k router weights of a token renormalised to sum to 1 (Mixtral), or
    # the softmax's as they are (OLMoE); Qwen3-MoE says per model
    norm_topk_prob: bool = declared(
        True, slot=Slot(27, only_with="num_experts"), shown=", top-k weights unnormalised",
        hf={"qwen3_moe": HFKey(("norm_topk_prob",), False)},
        flag=Flag("--norm-topk-prob", "llama: 1 renormalises a token's k router weights to "
                  "sum to 1 (Mixtral); 0 keeps the softmax's (OLMoE)"))
    # the load-balancing loss's coefficient (Switch Transformer / Mixtral:
    # E * sum over experts of f_e, the fraction of the layer's B T k
    # assignments routed to it (1 when even), times its mean router
    # probability; averaged over the MoE layers). transformers' loss divides
    # by B T, not B T k (k times ours), so router_aux_loss = k *
    # router_aux_loss_coef (io.hf reads and writes it so): the same total
    # loss for one MoE layer; with more, transformers pools the counts and
    # probabilities of all layers before multiplying, a little different.
    # config.json's router_aux_loss_coef counts only with
    # output_router_logits, as in transformers
    router_aux_loss: float = declared(
        0.0, slot=Slot(5, only_with="num_experts"), shown=", aux loss {c.router_aux_loss:g}",
        hf={"mixtral": HFKey(("router_aux_loss_coef",), 0.0),
            "qwen3_moe": HFKey(("router_aux_loss_coef",), 0.0)},
        flag=Flag("--router-aux-loss", "llama: the load-balancing loss's coefficient "
                  "(k times transformers' router_aux_loss_coef; 0: none)", NON_NEGATIVE))
    # the router z-loss's coefficient (ST-MoE: mean of logsumexp(router
    # logits)^2); no Hugging Face key
    router_z_loss: float = declared(
        0.0, slot=Slot(6, only_with="num_experts"), shown=", z loss {c.router_z_loss:g}",
        flag=Flag("--router-z-loss", "llama: the router z-loss's coefficient (ST-MoE: mean of "
                  "logsumexp(router logits)^2; 0: none)", NON_NEGATIVE))

    def __post_init__(self):
        if isinstance(self.num_kv_heads, int) and self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim and isinstance(self.num_heads, int) and self.num_heads > 0 \
                and self.head_dim * self.num_heads == self.channels:
            object.__setattr__(self, "head_dim", 0)   # one way to say C / NH
        if isinstance(self.ffn_hidden, int) and self.ffn_hidden == 0:
            self._validate_ffn_rule()
            default = llama_ffn_hidden(self.channels, self.ffn_multiple_of,
                                       self.ffn_dim_multiplier) \
                if self.mlp in GATED_MLPS else 4 * self.channels
            object.__setattr__(self, "ffn_hidden", default)
        if self._all_moe and isinstance(self.expert_hidden, int) and self.expert_hidden > 0:
            # no layer has a dense MLP: one way to say it (Mixtral's single
            # intermediate_size), so a round trip gives the same config
            object.__setattr__(self, "ffn_hidden", self.expert_hidden)
        # held as the float32 the kernels and file use
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type is float and isinstance(value, (int, float)) \
                    and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(np.float32(value)))
        self.validate()

    def _validate_ffn_rule(self):
        kind = type(self).__name__
        if not isinstance(self.ffn_multiple_of, int) or isinstance(self.ffn_multiple_of, bool) \
                or self.ffn_multiple_of <= 0:
            raise ShapeError(f"{kind}.ffn_multiple_of must be a positive int, got "
                             f"{self.ffn_multiple_of!r}")
        value = self.ffn_dim_multiplier
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not (0 < value < float("inf")):
            raise ShapeError(f"{kind}.ffn_dim_multiplier must be a positive finite number, "
                             f"got {value!r}")

    def validate(self):
        """Raises ShapeError naming the first field that cannot describe a model."""
        kind = type(self).__name__
        self._validate_ffn_rule()
        for name in ("max_seq_len", "vocab_size", "padded_vocab_size", "num_layers",
                     "num_heads", "num_kv_heads", "channels", "ffn_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ShapeError(f"{kind}.{name} must be a positive int, got {value!r}")
        for name, allowed in (("norm", NORMS), ("position", POSITIONS), ("mlp", MLPS),
                              ("block", BLOCKS)):
            if getattr(self, name) not in allowed:
                raise ShapeError(f"{kind}.{name} must be one of {allowed}, "
                                 f"got {getattr(self, name)!r}")
        for f in fields(self):
            if f.type is bool and not isinstance(getattr(self, f.name), bool):
                raise ShapeError(f"{kind}.{f.name} must be a bool, got "
                                 f"{getattr(self, f.name)!r}")
        for name in ("rope_theta", "norm_eps", "rope_factor", "rope_low_freq_factor",
                     "rope_high_freq_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not (0 < value < float("inf")):
                raise ShapeError(f"{kind}.{name} must be a positive finite number, "
                                 f"got {value!r}")
        if not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool) \
                or self.head_dim < 0:
            raise ShapeError(f"{kind}.head_dim must be an int >= 0 (0: channels / num_heads), "
                             f"got {self.head_dim!r}")
        if self.head_dim == 0 and self.channels % self.num_heads != 0:
            raise ShapeError(f"{kind}.channels={self.channels} is not divisible by "
                             f"num_heads={self.num_heads} (or give head_dim)")
        if self.num_heads % self.num_kv_heads != 0:
            raise ShapeError(f"{kind}.num_heads={self.num_heads} is not divisible by "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.position == "rope" and self.head_size % 2 != 0:
            raise ShapeError(f"{kind}: RoPE needs an even head size, got "
                             f"head_dim = {self.head_size}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ShapeError(f"{kind}.rope_scaling must be one of {ROPE_SCALINGS}, got "
                             f"{self.rope_scaling!r}")
        if self.rope_interleaved and self.position != "rope":
            raise ShapeError(f"{kind}.rope_interleaved is a RoPE layout; it needs "
                             f"position='rope', got {self.position!r}")
        if self.rope_scaling != "none" and self.position != "rope":
            raise ShapeError(f"{kind}.rope_scaling={self.rope_scaling!r} needs position='rope'")
        if not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool) \
                or self.sliding_window < 0:
            raise ShapeError(f"{kind}.sliding_window must be an int >= 0 (0: none), got "
                             f"{self.sliding_window!r}")
        if not isinstance(self.rope_original_max, int) or self.rope_original_max < 0:
            raise ShapeError(f"{kind}.rope_original_max must be an int >= 0, got "
                             f"{self.rope_original_max!r}")
        if self.rope_scaling == "llama3" and (
                self.rope_original_max == 0
                or self.rope_high_freq_factor <= self.rope_low_freq_factor):
            raise ShapeError(f"{kind}: llama3 RoPE scaling needs rope_original_max > 0 and "
                             f"rope_high_freq_factor > rope_low_freq_factor, got "
                             f"{self.rope_original_max}, {self.rope_high_freq_factor}, "
                             f"{self.rope_low_freq_factor}")
        if self.qk_norm and self.norm != "rmsnorm":
            raise ShapeError(f"{kind}.qk_norm is RMSNorm on the q and k heads; it needs "
                             f"norm='rmsnorm', got {self.norm!r}")
        self._validate_moe(kind)
        if self.padded_vocab_size < self.vocab_size:
            raise ShapeError(f"{kind}.padded_vocab_size={self.padded_vocab_size} is "
                             f"smaller than vocab_size={self.vocab_size}")

    @property
    def _all_moe(self):
        """True if every layer's MLP is experts (the fields' types unchecked yet)."""
        return isinstance(self.num_experts, int) and self.num_experts > 0 \
            and self.moe_every == 1

    def _validate_moe(self, kind):
        """The MoE fields: an error naming the first that is wrong."""
        for name in ("num_experts", "experts_per_token", "expert_hidden", "moe_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ShapeError(f"{kind}.{name} must be an int >= 0, got {value!r}")
        for name in ("router_aux_loss", "router_z_loss"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value < float("inf"):
                shown = f"{value:.7g}" if isinstance(value, float) else repr(value)
                raise ShapeError(f"{kind}.{name} is a loss coefficient: it must be a finite "
                                 f"number >= 0, got {shown}")
        E, k = self.num_experts, self.experts_per_token
        if E == 0:
            for name in MOE_FIELDS:
                if getattr(self, name) != MODEL_FIELDS[name].default:
                    raise ShapeError(f"{kind}.num_experts is 0 (one dense MLP per layer), but "
                                     f"{name}={getattr(self, name)!r} is a mixture-of-experts "
                                     f"setting: give num_experts >= 1")
            return
        if k < 1:
            raise ShapeError(f"{kind}.experts_per_token must be >= 1 with num_experts={E}, "
                             f"got {k}")
        if k > E:
            raise ShapeError(f"{kind}.experts_per_token={k} is more than num_experts={E}")
        if self.expert_hidden < 1:
            raise ShapeError(f"{kind}.expert_hidden must be >= 1 with num_experts={E}, got "
                             f"{self.expert_hidden}")
        if not 1 <= self.moe_every <= self.num_layers:
            raise ShapeError(f"{kind}.moe_every={self.moe_every} must be in 1..num_layers="
                             f"{self.num_layers} (layer l is MoE when (l + 1) % moe_every == 0)")
        if self.bias:
            raise ShapeError(f"{kind}.bias: the experts and the router have no biases "
                             f"(Mixtral's, Qwen3-MoE's); a bias=True model cannot have "
                             f"num_experts={E}")

    def rope_inv_freq(self):
        """RoPE's frequency for each of the hs/2 pairs, float64, for a scaled
        RoPE (rope_scaling); None for plain RoPE (theta^(-2i/hs), which the
        kernel computes itself)."""
        if self.rope_scaling == "none":
            return None
        hs, factor = self.head_size, self.rope_factor
        exponents = -2.0 * np.arange(hs // 2, dtype=np.float64) / hs
        if self.rope_scaling == "ntk":
            return (self.rope_theta * factor ** (hs / (hs - 2))) ** exponents
        freq = self.rope_theta ** exponents
        if self.rope_scaling == "linear":
            return freq / factor
        # llama3: by wavelength, against the trained context's
        wavelength = 2 * np.pi / freq
        low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
        original = self.rope_original_max
        blend = (original / wavelength - low) / (high - low)   # 0 at the long end, 1 at the short
        scaled = np.where(wavelength > original / low, freq / factor, freq)
        medium = (wavelength <= original / low) & (wavelength >= original / high)
        return np.where(medium, (1 - blend) * freq / factor + blend * freq, scaled)

    @property
    def head_size(self):
        """hs: head_dim, or C / NH when that is 0."""
        return self.head_dim or self.channels // self.num_heads

    @property
    def attn_channels(self):
        """Width of the attention's output (the q heads together): NH * hs,
        which is C unless head_dim says otherwise."""
        return self.num_heads * self.head_size

    @property
    def kv_dim(self):
        """Channels of the k (or v) heads together: NKV * hs."""
        return self.num_kv_heads * self.head_size

    @property
    def qkv_channels(self):
        """Width of the fused q, k, v projection: (NH + 2 NKV) * hs."""
        return self.attn_channels + 2 * self.kv_dim

    @property
    def fc_channels(self):
        """Width of the MLP's first projection: 2 FF for a gated MLP (W1 and
        W3 stacked), FF for the others."""
        return 2 * self.ffn_hidden if self.mlp in GATED_MLPS else self.ffn_hidden

    def is_moe_layer(self, l):
        """True if layer l's MLP is experts: (l + 1) % moe_every == 0
        (Qwen3-MoE's rule), with experts."""
        return self.num_experts > 0 and (l + 1) % self.moe_every == 0

    @property
    def moe_layers(self):
        """The layers whose MLP is experts, in order (a range)."""
        return range(self.moe_every - 1, self.num_layers, self.moe_every) \
            if self.num_experts else range(0)

    @property
    def dense_mlp_layers(self):
        """The layers with one dense MLP (fcw, fcprojw), in order: all but
        moe_layers."""
        return tuple(l for l in range(self.num_layers) if not self.is_moe_layer(l))

    @property
    def num_moe_layers(self):
        return len(self.moe_layers)

    @property
    def num_dense_mlp_layers(self):
        return self.num_layers - self.num_moe_layers

    @property
    def expert_fc_channels(self):
        """Width of an expert's first projection: 2 expert_hidden for a gated
        MLP (W1 and W3 stacked), expert_hidden for the others."""
        return (2 if self.mlp in GATED_MLPS else 1) * self.expert_hidden

    @property
    def learned_positions(self):
        return self.position == "learned"

    @property
    def second_norm(self):
        """True if a block has a second norm (ln2): all but the parallel block."""
        return self.block != "parallel"

    @property
    def is_gpt2(self):
        """True if the choices are GPT-2's (llm.c's model file can hold it)."""
        return all(getattr(self, name) == value for name, value in GPT2_CHOICES.items()) \
            and self.num_kv_heads == self.num_heads and self.ffn_hidden == 4 * self.channels \
            and self.attn_channels == self.channels and not self.qk_norm \
            and self.block == "pre" and self.sliding_window == 0 and not self.rope_interleaved \
            and self.num_experts == 0

    # llm.c's short names, so the model code reads like train_gpt2.c
    @property
    def C(self):
        return self.channels

    @property
    def L(self):
        return self.num_layers

    @property
    def NH(self):
        return self.num_heads

    @property
    def V(self):
        return self.vocab_size

    @property
    def Vp(self):
        return self.padded_vocab_size

    @property
    def maxT(self):
        return self.max_seq_len

    @property
    def NKV(self):
        return self.num_kv_heads

    @property
    def FF(self):
        return self.ffn_hidden


# GPT-2's choices: layernorm, learned positions, GELU, biases, a tied head
# (and NKV = NH, FF = 4C)
GPT2_CHOICES = dict(norm="layernorm", position="learned", mlp="gelu", bias=True,
                    tied_embeddings=True, norm_eps=float(np.float32(1e-5)))


@dataclass(frozen=True)
class LlamaConfig(TransformerConfig):
    """Llama 2's choices by default: RMSNorm, RoPE, SwiGLU, grouped-query
    attention, no biases; any field may be changed."""


@dataclass(frozen=True)
class GPT2Config(TransformerConfig):
    """GPT-2 (124M by default) as llm.c's checkpoint has it: only the sizes
    are free; the choices are GPT-2's, which llm.c's model file implies."""
    num_kv_heads: int = 0            # NKV = NH
    norm: str = GPT2_CHOICES["norm"]
    position: str = GPT2_CHOICES["position"]
    mlp: str = GPT2_CHOICES["mlp"]
    bias: bool = GPT2_CHOICES["bias"]

    def validate(self):
        super().validate()
        if not self.is_gpt2:
            raise ShapeError("GPT2Config holds GPT-2's choices (layernorm, learned, gelu, "
                             "bias, tied, num_kv_heads = num_heads, ffn_hidden = 4 channels, "
                             "norm_eps 1e-5, pre-norm blocks, no sliding window); use "
                             "LlamaConfig or "
                             "TransformerConfig for others")


@dataclass(frozen=True)
class ModelField:
    """A TransformerConfig field with its declaration (declared)."""
    name: str
    type: type
    default: object
    choices: tuple
    flag: Flag
    slot: Slot
    hf: dict
    gguf: dict
    shown: str
    always_shown: bool

    @property
    def flag_default(self):
        """The flag's default: the field's unless the flag says (a bool's flag
        is 0 or 1)."""
        default = self.default if self.flag.default is None else self.flag.default
        return int(default != self.flag.inverted) if self.type is bool else default

    def flag_options(self):
        """add_argument's keywords for the field's flag."""
        options = dict(default=self.flag_default, help=self.flag.help)
        if self.type is bool:
            return options | dict(type=int, choices=(0, 1))
        if self.choices:
            return options | dict(choices=self.choices)
        return options | dict(type=self.type)

    def from_flag(self, value):
        """The field's value for its flag's value."""
        return bool(value) != self.flag.inverted if self.type is bool else value


# every field, in the dataclass's order (describe's and the header reader's)
MODEL_FIELDS = {f.name: ModelField(f.name, f.type, f.default, **f.metadata)
                for f in fields(TransformerConfig)}
# the mixture-of-experts fields, which a dense model (num_experts 0) leaves at
# their defaults
MOE_FIELDS = ("experts_per_token", "expert_hidden", "moe_every", "norm_topk_prob",
              "router_aux_loss", "router_z_loss")
# the fields set by a flag, by the flag's dest
MODEL_FLAGS = {f.flag.dest: f for f in MODEL_FIELDS.values() if f.flag}
