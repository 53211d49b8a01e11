"""The training hook: measurements on a fixed probe batch every N steps, one
JSON line each in the run folder's metrics.jsonl.

A line's fields (lists run over layers, then heads; "layer 0" of the
representation lists is the embedding's output, layer l + 1 block l's):
  step                          the optimizer step just finished
  lr, loss, norm                its learning rate, mean train loss and global
                                gradient norm (before clipping)
  probe_loss                    the probe batch's mean loss, after the update
  attention_entropy             [L][NH] each head's mean row entropy (nats)
  attention_entropy_normalized  [L][NH] the same, each row's divided by
                                ln(t + 1) first (1 uniform, 0 one key)
  residual_ratio, mean_cosine, effective_rank
                                [L + 1] representation_stats
  grad_norm                     {tensor: [L] or a number} before clipping
                                (with experts, the dense MLPs' lists run over
                                config.dense_mlp_layers, the experts' over
                                config.moe_layers)
  grad_norm_layer               [L] over each layer's tensors together
  update_ratio                  {tensor: [L] or a number}
                                ||W_after - W_before|| / ||W_before||
  update_ratio_layer            [L] over each layer's tensors together
  with experts, moe_layers (config.moe_layers) and, per MoE layer (lists
  over moe_layers), of the probe:
  expert_fraction, expert_max_min, expert_entropy, router_entropy
                                monitors.experts.expert_stats
  aux_balance, aux_z            the auxiliary losses (model.aux_losses,
                                unweighted, mean over the MoE layers)
  warnings                      [text] thresholds crossed (also printed),
                                and each expert that received no token of
                                the training batches in all the interval's
                                steps (its collapse)
  monitor_ms                    what the measurement took (wall clock)
The numbers in lists and in the per-tensor objects carry 7 significant
digits, the others all of theirs; a non-finite number is null.
"""
import json
import math
import time

import numpy as np

from ..errors import LlmcError
from .attention import attention_entropy_rows, mean_entropy
from .experts import ExpertCollapse, expert_stats
from .parameters import gradient_norms, layer_totals, update_ratios
from .probe import run_forward
from .representation import representation_stats

METRICS_FILE = "metrics.jsonl"


def _number(x, digits):
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}") if digits else x


def jsonable(value, digits=None):
    """Arrays to nested lists, numbers to floats (None if not finite), through
    dicts and lists; the numbers inside a list or a nested dict rounded to
    ``digits`` significant digits (a record's own numbers kept whole)."""
    if isinstance(value, dict):
        inner = 7 if digits is None else digits
        return {k: jsonable(v, None if digits is None and not isinstance(v, dict) else inner)
                for k, v in value.items()}
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [jsonable(v, digits or 7) for v in value]
    if isinstance(value, (float, np.floating)):
        return _number(value, digits)
    if isinstance(value, np.integer):
        return int(value)
    return value


def read_metrics(path):
    """The measurements of a metrics.jsonl, in file order; a line that does
    not parse (the end of a line a killed run left half written) is skipped."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


def threshold_warnings(entropy, cosine, entropy_min, cosine_max):
    """The thresholds crossed, as texts: heads whose mean entropy (L, NH) is
    below ``entropy_min``, layers whose mean token cosine (L + 1,) is above
    ``cosine_max`` (either check off when None)."""
    found = []
    if entropy_min is not None:
        low = [(l, h, entropy[l, h]) for l, h in zip(*np.nonzero(entropy < entropy_min))]
        if low:
            worst = ", ".join(f"layer {l} head {h} {e:.3f}" for l, h, e in low[:4])
            more = f" and {len(low) - 4} more" if len(low) > 4 else ""
            found.append(f"attention entropy below {entropy_min:g} nats in {len(low)} "
                         f"head(s): {worst}{more}")
    if cosine_max is not None:
        high = [(i, c) for i, c in enumerate(cosine) if c > cosine_max]
        if high:
            where = ", ".join(("embedding" if i == 0 else f"layer {i - 1}") + f" {c:.3f}"
                              for i, c in high)
            found.append(f"mean token cosine above {cosine_max:g}: {where}")
    return found


class Monitor:
    """Measures ``model`` every ``every`` steps on the probe batch
    (``inputs``, ``targets``: (B, T) ints) and appends one JSON line to the
    open text file ``metrics``; ``say(text)`` prints the warnings. Install
    with ``trainer.after_backward.append(monitor.after_backward)`` and
    ``trainer.after_step.append(monitor.after_step)`` (and, with experts,
    ``trainer.after_micro_batch.append(monitor.after_micro_batch)``).

    After backward it takes the gradient norms and a copy of the parameters
    (one more parameter buffer, on measured steps only); after the update,
    the update ratios, then the probe's forward. Training reads nothing the
    probe writes: the next step's forward_backward rewrites every activation
    it uses, and the probe draws no random numbers, so a run's losses and
    parameters are bitwise those of the run without it.

    With experts it also counts, after every micro-batch of every step, the
    tokens each expert received, to name the experts that received none in
    a whole interval; or reads ``collapse``, an ExpertCollapse that the run
    fills (over all its ranks)."""

    def __init__(self, model, inputs, targets, every, metrics, *, entropy_min=None,
                 cosine_max=None, say=print, collapse=None):
        if every <= 0:
            raise ValueError(f"every must be positive, got {every}")
        self.model, self.inputs, self.targets = model, np.asarray(inputs), np.asarray(targets)
        self.every, self.metrics, self.say = every, metrics, say
        self.entropy_min, self.cosine_max = entropy_min, cosine_max
        self._pending = None   # (step, grad norms, parameters before the update, start time)
        # an ExpertCollapse that the run counts in (over its ranks), or the monitor's own
        self.counts_steps = collapse is None
        if collapse is None and model.config.num_experts:
            collapse = ExpertCollapse(model.config)
        self.collapse = collapse

    def after_micro_batch(self, trainer, step):
        if self.collapse is not None and self.counts_steps:
            self.collapse.add(self.model, step)

    def after_backward(self, trainer, step):
        if step % self.every:
            return
        t0 = time.perf_counter()
        self._pending = (step, gradient_norms(self.model), self.model.params.memory.copy(),
                         time.perf_counter() - t0)

    def after_step(self, trainer, result):
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != result.step:
            return
        step, grad_norms, before, spent = pending
        t0 = time.perf_counter()
        try:
            record = self.measure(result, grad_norms, before)
        except (LlmcError, ValueError, FloatingPointError) as e:   # as a failed evaluation
            self.say(f"step {step}: warning: the monitor failed ({type(e).__name__}: {e}); "
                     f"training goes on")
            return
        record["monitor_ms"] = (spent + time.perf_counter() - t0) * 1000
        self.metrics.write(json.dumps(jsonable(record), separators=(",", ":")) + "\n")
        self.metrics.flush()
        for text in record["warnings"]:
            self.say(f"step {step}: warning: {text}")

    def measure(self, result, grad_norms, before):
        """The record of step ``result`` (a StepResult) without monitor_ms."""
        model = self.model
        ratios, ratio_layer = update_ratios(model, before)
        del before
        probe_loss = run_forward(model, self.inputs, self.targets)
        rows = attention_entropy_rows(model)
        entropy = mean_entropy(rows)
        rep = representation_stats(model)
        experts = {}
        if self.collapse is not None:
            aux = model.aux_losses
            experts = {"moe_layers": list(model.config.moe_layers), **expert_stats(model),
                       "aux_balance": aux["balance"], "aux_z": aux["z"]}
        return {
            "step": result.step, "lr": result.lr, "loss": result.loss, "norm": result.norm,
            "probe_loss": probe_loss,
            "attention_entropy": entropy,
            "attention_entropy_normalized": mean_entropy(
                rows, normalized=True, window=model.config.sliding_window),
            **rep,
            "grad_norm": grad_norms, "grad_norm_layer": layer_totals(grad_norms, model.config),
            "update_ratio": ratios, "update_ratio_layer": ratio_layer, **experts,
            "warnings": threshold_warnings(entropy, rep["mean_cosine"], self.entropy_min,
                                           self.cosine_max)
            + (self.collapse.warnings(result.step) if self.collapse is not None else []),
        }
