"""How a mixture-of-experts model routes its tokens, from the router's own
activations (router_probs, topk_index) of a forward."""
import numpy as np

from .probe import last_forward_acts


def expert_counts(model):
    """int64 (MoE layers, E): how many of the last forward's B T k top-k
    assignments went to each expert, per MoE layer (config.moe_layers)."""
    c, a = model.config, model.acts
    N, E = model.B * model.T, c.num_experts
    counts = np.empty((c.num_moe_layers, E), np.int64)
    for m in range(c.num_moe_layers):
        chosen = a.topk_index[m].view(np.int32).reshape(-1, c.experts_per_token)[:N]
        counts[m] = np.bincount(chosen.ravel(), minlength=E)
    return counts


def entropy(p, axis=-1):
    """-sum p ln p over ``axis`` (float64; 0 ln 0 = 0)."""
    p = np.asarray(p, np.float64)
    logs = np.log(np.where(p > 0, p, 1.0))
    return -(p * logs).sum(axis=axis)


def expert_stats(model, tokens=None, targets=None):
    """Per MoE layer (lists over config.moe_layers), of a forward on
    ``tokens`` (run now) or of the model's last forward:
      expert_fraction      [Lm][E] the fraction of the B T k top-k
                           assignments each expert received (sums to 1)
      expert_max_min       [Lm] the largest fraction over the smallest
                           (inf when an expert received none; 1 balanced)
      expert_entropy       [Lm] the entropy of the fractions (nats; ln E
                           balanced, 0 all to one expert)
      router_entropy       [Lm] the mean over tokens of the entropy of the
                           router's softmax over the E experts (nats)"""
    a = last_forward_acts(model, tokens, targets)
    c = model.config
    N, E = model.B * model.T, c.num_experts
    fraction = expert_counts(model) / (N * c.experts_per_token)
    low, high = fraction.min(axis=1), fraction.max(axis=1)
    with np.errstate(divide="ignore"):
        max_min = np.where(low > 0, high / np.where(low > 0, low, 1.0), np.inf)
    router = [entropy(a.router_probs[m].reshape(-1, E)[:N]).mean()
              for m in range(c.num_moe_layers)]
    return {"expert_fraction": fraction, "expert_max_min": max_min,
            "expert_entropy": entropy(fraction), "router_entropy": np.array(router)}


class ExpertCollapse:
    """Counts the tokens each expert receives at every training step (from
    the top-k indices each micro-batch's forward left) and, once per
    monitoring interval, names the experts that received none in all of it.
    Under MPI every rank counts its own rows, and ``gather(world)`` at the
    interval's end sums them into rank 0's counts (exact: integers)."""

    def __init__(self, config):
        self.layers = config.moe_layers
        self.counts = np.zeros((len(self.layers), config.num_experts), np.int64)
        self.first_step = None

    def add(self, model, step):
        if self.first_step is None:
            self.first_step = step
        self.counts += expert_counts(model)

    def gather(self, world):
        """Rank 0's counts = every rank's summed; the others' start over."""
        total = world.sum_counts(self.counts)
        self.counts[...] = total if world.is_root else 0

    def warnings(self, step):
        """The collapsed experts of the interval ending at ``step``, as
        texts; starts the next interval."""
        found = [f"layer {self.layers[m]} expert {e} received no tokens in steps "
                 f"{self.first_step}-{step} (collapse)"
                 for m, e in zip(*np.nonzero(self.counts == 0))]
        self.counts[...] = 0
        self.first_step = None
        return found
