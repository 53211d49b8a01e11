"""The mixture-of-experts monitors: each MoE layer's expert fractions against
a count of the model's own top-k indices, the router's entropy, the auxiliary
losses in metrics.jsonl, the collapse warning, the plot's panel."""
import dataclasses
import json

import numpy as np
import pytest

from llmc_py import monitors
from llmc_py.monitors.experts import entropy, expert_counts, expert_stats
from llmc_py.train import AdamW, Trainer
from test_llama_step import BASE, make_model
from test_moe_model import MOE

# layer 0 dense, layers 1 and 3 experts (moe_every 2)
CONFIG = dataclasses.replace(MOE, num_layers=4, moe_every=2, ffn_hidden=40)


def test_expert_stats_count_the_models_own_topk():
    model = make_model(CONFIG, seed=3)
    rng = np.random.default_rng(0)
    B, T = 3, 7
    stats = expert_stats(model, rng.integers(0, 67, (B, T)))
    E, k = CONFIG.num_experts, CONFIG.experts_per_token
    a = model.acts
    for m in range(2):
        chosen = a.topk_index[m].view(np.int32).reshape(-1, k)[:B * T]
        counts = np.array([(chosen == e).sum() for e in range(E)])
        np.testing.assert_array_equal(stats["expert_fraction"][m], counts / (B * T * k))
        f = counts / (B * T * k)
        assert stats["expert_max_min"][m] == pytest.approx(f.max() / f.min())
        assert stats["expert_entropy"][m] == pytest.approx(-(f * np.log(f)).sum())
        p = a.router_probs[m].reshape(-1, E)[:B * T].astype(np.float64)
        assert stats["router_entropy"][m] == pytest.approx(-(p * np.log(p)).sum(1).mean())
    assert entropy([1.0, 0.0]) == 0.0


def monitored(model, steps, every, *, lr=1e-2, grad_accum=1, keep=None):
    """(metrics records, printed lines, probe) of ``steps`` Trainer steps on
    random batches (``grad_accum`` per step, appended to ``keep``) with a
    Monitor every ``every``."""
    rng = np.random.default_rng(5)
    data = rng.integers(0, 67, size=(steps * grad_accum, 2, 9))
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    if keep is not None:
        keep += batches
    batches = iter(batches)
    trainer = Trainer(model, AdamW(model), lambda step: lr, lambda: next(batches),
                      grad_accum=grad_accum)
    lines, said = [], []

    class Sink:
        write, flush = lines.append, staticmethod(lambda: None)
    probe = rng.integers(0, 67, size=(3, 5))
    monitor = monitors.Monitor(model, probe, probe, every, Sink(), say=said.append)
    trainer.after_micro_batch.append(monitor.after_micro_batch)
    trainer.after_backward.append(monitor.after_backward)
    trainer.after_step.append(monitor.after_step)
    for step in range(1, steps + 1):
        trainer.train_step(step)
    monitored.monitor = monitor
    return [json.loads(line) for line in lines], said, probe


def test_metrics_have_the_experts_of_the_probe():
    model = make_model(CONFIG, seed=3)
    records, said, probe = monitored(model, 4, 2)
    assert [r["step"] for r in records] == [2, 4] and said == []
    last = records[-1]
    # the probe's forward again on the final parameters: the same numbers
    stats = expert_stats(model, probe, probe)
    for field, value in stats.items():
        written = np.array(last[field], dtype=float)   # null (not finite) -> NaN
        np.testing.assert_allclose(written, np.where(np.isfinite(value), value, np.nan),
                                   rtol=1e-6, err_msg=field)
    aux = model.aux_losses
    assert last["aux_balance"] == aux["balance"] and last["aux_z"] == aux["z"]
    assert np.array(last["expert_fraction"]).shape == (2, CONFIG.num_experts)


def test_a_dense_model_has_no_expert_fields():
    model = make_model(BASE, seed=3)
    records, _, _ = monitored(model, 2, 2)
    assert "expert_fraction" not in records[0] and "aux_balance" not in records[0]


def test_collapse_warns_once_per_interval_naming_layer_and_expert():
    # a zero router ties every expert: the lower index wins, so top-1 sends
    # every token to expert 0; no update moves it (learning rate 0)
    model = make_model(dataclasses.replace(CONFIG, experts_per_token=1), seed=3)
    model.params["routerw"][...] = 0.0
    records, said, _ = monitored(model, 4, 2, lr=0.0)
    expected = [f"layer {l} expert {e} received no tokens in steps {a}-{b} (collapse)"
                for a, b in ((1, 2), (3, 4)) for l in (1, 3) for e in (1, 2)]
    assert [w for r in records for w in r["warnings"]] == expected
    assert said == [f"step {w.split('-')[1].split()[0]}: warning: {w}" for w in expected]


def test_collapse_counts_every_micro_batch():
    model = make_model(CONFIG, seed=3)
    batches = []
    monitored(model, 1, 2, lr=0.0, grad_accum=3, keep=batches)   # step 1 of 2: not measured
    counted = monitored.monitor.collapse.counts
    expected = 0
    for x, y in batches:                     # the same parameters (learning rate 0)
        model.forward(x, y)
        expected = expected + expert_counts(model)
    np.testing.assert_array_equal(counted, expected)
    assert counted.sum() == 3 * 2 * 8 * CONFIG.experts_per_token * 2   # 3 micro-batches, 2 layers


def test_no_collapse_warning_when_every_expert_gets_tokens():
    model = make_model(CONFIG, seed=3)
    records, said, _ = monitored(model, 4, 2)
    # (the 15 probe tokens may miss an expert: the warning counts the training batches')
    assert said == [] and all(r["warnings"] == [] for r in records)


def test_layer_totals_place_the_dense_and_expert_tensors_at_their_layers():
    model = make_model(CONFIG, seed=3)
    rng = np.random.default_rng(1)
    x = rng.integers(0, 67, (2, 8))
    model.forward_backward(x, x)
    totals = monitors.layer_totals(monitors.gradient_norms(model), model.config)
    dense, moe = list(CONFIG.dense_mlp_layers), list(CONFIG.moe_layers)
    assert dense == [0, 2] and moe == [1, 3]
    for l in range(CONFIG.num_layers):
        squares = 0.0
        for name, view in model.grads.items():
            if name in monitors.parameters.MODEL_WIDE:
                continue
            rows = (dense if name.startswith("fc") else moe if name in
                    ("routerw", "expertfcw", "expertprojw") else list(range(4)))
            if l in rows:
                squares += np.square(view[rows.index(l)].astype(np.float64)).sum()
        assert totals[l] == pytest.approx(np.sqrt(squares), rel=1e-6)


def test_plot_has_the_experts_panels(shards, tmp_path, capsys):
    import matplotlib.colors
    from llmc_py import plot
    from llmc_py import train as train_mod
    train_glob, val_glob = shards
    out = tmp_path / "out"
    assert train_mod.main(["-i", train_glob, "-j", val_glob, "-o", str(out), "--arch", "llama",
                           "-e", "d2", "--experts", "3", "--experts-per-token", "1",
                           "--expert-hidden", "16", "--moe-every", "2",
                           "--router-aux-loss", "0.01", "--router-z-loss", "0.001",
                           "-b", "2", "-t", "16", "-x", "2", "-v", "0", "-s", "0",
                           "--monitor-every", "1"]) == 0
    records = monitors.read_metrics(out / monitors.METRICS_FILE)
    assert [r["moe_layers"] for r in records] == [[1], [1]]
    fig = plot.plot_monitors(plot.pyplot("test"), records, plot.read_curves(out)[0], "m")
    assert len(fig.axes) == 12
    assert [ax.get_title() for ax in fig.axes[8:]] == [
        "expert load (fraction x E): busiest, -- idlest",
        "expert load entropy / ln E (1 balanced)",
        "router entropy (nats), mean over tokens", "auxiliary losses (unweighted)"]
    layer1 = {matplotlib.colors.to_hex(line.get_color()) for line in fig.axes[1].get_lines()
              if line.get_label().startswith("layer 1")}
    busiest, idlest = fig.axes[8].get_lines()
    assert {matplotlib.colors.to_hex(busiest.get_color())} == layer1   # the layer's colour
    np.testing.assert_allclose(busiest.get_ydata(),
                               [3 * max(r["expert_fraction"][0]) for r in records])
    np.testing.assert_allclose(idlest.get_ydata(),
                               [3 * min(r["expert_fraction"][0]) for r in records])
    np.testing.assert_allclose(fig.axes[11].get_lines()[0].get_ydata(),
                               [r["aux_balance"] for r in records])
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "load-balancing loss" in labels and "router z-loss" in labels
    assert plot.main([str(out)]) == 0 and (out / "monitors.png").exists()
