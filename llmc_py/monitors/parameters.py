"""Per-layer gradient norms and update-to-weight ratios, from the model's
flat buffers: the gradients after backward, the parameters before and after
the update."""
import math

import numpy as np

from .._native import kernels as K

# parameter tensors that belong to no block: one number each, not one per layer
MODEL_WIDE = ("wte", "wpe", "lnfw", "lnfb", "lm_head")
# block tensors with a row for some layers only: the dense MLPs' and the experts'
DENSE_MLP = ("fcw", "fcb", "fcprojw", "fcprojb")
EXPERTS = ("routerw", "expertfcw", "expertprojw")


def _norm(x):
    return math.sqrt(K.global_norm_squared(x.reshape(-1)))


def tensor_norms(group):
    """{name: norm} over a TensorGroup (params or grads): a float64 (L,) of
    per-layer L2 norms for a block's tensor, a float for a model-wide one."""
    out = {}
    for name, view in group.items():
        if name in MODEL_WIDE:
            out[name] = _norm(view)
        else:
            out[name] = np.array([_norm(view[l]) for l in range(view.shape[0])])
    return out


def gradient_norms(model):
    """tensor_norms of the model's gradients (what backward left in them: in
    training, before clipping)."""
    return tensor_norms(model.grads)


def tensor_layers(config, name):
    """The layers a block tensor's rows belong to, in order: with experts the
    dense MLPs' rows are config.dense_mlp_layers', the experts'
    config.moe_layers'; every other block tensor has one row per layer."""
    if config.num_experts and name in DENSE_MLP:
        return list(config.dense_mlp_layers)
    if config.num_experts and name in EXPERTS:
        return list(config.moe_layers)
    return list(range(config.num_layers))


def layer_totals(norms, config=None):
    """float64 (L,): each layer's norm over all of its tensors, from
    tensor_norms' per-layer entries (each placed at its layers by
    ``config``, which a model with experts needs)."""
    per_layer = {name: v for name, v in norms.items() if isinstance(v, np.ndarray)}
    if config is None or not config.num_experts:
        return np.sqrt(np.sum(np.square(list(per_layer.values())), axis=0))
    squares = np.zeros(config.num_layers)
    for name, v in per_layer.items():
        squares[tensor_layers(config, name)] += np.square(v)
    return np.sqrt(squares)


def update_ratios(model, before):
    """({name: ||after - before|| / ||before||} per tensor, as tensor_norms
    lays them out; float64 (L,) of the same ratio over each layer's tensors
    together) for the model's parameters now against ``before``, a flat copy
    of model.params.memory taken before the update. A tensor whose norm was 0
    (a bias at its zero start) gets inf, or NaN if it did not move."""
    params = model.params
    old = type(params)(model.param_specs, model.config, memory=before)
    change, size = {}, {}
    for name, view in params.items():
        delta = view - old[name]
        if name in MODEL_WIDE:
            change[name], size[name] = _norm(delta), _norm(old[name])
        else:
            change[name] = np.array([_norm(delta[l]) for l in range(view.shape[0])])
            size[name] = np.array([_norm(old[name][l]) for l in range(view.shape[0])])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = {name: np.divide(change[name], size[name]) for name in change}
        ratios = {name: float(r) if name in MODEL_WIDE else r for name, r in ratios.items()}
        per_layer = (layer_totals(change, model.config)
                     / layer_totals(size, model.config))
    return ratios, per_layer
