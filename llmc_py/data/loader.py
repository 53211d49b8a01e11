"""The DataLoader over llm.c's token shards (io.tokens)."""
import glob
import os

import numpy as np

from ..errors import DataError, ShapeError
from ..io.tokens import (IGNORE_INDEX, check_manifest, first_out_of_vocab, mask_path, read_mask,
                         read_mask_header, read_tokens, read_tokens_header)


class DataLoader:
    """Batches of B*T+1 consecutive tokens from the shards matching ``pattern``.

    ``next_batch()`` returns (inputs, targets), int32 (B, T), where targets
    are inputs shifted by one token, as in llm.c. A shard holds
    (ntok - 1) // (B*T) windows; the tokens after its last window are unused.

    Sequential (default): shards in sorted order, windows advancing by B*T;
    after the last shard the next epoch starts again at the first.
    Shuffled (``shuffle=True``): each epoch visits the shards in a permuted
    order and each shard's windows in a permuted order. The permutations are
    drawn from numpy Generators seeded by (seed, epoch[, shard]) rather than
    from one running stream, so the position (epoch, shard_pos, batch_pos) is
    the whole state: ``state_dict()`` is a small dict of ints that
    ``load_state_dict`` restores exactly.

    A shard with a loss mask beside it (NAME.mask, io.tokens) has its
    untrained targets set to IGNORE_INDEX, which the loss skips.

    Every shard's header and size, and its folder's manifest if it has one
    (io.tokens), are checked here; with ``vocab_size`` the token ids of a
    shard are checked when it is first opened.
    """

    def __init__(self, pattern, B, T, *, shuffle=False, seed=0, vocab_size=None):
        for name, value in (("B", B), ("T", T)):
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ShapeError(f"DataLoader: {name} must be a positive int, got {value!r}")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise DataError(f"DataLoader: seed must be a non-negative int, got {seed!r}")
        self.pattern = str(pattern)
        self.B, self.T = int(B), int(T)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.files = sorted(glob.glob(os.path.expanduser(self.pattern)))
        if not self.files:
            raise DataError(f"DataLoader: no token files match {self.pattern!r}")
        window = self.B * self.T + 1
        self.shard_tokens = []
        for path in self.files:
            check_manifest(path)
            ntok = read_tokens_header(path)
            if ntok < window:
                raise DataError(f"{path}: has {ntok} tokens, fewer than one batch needs "
                                f"(B*T+1 = {self.B}*{self.T}+1 = {window}); use a smaller "
                                f"batch or sequence length")
            mask = mask_path(path)
            masked = read_mask_header(mask) if mask.exists() else ntok
            if masked != ntok:
                raise DataError(f"{mask}: masks {masked} tokens, but its token file holds {ntok}")
            self.shard_tokens.append(ntok)
        # windows per shard, as llm.c: (ntok - 1) // (B*T)
        self.shard_batches = [(n - 1) // (self.B * self.T) for n in self.shard_tokens]
        self._checked = set()     # shards whose token ids were checked
        self._open_index, self._open_tokens, self._open_mask = None, None, None
        self._shard_order_epoch, self._shard_order = None, None
        self._window_order_key, self._window_order = None, None
        self.reset()

    @property
    def num_shards(self):
        return len(self.files)

    @property
    def num_batches(self):
        """Batches per epoch."""
        return sum(self.shard_batches)

    @property
    def tokens_per_epoch(self):
        """Input tokens served per epoch (num_batches * B * T)."""
        return self.num_batches * self.B * self.T

    def reset(self):
        """Back to the first batch of epoch 0."""
        self.epoch, self.shard_pos, self.batch_pos = 0, 0, 0

    # -- order ---------------------------------------------------------------------

    # Epoch e visits shards in permutation(default_rng([seed, e, 0])) order
    # and shard s's windows in permutation(default_rng([seed, e, 1, s])) order.
    # (The tag 0/1 keeps the two seed lists distinct: numpy's SeedSequence
    # pads short lists with zeros, so [a, b] and [a, b, 0] would collide.)

    def _shard_index(self, epoch, shard_pos):
        if not self.shuffle:
            return shard_pos
        if self._shard_order_epoch != epoch:
            self._shard_order = np.random.default_rng([self.seed, epoch, 0]) \
                .permutation(self.num_shards)
            self._shard_order_epoch = epoch
        return int(self._shard_order[shard_pos])

    def _window_index(self, epoch, shard, batch_pos):
        if not self.shuffle:
            return batch_pos
        if self._window_order_key != (epoch, shard):
            self._window_order = np.random.default_rng([self.seed, epoch, 1, shard]) \
                .permutation(self.shard_batches[shard])
            self._window_order_key = (epoch, shard)
        return int(self._window_order[batch_pos])

    def _tokens(self, shard):
        if self._open_index != shard:
            path = self.files[shard]
            tokens = read_tokens(path)
            if tokens.size != self.shard_tokens[shard]:
                raise DataError(f"{path}: now holds {tokens.size} tokens, had "
                                f"{self.shard_tokens[shard]} when the loader opened it")
            if self.vocab_size is not None and shard not in self._checked:
                self._check_vocab(path, tokens)
            self._checked.add(shard)
            self._open_index, self._open_tokens = shard, tokens
            mask = mask_path(path)
            self._open_mask = read_mask(mask) if mask.exists() else None
            if self._open_mask is not None and self._open_mask.size != tokens.size:
                raise DataError(f"{mask}: now masks {self._open_mask.size} tokens, its token "
                                f"file holds {tokens.size}")
        return self._open_tokens

    def _check_vocab(self, path, tokens):
        bad = first_out_of_vocab(tokens, self.vocab_size)
        if bad is not None:
            pos = int(bad[0])
            raise DataError(f"{path}: token {pos} is {int(tokens[pos])}, not below the "
                            f"model's vocab_size {self.vocab_size}")

    # -- batches -------------------------------------------------------------------

    def next_batch(self):
        """(inputs, targets), int32 (B, T) each; then advances one window."""
        B, T = self.B, self.T
        shard = self._shard_index(self.epoch, self.shard_pos)
        start = self._window_index(self.epoch, shard, self.batch_pos) * B * T
        buf = np.array(self._tokens(shard)[start:start + B * T + 1], dtype=np.int32)
        inputs = buf[:-1].reshape(B, T)
        targets = buf[1:].reshape(B, T).copy()
        if self._open_mask is not None:
            trained = self._open_mask[start + 1:start + B * T + 1].reshape(B, T)
            targets[trained == 0] = IGNORE_INDEX
        self.batch_pos += 1
        if self.batch_pos == self.shard_batches[shard]:
            self.batch_pos = 0
            self.shard_pos += 1
            if self.shard_pos == self.num_shards:
                self.shard_pos = 0
                self.epoch += 1
        return inputs, targets

    # -- resuming --------------------------------------------------------------------

    _SETTINGS = ("B", "T", "shuffle", "seed", "num_shards", "num_batches")

    def state_dict(self):
        """The position and the settings it depends on, as JSON-ready ints."""
        d = {name: int(getattr(self, name)) for name in self._SETTINGS}
        d.update(epoch=self.epoch, shard_pos=self.shard_pos, batch_pos=self.batch_pos)
        return d

    def load_state_dict(self, d, *, other_batch=False):
        """Restores a position saved by state_dict(); the loader must have the
        same settings and data (a mismatch is a DataError naming it). With
        ``other_batch`` a sequential loader may have another B (the number of
        processes changed): it goes on at the first window that starts at or
        after the saved position's first unread token."""
        try:
            saved = {k: int(d[k]) for k in self._SETTINGS + ("epoch", "shard_pos", "batch_pos")}
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"DataLoader state is malformed: {type(e).__name__}: {e}") from None
        if other_batch and not self.shuffle and saved["B"] != self.B:
            saved = self._rebatched(saved)
        for name in self._SETTINGS:
            if saved[name] != int(getattr(self, name)):
                raise DataError(f"DataLoader state: {name} is {saved[name]}, but this loader "
                                f"({self.pattern!r}) has {int(getattr(self, name))}")
        epoch, shard_pos, batch_pos = saved["epoch"], saved["shard_pos"], saved["batch_pos"]
        if epoch < 0 or not 0 <= shard_pos < self.num_shards:
            raise DataError(f"DataLoader state: epoch {epoch}, shard_pos {shard_pos} out of "
                            f"range for {self.num_shards} shards")
        shard = self._shard_index(epoch, shard_pos)
        if not 0 <= batch_pos < self.shard_batches[shard]:
            raise DataError(f"DataLoader state: batch_pos {batch_pos} out of range for "
                            f"{self.files[shard]} ({self.shard_batches[shard]} batches)")
        self.epoch, self.shard_pos, self.batch_pos = epoch, shard_pos, batch_pos

    def _rebatched(self, saved):
        """``saved`` (a sequential position for another B) in this loader's B."""
        tokens = saved["batch_pos"] * saved["B"] * self.T   # read of its shard
        epoch, shard_pos = saved["epoch"], saved["shard_pos"]
        batch_pos = -(-tokens // (self.B * self.T))
        if not 0 <= shard_pos < self.num_shards:
            return saved   # refused below
        if batch_pos >= self.shard_batches[shard_pos]:
            batch_pos, shard_pos = 0, shard_pos + 1
            if shard_pos == self.num_shards:
                shard_pos, epoch = 0, epoch + 1
        return dict(saved, B=self.B, num_batches=self.num_batches, epoch=epoch,
                    shard_pos=shard_pos, batch_pos=batch_pos)

    def __repr__(self):
        return (f"DataLoader({self.pattern!r}, B={self.B}, T={self.T}, shuffle={self.shuffle}, "
                f"{self.num_shards} shards, {self.num_batches} batches/epoch)")
