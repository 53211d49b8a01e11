"""What a training run is asked to do: ``RunSpec``, one field per flag of
``python -m llmc_py.train`` with the same default (the parser takes its
defaults from here), the model-family flags together in ``family``.

The CLI parses its command line into a RunSpec once; from Python, give the
fields that differ: ``RunSpec(train_data="data/*.bin", max_steps=20)``.
Every state file saves ``flags()`` (with what the run derived from them):
a resume takes those it was not given and compares the rest (train.resume).
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..config import MODEL_FLAGS
from ..errors import UsageError
from ..flags import FRACTION, NON_NEGATIVE, POSITIVE, SEED, Range, check_flags, flag_name
from ..model.dropout import RATES as DROPOUT_SITES, Dropout
from ..model.transformer import INIT_STD
from .schedule import LRSchedule

DEFAULT_MODEL = "d4"            # 4 layers, 256 channels, 4 heads: 16.3M parameters


# ---- the model family: the flags of the parser's "model family" group, each
# declared once with its config field (config.MODEL_FLAGS), and --arch

def family_defaults():
    """{dest: default} of the model-family flags."""
    return {"arch": "gpt2", **{dest: f.flag_default for dest, f in MODEL_FLAGS.items()}}


# ---- the specification ----------------------------------------------------------

@dataclass(frozen=True)
class RunSpec:
    """A training run; each field is the flag of the same name (``--help``
    says what it does). Read, never changed, by the run."""
    train_data: str | None = None     # -i; None: the Shakespeare set, prepared if missing
    val_data: str | None = None       # -j
    init: str = DEFAULT_MODEL         # -e: a depth (d4), an llm.c model file or an HF folder
    tokenizer: str | None = None
    export_hf: str | None = None
    output_dir: str = "out"           # -o
    batch_size: int = 8               # -b: B, per process
    seq_len: int = 128                # -t: T
    total_batch_tokens: int = 0       # -d; 0: B*T (times the processes)
    max_steps: int = 500              # -x
    learning_rate: float = 1e-3       # -l
    warmup_steps: int = 25            # -u
    final_lr_fraction: float = 0.1    # -q
    schedule: str = "cosine"          # -k: train.schedule.SCHEDULES
    weight_decay: float = 0.1         # -c
    decay_on: str = "matrices"        # train.optimizer.DECAY_ON
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0            # 0: no clipping
    val_every: int = 50               # -v; 0: never
    val_batches: int = 10             # -m
    sample_every: int = 100           # -s; 0: never
    gen_tokens: int = 64              # -g
    sample_top_k: int = 40            # 0: the whole vocabulary
    checkpoint_every: int = 100       # -n; 0: only at the end
    keep_checkpoints: int = 1         # -nk; 0: all (llm.c's)
    keep_best: int = 1                # kept when there is validation data
    resume: int = 0                   # -y
    overwrite: bool = False
    overfit_single_batch: int = 0     # -a
    shuffle: int = 0
    seed: int = 1337
    precision: str = "fp32"           # model.PRECISIONS
    dropout: float = 0.0
    dropout_embedding: float | None = None   # None: dropout's
    dropout_attention: float | None = None
    dropout_residual: float | None = None
    recompute: int = 0
    threads: int = 0                  # 0: OpenMP's default
    init_scheme: str = "gpt2"         # model.transformer.INIT_SCHEMES
    init_std: float = INIT_STD
    zero: int = 0
    monitor_every: int = 0
    monitor_entropy_min: float = 0.1
    monitor_cosine_max: float = 0.99
    data_dir: str = "data"
    lora_rank: int = 0                # 0: full fine-tuning; R: LoRA adapters of rank R
    lora_alpha: float | None = None   # None: 2 * lora_rank
    lora_targets: str | None = None   # comma-separated (LORA_SHORT_NAMES); None: every one
    lora_dropout: float = 0.0
    lora_rslora: int = 0
    base_weights: str | None = None   # "q8_0", "q4_0": LoRA on the base quantized (QLoRA)
    # the model-family flags {dest: value}; those left out take their defaults
    family: dict = field(default_factory=dict)
    # the flags given on the command line (None: the fields not at their
    # defaults); a resume takes the others from the run (train.resume)
    explicit: frozenset | None = None
    # how the command line names each flag {dest: "-b/--batch-size"}, for
    # messages (a flag not in it: its long name)
    flag_names: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        defaults = family_defaults()
        unknown = sorted(set(self.family) - set(defaults))
        if unknown:
            raise UsageError(f"family: {', '.join(unknown)} is not a model-family flag (those "
                             f"are {', '.join(defaults)})")
        object.__setattr__(self, "family", {**defaults, **self.family})
        if self.explicit is None:
            given = {dest for dest, value in self.flags().items() if value != DEFAULTS[dest]}
            object.__setattr__(self, "explicit", frozenset(given))

    def flag(self, dest):
        """How the command line names the flag of field ``dest``: "-b/--batch-size"."""
        return self.flag_names.get(dest) or flag_name(dest)

    def flags(self):
        """{dest: value} of every flag, the model family's too: what the
        parser's namespace holds."""
        values = {f.name: getattr(self, f.name) for f in fields(self)
                  if f.name not in ("family", "explicit", "flag_names")}
        return {**values, **self.family}

    def check(self):
        """Raises UsageError naming the first flag outside its range."""
        check_flags(types.SimpleNamespace(**self.flags()), FLAG_RANGES, self.flag)

    def grad_accum(self, ranks=1):
        """Micro-batches per optimizer step, from -d (0: one), the tokens of a
        step over all ``ranks`` processes (llm.c's convention: -b is per process)."""
        bt = self.batch_size * self.seq_len * ranks
        total = self.total_batch_tokens or bt
        if total % bt:
            whose = "" if "total_batch_tokens" in self.explicit else " (the resumed run's)"
            raise UsageError(f"{self.flag('total_batch_tokens')} {total}{whose} is not a "
                             f"multiple of B*T*processes = {self.batch_size}*{self.seq_len}*"
                             f"{ranks} = {bt}")
        return total // bt

    def lr_schedule(self):
        return LRSchedule(peak=self.learning_rate, total_steps=self.max_steps,
                          warmup_steps=self.warmup_steps, kind=self.schedule,
                          final_fraction=self.final_lr_fraction)

    def dropout_masks(self):
        """The run's Dropout: --dropout at every site unless a site's own flag
        says otherwise; its masks come from --seed."""
        rates = {site: getattr(self, f"dropout_{site}") for site in DROPOUT_SITES}
        try:
            return Dropout(**{site: self.dropout if p is None else p
                              for site, p in rates.items()}, seed=self.seed)
        except ValueError as e:   # a probability that rounds to 1 in float32
            raise UsageError(f"{self.flag('dropout')}: {e}") from None

    def lora_options(self):
        """add_lora's keyword arguments from the --lora-* flags, or None
        without --lora-rank."""
        if not self.lora_rank:
            return None
        names = None if self.lora_targets is None else tuple(
            LORA_SHORT_NAMES.get(name.strip(), name.strip())
            for name in self.lora_targets.split(","))
        alpha = 2 * self.lora_rank if self.lora_alpha is None else self.lora_alpha
        return dict(rank=self.lora_rank, alpha=alpha, targets=names,
                    dropout=self.lora_dropout, seed=self.seed, rslora=bool(self.lora_rslora))

    def tokenizer_source(self):
        """Where the run's tokenizer comes from: --tokenizer, else -e when it
        is a folder (a Hugging Face model's); None for GPT-2's."""
        if self.tokenizer:
            return self.tokenizer
        return self.init if Path(self.init).is_dir() else None


# --lora-targets' short names for Hugging Face's modules; other names are taken as they are
# (GPT-2's c_attn, c_proj, c_fc, mlp.c_proj)
LORA_SHORT_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                    "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

# every flag's default, the model family's too
DEFAULTS = RunSpec(explicit=frozenset()).flags()

BELOW_ONE = Range(lo=0, hi=1, hi_open=True, text="in [0, 1)")
# every numeric flag's allowed values
FLAG_RANGES = {
    "batch_size": POSITIVE, "seq_len": POSITIVE, "total_batch_tokens": NON_NEGATIVE,
    "max_steps": POSITIVE, "learning_rate": POSITIVE, "warmup_steps": NON_NEGATIVE,
    "final_lr_fraction": FRACTION, "weight_decay": NON_NEGATIVE,
    "beta1": BELOW_ONE, "beta2": BELOW_ONE, "adam_eps": POSITIVE,
    "grad_clip": NON_NEGATIVE, "val_every": NON_NEGATIVE, "val_batches": POSITIVE,
    "sample_every": NON_NEGATIVE, "gen_tokens": POSITIVE,
    "sample_top_k": NON_NEGATIVE, "checkpoint_every": NON_NEGATIVE,
    "keep_checkpoints": NON_NEGATIVE, "seed": SEED, "threads": NON_NEGATIVE,
    **{dest: f.flag.range for dest, f in MODEL_FLAGS.items() if f.flag.range},
    "init_std": POSITIVE,
    "monitor_every": NON_NEGATIVE, "monitor_entropy_min": NON_NEGATIVE,
    "monitor_cosine_max": Range(lo=-1, hi=1, text="in [-1, 1]"),
    "lora_rank": NON_NEGATIVE, "lora_alpha": POSITIVE, "lora_dropout": BELOW_ONE,
    "dropout": BELOW_ONE, **{f"dropout_{site}": BELOW_ONE for site in DROPOUT_SITES},
}
