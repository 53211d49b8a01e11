"""Resuming a run: the newest checkpoint that loads, the flags a resume takes
from it (those it was not given), and which flags a resumed run may change
(each change said in one line) or must keep (refused)."""
import dataclasses

from ..config import MODEL_FLAGS
from ..errors import CheckpointError, UsageError
from ..model import load_model


# on resume: flags whose change would make a different run (refused), and
# flags a resumed run may change (each change said in one line)
FIXED_ON_RESUME = ("batch_size", "seq_len", "grad_accum", "shuffle", "seed",
                   "overfit_single_batch", "train_fingerprint", "dropout",
                   "dropout_embedding", "dropout_attention", "dropout_residual")
# (the model comes from the checkpoint: a model flag given must agree)
FIXED_MODEL_FLAGS = ("init", "tokenizer", "arch", *MODEL_FLAGS, "init_scheme", "init_std",
                     "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "lora_rslora",
                     "lora_base", "base_weights")
CHANGEABLE_ON_RESUME = ("max_steps", "learning_rate", "warmup_steps", "final_lr_fraction",
                        "schedule", "weight_decay", "decay_on", "beta1", "beta2", "adam_eps",
                        "grad_clip", "val_fingerprint", "val_every", "val_batches",
                        "sample_every", "gen_tokens", "sample_top_k", "checkpoint_every",
                        "keep_checkpoints", "keep_best",
                        "precision", "recompute", "world_size", "zero", "total_batch_tokens",
                        "monitor_every", "monitor_entropy_min",
                        "monitor_cosine_max")
# flags of this command line alone, never taken from the run
OWN_FLAGS = ("output_dir", "resume", "overwrite", "threads", "data_dir")


def take_run_flags(spec, saved):
    """``spec`` with every flag it was not given (but OWN_FLAGS) set to the
    resumed run's, from ``saved`` (the settings in its state file), and the
    taken flags whose value that changes, as text ("--seed 7")."""
    flags = spec.flags()
    taken = {dest: saved[dest] for dest in flags
             if dest in saved and dest not in spec.explicit and dest not in OWN_FLAGS}
    family = {dest: taken.get(dest, value) for dest, value in spec.family.items()}
    adopted = dataclasses.replace(
        spec, **{dest: value for dest, value in taken.items() if dest not in family},
        family=family)
    return adopted, [f"{spec.flag(dest)} {value}" for dest, value in taken.items()
                     if value != flags[dest]]


def resume_changes(saved, settings, spec):
    """The changeable settings that differ from the checkpoint's, as text,
    after refuse_changes."""
    refuse_changes(saved, settings, spec)
    return [f"{key} {saved[key]} -> {settings[key]}" for key in CHANGEABLE_ON_RESUME
            if key in saved and saved[key] != settings[key]]


def refuse_changes(saved, settings, spec):
    """Raises UsageError for a setting in both the run's ``saved`` and this
    resume's ``settings`` that must not change, naming its flag as ``spec``
    (the resume's RunSpec) does. Another number of processes (world_size)
    may change the micro-batches per step."""
    fixed = FIXED_ON_RESUME + FIXED_MODEL_FLAGS
    if saved.get("world_size", 1) != settings.get("world_size", 1):
        fixed = tuple(k for k in fixed if k != "grad_accum")
    for key in fixed:
        if key in saved and key in settings and saved[key] != settings[key]:
            raise UsageError(f"-y 1: {refusal(key, saved, settings, spec)}; a resumed run must "
                             f"keep it (start a new run in another -o to change it)")


def refusal(key, saved, settings, spec):
    """What differs in ``key`` between the run (``saved``) and this resume
    (``settings``), said with the flag that sets it."""
    if key == "train_fingerprint":
        return (f"the training data of {spec.flag('train_data')} {settings['train_data']} "
                f"differ from the run's")
    if key == "lora_base":
        precisions = saved.get("precision"), settings.get("precision")
        held = ("; with --precision bf16 the base is held in bf16 alone, its float32 "
                "weights rounded" if "bf16" in precisions and len(set(precisions)) == 2 else "")
        return (f"the base model of {spec.flag('init')} {settings['init']} differs from the "
                f"run's (its parameters' hash is {settings[key]}, the run's {saved[key]}"
                f"{held})")
    if key == "grad_accum":   # B and T agree (compared first): -d differs
        return (f"the run was made with {spec.flag('total_batch_tokens')} "
                f"{saved.get('total_batch_tokens')} ({saved[key]} micro-batch(es) per step), "
                f"this resume gives {settings['total_batch_tokens']} ({settings[key]})")
    return f"the run was made with {spec.flag(key)} {saved[key]}, this resume gives {settings[key]}"


def usable_checkpoint(folder, progress, precision="fp32"):
    """(step, model, m, v, extra) of the newest checkpoint that loads, the
    model in ``precision`` (None for a LoRA run's: its adapters are the
    folder's adapter_path); a newer one that does not is passed over with a
    line saying why."""
    done = folder.completed_steps()
    if not done:
        raise UsageError(f"-y 1: no complete checkpoint (DONE_*) in {folder.path}")
    for step in reversed(done):
        try:
            if folder.adapter_path(step).is_dir():   # a LoRA run's: the base is -e's
                return (step, None, *folder.read_state(step, None))
            model = load_model(folder.checkpoint_paths(step)[0], precision=precision)
            m, v, extra = folder.read_state(step, model.num_parameters)
            return step, model, m, v, extra
        except (CheckpointError, OSError) as e:
            progress.say(f"checkpoint of step {step} is unusable ({e}); trying an older one")
    raise UsageError(f"-y 1: no checkpoint in {folder.path} loads")
