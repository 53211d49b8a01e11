"""A run's work between steps, as train.loop.Trainer hooks: each is a
callable f(trainer, result) for ``end_of_step`` (Checkpoints also has one
for ``after_step``). Run (train.runner) adds them in the order a step's lines
come: the log, the evaluation (and with it the best model), the sample,
the checkpoint."""
import math
import time
import types

from ..errors import LlmcError, UsageError, WriteError
from ..generate import stream
from .loop import evaluate, perplexity
from .progress import signal_name
from .signals import Stopped

# an end-of-text token in a sample, shown on a line of its own
END_OF_TEXT = "--- end of text ---"


def due(step, every, last_step):
    """Whether work done every ``every`` steps (0: never) and at the last is due."""
    return (every and step % every == 0) or step == last_step


class StepLog:
    """Each step's line in main.log (llm.c's format) and on the progress
    display, for steps after ``start_step`` (0, or the resumed checkpoint's)
    up to ``last_step``; the losses, for the summary."""

    def __init__(self, log, progress, start_step, last_step, tokens_per_step):
        self.log, self.progress = log, progress
        self.start_step, self.last_step = start_step, last_step
        self.tokens_per_step = tokens_per_step
        self.losses = []
        self.started = time.perf_counter()

    def __call__(self, trainer, r):
        self.losses.append(r.loss)
        apart = "".join(f" {name}:{value:.6f}" for name, value in r.parts.items())
        self.log.write(f"s:{r.step} trl:{r.loss:.6f}{apart} lr:{r.lr:.6e} norm:{r.norm:.6f}\n")
        self.log.flush()
        elapsed = time.perf_counter() - self.started
        eta = elapsed / (r.step - self.start_step) * (self.last_step - r.step)
        self.progress.step(r.step, self.last_step, r.loss, r.norm, r.lr, r.ms,
                           self.tokens_per_step / (r.ms / 1000), eta, r.parts)


class Evaluation:
    """The mean loss over the counted targets of ``batches`` validation
    batches (on every rank together) every ``every`` steps
    and at the last, in main.log and said, and offered to ``keep_best``; a
    failure is a warning. ``loss``: the latest."""

    def __init__(self, model, loader, batches, every, last_step, world, log, progress,
                 keep_best=None):
        self.model, self.loader, self.batches = model, loader, batches
        self.every, self.last_step = every, last_step
        self.world, self.log, self.progress = world, log, progress
        self.keep_best = keep_best
        self.loss = None

    def __call__(self, trainer, r):
        if not due(r.step, self.every, self.last_step):
            return
        try:
            self.loss = evaluate(self.model, self.loader, self.batches, self.world)
            self.log.write(f"s:{r.step} tel:{self.loss:.6f}\n")
            self.log.flush()
            self.progress.say(f"step {r.step}: val loss {self.loss:.6f} "
                              f"(perplexity {perplexity(self.loss):.4f})")
        except (LlmcError, ValueError) as e:
            self.progress.warn("evaluation", r.step, e)
        else:
            if self.keep_best is not None:
                self.keep_best.offer(r.step, self.loss)


class KeepBest:
    """--keep-best: the model of the lowest validation loss so far as the
    folder's model_best.bin; ``measured_on`` says what makes two losses
    comparable. A resumed run starts from the folder's best.json."""

    def __init__(self, folder, model, measured_on, signals, progress, resumed):
        self.folder, self.model, self.measured_on = folder, model, measured_on
        self.signals, self.progress = signals, progress
        self.loss = math.inf   # to beat
        self.best = folder.read_best() if resumed else None
        if self.best is None:
            return
        if self.best.get("measured_on") == measured_on:
            self.loss = self.best["val_loss"]
            progress.say(f"best so far: step {self.best.get('step')}, val loss {self.loss:.6f} "
                         f"({folder.best_of(model)})")
        else:
            progress.say(f"{folder.best_of(model)} (step {self.best.get('step')}) was measured on "
                         f"other validation data or batches: the next evaluation replaces it")

    def offer(self, step, loss):
        if loss >= self.loss:
            return
        try:
            with self.signals.deferred():
                self.folder.save_best(step, self.model, loss, self.measured_on)
        except WriteError as e:
            self.progress.warn("saving the best model", step, e)
        else:
            self.loss, self.best = loss, {"step": step}
            self.progress.say(f"step {step}: new best val loss {loss:.6f}, saved as "
                              f"{self.folder.best_of(self.model)}")


class Sampling:
    """A sample of ``tokens`` tokens after the end-of-text token, from the
    ``top_k`` likeliest tokens (0: all) at temperature 1, every ``every``
    steps and at the last; an end-of-text token sampled on the way is shown
    as a separator line (the sample goes on with a new text). A failure is a
    warning. ``rng_moved()`` is called after each, as the sampler's RNG is
    part of the run's state."""

    def __init__(self, model, encoding, tokens, top_k, every, last_step, rng, progress,
                 rng_moved):
        self.model, self.encoding, self.tokens = model, encoding, tokens
        self.top_k = top_k or None
        self.prompt = [[encoding.eot_token]]
        self.every, self.last_step = every, last_step
        self.rng, self.progress, self.rng_moved = rng, progress, rng_moved

    def __call__(self, trainer, r):
        if not due(r.step, self.every, self.last_step):
            return
        try:
            ids = [int(new[0]) for new in stream(self.model, self.prompt, self.tokens,
                                                 temperature=1.0, top_k=self.top_k,
                                                 rng=self.rng)]
            how = f"top-k {self.top_k}" if self.top_k else "the whole vocabulary"
            self.progress.say(f"step {r.step}: sample of {self.tokens} tokens after an "
                              f"end-of-text token, temperature 1, {how}:\n---\n"
                              f"{self.text(ids)}\n---")
        except (LlmcError, ValueError) as e:
            self.progress.warn("sampling", r.step, e)
        self.rng_moved()

    def text(self, ids):
        """The decoded ``ids``, each end-of-text token a line of its own."""
        eot, texts, start = self.encoding.eot_token, [], 0
        for i, token in enumerate(ids + [eot]):
            if token == eot:
                texts.append(self.encoding.decode(ids[start:i]).strip("\n"))
                start = i + 1
        return f"\n{END_OF_TEXT}\n".join(texts)


class Checkpoints:
    """Rank 0 writes a checkpoint every ``every`` steps (0: none) and at the
    last, keeping the newest ``keep`` (0: all); on a stop signal, one of the
    last step whose update finished (``start_step`` until one does). ``state_extra()``: the run's state
    beside the model and moments (data loader, RNG, settings)."""

    def __init__(self, folder, model, optimizer, state_extra, every, last_step, keep,
                 start_step, world, signals, progress, sharded):
        self.folder, self.model, self.optimizer = folder, model, optimizer
        self.state_extra = state_extra
        self.every, self.last_step, self.keep = every, last_step, keep
        self.world, self.signals, self.progress = world, signals, progress
        self.sharded = sharded
        # the last step whose update finished, and the state that goes with it
        self.finished_step, self.extra = start_step, state_extra()
        self.last_good = start_step   # the newest checkpoint written

    def step_finished(self, trainer, r):
        """An after_step hook: inside the update's guard, with it."""
        self.finished_step, self.extra = r.step, self.state_extra()

    def refresh(self):
        self.extra = self.state_extra()

    def __call__(self, trainer, r):
        if due(r.step, self.every, self.last_step):
            self.save(r.step)
            self.last_good = r.step

    def save(self, step):
        """Rank 0 writes the checkpoint, whole: ZeRO's moment shards are
        gathered first (every rank takes part in that)."""
        try:
            with self.signals.deferred():
                state = self.optimizer
                if self.sharded:
                    state = types.SimpleNamespace(m=None, v=None)
                    state.m, state.v = self.optimizer.gathered_moments()
                if self.world.is_root:
                    self.folder.save(step, self.model, state, self.extra, self.keep)
        except WriteError as e:
            intact = (f"the checkpoint of step {self.last_good} is intact" if self.last_good
                      else "no checkpoint was written before")
            raise UsageError(f"saving the checkpoint of step {step} failed: {e}; {intact} in "
                             f"{self.folder.path}; free space and resume with -y 1") from None

    def stopped(self, signum):
        """After a stop signal: the parameters, moments and ``extra`` all
        describe the last step whose update finished; saves it and raises
        Stopped. Further signals only wait for the save."""
        self.signals.hold()
        if self.finished_step > self.last_good:
            self.save(self.finished_step)
        if self.finished_step:
            self.progress.say(f"stopped by {signal_name(signum)}: checkpoint of step "
                              f"{self.finished_step} in {self.folder.path}; resume with -y 1")
        else:
            self.progress.say(f"stopped by {signal_name(signum)} before the first step "
                              f"finished; nothing saved")
        raise Stopped(signum, handled=True) from None
