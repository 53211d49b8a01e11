"""The forward a measurement runs on, or reads."""
import numpy as np


def run_forward(model, tokens, targets=None):
    """The model's forward on int ``tokens`` (B, T), without keeping the
    logits but keeping every layer's activations (what a measurement
    reads); returns the mean loss against ``targets``, or None without them
    (the loss is then computed against token 0 and dropped)."""
    tokens = np.asarray(tokens)
    loss = model.forward(tokens, np.zeros_like(tokens) if targets is None else targets,
                         keep_logits=False, keep_activations=True)
    return None if targets is None else loss


def last_forward_acts(model, tokens, targets=None):
    """The activations a measurement reads: of a forward on ``tokens`` (run
    now), or with tokens None, of the model's last forward."""
    if tokens is not None:
        run_forward(model, tokens, targets)
    elif model.acts is None or model.inputs is None:
        raise RuntimeError("no forward to measure: pass tokens, or run model.forward first")
    elif not model.kept_activations:
        raise RuntimeError("the last forward kept one layer's activations "
                           "(keep_activations=False): pass tokens, or run model.forward(..., "
                           "keep_activations=True) first")
    return model.acts
