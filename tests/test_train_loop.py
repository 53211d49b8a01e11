"""The training loop's parts on their own: the AdamW object against
model.update, the schedule, the run folder, Trainer's hooks, and the CLI with
llm.c's optimizer settings against a plain model.update loop."""
import re

import numpy as np
import pytest

from llmc_py import GPT2, Dropout, GPT2Config, Llama, LlamaConfig
from llmc_py import train as train_mod
from llmc_py.data import DataLoader, write_tokens
from llmc_py.train import AdamW, LRSchedule, RunFolder, Trainer

TINY = GPT2Config(max_seq_len=16, vocab_size=67, padded_vocab_size=128, num_layers=2,
                  num_heads=2, channels=32)


def batch(rng, config, B=2, T=8):
    tokens = rng.integers(0, config.vocab_size, size=(B, T + 1))
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("make", [lambda: GPT2(TINY, seed=3),
                                  lambda: Llama(LlamaConfig(max_seq_len=16, vocab_size=67,
                                                            padded_vocab_size=128, num_layers=1,
                                                            num_heads=4, num_kv_heads=2,
                                                            channels=32, tied_embeddings=False),
                                                seed=3)])
@pytest.mark.parametrize("decay_on", ["all", "matrices"])
def test_adamw_object_equals_model_update_bitwise(rng, make, decay_on):
    x, y = batch(rng, TINY)
    ours, plain = make(), make()
    optimizer = AdamW(ours, beta1=0.8, beta2=0.99, eps=1e-7, weight_decay=0.1,
                      decay_on=decay_on)
    decay = None if decay_on == "all" else plain.matrix_params
    for t in (1, 2, 3):
        for model in (ours, plain):
            model.zero_grad()
            model.forward(x, y)
            model.backward()
        optimizer.step(1e-2, t)
        plain.update(1e-2, 0.8, 0.99, 1e-7, 0.1, t, decay=decay)
        assert np.array_equal(ours.params.memory, plain.params.memory)
    assert np.array_equal(optimizer.m, plain.m_memory)
    assert np.array_equal(optimizer.v, plain.v_memory)


def test_adamw_decays_only_matrices_when_asked():
    model = GPT2(TINY, seed=0)
    model.grads.zero()   # a zero gradient: only the decay moves parameters
    before = {name: model.params[name].copy() for name in model.params.names}
    AdamW(model, weight_decay=0.5, decay_on="matrices").step(0.1, 1)
    moved = {name for name in model.params.names
             if not np.array_equal(model.params[name], before[name])}
    assert moved == set(model.matrix_params) == {"wte", "wpe", "qkvw", "attprojw", "fcw",
                                                 "fcprojw"}
    with pytest.raises(ValueError, match="decay_on"):
        AdamW(model, decay_on="biases")


def test_adamw_moments_restore():
    model = GPT2(TINY, seed=0)
    optimizer = AdamW(model)
    m = np.arange(model.num_parameters, dtype=np.float32)
    optimizer.load_moments(m, 2 * m)
    assert np.array_equal(optimizer.m, m) and np.array_equal(optimizer.v, 2 * m)


def test_schedule_shapes_and_checks():
    cosine = LRSchedule(peak=1.0, total_steps=110, warmup_steps=10, final_fraction=0.1)
    assert [cosine(s) for s in (5, 10, 110, 200)] == pytest.approx([0.5, 1.0, 0.1, 0.1])
    assert cosine(60) == pytest.approx(0.55)
    linear = LRSchedule(1.0, 110, 10, "linear", 0.1)
    assert linear(35) == pytest.approx(0.775)
    assert LRSchedule(2.0, 10, 0, "constant")(7) == 2.0
    for bad in (dict(kind="step"), dict(peak=0.0), dict(peak=float("nan")),
                dict(final_fraction=1.5), dict(warmup_steps=-1), dict(total_steps=0)):
        with pytest.raises(ValueError):
            LRSchedule(**{**dict(peak=1.0, total_steps=10), **bad})


def test_run_folder_keeps_the_last_checkpoints_and_truncates_the_log(tmp_path):
    model = GPT2(TINY, seed=0)
    optimizer = AdamW(model)
    folder = RunFolder(tmp_path / "run")
    folder.create()
    for step in (1, 2, 3):
        folder.save(step, model, optimizer, {"step": step}, keep=2)
    assert folder.completed_steps() == [2, 3]
    assert not any(p.exists() for p in folder.checkpoint_paths(1))
    m, v, extra = folder.read_state(3, model.num_parameters)
    assert extra == {"step": 3} and np.array_equal(m, optimizer.m)

    folder.log_path.write_text("s:1 trl:1.0\ns:2 trl:2.0\ns:2 tel:2.5\ns:10 trl:3.0\n")
    folder.truncate_log(2)
    assert folder.log_path.read_text() == "s:1 trl:1.0\ns:2 trl:2.0\ns:2 tel:2.5\n"

    (folder.path / ".state_00000004.bin.abc.tmp").write_bytes(b"x")
    (folder.path / ".model_best.bin.abc.tmp").write_bytes(b"x")
    (folder.path / ".best.json.abc.tmp").write_bytes(b"x")
    (folder.path / "notes.tmp").write_bytes(b"mine")
    assert folder.remove_stale_temporaries() == 3
    assert (folder.path / "notes.tmp").exists()

    # the best model: beside the checkpoints, never removed by keep
    assert folder.read_best() is None
    folder.save_best(2, model, 4.5, {"val_batches": 3})
    folder.save(4, model, optimizer, {"step": 4}, keep=1)
    assert folder.completed_steps() == [4]
    assert folder.read_best() == {"step": 2, "val_loss": 4.5, "measured_on": {"val_batches": 3}}
    assert folder.best_path.read_bytes() == folder.checkpoint_paths(4)[0].read_bytes()
    assert {"model_best.bin", "best.json"} <= {p.name for p in folder.run_files()}
    folder.best_path.unlink()   # a best.json without its model is no best
    assert folder.read_best() is None


def test_trainer_hooks_see_the_gradients_before_clipping(rng):
    """after_backward runs once the step's gradients are whole and before the
    norm is taken (where an all-reduce goes): doubling them there doubles the
    norm the step reports. after_step gets each applied step's result."""
    x, y = batch(rng, TINY)
    norms = {}
    for double in (False, True):
        model = GPT2(TINY, seed=1)
        trainer = Trainer(model, AdamW(model), LRSchedule(1e-3, 10, warmup_steps=10),
                          lambda: (x, y), grad_accum=2, grad_clip=0)
        seen = []
        if double:
            trainer.after_backward.append(lambda t, step: t.model.grads.memory.__imul__(2))
        trainer.after_step.append(lambda t, result: seen.append(result))
        result = trainer.train_step(1)
        assert seen == [result] and result.finite and result.lr == pytest.approx(1e-4)
        norms[double] = result.norm
    assert norms[True] == pytest.approx(2 * norms[False], rel=1e-6)


def test_trainer_dropout_masks_follow_the_steps_rows(rng):
    """With dropout, a step of 2 micro-batches of 2 rows draws the masks of
    one batch of 4 (each micro-batch's rows placed by row0), so it has that
    step's loss and gradient up to float32 sums; another step, other masks."""
    x, y = batch(rng, TINY, B=4)
    dropout = Dropout(embedding=0.1, attention=0.2, residual=0.1, seed=7)
    results = {}
    for accum in (1, 2):
        model = GPT2(TINY, seed=1)
        halves = iter([(x[:2], y[:2]), (x[2:], y[2:])])
        trainer = Trainer(model, AdamW(model), LRSchedule(1e-3, 10),
                          (lambda: (x, y)) if accum == 1 else (lambda: next(halves)),
                          grad_accum=accum, grad_clip=0, dropout=dropout)
        results[accum] = trainer.train_step(3), model.grads.memory.copy()
    (one, grads_one), (two, grads_two) = results[1], results[2]
    assert two.loss == pytest.approx(one.loss, rel=1e-6)
    np.testing.assert_allclose(grads_two, grads_one, rtol=0,
                               atol=1e-5 * np.abs(grads_one).max())
    model = GPT2(TINY, seed=1)
    other = Trainer(model, AdamW(model), LRSchedule(1e-3, 10), lambda: (x, y), grad_clip=0,
                    dropout=dropout).train_step(4)
    assert other.loss != one.loss


def test_trainer_skips_the_update_on_a_non_finite_loss(rng):
    x, y = batch(rng, TINY)
    model = GPT2(TINY, seed=1)
    trainer = Trainer(model, AdamW(model), LRSchedule(1e-3, 10), lambda: (x, y))
    trainer.after_backward.append(lambda t, step: t.model.grads.memory.__setitem__(0, np.inf))
    before = model.params.memory.copy()
    result = trainer.train_step(1)
    assert not result.finite and np.array_equal(model.params.memory, before)


def test_cli_with_llmc_optimizer_settings_equals_a_plain_update_loop(tmp_path):
    """llm.c's train_gpt2.c: betas 0.9/0.999, decay on every parameter, no
    clipping, a constant rate. The CLI's step losses and final parameters
    equal a plain model.update loop on the same batches, bitwise."""
    rng = np.random.default_rng(0)
    write_tokens(tmp_path / "train.bin", rng.integers(0, 50257, size=400))
    B, T, steps, lr, wd = 2, 16, 4, 3e-3, 0.1
    out = tmp_path / "out"
    argv = ["-i", str(tmp_path / "train.bin"), "-o", str(out), "-e", "d1", "-b", str(B),
            "-t", str(T), "-x", str(steps), "-v", "0", "-s", "0", "-l", str(lr), "-c", str(wd),
            "--beta2", "0.999", "--decay-on", "all", "--grad-clip", "0", "-k", "constant",
            "-u", "0", "--seed", "5"]
    assert train_mod.main(argv) == 0
    cli_losses = re.findall(r"s:\d+ trl:(\S+)", (out / "main.log").read_text())

    model = GPT2(train_mod.config_from_depth("d1"), seed=5)
    loader = DataLoader(str(tmp_path / "train.bin"), B, T, seed=5)
    losses = []
    for t in range(1, steps + 1):
        model.zero_grad()
        losses.append(f"{model.forward(*loader.next_batch()):.6f}")
        model.backward()
        model.update(lr, 0.9, 0.999, 1e-8, wd, t)
    assert cli_losses == losses
    saved = GPT2.from_checkpoint(out / f"model_{steps:08d}.bin")
    assert np.array_equal(saved.params.memory, model.params.memory)


@pytest.mark.parametrize("flag,value", [("--beta1", "1.0"), ("--beta2", "-0.1"),
                                        ("--adam-eps", "0")])
def test_cli_rejects_bad_optimizer_settings(tmp_path, capsys, flag, value):
    code = train_mod.main(["-i", str(tmp_path / "none.bin"), "-o", str(tmp_path / "out"),
                           flag, value])
    err = capsys.readouterr().err
    assert code == 1 and flag in err and err.count("\n") == 1
