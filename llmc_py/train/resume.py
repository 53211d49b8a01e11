"""Resuming a run: the newest checkpoint that loads, and which flags a resumed
run may change (each change said in one line) or must keep (refused)."""
from ..config import MODEL_FLAGS
from ..errors import CheckpointError, UsageError
from ..model import load_model


# on resume: flags whose change would make a different run (refused), and
# flags a resumed run may change (each change said in one line)
FIXED_ON_RESUME = ("batch_size", "seq_len", "grad_accum", "shuffle", "seed",
                   "overfit_single_batch", "train_fingerprint", "dropout",
                   "dropout_embedding", "dropout_attention", "dropout_residual")
# (a model flag given on resume must agree: the model comes from the checkpoint)
FIXED_MODEL_FLAGS = ("init", "tokenizer", "arch", *MODEL_FLAGS, "init_scheme", "init_std")
CHANGEABLE_ON_RESUME = ("max_steps", "learning_rate", "warmup_steps", "final_lr_fraction",
                        "schedule", "weight_decay", "decay_on", "beta1", "beta2", "adam_eps",
                        "grad_clip", "val_fingerprint", "val_every", "val_batches",
                        "sample_every", "gen_tokens", "sample_top_k", "checkpoint_every",
                        "keep_checkpoints", "keep_best",
                        "precision", "recompute", "world_size", "zero", "total_batch_tokens",
                        "monitor_every", "monitor_entropy_min",
                        "monitor_cosine_max")


def resume_changes(saved, settings, explicit):
    """The changeable settings that differ from the checkpoint's, as text;
    raises UsageError for one that must not change. ``explicit`` names the
    flags given on this command line (a model flag left at its default is
    not a change: the model comes from the checkpoint). Another number of
    processes (world_size) may change the micro-batches per step too."""
    fixed = FIXED_ON_RESUME
    if saved.get("world_size", 1) != settings.get("world_size", 1):
        fixed = tuple(k for k in fixed if k != "grad_accum")
    for key in fixed + tuple(k for k in FIXED_MODEL_FLAGS if k in explicit):
        if key in saved and saved[key] != settings[key]:
            what = ("the training data differ from the checkpoint's"
                    if key == "train_fingerprint" else
                    f"the checkpoint was made with {key}={saved[key]}, this run has "
                    f"{settings[key]}")
            raise UsageError(f"-y 1: {what}; a resumed run must keep it (start a new run "
                             f"in another -o to change it)")
    return [f"{key} {saved[key]} -> {settings[key]}" for key in CHANGEABLE_ON_RESUME
            if key in saved and saved[key] != settings[key]]


def usable_checkpoint(folder, progress, precision="fp32"):
    """(step, model, m, v, extra) of the newest checkpoint that loads, the
    model in ``precision``; a newer one that does not is passed over with a
    line saying why."""
    done = folder.completed_steps()
    if not done:
        raise UsageError(f"-y 1: no complete checkpoint (DONE_*) in {folder.path}")
    for step in reversed(done):
        try:
            model = load_model(folder.checkpoint_paths(step)[0], precision=precision)
            m, v, extra = folder.read_state(step, model.num_parameters)
            return step, model, m, v, extra
        except (CheckpointError, OSError) as e:
            progress.say(f"checkpoint of step {step} is unusable ({e}); trying an older one")
    raise UsageError(f"-y 1: no checkpoint in {folder.path} loads")
