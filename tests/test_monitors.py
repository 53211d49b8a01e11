"""llmc_py.monitors against PyTorch and numpy on the reference model's own
attention and hidden states; --monitor-every in training: no change to the
run, metrics.jsonl that parses and survives resume, warnings."""
import json
import re

import numpy as np
import pytest
import torch

import model_reference as ref
from data_helpers import REAL_RANKS, require_real_ranks
from helpers import TOL, assert_close
from reference import attention_entropy as ref_attention_entropy
from llmc_py import GPT2, GPT2Config, Llama, LlamaConfig, load_model
from llmc_py import monitors
from llmc_py import train as train_mod
from llmc_py.io import read_state
from llmc_py.monitors.parameters import MODEL_WIDE
from llmc_py.monitors.representation import sequence_measures
from llmc_py.train import AdamW, LRSchedule, Trainer

CONFIGS = {
    # hs = 15: no vector width divides it
    "gpt2": GPT2Config(max_seq_len=32, vocab_size=67, padded_vocab_size=128, num_layers=2,
                       num_heads=3, channels=45),
    # grouped-query attention after RoPE
    "llama_rope_gqa": LlamaConfig(max_seq_len=32, vocab_size=67, padded_vocab_size=128,
                                  num_layers=2, num_heads=4, num_kv_heads=2, channels=40),
    # ALiBi, multi-query, layernorm and GELU
    "llama_alibi_mqa": LlamaConfig(max_seq_len=32, vocab_size=67, padded_vocab_size=128,
                                   num_layers=3, num_heads=6, num_kv_heads=1, channels=48,
                                   position="alibi", norm="layernorm", mlp="gelu"),
}


def sharp_model(name, seed=0):
    """A random model whose attention is far from uniform: its qkv weights
    scaled up, so that rows range from nearly one-hot to nearly flat."""
    config = CONFIGS[name]
    model = (GPT2 if name == "gpt2" else Llama)(config, seed=seed)
    model.params.qkvw[...] *= 12.0
    return model


def reference_trace(model, tokens):
    trace = {}
    ref.forward(ref.torch_params(model.params.memory, model.config), model.config, tokens,
                trace=trace)
    return trace


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("B,T", [(1, 13), (3, 32), (2, 1)])   # odd T; B = 1; one position
def test_attention_entropy_matches_torch(rng, name, B, T):
    model = sharp_model(name)
    tokens = rng.integers(0, model.config.vocab_size, size=(B, T))
    ours = monitors.attention_entropy(model, tokens)
    ours_norm = monitors.attention_entropy(model, normalized=True)   # the same forward's
    att = reference_trace(model, tokens)["att"]
    rows = torch.stack([ref_attention_entropy(a) for a in att]).detach().numpy()   # L,B,NH,T
    assert ours.shape == (model.config.L, model.config.NH) and ours.dtype == np.float64
    assert_close("entropy", ours, rows.mean(axis=(1, 3)), TOL["attention_entropy"]["fwd"])
    if T == 1:
        assert np.isnan(ours_norm).all() and (ours == 0).all()
        return
    normalized = rows[..., 1:] / np.log(np.arange(2, T + 1))
    assert_close("normalized", ours_norm, normalized.mean(axis=(1, 3)),
                 TOL["attention_entropy"]["fwd"])
    spread = rows.mean(axis=(1, 3))
    assert spread.max() - spread.min() > 0.1, "the test's heads should differ"


def numpy_measures(X):
    """The three measures of one sequence X (T, C), by their definitions."""
    X = np.asarray(X, dtype=np.float64)
    T = X.shape[0]
    ratio = np.linalg.norm(X - X.mean(axis=0)) / np.linalg.norm(X)
    U = X / np.linalg.norm(X, axis=1, keepdims=True)
    cos = U @ U.T
    cosine = (cos.sum() - np.trace(cos)) / (T * (T - 1))
    s = np.linalg.svd(X, compute_uv=False)
    p = s / s.sum()
    p = p[p > 0]
    return ratio, cosine, np.exp(-(p * np.log(p)).sum())


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("B,T", [(1, 7), (3, 32)])   # B = 1; T odd; T < C (C >= 40)
def test_representation_stats_match_numpy(rng, name, B, T):
    model = sharp_model(name)
    tokens = rng.integers(0, model.config.vocab_size, size=(B, T))
    ours = monitors.representation_stats(model, tokens)
    hidden = reference_trace(model, tokens)["hidden"]
    assert len(hidden) == model.config.L + 1
    expected = np.array([[numpy_measures(X) for X in H.detach().numpy()] for H in hidden])
    expected = expected.mean(axis=1)                                     # (L + 1, 3)
    for j, measure in enumerate(("residual_ratio", "mean_cosine", "effective_rank")):
        # float32 hidden states against float64 ones (seen 3.3e-7, the cosine)
        assert_close(measure, ours[measure], expected[:, j], 1e-5)


def test_sequence_measures_at_the_extremes():
    rng = np.random.default_rng(2)
    v = rng.standard_normal(24)
    collapsed = np.stack([v * s for s in (1.0, 2.0, 0.5, 3.0, 1.5)])[None]   # rank one
    ratio, cosine, erank = sequence_measures(collapsed)
    assert ratio[0] < 0.7 and cosine[0] == pytest.approx(1.0, abs=1e-12)
    assert erank[0] == pytest.approx(1.0, abs=1e-6)
    same = np.tile(v, (6, 1))[None]                                     # one token, repeated
    assert sequence_measures(same)[0][0] == pytest.approx(0.0, abs=1e-12)
    orthogonal = np.eye(8, 24)[None] * 3.0                              # 8 orthogonal tokens
    ratio, cosine, erank = sequence_measures(orthogonal)
    assert cosine[0] == pytest.approx(0.0, abs=1e-12) and erank[0] == pytest.approx(8.0)
    # more tokens than channels: the other Gram matrix
    tall = rng.standard_normal((2, 50, 20)) + 0.5
    np.testing.assert_allclose(np.array(sequence_measures(tall)).T,
                               [numpy_measures(X) for X in tall], rtol=1e-10)


def test_gradient_norms_and_update_ratios_match_numpy(rng):
    model = sharp_model("llama_rope_gqa")
    x = rng.integers(0, 67, size=(2, 9))
    model.zero_grad()
    model.forward_backward(x, np.roll(x, -1, axis=1))
    norms = monitors.gradient_norms(model)
    for name, g in model.grads.items():
        g = g.astype(np.float64)
        expected = (np.linalg.norm(g) if name in MODEL_WIDE else
                    np.linalg.norm(g.reshape(g.shape[0], -1), axis=1))
        np.testing.assert_allclose(norms[name], expected, rtol=1e-12, err_msg=name)
    per_layer = monitors.layer_totals(norms)
    blocks = [n for n in model.grads.names if n not in MODEL_WIDE]
    np.testing.assert_allclose(per_layer, [np.sqrt(sum(
        np.sum(model.grads[n][l].astype(np.float64) ** 2) for n in blocks))
        for l in range(model.config.L)], rtol=1e-12)

    before = model.params.memory.copy()
    old = {name: view.astype(np.float64) for name, view in model.params.items()}
    model.update(1e-2, weight_decay=0.1, t=1)
    ratios, ratio_layer = monitors.update_ratios(model, before)
    for name, view in model.params.items():
        delta = view.astype(np.float64) - old[name]
        if name in MODEL_WIDE:
            expected = np.linalg.norm(delta) / np.linalg.norm(old[name])
        else:
            L = view.shape[0]
            expected = (np.linalg.norm(delta.reshape(L, -1), axis=1)
                        / np.linalg.norm(old[name].reshape(L, -1), axis=1))
        np.testing.assert_allclose(ratios[name], expected, rtol=1e-6, err_msg=name)
    assert np.all(np.isfinite(ratio_layer)) and np.all(ratio_layer > 0)


def test_measuring_needs_a_forward():
    model = GPT2(CONFIGS["gpt2"], seed=0)
    with pytest.raises(RuntimeError, match="forward"):
        monitors.attention_entropy(model)


# ---- in training ---------------------------------------------------------------

def trainer_losses(monitor_every, steps=6):
    """(losses, final parameters) of a few steps of the Trainer, with a Monitor
    installed when monitor_every > 0 (writing into a list)."""
    rng = np.random.default_rng(5)
    data = rng.integers(0, 67, size=(steps * 2 + 1, 2, 9))
    batches = iter([(d[:, :-1], d[:, 1:]) for d in data])
    model = sharp_model("gpt2", seed=1)
    trainer = Trainer(model, AdamW(model), LRSchedule(peak=1e-2, total_steps=steps),
                      lambda: next(batches), grad_accum=2)
    lines = []
    if monitor_every:
        class Sink:
            write, flush = lines.append, staticmethod(lambda: None)
        probe = rng.integers(0, 67, size=(3, 5))   # another shape than training's
        monitor = monitors.Monitor(model, probe, probe, monitor_every, Sink(), say=lines.append)
        trainer.after_backward.append(monitor.after_backward)
        trainer.after_step.append(monitor.after_step)
    losses = [trainer.train_step(step).loss for step in range(1, steps + 1)]
    return losses, model.params.memory.copy(), lines


def test_monitor_leaves_the_trainer_bitwise_unchanged():
    plain_losses, plain_params, _ = trainer_losses(0)
    losses, params, lines = trainer_losses(2)
    assert losses == plain_losses                     # floats compared exactly
    assert np.array_equal(params, plain_params)
    assert [json.loads(line)["step"] for line in lines] == [2, 4, 6]


SMALL = ["-e", "d2", "-b", "2", "-t", "16", "-v", "4", "-m", "2", "-s", "0", "-l", "3e-3",
         "-u", "3"]


def run(shards, out_dir, *extra):
    train_glob, val_glob = shards
    return train_mod.main(["-i", train_glob, "-j", val_glob, "-o", str(out_dir), *SMALL, *extra])


def test_monitor_every_leaves_training_bitwise_unchanged(shards, tmp_path):
    assert run(shards, tmp_path / "plain", "-x", "6") == 0
    assert run(shards, tmp_path / "monitored", "-x", "6", "--monitor-every", "2") == 0
    for name in ("main.log", "model_00000006.bin"):
        assert (tmp_path / "plain" / name).read_bytes() == \
            (tmp_path / "monitored" / name).read_bytes(), name
    # the optimizer's state too (the state file's settings name the flag itself)
    count = load_model(tmp_path / "plain" / "model_00000006.bin").num_parameters
    plain, monitored = (read_state(tmp_path / d / "state_00000006.bin", count)
                        for d in ("plain", "monitored"))
    assert plain[0] == monitored[0]
    assert np.array_equal(plain[1], monitored[1]) and np.array_equal(plain[2], monitored[2])
    for key in ("train_loader", "sample_rng"):
        assert plain[3][key] == monitored[3][key]
    assert not (tmp_path / "plain" / "metrics.jsonl").exists()


def read_steps(log):
    return re.findall(r"s:(\d+) trl:", log.read_text()) if log.exists() else []


def read_records(out_dir):
    return monitors.read_metrics(out_dir / "metrics.jsonl")


def test_metrics_jsonl_fields(shards, tmp_path):
    assert run(shards, tmp_path / "out", "-x", "4", "--monitor-every", "2") == 0
    records = read_records(tmp_path / "out")
    assert [r["step"] for r in records] == [2, 4]
    L, NH = 2, 2   # d2
    log = dict(re.findall(r"s:(\d+) trl:(\S+)", (tmp_path / "out" / "main.log").read_text()))
    for r in records:
        assert f"{r['loss']:.6f}" == log[str(r["step"])]
        assert np.array(r["attention_entropy"]).shape == (L, NH)
        assert np.array(r["attention_entropy_normalized"]).shape == (L, NH)
        entropy = np.array(r["attention_entropy"])
        assert ((entropy > 0) & (entropy < np.log(16))).all()
        for measure in ("residual_ratio", "mean_cosine", "effective_rank"):
            assert len(r[measure]) == L + 1
        assert set(r["grad_norm"]) == set(r["update_ratio"]) == set(GPT2(
            GPT2Config(num_layers=1, num_heads=1, channels=8), seed=0).params.names)
        assert len(r["grad_norm"]["qkvw"]) == L and isinstance(r["grad_norm"]["wte"], float)
        assert len(r["grad_norm_layer"]) == len(r["update_ratio_layer"]) == L
        assert r["probe_loss"] > 0 and r["monitor_ms"] > 0 and r["warnings"] == []


def test_metrics_jsonl_survives_resume(shards, tmp_path, monkeypatch):
    """A run that died past its last checkpoint left measurements past it (and
    half a line); the resumed run replaces them: no step missing or twice,
    each the uninterrupted run's."""
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    common = ("-x", "10", "-n", "5", "--monitor-every", "2")
    assert run(shards, straight, *common) == 0
    real = GPT2.forward_backward

    def inf_at_step_8(model, inputs, targets, loss_scale=1.0, **kwargs):
        loss = real(model, inputs, targets, loss_scale, **kwargs)
        return float("inf") if len(read_steps(crashed / "main.log")) == 7 else loss
    monkeypatch.setattr(GPT2, "forward_backward", inf_at_step_8)
    assert run(shards, crashed, *common) == 1                      # stops at step 8
    monkeypatch.undo()
    with open(crashed / "metrics.jsonl", "a") as f:
        f.write('{"step":8,"attention_ent')                       # killed mid-line
    assert [r["step"] for r in read_records(crashed)] == [2, 4, 6]
    assert run(shards, crashed, *common, "-y", "1") == 0           # from step 5
    resumed, expected = read_records(crashed), read_records(straight)
    assert [r["step"] for r in resumed] == [2, 4, 6, 8, 10]
    for a, b in zip(resumed, expected):
        a.pop("monitor_ms"), b.pop("monitor_ms")
        assert a == b, a["step"]
    assert (crashed / "metrics.jsonl").read_text().endswith("}\n")


def test_monitor_warnings_are_printed_and_recorded(shards, tmp_path, capsys):
    assert run(shards, tmp_path / "out", "-x", "2", "--monitor-every", "1",
               "--monitor-entropy-min", "50", "--monitor-cosine-max", "-1") == 0
    out = capsys.readouterr().out
    assert re.search(r"step 1: warning: attention entropy below 50 nats in 4 head\(s\): "
                     r"layer 0 head 0 \d", out)
    assert "step 2: warning: mean token cosine above -1: embedding" in out
    assert all(len(r["warnings"]) == 2 for r in read_records(tmp_path / "out"))
    assert run(shards, tmp_path / "quiet", "-x", "2", "--monitor-every", "1",
               "--monitor-entropy-min", "0", "--monitor-cosine-max", "1") == 0
    assert ": warning:" not in capsys.readouterr().out


def test_monitor_needs_validation_data(shards, tmp_path, capsys):
    train_glob, _ = shards
    assert train_mod.main(["-i", train_glob, "-o", str(tmp_path / "out"), *SMALL,
                           "--monitor-every", "2"]) == 1
    assert "--monitor-every" in capsys.readouterr().err
    assert run(shards, tmp_path / "out", "--monitor-every", "-1") == 1
    assert "--monitor-every" in capsys.readouterr().err


def test_inspect_draws_every_head_and_prints_entropies(shards, tmp_path, monkeypatch, capsys):
    require_real_ranks()
    monkeypatch.setenv("LLMC_CACHE_DIR", str(REAL_RANKS.parent))
    monkeypatch.setenv("LLMC_OFFLINE", "1")
    from llmc_py import inspect
    from llmc_py.tokenizer import get_encoding
    get_encoding.cache_clear()
    path = tmp_path / "model.bin"                           # 3 layers, 6 heads, ALiBi
    llama = Llama(LlamaConfig(**{**CONFIGS["llama_alibi_mqa"].__dict__, "vocab_size": 50257,
                                 "padded_vocab_size": 50304}), seed=0)
    llama.params.qkvw[...] *= 12.0
    llama.save_checkpoint(path)
    png = tmp_path / "att.png"
    prompt = "ROMEO: But soft, what light"
    assert inspect.main([str(path), "--prompt", prompt, "--layer", "2", "-o", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = out.splitlines()
    T = len(get_encoding().encode(prompt))
    assert lines[0] == f"{T} tokens, 3 layers x 6 heads"
    table = [line for line in lines if re.match(r"[ *]layer ", line)]
    assert [line[:9] for line in table] == [" layer  0", " layer  1", "*layer  2"]
    printed = np.array([[float(v) for v in re.findall(r"(\d+\.\d+) \(", line)]
                        for line in table])
    ids = np.array([get_encoding().encode(prompt)])
    expected = monitors.attention_entropy(llama, ids)
    np.testing.assert_allclose(printed, expected, atol=0.006)   # printed to 2 decimals
    maps = inspect.attention_maps(llama, 2)
    assert maps.shape == (6, T, T) and np.allclose(maps.sum(-1), 1, atol=1e-5)
    assert inspect.main([str(path), "--prompt", prompt, "--layer", "3"]) == 1
    assert "--layer 3" in capsys.readouterr().err
    elsewhere = tmp_path / "elsewhere"                      # without -o: beside the model
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert inspect.main([str(path), "--prompt", prompt, "--layer", "1"]) == 0
    beside = tmp_path / "attention_layer1.png"
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {beside}"
    assert beside.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not any(elsewhere.iterdir())


def test_attention_maps_have_a_colour_bar():
    from llmc_py import inspect
    from llmc_py.plot import pyplot
    maps = np.tril(np.ones((3, 4, 4), np.float32))
    maps /= maps.sum(-1, keepdims=True)
    fig = inspect.draw(pyplot("test"), maps, list("abcd"), [0.5, 0.6, 0.7], "model: layer 0")
    heatmaps = [ax.images[0] for ax in fig.axes if ax.images]
    assert len(heatmaps) == 3                               # one per head, sharing one bar
    bar = heatmaps[-1].colorbar
    assert bar is not None and bar.ax in fig.axes and bar.ax.get_ylabel() == "attention probability"
    assert bar.vmin == 0.0 and bar.vmax == 1.0


def test_a_failing_measurement_is_a_warning(shards, tmp_path, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise ValueError("no probe today")
    monkeypatch.setattr(monitors.Monitor, "measure", fail)
    assert run(shards, tmp_path / "out", "-x", "2", "--monitor-every", "1") == 0
    out = capsys.readouterr().out
    assert "step 2: warning: the monitor failed (ValueError: no probe today); training goes " \
        "on" in out
    assert read_records(tmp_path / "out") == []
