"""A training run from its parts: ``run(spec)`` (or ``Run(spec).train()``)
trains as a train.spec.RunSpec says, which is what ``python -m
llmc_py.train`` does with its flags:

    from llmc_py.train import RunSpec, run
    run(RunSpec(train_data="data/shakespeare/train.bin", max_steps=20, output_dir="out"))

Run builds the data, the model (fresh from a depth, resumed from the output
folder, or loaded from an llm.c model file or a Hugging Face folder), the
world of processes (train.distributed) and the optimizer, then trains with
train.loop.Trainer, whose hooks (train.hooks) log, evaluate, keep the best
model, sample and checkpoint. What it says goes to ``out`` (stdout).
"""
import contextlib
import hashlib
import math
import os
import signal
import time
from pathlib import Path

import numpy as np

from .._native.lib import set_num_threads
from ..errors import CheckpointError, UnsupportedError, UsageError
from ..io.files import atomic_write, from_bf16
from ..io.tokens import fingerprint
from ..model import load_model
from ..model.presets import GPT2_VOCAB, config_from_depth, describe, preset_for
from ..model.dropout import RATES as DROPOUT_SITES
from ..model.transformer import INIT_STD
from ..monitors import ExpertCollapse, Monitor
from . import distributed
from .distributed import RankRows, ShardedAdamW, Solo, raise_injected_fault
from .hooks import Checkpoints, Evaluation, KeepBest, Sampling, StepLog
from .loop import Trainer, perplexity
from .optimizer import AdamW
from .progress import Progress, format_seconds, signal_name
from .resume import refuse_changes, resume_changes, take_run_flags, usable_checkpoint
from .run_folder import RunFolder
from .signals import StopSignals

DEFAULT_DATASET = "shakespeare"
# a Hugging Face folder's tokenizer files, copied beside an export
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")
# bf16 weights model_digest widens at once (16 MiB of float32)
DIGEST_CHUNK = 1 << 22


def run(spec, out=None, world=None):
    """Trains as ``spec`` (a RunSpec) says; returns the exit code: 0 when
    done, 1 after a loss or gradient norm that is not finite, 128 + N after
    signal N (Ctrl-C: 130), once the last finished step is saved. Settings
    that cannot work raise UsageError (an LlmcError) before step 1.
    ``out``: where progress goes (stdout); ``world``: train.distributed's
    (default: this process alone)."""
    return Run(spec, out, world).train()


class Run:
    """One training run; after ``train()`` its parts stay readable
    (``model``, ``optimizer``, ``folder``, ``settings``)."""

    def __init__(self, spec, out=None, world=None):
        self.spec = spec
        self.progress = Progress(out)
        self.world = Solo() if world is None else world

    def train(self):
        """The run, start to end; returns the exit code (``run``'s)."""
        # several ranks only record a signal until they agree to stop (_steps)
        with StopSignals(held=self.world.size > 1) as self.signals:
            try:
                return self._train()
            except KeyboardInterrupt as stop:   # Stopped, or Ctrl-C before the handlers were in
                signum = getattr(stop, "signum", signal.SIGINT)
                if not getattr(stop, "handled", False):
                    self.progress.say(f"stopped by {signal_name(signum)} before training "
                                      f"started; nothing saved")
                return 128 + signum

    def _train(self):
        spec = self.spec
        spec.check()
        if spec.threads:
            set_num_threads(spec.threads)
        self.folder = RunFolder(spec.output_dir)
        with self._folder_taken():
            self._build()
            return self._steps()

    @contextlib.contextmanager
    def _folder_taken(self):
        """Rank 0 creates and locks the output folder (the others never touch
        it), removes what a killed save left, and refuses another run's
        files unless resuming or told to remove them."""
        folder, say = self.folder, self.progress.say
        if not self.world.is_root:
            yield
            return
        folder.create()
        folder.lock()
        try:
            stale = folder.remove_stale_temporaries()
            if stale:
                say(f"removed {stale} temporary file(s) of an interrupted save in {folder.path}")
            if not self.spec.resume and folder.run_files():
                if not self.spec.overwrite:
                    raise UsageError(f"{folder.path} holds another run's checkpoints or log: "
                                     f"resume it with -y 1, remove it with --overwrite, or "
                                     f"give another -o")
                folder.clear()
                say(f"removed the earlier run in {folder.path} (--overwrite)")
            yield
        finally:
            folder.unlock()

    # ---- the parts -----------------------------------------------------------

    def _build(self):
        """Everything before step 1, each setting checked on the way."""
        checkpoint = self._checkpoint()   # a resume's flags not given: the run's
        spec, world = self.spec, self.world
        self.grad_accum = spec.grad_accum(world.size)
        self.dropout = spec.dropout_masks()
        self._check_extras()
        train_data, val_data = self._data()
        moments, extra = self._model(checkpoint)
        self._check_model_fits()
        self._add_lora()
        self.sharded = bool(spec.zero) and world.size > 1
        shard = distributed.shard_bounds(self.model.num_parameters, world.size)[world.rank]
        # fails now if a step cannot fit in memory
        self.model.reserve(spec.batch_size, spec.seq_len, training=True,
                           moment_params=shard[1] - shard[0] if self.sharded else None)
        adamw = dict(beta1=spec.beta1, beta2=spec.beta2, eps=spec.adam_eps,
                     weight_decay=spec.weight_decay, decay_on=spec.decay_on)
        self.optimizer = (ShardedAdamW(self.model, world, **adamw) if self.sharded
                          else AdamW(self.model, **adamw))
        self._loaders(train_data, val_data)
        if self.encoding is None and spec.sample_every:
            from ..tokenizer import get_encoding
            self.encoding = get_encoding()
        self.sample_rng = np.random.default_rng(spec.seed)
        self.tokens_per_step = self.grad_accum * spec.batch_size * spec.seq_len * world.size
        # what a resumed run must share with this one, saved in every state file
        self.settings = dict(
            spec.flags(), train_data=train_data, val_data=val_data,
            total_batch_tokens=self.tokens_per_step, grad_accum=self.grad_accum,
            world_size=world.size, val_batches=self.val_batches,
            lora_base=self.lora_base,
            train_fingerprint=fingerprint(self.train_loader.files),
            val_fingerprint=fingerprint(self.val_loader.files) if self.val_loader else None)
        if self.resume_step:
            self._restore(*moments, extra)
        self._say_model()
        self.keep_best = None
        if self.keeps_best and world.is_root:
            measured_on = {"val_data": self.settings["val_fingerprint"],
                           "val_batches": self.val_batches, "processes": world.size}
            self.keep_best = KeepBest(self.folder, self.model, measured_on, self.signals,
                                      self.progress, resumed=bool(self.resume_step))

    def _check_extras(self):
        """The optional packages a flag needs at the end of the run, checked
        before its first step."""
        if self.spec.export_hf:
            from ..io.hf import require_packages
            try:
                require_packages()
            except UnsupportedError as e:
                raise UsageError(f"--export-hf {self.spec.export_hf}: {e}") from None

    def _data(self):
        """(train, val) token file globs, in the tokens of the model's
        tokenizer (GPT-2's unless a Hugging Face folder or --tokenizer gives
        another); the default dataset is prepared if missing."""
        from ..data import prepare_dataset   # noqa: deferred, pulls tiktoken
        from ..tokenizer import load_tokenizer
        spec, world = self.spec, self.world
        source = spec.tokenizer_source()
        self.encoding = load_tokenizer(source) if source else None
        train_data, val_data = spec.train_data, spec.val_data
        if train_data is None:
            from ..data.prepare import dataset_name
            for preparing in (True, False):   # rank 0 first; the others then find it ready
                if preparing == world.is_root:
                    train_path, val_path = prepare_dataset(
                        DEFAULT_DATASET, spec.data_dir, encoding=self.encoding,
                        folder=dataset_name(DEFAULT_DATASET, self.encoding),
                        quiet=not world.is_root)
                world.barrier()
            train_data = str(train_path)
            if val_data is None:
                val_data = str(val_path)
        return train_data, val_data

    def _checkpoint(self):
        """When resuming, the newest usable checkpoint (step, model, config,
        (m, v), extra), read by rank 0 (the others get its step, config and
        extra: model, m and v None); its run's flags replace those not given
        (said in one line). None for a fresh run."""
        spec, world, root, say = self.spec, self.world, self.world.is_root, self.progress.say
        # -y 1 on a folder without a checkpoint (new, or killed before the
        # first) starts afresh: one job line serves the first start and every restart
        resuming = bool(spec.resume) and world.broadcast_object(
            bool(self.folder.completed_steps()) if root else None)
        if spec.resume and not resuming:
            say(f"-y 1: no checkpoint in {self.folder.path} yet; starting a fresh run")
        if not resuming:
            return None
        step, model, m, v, extra = (usable_checkpoint(self.folder, self.progress, spec.precision)
                                    if root else (None,) * 5)
        # the other ranks need no access to -o
        step, config, extra = world.broadcast_object(
            (step, model and model.config, extra) if root else None)
        saved = extra.get("args") if isinstance(extra.get("args"), dict) else {}
        self.spec, taken = take_run_flags(spec, saved)
        self.spec.check()
        refuse_changes(saved, self.spec.flags(), self.spec)   # the flags given; derived: _restore
        if taken:
            say("resume: took " + ", ".join(taken) + " from the run")
        return step, model, config, (m, v), extra

    def _model(self, checkpoint):
        """The model: the resumed ``checkpoint``'s (in the run's precision),
        else -e's. Every rank starts from rank 0's parameters. Returns the
        checkpoint's ((m, v), extra) when resuming."""
        spec, world, root = self.spec, self.world, self.world.is_root
        self.resume_step, moments, extra = 0, (None, None), None
        if checkpoint is not None:
            self.resume_step, model, config, moments, extra = checkpoint
            if root and spec.max_steps < self.resume_step:
                raise UsageError(f"{spec.flag('max_steps')} {spec.max_steps} is below the "
                                 f"checkpoint's step {self.resume_step} in {self.folder.path}")
        if checkpoint is not None and config is None:   # a LoRA run's: the base is -e's
            self.model = self._initial_model()
        elif checkpoint is not None:
            if root and model.precision == spec.precision:
                self.model = model
            else:   # another rank's, or another precision than the one it was read in
                self.model = preset_for(config)(
                    config, params=model.params.memory if root else None,
                    precision=spec.precision)
        else:
            self.model = self._initial_model()
            if world.size > 1:
                world.same_on_every_rank("model (-e and its file)", model_digest(self.model))
        if world.size > 1:
            world.broadcast(self.model.params.memory)
            if self.model.frozen:
                world.broadcast(self.model.params_bf16.memory)
            elif self.model.params_bf16 is not None:
                self.model.refresh_bf16()
        self.model.recompute = spec.recompute
        return moments, extra

    def _add_lora(self):
        """With --lora-rank: freezes the model and adds its adapters."""
        spec, options = self.spec, self.spec.lora_options()
        self.lora_base = None
        if options is None:
            given = sorted(spec.explicit & {"lora_alpha", "lora_targets", "lora_dropout",
                                            "lora_rslora"})
            if spec.base_weights:
                given.append("base_weights")
            if given:
                raise UsageError(f"{spec.flag(given[0])} needs --lora-rank")
            return
        if spec.zero and self.world.size > 1:
            raise UsageError("--zero 1 with --lora-rank: ZeRO-1 shards the full model's "
                             "moments; a LoRA run's are small, run without --zero")
        if spec.monitor_every:
            raise UsageError("--monitor-every with --lora-rank: the monitors read the full "
                             "model's gradients, which a LoRA run has not")
        self.lora_base = model_digest(self.model)   # a resume must find the same base
        self._quantize_base()
        try:
            self.model.add_lora(**options)
        except ValueError as e:
            flag = spec.flag("lora_targets" if "targets" in str(e) else "lora_rank")
            raise UsageError(f"{flag}: {e}") from None
        if self.resume_step:   # the checkpoint's adapters, read by rank 0
            if self.world.is_root:
                self._read_adapters(self.folder.adapter_path(self.resume_step))
            self.world.broadcast(self.model.lora.params.memory)

    def _quantize_base(self):
        """With --base-weights: the frozen base quantized (model.quantize),
        the adapters to be trained on it (QLoRA)."""
        spec = self.spec
        if not spec.base_weights:
            return
        both = f"with {spec.flag('base_weights')} {spec.base_weights}"
        if spec.precision != "fp32":
            raise UsageError(f"{spec.flag('precision')} {spec.precision} {both}: a quantized "
                             f"base has its own arithmetic (bf16 panels); leave out --precision")
        if spec.export_hf:
            raise UsageError(f"{spec.flag('export_hf')} {both}: a quantized base has no float "
                             f"weights to merge the adapters into; the run's lora_*/ folders "
                             f"are the adapters")
        self.model.quantize(spec.base_weights)

    def _read_adapters(self, folder):
        """Replaces the adapters' parameters by those of the PEFT ``folder``."""
        from ..io.peft import read_peft
        saved, params = read_peft(folder, self.model.config).params, self.model.lora.params
        if saved.names != params.names or saved.size != params.size:
            raise CheckpointError(f"{folder}: its adapters ({', '.join(saved.names)}) are not "
                                  f"those of the run's --lora-* flags")
        params.memory[...] = saved.memory

    def _initial_model(self):
        """A fresh model of the -e depth, or the -e model file's or folder's;
        a frozen bf16 base when _frozen_base says so."""
        spec, frozen = self.spec, self._frozen_base()
        config = config_from_depth(spec.init, family=spec.family)
        if config is not None:
            model = preset_for(config)(config, seed=spec.seed,
                                       precision="fp32" if frozen else spec.precision)
            if (spec.init_scheme, spec.init_std) != ("gpt2", INIT_STD):
                model.initialize(spec.seed, spec.init_scheme, spec.init_std)
            if frozen:   # rounded as a bf16 model's copy is
                model = preset_for(config)(config, params=model.params.memory,
                                           precision="bf16", frozen=True)
            return model
        if not Path(spec.init).exists():
            raise UsageError(f"-e {spec.init}: no such model file, and not a depth like d6")
        return load_model(spec.init, precision=spec.precision, frozen=frozen)

    def _frozen_base(self):
        """Whether -e is held as a frozen bf16 base (load_model's frozen=True):
        a LoRA run in bf16 never changes the base's weights, so they are bf16
        alone, with no float32 master, weight gradients or moments (a Hugging
        Face folder is read into them tensor by tensor)."""
        return bool(self.spec.lora_rank) and self.spec.precision == "bf16"

    def _check_model_fits(self):
        """Everything the spec asks of the model, checked before step 1; the
        tokenizer (None: GPT-2's) must fit its vocabulary."""
        spec, config, encoding = self.spec, self.model.config, self.encoding
        if encoding is None and config.vocab_size != GPT2_VOCAB:
            raise UsageError(f"the model's vocab_size is {config.vocab_size}; the GPT-2 "
                             f"tokenizer needs {GPT2_VOCAB} (give the model's tokenizer with "
                             f"--tokenizer)")
        if encoding is not None and encoding.n_vocab > config.vocab_size:
            raise UsageError(f"the model's vocab_size is {config.vocab_size}, fewer than the "
                             f"{encoding.n_vocab} tokens of {spec.tokenizer_source()}")
        if config.learned_positions:
            if spec.seq_len > config.max_seq_len:
                raise UsageError(f"-t {spec.seq_len} is longer than the model's max_seq_len "
                                 f"{config.max_seq_len}")
            if spec.sample_every and spec.gen_tokens > config.max_seq_len:
                raise UsageError(f"-g {spec.gen_tokens}: a sample of that many tokens does not "
                                 f"fit the model's max_seq_len {config.max_seq_len}")

    def _loaders(self, train_data, val_data):
        """The training and validation loaders, each rank reading its B rows
        of every batch of ranks * B, and the fixed batch of the monitors."""
        from ..data import DataLoader
        spec, world = self.spec, self.world
        B, T, V = spec.batch_size, spec.seq_len, self.model.config.vocab_size
        self.train_loader = RankRows(DataLoader(train_data, B * world.size, T,
                                                shuffle=bool(spec.shuffle), seed=spec.seed,
                                                vocab_size=V), world)
        self.val_loader, self.val_batches = None, spec.val_batches
        if val_data and spec.val_every:
            self.val_loader = RankRows(DataLoader(val_data, B * world.size, T, vocab_size=V),
                                       world)
            self.val_batches = min(self.val_batches, self.val_loader.num_batches)
        world.same_on_every_rank("training data (-i)", fingerprint(self.train_loader.files))
        # --keep-best is on by default: without validation data it keeps
        # nothing, unless the user asked for it by name
        self.keeps_best = bool(spec.keep_best) and self.val_loader is not None
        if spec.keep_best and self.val_loader is None and "keep_best" in spec.explicit:
            raise UsageError("--keep-best 1 keeps the model with the best validation loss: it "
                             "needs validation data (-j) and evaluations (-v > 0)")
        self.probe = None
        if spec.monitor_every:
            if not val_data:
                raise UsageError("--monitor-every measures on a validation batch: give -j "
                                 "(the default dataset has one)")
            self.probe = DataLoader(val_data, B, T, vocab_size=V).next_batch()

    def _restore(self, m, v, extra):
        """The checkpoint's data position, sampler RNG and moments; the
        settings it shares with this run are compared first."""
        folder, world, step = self.folder, self.world, self.resume_step
        saved = extra.get("args") if isinstance(extra.get("args"), dict) else {}
        changes = resume_changes(saved, self.settings, self.spec)
        try:
            self.train_loader.load_state_dict(
                extra["train_loader"], other_batch=saved.get("world_size", 1) != world.size)
            self.sample_rng.bit_generator.state = extra["sample_rng"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{folder.checkpoint_paths(step)[1]}: the data loader or RNG "
                                  f"state is not usable ({type(e).__name__}: {e})") from None
        if world.size > 1 and not self.sharded:   # every rank holds all of m and v
            if not world.is_root:
                n = self.optimizer.m.size   # the adapters' after add_lora
                m, v = np.empty(n, np.float32), np.empty(n, np.float32)
            world.broadcast(m)
            world.broadcast(v)
        self.optimizer.load_moments(m, v)
        if world.is_root:
            folder.truncate_log(step)
            folder.truncate_metrics(step)
        self.progress.say(f"resumed from step {step} in {folder.path}")
        if changes:
            self.progress.say("changed on resume: " + ", ".join(changes))
        ranks = saved.get("world_size", 1)
        if ranks != world.size and self.val_loader is not None:
            self._say_other_validation_rows(ranks)

    def _say_other_validation_rows(self, ranks):
        """A resume on another number of processes than the run's ``ranks``
        evaluates on other rows: -m counts batches of B rows per process."""
        spec, now = self.spec, self.world.size
        rows = self.val_batches * spec.batch_size
        same = ranks * self.val_batches
        hint = (f"; {spec.flag('val_batches')} {same // now} reads the run's rows"
                if same % now == 0 else "")
        self.progress.say(
            f"resume: the run had {ranks} process(es), this one {now}: "
            f"{spec.flag('val_batches')} counts batches of B rows on each process, so an "
            f"evaluation reads {rows * now} rows (the run read {rows * ranks}) and its loss "
            f"is not comparable with the run's" + hint)

    def _say_model(self):
        spec, model, ranks = self.spec, self.model, self.world.size
        self.progress.say(
            f"model: {describe(model.config)}, {model.num_parameters / 1e6:.1f}M parameters, "
            f"{model.precision}"
            + (f", {describe_dropout(self.dropout)}" if self.dropout.active else "")
            + f"; batch {spec.batch_size}x{spec.seq_len}"
            + (f" on each of {ranks} processes" + (" (ZeRO-1)" if self.sharded else "")
               if ranks > 1 else "")
            + f", {self.grad_accum} micro-batch(es) per step; {spec.max_steps} steps")

    def _state_extra(self):
        """The run's state beside the model and moments in a state file."""
        return {"args": self.settings,
                "train_loader": self.train_loader.state_dict(),
                "sample_rng": self.sample_rng.bit_generator.state}

    # ---- training ------------------------------------------------------------

    def _trainer(self, log, metrics):
        """The Trainer with the run's hooks, in the order of a step's work."""
        spec, world = self.spec, self.world
        self.checkpoints = Checkpoints(
            self.folder, self.model, self.optimizer, self._state_extra, spec.checkpoint_every,
            spec.max_steps, spec.keep_checkpoints, self.resume_step, world, self.signals,
            self.progress, self.sharded)
        next_batch = self.train_loader.next_batch
        if spec.overfit_single_batch:
            fixed_batch = next_batch()
            next_batch = lambda: fixed_batch   # noqa: E731
        trainer = Trainer(self.model, self.optimizer, spec.lr_schedule(), next_batch,
                          grad_accum=self.grad_accum, grad_clip=spec.grad_clip,
                          update_guard=self.signals.deferred, world=world, dropout=self.dropout)
        if world.size > 1:   # first of all: the gradients averaged over the ranks
            reduce = world.reduce_scatter_mean if self.sharded else world.average
            trainer.after_backward.append(
                lambda trainer, step: reduce(self.model.trained[1].memory))
        trainer.after_step.append(self.checkpoints.step_finished)
        if self.probe is not None and self.sharded:
            # ZeRO-1 averages each rank's shard of the gradients only; the
            # monitor reads them all: rank 0 gathers them on measured steps
            trainer.after_backward.append(self._gather_measured_gradients)
        collapse = None
        if self.probe is not None and self.model.config.num_experts and world.size > 1:
            # every rank counts its rows' experts, rank 0 warns of the whole batch's
            collapse = ExpertCollapse(self.model.config)
            trainer.after_micro_batch.append(
                lambda trainer, step: collapse.add(self.model, step))
            trainer.after_backward.append(
                lambda trainer, step: self._gather_expert_counts(collapse, step))
        if self.probe is not None and world.is_root:
            monitor = Monitor(self.model, *self.probe, spec.monitor_every, metrics,
                              entropy_min=spec.monitor_entropy_min or None,
                              cosine_max=spec.monitor_cosine_max
                              if spec.monitor_cosine_max < 1 else None, say=self.progress.say,
                              collapse=collapse)
            trainer.after_micro_batch.append(monitor.after_micro_batch)
            trainer.after_backward.append(monitor.after_backward)
            trainer.after_step.append(monitor.after_step)
        trainer.end_of_step += self._end_of_step_hooks(log)
        return trainer

    def _gather_expert_counts(self, collapse, step):
        if step % self.spec.monitor_every == 0:
            collapse.gather(self.world)

    def _gather_measured_gradients(self, trainer, step):
        if step % self.spec.monitor_every == 0:
            self.world.gather_shards(self.model.grads.memory)

    def _end_of_step_hooks(self, log):
        """The log, the evaluation (offering the best model to --keep-best),
        the sample and the checkpoint."""
        spec, world, progress, last = self.spec, self.world, self.progress, self.spec.max_steps
        self.step_log = StepLog(log, progress, self.resume_step, last, self.tokens_per_step)
        hooks = [self.step_log, lambda trainer, r: raise_injected_fault(world.rank, r.step)]
        self.evaluation = None
        if self.val_loader is not None:
            self.evaluation = Evaluation(self.model, self.val_loader, self.val_batches,
                                         spec.val_every, last, world, log, progress,
                                         self.keep_best)
            hooks.append(self.evaluation)
        if spec.sample_every and world.is_root:
            hooks.append(Sampling(self.model, self.encoding, spec.gen_tokens, spec.sample_top_k,
                                  spec.sample_every, last, self.sample_rng, progress,
                                  self.checkpoints.refresh))
        return hooks + [self.checkpoints]

    def _steps(self):
        """Steps resume_step + 1 .. max_steps, then the summary and the export."""
        spec, root, folder = self.spec, self.world.is_root, self.folder
        log = folder.open_log(append=bool(self.resume_step)) if root else open(os.devnull, "w")
        metrics = (folder.open_metrics(append=bool(self.resume_step))
                   if self.probe is not None and root else None)
        trainer = self._trainer(log, metrics)
        try:
            # a signal on any rank stops every rank after the same step (one
            # small allreduce per step)
            self.signals.agree(self.world)
            for step in range(self.resume_step + 1, spec.max_steps + 1):
                r = trainer.train_step(step)
                if not r.finite:
                    last_good = self.checkpoints.last_good
                    self.progress.say(
                        f"step {step}: the loss ({r.loss}) or gradient norm ({r.norm}) is not "
                        f"finite; stopping. The last good checkpoint is step {last_good}"
                        + ("" if last_good else " (none written)") + f" in {folder.path}")
                    return 1
                self.signals.agree(self.world)
        except KeyboardInterrupt as stop:
            self.checkpoints.stopped(getattr(stop, "signum", signal.SIGINT))
        finally:
            log.close()
            if metrics is not None:
                metrics.close()
        self._say_summary()
        if spec.export_hf and root:
            if self.model.lora is not None:   # the run is over: its adapters fold into the base
                self.model.merge_lora()
            export_hf(self.model, spec.export_hf, spec.tokenizer_source())
            self.progress.say(f"exported as a Hugging Face folder: {spec.export_hf}")
        return 0

    def _say_summary(self):
        spec, world, say = self.spec, self.world, self.progress.say
        elapsed = time.perf_counter() - self.step_log.started
        steps_run = spec.max_steps - self.resume_step
        losses = self.step_log.losses
        val_loss = self.evaluation.loss if self.evaluation is not None else None
        summary = f"done: {steps_run} steps in {format_seconds(elapsed)}"
        if losses:
            summary += (f", train loss {losses[0]:.4f} -> {losses[-1]:.4f} (perplexity "
                        f"{perplexity(losses[0]):.2f} -> {perplexity(losses[-1]):.2f})")
        if val_loss is not None:
            summary += f", val loss {val_loss:.4f} (perplexity {perplexity(val_loss):.2f})"
        keep_best = self.keep_best
        if keep_best is not None and keep_best.best is not None and keep_best.loss < math.inf:
            summary += (f", best val loss {keep_best.loss:.4f} at step {keep_best.best['step']} "
                        f"({self.folder.best_of(self.model)})")
        say(summary + f"; checkpoint {self.folder.model_path(spec.max_steps, self.model)}")
        if world.size > 1 and steps_run:   # rank 0's share of the exchanges
            say(f"communication (rank 0): {world.seconds / steps_run * 1000:.1f} ms and "
                f"{world.bytes_sent / steps_run / 2**20:.1f} MiB sent per step "
                f"({100 * world.seconds / elapsed:.1f}% of the time)")


def describe_dropout(dropout):
    """"dropout P", or each site's when they differ."""
    rates = [getattr(dropout, site) for site in DROPOUT_SITES]
    if len(set(rates)) == 1:
        return f"dropout {rates[0]:g}"
    return "dropout " + ", ".join(f"{site} {p:g}" for site, p in zip(DROPOUT_SITES, rates))


def export_hf(model, folder, tokenizer_from=None):
    """The model as a Hugging Face folder, with the tokenizer files and the
    bos/eos/pad ids of the folder ``tokenizer_from`` (a model's, or a
    tokenizer.json's) when given."""
    from ..io.hf import token_ids
    dtype = "bf16" if model.frozen else "fp32"   # a frozen base has no float32 weights
    if tokenizer_from is None:
        model.save_pretrained(folder, dtype=dtype)
        return
    source = Path(tokenizer_from)
    source = source if source.is_dir() else source.parent
    model.save_pretrained(folder, dtype=dtype, token_ids=token_ids(source))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            atomic_write(Path(folder) / name, [(source / name).read_bytes()])


def model_digest(model):
    """A hash of a model's config and parameters, to compare across ranks
    and resumes; a frozen bf16 base's are hashed as their float32 values,
    so that it is the same model loaded with a float32 master (a resume may
    change --precision)."""
    digest = hashlib.sha256(repr(model.config).encode())
    if not model.frozen:
        digest.update(model.params.memory)
        return digest.hexdigest()[:16]
    for name, _ in model.param_specs:   # in the float32 layout's order
        if name not in model.params_bf16:
            digest.update(model.params[name])
            continue
        bits = model.params_bf16[name].reshape(-1)
        for start in range(0, bits.size, DIGEST_CHUNK):   # widened a chunk at a time
            digest.update(from_bf16(bits[start:start + DIGEST_CHUNK]))
    return digest.hexdigest()[:16]
