"""One optimizer step, with seams: ``Trainer.train_step`` runs the micro-batches'
forward and backward, then the hooks after backward (where gradients would be
reduced across processes), clipping, the schedule's learning rate and the
optimizer, then the hooks after the step (metrics, monitors)."""
import contextlib
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .._native import kernels as K
from .distributed import Solo


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float      # the mean of the step's micro-batches' mean losses
    norm: float      # the global gradient norm before clipping
    lr: float        # 0.0 when the step was not applied
    ms: float
    finite: bool     # False: the loss or norm was inf or NaN and no update was made
    # with experts, the loss's parts (each the mean over micro-batches and
    # ranks): "ce" the cross-entropy, "balance" and "z" the auxiliary losses
    # (model.aux_losses, unweighted); empty for a dense model
    parts: dict = field(default_factory=dict)


class Trainer:
    """Trains ``model`` with ``optimizer`` (train.optimizer.AdamW) by
    ``schedule`` (step -> learning rate) on ``next_batch()`` -> (inputs,
    targets); ``grad_accum`` micro-batches per step, gradients clipped to a
    global norm of ``grad_clip`` (0: never).

    A step's loss and gradient average its micro-batches' (llm.c's way):
    each micro-batch's mean over its counted targets (those not
    IGNORE_INDEX) weighs 1/grad_accum, however many targets it counts.

    ``after_micro_batch``: callables f(trainer, step), run after each
    micro-batch's forward_backward (its activations still there).
    ``after_backward``: callables f(trainer, step), run once the step's
    gradients are complete, before the norm is taken. ``after_step``:
    callables f(trainer, result), run after each step that was applied.
    ``update_guard``: a context manager factory around the update and the
    after_step hooks, so that they run whole or not at all (a run holds
    stop signals there). ``end_of_step``: callables f(trainer, result), run
    after that guard for each step that was applied (a run's log, its
    evaluations, samples and checkpoints, which a stop signal may cut short).

    ``world`` (train.distributed; default one process): the loss is the mean
    over its ranks, and with an optimizer that updates a shard (``span``,
    ZeRO-1) the gradient norm is the shards' together. Reducing the
    gradients is an after_backward hook's work.

    ``dropout`` (model.dropout.Dropout; its seed is the run's): the masks of
    step s are Dropout.at_step(s, row0) with row0 each micro-batch's first
    row among the step's rows over all ranks, so that a step's masks depend
    on the step and the rows alone: a resumed run draws the same ones, and
    so does a run that splits its rows over other ranks or micro-batches."""

    def __init__(self, model, optimizer, schedule, next_batch, *, grad_accum=1, grad_clip=1.0,
                 update_guard=contextlib.nullcontext, world=None, dropout=None):
        self.model, self.optimizer, self.schedule = model, optimizer, schedule
        self.next_batch = next_batch
        self.grad_accum, self.grad_clip = grad_accum, grad_clip
        self.update_guard = update_guard
        self.world = Solo() if world is None else world
        self.dropout = dropout if dropout is not None and dropout.active else None
        self.after_micro_batch = []
        self.after_backward = []
        self.after_step = []
        self.end_of_step = []

    def train_step(self, step):
        """Optimizer step ``step`` (1-based); returns its StepResult. A step
        whose loss or gradient norm is not finite leaves the parameters as
        they were (finite=False)."""
        model, n = self.model, self.grad_accum
        t0 = time.perf_counter()
        model.zero_grad()
        loss = 0.0
        parts = {}
        for micro in range(n):
            x, y = self.next_batch()
            with model.balance_over(self.world):
                loss += model.forward_backward(x, y, loss_scale=1.0 / n,
                                               dropout=self._dropout_at(step, micro, len(x))) / n
            for hook in self.after_micro_batch:
                hook(self, step)
            if model.config.num_experts:
                for name, value in (("ce", model.ce_loss), *model.aux_losses.items()):
                    parts[name] = parts.get(name, 0.0) + value / n
        loss = self.world.mean(loss)
        parts = {name: self.world.mean(value) for name, value in parts.items()}
        for hook in self.after_backward:
            hook(self, step)
        norm = self._clip_grad_norm()
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return StepResult(step, loss, norm, 0.0, (time.perf_counter() - t0) * 1000, False,
                              parts)
        lr = self.schedule(step)
        with self.update_guard():
            self.optimizer.step(lr, step)
            result = StepResult(step, loss, norm, lr, (time.perf_counter() - t0) * 1000, True,
                                parts)
            for hook in self.after_step:
                hook(self, result)
        for hook in self.end_of_step:
            hook(self, result)
        return result


    def _dropout_at(self, step, micro, B):
        """The dropout of micro-batch ``micro`` (of B rows on each rank) of
        step ``step``, or None."""
        if self.dropout is None:
            return None
        world = self.world
        return self.dropout.at_step(step, row0=(micro * world.size + world.rank) * B)

    def _clip_grad_norm(self):
        """The global gradient norm, before clipping the gradients to grad_clip."""
        model, span = self.model, getattr(self.optimizer, "span", None)
        if span is None:   # every rank holds all of the (averaged) gradients
            norm = model.grad_norm()
        else:
            shard = model.trained[1].memory[span[0]:span[1]]
            norm = math.sqrt(self.world.sum(K.global_norm_squared(shard)))
        if 0 < self.grad_clip < norm:
            K.scale_inplace(model.trained[1].memory, self.grad_clip / norm)
        return norm


def perplexity(loss):
    """exp(loss): the perplexity of a mean cross-entropy in nats (inf when
    it overflows a float, NaN for a NaN loss)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def validation_loss(model, batches, world=None):
    """(mean cross-entropy, targets counted) of ``model`` over the counted targets
    (not IGNORE_INDEX) of ``batches``, (inputs, targets) pairs, on every rank
    of ``world`` together: the sum of their losses over their number, each
    summed over the ranks (not a mean of batch means, which would weigh a
    target by how many others its batch counts). ValueError if none counts.
    No backward follows, so each forward keeps one layer's activations."""
    world = Solo() if world is None else world
    sums, counted = [], 0
    for inputs, targets in batches:
        model.forward(inputs, targets, keep_logits=False, keep_activations=False)
        loss = model.ce_loss   # without a model's auxiliary losses (experts)
        sums.append(loss * model.counted)   # the batch's sum, from its mean over counted targets
        counted += model.counted
    total, counted = world.sum(np.sum(sums)), round(world.sum(counted))
    if not counted:
        raise ValueError("every validation target is IGNORE_INDEX: no loss to average")
    return total / counted, counted


def evaluate(model, loader, batches, world=None):
    """The mean loss over the counted targets of the first ``batches``
    batches of ``loader`` (validation_loss), over the ranks of ``world``."""
    loader.reset()
    return validation_loss(model, (loader.next_batch() for _ in range(batches)), world)[0]
