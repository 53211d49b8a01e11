"""python -m llmc_py.eval: loss and perplexity at several context lengths,
with sliding windows that score every target once; a learned-position model
asked past its table is a clear error. Its loss and training's validation
loss are one mean over the counted targets (train.loop.validation_loss)."""
import dataclasses
import io
import re
import types

import numpy as np
import pytest

import torch

from llmc_py import GPT2, IGNORE_INDEX, Llama, UsageError
from llmc_py import eval as evaluation
from llmc_py.data import write_tokens
from llmc_py.io.tokens import write_mask
from llmc_py.train.distributed import Solo
from llmc_py.train.hooks import Evaluation
from test_gpt2_step import SMALL
from test_llama_step import BASE

ROPE = dataclasses.replace(BASE, max_seq_len=16)   # RoPE goes past its max_seq_len


@pytest.mark.parametrize("n", [2, 9, 17, 40])
def test_windows_score_every_target_once(n):
    for length in range(1, n):
        for stride in range(1, length + 1):
            spans = evaluation.windows(n, length, stride)
            scored = [begin + j + 1 for begin, first in spans for j in range(first, length)]
            assert scored == list(range(1, n)), (n, length, stride, spans)
            # every window but the first leaves at least length - stride of context
            assert all(first >= length - stride for _, first in spans[1:-1])


def test_windows_refuse_what_cannot_be():
    with pytest.raises(UsageError, match="stride"):
        evaluation.windows(100, 8, 9)
    with pytest.raises(ValueError, match="a window of 8 needs 9"):
        evaluation.windows(8, 8, 8)


def test_one_window_is_the_models_forward():
    model = Llama(ROPE, seed=3)
    tokens = np.random.default_rng(3).integers(0, ROPE.vocab_size, 25).astype(np.int32)
    loss, counted, n = evaluation.evaluate_length(model, tokens, 24)
    assert (counted, n) == (24, 1)
    assert loss == model.forward(tokens[None, :-1], tokens[None, 1:])


def test_side_by_side_windows_average_every_target():
    """Stride = length: each window is a forward of its own; the loss is the
    mean over all targets (not the mean of window means: the last window
    scores fewer)."""
    model = GPT2(SMALL, seed=4)
    tokens = np.random.default_rng(4).integers(0, SMALL.vocab_size, 30).astype(np.int32)
    loss, counted, n = evaluation.evaluate_length(model, tokens, 8)
    assert (counted, n) == (29, 4)
    sums = []
    for begin in (0, 8, 16):
        model.forward(tokens[None, begin:begin + 8], tokens[None, begin + 1:begin + 9])
        sums.append(model.acts.losses.astype(np.float64).sum())
    model.forward(tokens[None, 21:29], tokens[None, 22:30])   # the last 8: 5 new targets
    sums.append(model.acts.losses[0, 3:].astype(np.float64).sum())
    assert abs(loss - sum(sums) / 29) <= 1e-6 * loss
    # windows in batches give the same loss
    batched, _, _ = evaluation.evaluate_length(model, tokens, 8, batch_size=3)
    assert abs(batched - loss) <= 1e-6 * loss


def test_a_sliding_window_scores_with_more_context():
    """With stride 1 each target after the first window is scored with the
    full length of context: its loss is the last position's of that window."""
    model = Llama(ROPE, seed=5)
    tokens = np.random.default_rng(5).integers(0, ROPE.vocab_size, 14).astype(np.int32)
    loss, counted, n = evaluation.evaluate_length(model, tokens, 6, stride=1)
    assert (counted, n) == (13, 8)
    model.forward(tokens[None, :6], tokens[None, 1:7])
    total = model.acts.losses.astype(np.float64).sum()
    for begin in range(1, 8):
        model.forward(tokens[None, begin:begin + 6], tokens[None, begin + 1:begin + 7])
        total += float(model.acts.losses[0, -1])
    assert abs(loss - total / 13) <= 1e-6 * loss


def write_text(tmp_path, vocab, n):
    tokens = np.random.default_rng(6).integers(0, vocab, n)
    write_tokens(tmp_path / "val_000.bin", tokens[:n // 2])
    write_tokens(tmp_path / "val_001.bin", tokens[n // 2:])
    return str(tmp_path / "val_*.bin"), tokens


def test_cli_table(tmp_path, capsys):
    model = Llama(ROPE, seed=7)
    model.save_checkpoint(tmp_path / "rope.bin")
    data, tokens = write_text(tmp_path, ROPE.vocab_size, 101)
    # 32 is past max_seq_len 16: RoPE extrapolates
    assert evaluation.main([str(tmp_path / "rope.bin"), data, "--lengths", "8", "32",
                            "--stride", "4", "-b", "2"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^ +(\d+) +(\d+) +(\d+) +(\d+) +(\S+) +(\S+)$", out, re.M)
    assert [r[:4] for r in rows] == [("8", "4", "24", "100"), ("32", "4", "18", "100")]
    for length, *_, loss, ppl in rows:
        assert abs(float(ppl) - np.exp(float(loss))) <= 1e-3 * float(ppl)
        expected, _, _ = evaluation.evaluate_length(model, tokens.astype(np.int32),
                                                    int(length), 4)
        assert abs(float(loss) - expected) <= 1e-4


def test_learned_positions_past_their_table_is_a_clear_error(tmp_path, capsys):
    GPT2(SMALL).save_checkpoint(tmp_path / "gpt2.bin")   # max_seq_len 32
    data, _ = write_text(tmp_path, SMALL.vocab_size, 200)
    assert evaluation.main([str(tmp_path / "gpt2.bin"), data, "--lengths", "16", "64"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --lengths 64: past the model's learned position table "
                          "(max_seq_len 32)") and err.count("\n") == 1
    with pytest.raises(UsageError, match="max_seq_len 32"):
        evaluation.evaluate_length(GPT2(SMALL), np.zeros(100, np.int32), 33)
    Llama(ROPE).save_checkpoint(tmp_path / "rope.bin")
    data, _ = write_text(tmp_path, ROPE.vocab_size, 200)
    assert evaluation.main([str(tmp_path / "rope.bin"), data, "--lengths", "250"]) == 1
    assert "the text has 200 tokens; a window of 250 needs 251" in capsys.readouterr().err


# ---- one validation mean, in training and in eval ----------------------------------

class Batches:
    """A validation loader over fixed (inputs, targets) batches of B rows."""

    def __init__(self, batches):
        self.batches, self.B, self.files = batches, len(batches[0][0]), []
        self.num_batches, self.position = len(batches), 0

    def reset(self):
        self.position = 0

    def next_batch(self):
        self.position += 1
        return self.batches[self.position - 1]


def test_a_loss_mask_beside_the_tokens_leaves_its_targets_unscored(tmp_path, capsys):
    """Token files with NAME.mask beside them (llmc_py.data --jsonl): eval
    scores only the targets the mask trains, as the training loader does."""
    model = Llama(ROPE, seed=10)
    model.save_checkpoint(tmp_path / "rope.bin")
    data, tokens = write_text(tmp_path, ROPE.vocab_size, 61)
    trained = np.random.default_rng(10).integers(0, 2, 61).astype(np.uint8)
    write_mask(tmp_path / "val_000.mask", trained[:30])
    write_mask(tmp_path / "val_001.mask", trained[30:])
    assert evaluation.main([str(tmp_path / "rope.bin"), data, "--lengths", "12"]) == 0
    row = re.search(r"^ +12 +12 +(\d+) +(\d+) +(\S+) ", capsys.readouterr().out, re.M)
    assert int(row.group(2)) == int(trained[1:].sum())
    tokens = tokens.astype(np.int32)
    x = np.stack([tokens[b:b + 12] for b in range(0, 60, 12)])
    y = np.stack([tokens[b + 1:b + 13] for b in range(0, 60, 12)])
    y[np.stack([trained[b + 1:b + 13] for b in range(0, 60, 12)]) == 0] = IGNORE_INDEX
    assert abs(float(row.group(3)) - reference_mean(model, [(x, y)])) <= 1e-4


def masked_batches(config, n, B, T, seed):
    """n batches of (inputs, targets) whose rows count from T targets down to
    one (the others IGNORE_INDEX): batches and rows of unequal weight."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(n):
        tokens = rng.integers(0, config.vocab_size, (B, T + 1)).astype(np.int32)
        y = tokens[:, 1:].copy()
        for row in range(B):
            y[row, rng.permutation(T)[:rng.integers(0, T)]] = IGNORE_INDEX
        batches.append((tokens[:, :-1].copy(), y))
    return batches


def reference_mean(model, batches):
    """torch: the sum of every counted target's cross-entropy (from the
    model's logits) over their number."""
    total, counted = 0.0, 0
    for x, y in batches:
        model.forward(x, y)
        logits = torch.from_numpy(np.array(model.logits[..., :model.config.vocab_size]))
        losses = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).double(), torch.from_numpy(y).long().reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="none")
        total += float(losses.sum())
        counted += int((torch.from_numpy(y) != IGNORE_INDEX).sum())
    return total / counted


def training_evaluation(model, batches):
    """The loss the training run's Evaluation hook logs for ``batches``."""
    log = io.StringIO()
    quiet = types.SimpleNamespace(say=lambda text: None, warn=pytest.fail)
    hook = Evaluation(model, Batches(batches), len(batches), 1, 1, Solo(), log, quiet)
    hook(None, types.SimpleNamespace(step=1))
    assert log.getvalue() == f"s:1 tel:{hook.loss:.6f}\n"
    return hook.loss


def test_training_and_eval_take_one_mean_over_counted_targets():
    """A validation set with masked targets: the training run's evaluation
    and eval's give the same number, the mean over the counted targets
    (not the mean of batch means, which is further from it than rounding)."""
    model = GPT2(SMALL, seed=8)
    batches = masked_batches(SMALL, 3, 2, 8, seed=8)
    reference = reference_mean(model, batches)
    in_training = training_evaluation(model, batches)
    assert abs(in_training - reference) <= 1e-6 * reference
    batch_means = np.mean([model.forward(x, y) for x, y in batches])
    assert abs(batch_means - reference) > 1e-4 * reference   # the masks do weigh
    # eval's windows with a stride below their length mask the targets scored before
    tokens = np.random.default_rng(9).integers(0, SMALL.vocab_size, 40).astype(np.int32)
    spans = evaluation.windows(len(tokens), 8, 3)
    windows = list(evaluation.window_batches(tokens, 8, spans, 2))
    assert any((y == IGNORE_INDEX).any() for _, y in windows)
    loss, counted, _ = evaluation.evaluate_length(model, tokens, 8, 3, batch_size=2)
    assert counted == len(tokens) - 1
    assert loss == training_evaluation(model, windows)
    assert abs(loss - reference_mean(model, windows)) <= 1e-6 * loss


def test_every_target_ignored_is_a_warning_not_a_number():
    model = GPT2(SMALL, seed=8)
    x, y = masked_batches(SMALL, 1, 2, 8, seed=8)[0]
    said = []
    hook = Evaluation(model, Batches([(x, np.full_like(y, IGNORE_INDEX))]), 1, 1, 1, Solo(),
                      io.StringIO(), types.SimpleNamespace(
                          say=pytest.fail, warn=lambda what, step, e: said.append(str(e))))
    hook(None, types.SimpleNamespace(step=1))
    assert hook.loss is None and said == ["every validation target is IGNORE_INDEX: no loss "
                                          "to average"]
