"""The training CLI end to end on tiny data: resume is bitwise exact,
checkpoints follow llm.c's naming, bad input is one line and a non-zero
exit, a non-finite loss stops the run and keeps the last good checkpoint."""
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_helpers import REAL_RANKS, require_real_ranks
from llmc_py import GPT2, GPT2Config, Llama, UsageError, load_model
from llmc_py.config import GATED_MLPS, llama_ffn_hidden
from llmc_py.io import state as io_state
from llmc_py import train as train_mod
from llmc_py.train import RunFolder
from llmc_py.io import read_state
from llmc_py.data import DataLoader, write_tokens
from llmc_py.model.sampling import generate, sample_next

SMALL = ["-e", "d1", "-b", "2", "-t", "16", "-v", "4", "-m", "2", "-s", "0", "-l", "3e-3",
         "-u", "3"]


def run(shards, out_dir, *extra):
    train_glob, val_glob = shards
    return train_mod.main(["-i", train_glob, "-j", val_glob, "-o", str(out_dir), *SMALL, *extra])


def completed_steps(out_dir):
    return RunFolder(out_dir).completed_steps()


def train_losses(out_dir):
    return re.findall(r"s:(\d+) trl:(\S+)", (out_dir / "main.log").read_text())


def interrupt_at_batch(monkeypatch, n):
    """Makes the n-th training batch raise KeyboardInterrupt (Ctrl-C)."""
    real = DataLoader.next_batch
    calls = {"n": 0}

    def next_batch(self):
        if self.pattern.endswith("train_*.bin"):
            calls["n"] += 1
            if calls["n"] == n:
                raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(DataLoader, "next_batch", next_batch)


def bad_loss_at_step(monkeypatch, n, value):
    """Makes the training loss (batches of B=2) of the n-th training step's
    forward_backward ``value``."""
    real = GPT2.forward_backward
    calls = {"n": 0}

    def forward_backward(self, inputs, targets, loss_scale=1.0, **kwargs):
        loss = real(self, inputs, targets, loss_scale, **kwargs)
        if self.B == 2:
            calls["n"] += 1
            if calls["n"] == n:
                return value
        return loss
    monkeypatch.setattr(GPT2, "forward_backward", forward_backward)


@pytest.mark.parametrize("shuffle", ["0", "1"])
def test_resume_after_ctrl_c_is_bitwise_exact(shards, tmp_path, monkeypatch, capsys, shuffle):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(shards, straight, "-x", "20", "-n", "5", "-nk", "2", "--shuffle", shuffle) == 0

    interrupt_at_batch(monkeypatch, 11)            # during step 11: step 10 is the last whole one
    assert run(shards, resumed, "-x", "20", "-n", "5", "-nk", "2", "--shuffle", shuffle) == 130
    assert "checkpoint of step 10" in capsys.readouterr().out
    assert completed_steps(resumed) == [5, 10]
    monkeypatch.undo()
    assert run(shards, resumed, "-x", "20", "-n", "5", "-nk", "2", "--shuffle", shuffle,
               "-y", "1") == 0

    assert train_losses(resumed) == train_losses(straight)
    assert len(train_losses(straight)) == 20
    for step in (15, 20):
        name = f"model_{step:08d}.bin"
        assert (resumed / name).read_bytes() == (straight / name).read_bytes()


def test_a_resume_needs_only_the_output_folder_and_y_1(shards, tmp_path, monkeypatch, capsys):
    """A resume takes every flag it is not given from the run's state file,
    names in one line those whose value that sets, and is the uninterrupted
    run to the bit; a fixed flag given with another value is refused, named
    as the command line names it."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ("-x", "6", "-n", "3", "-d", "64", "--seed", "7", "--dropout", "0.1",
            "--precision", "bf16")
    assert run(shards, straight, *args) == 0
    interrupt_at_batch(monkeypatch, 9)   # during step 5 (2 micro-batches a step): 4 is saved
    assert run(shards, resumed, *args) == 130
    monkeypatch.undo()
    capsys.readouterr()
    assert train_mod.main(["-o", str(resumed), "-y", "1"]) == 0
    said = capsys.readouterr().out
    took = [line for line in said.splitlines() if line.startswith("resume: took ")]
    assert len(took) == 1 and took[0].endswith(" from the run"), said
    for flag in ("-b/--batch-size 2", "-t/--seq-len 16", "-d/--total-batch-tokens 64",
                 "-x/--max-steps 6", "-l/--learning-rate 0.003", "--seed 7", "--dropout 0.1",
                 "--precision bf16"):
        assert flag in took[0], flag
    assert "resumed from step 4" in said and "changed on resume" not in said
    assert train_losses(resumed) == train_losses(straight)
    assert (resumed / "model_00000006.bin").read_bytes() == \
        (straight / "model_00000006.bin").read_bytes()

    assert train_mod.main(["-o", str(resumed), "-y", "1", "-x", "8", "--seed", "8"]) == 1
    assert capsys.readouterr().err == (
        "error: -y 1: the run was made with --seed 7, this resume gives 8; a resumed run must "
        "keep it (start a new run in another -o to change it)\n")
    assert train_mod.main(["-o", str(resumed), "-y", "1", "-x", "8", "-d", "32"]) == 1
    assert ("the run was made with -d/--total-batch-tokens 64 (2 micro-batch(es) per step), "
            "this resume gives 32 (1)") in capsys.readouterr().err
    assert completed_steps(resumed) == [6]   # refused before anything was written (-nk 1)


def test_a_resume_takes_only_the_flags_it_was_not_given():
    from llmc_py.train.cli import parse
    from llmc_py.train.resume import take_run_flags
    from llmc_py.train import RunSpec
    saved = {"learning_rate": 1e-3, "seed": 7, "kv_heads": 2, "output_dir": "there",
             "threads": 3, "world_size": 2, "batch_size": 8}
    # from Python, a field given is one not at its default
    spec, said = take_run_flags(RunSpec(learning_rate=5e-4, output_dir="here", resume=1), saved)
    assert (spec.learning_rate, spec.seed, spec.family["kv_heads"]) == (5e-4, 7, 2)
    assert (spec.output_dir, spec.threads) == ("here", 0)   # this command line's own
    assert said == ["--seed 7", "--kv-heads 2"]   # batch_size 8 is the default: not said
    # from the command line, a flag typed is given, even with its default value
    spec, said = take_run_flags(parse(["--seed", "1337", "-y", "1"]), saved)
    assert spec.seed == 1337 and said == ["--kv-heads 2"]


def test_flag_errors_name_the_flag_as_the_command_line_does():
    from llmc_py.train.cli import parse
    from llmc_py.train import RunSpec
    with pytest.raises(UsageError, match="^-b/--batch-size must be positive, got 0$"):
        parse(["-b", "0"]).check()
    with pytest.raises(UsageError, match="^--batch-size must be positive"):
        RunSpec(batch_size=0).check()   # from Python: the long name
    with pytest.raises(UsageError, match=r"^-d/--total-batch-tokens 100 is not a "):
        parse(["-d", "100"]).grad_accum()


def test_resume_with_gradient_accumulation_and_constant_schedule(shards, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ("-d", "64", "-k", "constant", "-n", "3")
    assert run(shards, straight, "-x", "6", *args) == 0
    assert run(shards, resumed, "-x", "3", *args) == 0
    assert run(shards, resumed, "-x", "6", *args, "-y", "1") == 0
    assert train_losses(resumed) == train_losses(straight)
    assert (resumed / "model_00000006.bin").read_bytes() == \
        (straight / "model_00000006.bin").read_bytes()
    num_params = GPT2.from_checkpoint(straight / "model_00000006.bin").num_parameters
    step_a, m_a, v_a, extra_a = read_state(straight / "state_00000006.bin", num_params)
    step_b, m_b, v_b, extra_b = read_state(resumed / "state_00000006.bin", num_params)
    assert step_a == step_b == 6 and extra_a["train_loader"] == extra_b["train_loader"]
    assert np.array_equal(m_a, m_b) and np.array_equal(v_a, v_b)


def test_gradient_accumulation_matches_a_bigger_batch(shards, tmp_path):
    """-d 2*B*T with B=2 averages two micro-batches: the same gradient as one
    batch of 4 (up to fp32 rounding), so the same first loss and update."""
    train_glob, val_glob = shards
    base = ["-i", train_glob, "-j", val_glob, "-e", "d1", "-t", "16", "-x", "2", "-v", "0",
            "-s", "0", "-k", "constant", "-u", "0"]
    assert train_mod.main(base + ["-o", str(tmp_path / "a"), "-b", "2", "-d", "64"]) == 0
    assert train_mod.main(base + ["-o", str(tmp_path / "b"), "-b", "4"]) == 0
    la = [float(x) for _, x in train_losses(tmp_path / "a")]
    lb = [float(x) for _, x in train_losses(tmp_path / "b")]
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    pa = GPT2.from_checkpoint(tmp_path / "a" / "model_00000002.bin").params.memory
    pb = GPT2.from_checkpoint(tmp_path / "b" / "model_00000002.bin").params.memory
    np.testing.assert_allclose(pa, pb, rtol=0, atol=1e-5)


def test_checkpoint_files_and_keep_last(shards, tmp_path):
    out = tmp_path / "out"
    assert run(shards, out, "-x", "6", "-n", "2", "-nk", "2", "--keep-best", "0") == 0
    assert completed_steps(out) == [4, 6]
    names = sorted(p.name for p in out.iterdir())
    assert names == [".lock", "DONE_00000004", "DONE_00000006", "main.log", "model_00000004.bin",
                     "model_00000006.bin", "state_00000004.bin", "state_00000006.bin"]
    log = (out / "main.log").read_text().splitlines()
    assert re.fullmatch(r"s:1 trl:\d+\.\d+ lr:\S+ norm:\d+\.\d+", log[0])
    assert "s:4 tel:" in "\n".join(log) and "s:6 tel:" in log[-1]
    # the model file is llm.c's: it loads on its own
    assert GPT2.from_checkpoint(out / "model_00000006.bin").config.num_layers == 1


def test_plain_progress_lines(shards, tmp_path, capsys):
    assert run(shards, tmp_path / "out", "-x", "3", "-v", "0") == 0
    out = capsys.readouterr().out
    steps = re.findall(r"^step (\d+)/3: train loss (\S+) ppl (\S+) norm (\S+) lr (\S+) "
                       r"\(took (\S+) ms, (\d+) tok/s, eta (\d+:\d\d:\d\d)\)$", out, re.M)
    assert [s[0] for s in steps] == ["1", "2", "3"]
    for _, loss, ppl, *_ in steps:   # the perplexity is exp(loss)
        assert abs(float(ppl) - np.exp(float(loss))) <= 1e-4 * float(ppl)
    assert "done: 3 steps" in out


def test_perplexity_beside_every_loss_but_not_in_main_log(shards, tmp_path, capsys):
    out_dir = tmp_path / "out"
    assert run(shards, out_dir, "-x", "4") == 0   # -v 4: one evaluation, at the end
    out = capsys.readouterr().out
    (val, ppl), = re.findall(r"^step 4: val loss (\S+) \(perplexity (\S+)\)$", out, re.M)
    assert abs(float(ppl) - np.exp(float(val))) <= 1e-4 * float(ppl)
    first, last, ppl_first, ppl_last, val_s, ppl_val = re.search(
        r"train loss (\S+) -> (\S+) \(perplexity (\S+) -> (\S+)\), val loss (\S+) "
        r"\(perplexity (\S+)\)", out).groups()
    for loss, ppl in ((first, ppl_first), (last, ppl_last), (val_s, ppl_val)):
        assert abs(float(ppl) - np.exp(float(loss))) <= 0.01 * float(ppl)
    # main.log keeps llm.c's fields only
    log = (out_dir / "main.log").read_text().splitlines()
    assert all(re.fullmatch(r"s:\d+ (trl:\S+ lr:\S+ norm:\S+|tel:\S+)", line) for line in log)
    assert "ppl" not in "\n".join(log) and "perplexity" not in "\n".join(log)


def test_perplexity():
    assert train_mod.perplexity(0.0) == 1.0
    assert train_mod.perplexity(np.log(50257.0)) == pytest.approx(50257.0)
    assert train_mod.perplexity(1e4) == float("inf")   # exp overflows a float


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(shards, tmp_path, monkeypatch,
                                                             capsys):
    bad_loss_at_step(monkeypatch, 3, float("nan"))
    out = tmp_path / "out"
    assert run(shards, out, "-x", "6", "-n", "2", "-v", "0") == 1
    text = capsys.readouterr().out
    assert "not finite" in text and "last good checkpoint is step 2" in text
    assert completed_steps(out) == [2]
    assert not (out / "model_00000003.bin").exists()


def test_resume_after_a_crash_past_the_checkpoint(shards, tmp_path, monkeypatch):
    """A run that died after its last checkpoint left log lines past it; the
    resumed run replaces them and matches an uninterrupted run."""
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert run(shards, straight, "-x", "10", "-n", "5") == 0
    bad_loss_at_step(monkeypatch, 8, float("inf"))
    assert run(shards, crashed, "-x", "10", "-n", "5", "-v", "0") == 1
    monkeypatch.undo()
    assert [s for s, _ in train_losses(crashed)] == [str(i) for i in range(1, 8)]
    assert run(shards, crashed, "-x", "10", "-n", "5", "-v", "0", "-y", "1") == 0
    assert train_losses(crashed) == train_losses(straight)
    assert (crashed / "model_00000010.bin").read_bytes() == \
        (straight / "model_00000010.bin").read_bytes()


def bad_gradient_at_step(monkeypatch, n, value):
    """Makes one parameter gradient ``value`` after the n-th backward (the loss
    stays finite)."""
    real = GPT2.forward_backward
    calls = {"n": 0}

    def forward_backward(self, inputs, targets, loss_scale=1.0, **kwargs):
        loss = real(self, inputs, targets, loss_scale, **kwargs)
        calls["n"] += 1
        if calls["n"] == n:
            self.grads.memory[123] = value
        return loss
    monkeypatch.setattr(GPT2, "forward_backward", forward_backward)


def straight_run(shards, out_dir):
    """An uninterrupted run of 10 steps, checkpoints every 5: (losses, last model bytes)."""
    assert run(shards, out_dir, "-x", "10", "-n", "5", "-v", "0") == 0
    return train_losses(out_dir), (out_dir / "model_00000010.bin").read_bytes()


def resume_matches(shards, out_dir, straight):
    assert run(shards, out_dir, "-x", "10", "-n", "5", "-v", "0", "-y", "1") == 0
    assert train_losses(out_dir) == straight[0]
    assert (out_dir / "model_00000010.bin").read_bytes() == straight[1]


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_gradient_norm_stops_and_resume_is_bitwise(shards, tmp_path, monkeypatch,
                                                            capsys, value):
    straight = straight_run(shards, tmp_path / "straight")
    out = tmp_path / "out"
    bad_gradient_at_step(monkeypatch, 8, value)
    assert run(shards, out, "-x", "10", "-n", "5", "-v", "0") == 1
    text = capsys.readouterr().out
    assert f"gradient norm ({value})" in text and "not finite" in text
    assert "last good checkpoint is step 5" in text
    assert completed_steps(out) == [5] and not (out / "model_00000008.bin").exists()
    monkeypatch.undo()
    resume_matches(shards, out, straight)


def test_ctrl_c_while_saving_a_checkpoint(shards, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the middle of writing step 5's state file: the half-written
    file is dropped, the checkpoint is written whole once more, and the run
    stops cleanly; resuming continues as if nothing happened."""
    straight = straight_run(shards, tmp_path / "straight")
    out = tmp_path / "out"
    real = io_state.atomic_write
    fired = []

    def atomic_write(path, chunks, **kwargs):
        if Path(path).name == "state_00000005.bin" and not fired:
            fired.append(path)

            def interrupted():
                chunks_list = list(chunks)
                yield chunks_list[0]
                raise KeyboardInterrupt
            return real(path, interrupted(), **kwargs)
        return real(path, chunks, **kwargs)
    monkeypatch.setattr(io_state, "atomic_write", atomic_write)
    assert run(shards, out, "-x", "10", "-n", "5", "-v", "0") == 130
    assert fired and "checkpoint of step 5" in capsys.readouterr().out
    assert completed_steps(out) == [5]
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.undo()
    resume_matches(shards, out, straight)


# A training run in a child process that stops inside the writing of step
# 10's state file (after the model file), to be killed there.
_KILLED_TRAINER = r"""
import sys, time
from llmc_py import train
from llmc_py.train import run_folder

real = run_folder.write_state
def write_state(path, step, *args, **kwargs):
    if step == 10:
        print("stopped", flush=True)
        time.sleep(60)
    return real(path, step, *args, **kwargs)
run_folder.write_state = write_state
sys.exit(train.main(sys.argv[1:]))
"""


def test_trainer_killed_while_saving_resumes_from_the_last_complete_checkpoint(shards,
                                                                              tmp_path):
    straight = straight_run(shards, tmp_path / "straight")
    out = tmp_path / "out"
    train_glob, val_glob = shards
    argv = ["-i", train_glob, "-j", val_glob, "-o", str(out), *SMALL, "-x", "10", "-n", "5",
            "-v", "0"]
    child = subprocess.Popen([sys.executable, "-c", _KILLED_TRAINER, *argv],
                             stdout=subprocess.PIPE, text=True,
                             cwd=Path(train_mod.__file__).resolve().parents[2])
    try:
        lines = iter(child.stdout.readline, "")
        assert "stopped\n" in lines, "the child never reached step 10's state file"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    # step 10's model file is there, but without its state and DONE marker the
    # checkpoint is incomplete: resuming starts from step 5
    assert (out / "model_00000010.bin").exists()
    assert completed_steps(out) == [5]
    # what a kill inside atomic_write leaves; the next run removes it, and only it
    stale = out / ".state_00000010.bin.k3x_9q.tmp"
    stale.write_bytes(b"partial")
    (out / "notes.tmp").write_text("not ours")
    resume_matches(shards, out, straight)
    assert not stale.exists() and (out / "notes.tmp").exists()


@pytest.mark.parametrize("extra,message", [
    (["-t", "2000"], "max_seq_len"),
    (["-t", "200"], "fewer than one batch"),
    (["-d", "50"], "not a multiple"),
    (["-b", "0"], "must be positive"),
    (["--dropout", "1"], "--dropout must be in [0, 1), got 1.0"),
    (["--dropout-attention", "-0.1"], "--dropout-attention must be in [0, 1)"),
    (["--dropout", "0.99999999"], "1 in float32"),
])
def test_bad_settings_are_one_line_errors(shards, tmp_path, capsys, extra, message):
    assert run(shards, tmp_path / "out", "-x", "2", *extra) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_bad_files_are_one_line_errors(shards, tmp_path, capsys):
    train_glob, val_glob = shards
    out = str(tmp_path / "out")
    small = GPT2(GPT2Config(max_seq_len=16, vocab_size=100, padded_vocab_size=128,
                            num_layers=1, num_heads=1, channels=8))
    small.save_checkpoint(tmp_path / "small_vocab.bin")
    (tmp_path / "junk.bin").write_bytes(b"not a model")
    cases = [
        (["-i", str(tmp_path / "nothing_*.bin"), "-e", "d1"], "no token files match"),
        (["-i", train_glob, "-e", str(tmp_path / "small_vocab.bin")], "vocab_size is 100"),
        (["-i", train_glob, "-e", str(tmp_path / "junk.bin")], "smaller than"),
        (["-i", train_glob, "-e", str(tmp_path / "missing.bin")], "no such model file"),
    ]
    for args, message in cases:
        code = train_mod.main(["-o", out, "-s", "0", "-v", "0", "-x", "1"] + args)
        err = capsys.readouterr().err
        assert code == 1 and message in err and err.count("\n") == 1, (args, err)


def test_out_of_vocab_tokens_in_data(tmp_path, capsys):
    write_tokens(tmp_path / "train.bin", np.full(100, 50257 + 3))
    code = train_mod.main(["-i", str(tmp_path / "train.bin"), "-e", "d1", "-b", "1", "-t", "8",
                           "-x", "1", "-v", "0", "-s", "0", "-o", str(tmp_path / "out")])
    assert code == 1 and "50260" in capsys.readouterr().err


def test_a_run_from_python_is_the_cli_run(shards, tmp_path):
    """llmc_py.train.run(RunSpec(...)) with the CLI's settings writes the same
    main.log and checkpoints as the command line."""
    from llmc_py.train import RunSpec
    assert run(shards, tmp_path / "cli", "-x", "6", "-n", "3", "-nk", "2") == 0
    train_glob, val_glob = shards
    spec = RunSpec(train_data=train_glob, val_data=val_glob, output_dir=str(tmp_path / "py"),
                   init="d1", batch_size=2, seq_len=16, val_every=4, val_batches=2,
                   sample_every=0, learning_rate=3e-3, warmup_steps=3, max_steps=6,
                   checkpoint_every=3, keep_checkpoints=2)
    assert train_mod.run(spec) == 0
    for name in ("main.log", "model_00000003.bin", "model_00000006.bin"):
        assert (tmp_path / "py" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes()


def test_run_spec_has_the_command_lines_defaults():
    from llmc_py.errors import UsageError
    from llmc_py.train import RunSpec
    from llmc_py.train.cli import parse
    assert RunSpec() == parse([])
    llama = RunSpec(family={"arch": "llama", "kv_heads": 1})
    assert llama.flags() == parse(["--arch", "llama", "--kv-heads", "1"]).flags()
    with pytest.raises(UsageError, match="kv_head is not a model-family flag"):
        RunSpec(family={"kv_head": 1})


def test_learning_rate_schedules():
    parser = train_mod.build_parser()
    args = parser.parse_args(["-l", "1.0", "-u", "10", "-x", "110", "-q", "0.1"])
    assert train_mod.lr_at(5, args) == pytest.approx(0.5)
    assert train_mod.lr_at(10, args) == pytest.approx(1.0)
    assert train_mod.lr_at(60, args) == pytest.approx(0.55)     # cosine midpoint
    assert train_mod.lr_at(110, args) == pytest.approx(0.1)
    args.schedule = "linear"
    assert train_mod.lr_at(60, args) == pytest.approx(0.55)
    assert train_mod.lr_at(35, args) == pytest.approx(0.775)
    args.schedule = "constant"
    assert train_mod.lr_at(100, args) == 1.0


def test_depth_descriptors():
    c = train_mod.config_from_depth("d12")
    assert (c.num_layers, c.channels, c.num_heads, c.padded_vocab_size) == (12, 768, 12, 50304)
    c = train_mod.config_from_depth("d4")
    assert (c.num_layers, c.channels, c.num_heads) == (4, 256, 4)
    assert train_mod.config_from_depth("gpt2_124M.bin") is None


def test_sampling_is_seeded_and_greedy_is_argmax():
    model = GPT2(GPT2Config(max_seq_len=12, vocab_size=50, padded_vocab_size=64,
                            num_layers=1, num_heads=2, channels=16), seed=3)
    prompt = [1, 2, 3]
    greedy = list(generate(model, prompt, 12, temperature=0))   # runs past max_seq_len
    context = list(prompt)
    for token in greedy:
        model.forward(np.array([context[-12:]]))
        assert token == int(np.argmax(model.logits[0, -1, :50]))
        context.append(token)
    a = list(generate(model, prompt, 10, temperature=1.0, top_k=20, top_p=0.9, seed=7))
    b = list(generate(model, prompt, 10, temperature=1.0, top_k=20, top_p=0.9, seed=7))
    c = list(generate(model, prompt, 10, temperature=1.0, top_k=20, top_p=0.9, seed=8))
    assert a == b and a != c


def test_top_k_and_top_p_restrict_the_choice():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    picks = {sample_next(logits, rng, 1.0, top_k=2) for _ in range(200)}
    assert picks == {0, 1}
    picks = {sample_next(logits, rng, 1.0, top_p=0.7) for _ in range(200)}
    assert picks == {0, 1}
    picks = {sample_next(logits, rng, 1.0) for _ in range(400)}
    assert picks == {0, 1, 2, 3}


def test_sample_cli_streams_text(shards, tmp_path, monkeypatch, capsys):
    require_real_ranks()
    monkeypatch.setenv("LLMC_CACHE_DIR", str(REAL_RANKS.parent))
    monkeypatch.setenv("LLMC_OFFLINE", "1")
    from llmc_py import sample
    from llmc_py.tokenizer import get_encoding
    get_encoding.cache_clear()
    assert run(shards, tmp_path / "out", "-x", "2") == 0
    model_path = str(tmp_path / "out" / "model_00000002.bin")
    capsys.readouterr()
    args = ["-e", model_path, "--prompt", "ROMEO:", "-g", "8", "--seed", "5", "--stop-at-eot", "0"]
    assert sample.main(args + ["--temperature", "0"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("ROMEO:") and len(first) > len("ROMEO:\n")
    assert sample.main(args + ["--temperature", "0"]) == 0
    assert capsys.readouterr().out == first
    assert sample.main(["-e", str(tmp_path / "missing.bin")]) == 1
    assert "missing.bin" in capsys.readouterr().err


@pytest.mark.parametrize("choices", [
    [],                                                           # rmsnorm, rope, swiglu
    ["--position", "alibi", "--norm", "layernorm", "--mlp", "gelu", "--bias", "1",
     "--untied", "1"],
])
def test_llama_arch_trains_resumes_and_samples(shards, tmp_path, monkeypatch, capsys, choices):
    llama = ["--arch", "llama", "--kv-heads", "1", "-s", "3", "-g", "4", *choices]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(shards, straight, "-x", "6", "-n", "3", *llama) == 0
    losses = [float(x) for _, x in train_losses(straight)]
    assert len(losses) == 6 and all(np.isfinite(losses))
    model = load_model(straight / "model_00000006.bin")
    assert isinstance(model, Llama) and model.config.num_kv_heads == 1
    assert model.config.position == ("alibi" if choices else "rope")
    assert not model.config.tied_embeddings if choices else model.config.tied_embeddings
    assert "lm_head" in model.matrix_params if choices else "lm_head" not in model.params

    interrupt_at_batch(monkeypatch, 5)
    assert run(shards, resumed, "-x", "6", "-n", "3", *llama) == 130
    monkeypatch.undo()
    assert run(shards, resumed, "-x", "6", "-n", "3", *llama, "-y", "1") == 0
    assert train_losses(resumed) == train_losses(straight)
    assert (resumed / "model_00000006.bin").read_bytes() == \
        (straight / "model_00000006.bin").read_bytes()
    out = capsys.readouterr().out
    assert "(1 kv)" in out


def test_llama_choices_are_checked(shards, tmp_path, capsys):
    assert run(shards, tmp_path / "out", "-x", "1", "--arch", "llama", "--kv-heads", "3") == 1
    assert "not divisible by num_kv_heads=3" in capsys.readouterr().err


@pytest.mark.parametrize("mlp", ["geglu", "reglu", "relu", "gelu_erf"])
def test_llama_mlp_flags_reach_the_model_file(shards, tmp_path, mlp):
    out = tmp_path / "out"
    assert run(shards, out, "-x", "2", "-n", "2", "--arch", "llama", "--mlp", mlp,
               "--ffn-multiple-of", "16", "--ffn-dim-multiplier", "1.3") == 0
    c = load_model(out / "model_00000002.bin").config
    assert (c.mlp, c.ffn_multiple_of) == (mlp, 16) and abs(c.ffn_dim_multiplier - 1.3) < 1e-6
    gated = mlp in GATED_MLPS
    assert c.ffn_hidden == (llama_ffn_hidden(c.channels, 16, 1.3) if gated else 4 * c.channels)
    assert c.fc_channels == (2 if gated else 1) * c.ffn_hidden


@pytest.mark.parametrize("block", ["post", "parallel"])
def test_llama_block_flag_reaches_the_model_file(shards, tmp_path, capsys, block):
    out = tmp_path / "out"
    assert run(shards, out, "-x", "2", "-n", "2", "--arch", "llama", "--block", block,
               "--position", "sinusoidal") == 0
    config = load_model(out / "model_00000002.bin").config
    assert (config.block, config.position) == (block, "sinusoidal")
    assert f"sinusoidal, swiglu 192, {block} block" in capsys.readouterr().out


def test_sliding_window_and_rope_flags_reach_the_model_file(shards, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(shards, out, "-x", "2", "-n", "2", "--arch", "llama", "--sliding-window", "5",
               "--rope-scaling", "linear", "--rope-factor", "2", "--rope-interleaved", "1") == 0
    config = load_model(out / "model_00000002.bin").config
    assert (config.sliding_window, config.rope_scaling, config.rope_factor,
            config.rope_interleaved) == (5, "linear", 2.0, True)
    assert "window 5, rope linear x2, interleaved rope" in capsys.readouterr().out
    # a resume must keep them
    assert run(shards, out, "-x", "3", "-n", "2", "-y", "1", "--arch", "llama",
               "--sliding-window", "6") == 1
    assert ("the run was made with --sliding-window 5, this resume gives 6"
            in capsys.readouterr().err)


def test_recompute_trains_the_same_run_and_may_change_on_resume(shards, tmp_path, capsys):
    """--recompute 1 and 2 recompute activations in backward: the same losses
    and model to the bit; a resume may switch it, and says so."""
    plain, lean = tmp_path / "plain", tmp_path / "lean"
    assert run(shards, plain, "-x", "4", "-n", "2", "-v", "2") == 0
    assert run(shards, lean, "-x", "2", "-n", "2", "-v", "2", "--recompute", "2") == 0
    assert run(shards, lean, "-x", "4", "-n", "2", "-v", "2", "--recompute", "1", "-y", "1") == 0
    said = capsys.readouterr()
    assert "recompute 2 -> 1" in said.out + said.err
    assert train_losses(lean) == train_losses(plain)
    assert (lean / "model_00000004.bin").read_bytes() == \
        (plain / "model_00000004.bin").read_bytes()


def test_dropout_run_resumes_bitwise(shards, tmp_path, monkeypatch, capsys):
    """--dropout: the masks come from --seed, the step and the step's rows,
    so a run stopped and resumed (with micro-batches: -d) is the
    uninterrupted run to the bit; it differs from a run without dropout,
    and a resume must keep the checkpoint's dropout."""
    straight, resumed, plain = tmp_path / "straight", tmp_path / "resumed", tmp_path / "plain"
    args = ("-x", "8", "-n", "4", "-d", "64", "--dropout", "0.1", "--dropout-residual", "0.2")
    assert run(shards, straight, *args) == 0
    assert "dropout embedding 0.1, attention 0.1, residual 0.2" in capsys.readouterr().out
    interrupt_at_batch(monkeypatch, 13)            # during step 7: step 6 is the last whole one
    assert run(shards, resumed, *args) == 130
    monkeypatch.undo()
    assert run(shards, resumed, *args, "-y", "1") == 0
    assert len(train_losses(straight)) == 8
    assert train_losses(resumed) == train_losses(straight)
    assert (resumed / "model_00000008.bin").read_bytes() == \
        (straight / "model_00000008.bin").read_bytes()
    assert run(shards, plain, "-x", "8", "-n", "4", "-d", "64") == 0
    assert train_losses(plain) != train_losses(straight)
    capsys.readouterr()
    assert run(shards, resumed, "-x", "9", "-n", "4", "-d", "64", "--dropout", "0.1",
               "--dropout-residual", "0.1", "-y", "1") == 1
    assert ("the run was made with --dropout-residual 0.2, this resume gives 0.1"
            in capsys.readouterr().err)


def test_dropout_0_is_no_dropout_and_bf16_trains_with_dropout(shards, tmp_path):
    assert run(shards, tmp_path / "plain", "-x", "2") == 0
    assert run(shards, tmp_path / "zero", "-x", "2", "--dropout", "0") == 0
    assert (tmp_path / "zero" / "model_00000002.bin").read_bytes() == \
        (tmp_path / "plain" / "model_00000002.bin").read_bytes()
    assert run(shards, tmp_path / "bf16", "-x", "2", "--precision", "bf16", "--dropout",
               "0.1") == 0
    losses = [float(x) for _, x in train_losses(tmp_path / "bf16")]
    plain = [float(x) for _, x in train_losses(tmp_path / "plain")]
    assert np.isfinite(losses).all() and losses != plain


def test_live_progress_line_shows_perplexity():
    import io
    from llmc_py.train.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    term = Terminal()
    Progress(term).step(7, 10, 2.0, 0.5, 1e-3, 12.0, 1000.0, 3.0)
    assert term.getvalue().startswith("\rstep     7/10 | loss 2.0000 | ppl 7.39 | norm 0.500")


def scripted_val_losses(monkeypatch, losses):
    """Makes the evaluations return ``losses`` in turn (the real one runs too)."""
    from llmc_py.train import hooks, loop
    real, script = loop.evaluate, iter(losses)

    def evaluate(*args):
        real(*args)
        return next(script)
    monkeypatch.setattr(hooks, "evaluate", evaluate)


def best_info(out_dir):
    import json
    return json.loads((out_dir / "best.json").read_text())


def test_keep_best_keeps_the_best_model_beside_the_last_n(shards, tmp_path, monkeypatch,
                                                          capsys):
    straight, best = tmp_path / "straight", tmp_path / "best"
    args = ("-x", "8", "-v", "2", "-n", "2")
    assert run(shards, straight, *args, "-nk", "0", "--keep-best", "0") == 0   # llm.c's: all kept
    scripted_val_losses(monkeypatch, [3.0, 2.0, 2.5, 2.0])   # steps 2, 4, 6, 8
    assert run(shards, best, *args, "-nk", "1", "--keep-best", "1") == 0
    out = capsys.readouterr().out
    assert re.findall(r"^step (\d+): new best val loss (\S+), saved as (\S+)$", out, re.M) == \
        [("2", "3.000000", str(best / "model_best.bin")),
         ("4", "2.000000", str(best / "model_best.bin"))]   # a tie is not a new best
    assert "best val loss 2.0000 at step 4" in out
    assert completed_steps(best) == [8]   # -nk 1 removed step 4's checkpoint, not the best
    assert (best / "model_best.bin").read_bytes() == (straight / "model_00000004.bin").read_bytes()
    info = best_info(best)
    assert info["step"] == 4 and info["val_loss"] == 2.0


def test_keep_best_survives_resume(shards, tmp_path, monkeypatch, capsys):
    out_dir, straight = tmp_path / "out", tmp_path / "straight"
    assert run(shards, straight, "-x", "4", "-v", "2", "-n", "2") == 0   # -x: the schedule
    scripted_val_losses(monkeypatch, [3.0, 2.0])
    assert run(shards, out_dir, "-x", "4", "-v", "2", "-n", "2", "--keep-best", "1") == 0
    scripted_val_losses(monkeypatch, [2.5, 2.1])   # worse than the best before the resume
    assert run(shards, out_dir, "-x", "8", "-v", "2", "-n", "2", "--keep-best", "1",
               "-y", "1") == 0
    out = capsys.readouterr().out
    assert "best so far: step 4, val loss 2.000000" in out
    assert best_info(out_dir)["step"] == 4
    assert (out_dir / "model_best.bin").read_bytes() == \
        (straight / "model_00000004.bin").read_bytes()
    scripted_val_losses(monkeypatch, [1.5])   # better: replaces it
    assert run(shards, out_dir, "-x", "10", "-v", "2", "-n", "2", "--keep-best", "1",
               "-y", "1") == 0
    assert best_info(out_dir)["step"] == 10 and best_info(out_dir)["val_loss"] == 1.5
    assert (out_dir / "model_best.bin").read_bytes() == \
        (out_dir / "model_00000010.bin").read_bytes()


def test_keep_best_restarts_when_the_validation_set_changes(shards, tmp_path, monkeypatch,
                                                          capsys):
    out_dir = tmp_path / "out"
    scripted_val_losses(monkeypatch, [1.0])
    assert run(shards, out_dir, "-x", "2", "-v", "2", "--keep-best", "1") == 0
    scripted_val_losses(monkeypatch, [2.0])   # other batches: not comparable with 1.0
    assert run(shards, out_dir, "-x", "4", "-v", "4", "-m", "1", "--keep-best", "1",
               "-y", "1") == 0
    assert "measured on other validation data or batches" in capsys.readouterr().out
    assert best_info(out_dir)["step"] == 4


def test_keep_best_needs_validation_and_overwrite_removes_it(shards, tmp_path, monkeypatch,
                                                            capsys):
    out_dir = tmp_path / "out"
    assert run(shards, out_dir, "-x", "2", "-v", "0", "--keep-best", "1") == 1
    assert "--keep-best 1" in capsys.readouterr().err
    assert run(shards, out_dir, "-x", "2", "--keep-best", "1", "--overwrite") == 0
    assert (out_dir / "model_best.bin").exists() and (out_dir / "best.json").exists()
    assert run(shards, out_dir, "-x", "2") == 1   # another run's files: refused
    assert run(shards, out_dir, "-x", "2", "--keep-best", "0", "--overwrite") == 0
    assert not (out_dir / "model_best.bin").exists() and not (out_dir / "best.json").exists()
