"""See inside a model while it trains (python -m llmc_py.train --monitor-every N).

- attention_entropy(model, tokens): (L, NH), each head's mean entropy of its
  causal attention rows, computed by the attention kernel from the scores and
  the softmax's saved row statistics (attention_gqa_entropy), never from
  (T, T) probabilities. Attention entropy collapse precedes unstable training
  (Zhai et al. 2023).
- representation_stats(model, tokens): per layer (the embedding, then each
  block's output) the residual ratio ||X - 1 mean(X)|| / ||X|| (distance from
  rank one, Dong et al. 2021), the mean cosine between a sequence's token
  vectors (Noci et al. 2022) and the effective rank (Roy and Vetterli 2007).
- gradient_norms(model), update_ratios(model, before): per tensor and layer,
  from the buffers after backward and after the update.
- expert_stats(model, tokens): per MoE layer, the fraction of the top-k
  assignments each expert received (their max/min ratio and entropy) and
  the mean entropy of the router's softmax; ExpertCollapse names the experts
  that received no token in a whole monitoring interval.
- Monitor: the training hook that measures all of it on a fixed probe batch
  every N steps and appends one JSON line per measurement to metrics.jsonl.

Each measurement function takes tokens (B, T) and runs the model's forward
on them first, or, with tokens None, reads the activations of the model's
last forward (or forward_backward).
"""
from .attention import attention_entropy, attention_entropy_rows
from .experts import ExpertCollapse, expert_stats
from .parameters import gradient_norms, layer_totals, update_ratios
from .representation import representation_stats
from .run import METRICS_FILE, Monitor, read_metrics

__all__ = ["attention_entropy", "attention_entropy_rows", "representation_stats",
           "expert_stats", "ExpertCollapse",
           "gradient_norms", "update_ratios", "layer_totals", "Monitor", "read_metrics",
           "METRICS_FILE"]
