"""The run folder: where a training run keeps its log and checkpoints.

  main.log          one line per step ``s:N trl:LOSS lr:LR norm:NORM`` (with
                    experts ``ce:X balance:X z:X`` after LOSS, its parts) and
                    per evaluation ``s:N tel:LOSS`` (llm.c's format)
  metrics.jsonl     with --monitor-every: one JSON object per measurement,
                    its "step" first (llmc_py.monitors.run lists the fields)
  model_%08d.bin    the model file (io.model_file: llm.c's for GPT-2)
  lora_%08d/        instead, in a LoRA run (--lora-rank): the adapters as a
                    PEFT folder (adapter_config.json, adapter_model.safetensors);
                    the state file then holds the adapters' moments
  state_%08d.bin    the training state (io.state); both record a checksum
                    (io.files.CHECKSUM_SLOT), and a checkpoint that fails it
                    is passed over on resume (train.resume)
  DONE_%08d         empty; written last, marks a complete checkpoint
  model_best.bin    with --keep-best 1: the model file of the step with the
                    lowest validation loss so far, never removed by -nk
                    (lora_best/ in a LoRA run: its adapters' PEFT folder)
  best.json         its step and validation loss (and what the loss was
                    measured on), written after model_best.bin
  .lock             holds the PID of the trainer using the folder

One trainer at a time: ``lock()`` takes an exclusive advisory lock on .lock,
which the kernel drops when the process ends however it ends, so a crash
never leaves a stale lock.
"""
import json
import math
import os
import re
import shutil
from pathlib import Path

from ..errors import UsageError, WriteError
from ..io.files import atomic_write
from ..io.state import read_state, write_state

try:
    import fcntl
except ImportError:   # Windows: no advisory locks here; the folder is not guarded
    fcntl = None

# the temporary files of io.files.atomic_write for this folder's files, which
# stay behind only when the writing process was killed before its rename
_TEMPORARY = re.compile(
    r"\.(model_\d{8}\.bin|state_\d{8}\.bin|DONE_\d{8}|main\.log|metrics\.jsonl|model_best\.bin|"
    r"best\.json|lora_\d{8}|lora_best)\..+\.tmp")
_DONE = re.compile(r"DONE_(\d{8})")
_STEP_LINE = re.compile(r"s:(\d+) ")


def _metrics_step(line):
    """The "step" of a metrics.jsonl line; a line that is not a measurement
    counts as past every step."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return math.inf
    return step if isinstance(step, int) else math.inf


class RunFolder:
    def __init__(self, path):
        self.path = Path(path)
        self.log_path = self.path / "main.log"
        self.metrics_path = self.path / "metrics.jsonl"
        self.best_path = self.path / "model_best.bin"
        self.best_adapter_path = self.path / "lora_best"   # a LoRA run's best
        self.best_info_path = self.path / "best.json"
        self._lock_fd = None

    def create(self):
        if self.path.exists() and not self.path.is_dir():
            raise UsageError(f"-o {self.path}: exists and is not a folder")
        self.path.mkdir(parents=True, exist_ok=True)

    def lock(self):
        """Takes the folder for this process, or raises UsageError naming the
        PID of the trainer that has it. Released by ``unlock`` or at exit."""
        if fcntl is None:
            return
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError(f"{self.path} is in use by another trainer (PID {holder}); "
                             f"wait for it to end, or give another -o") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def unlock(self):
        if self._lock_fd is not None:
            os.close(self._lock_fd)   # closing drops the lock
            self._lock_fd = None

    def run_files(self):
        """The files of a run in this folder: checkpoints, the best model,
        main.log and metrics.jsonl."""
        names = re.compile(r"(model|state)_\d{8}\.bin|DONE_\d{8}|main\.log|metrics\.jsonl|"
                           r"model_best\.bin|best\.json|lora_\d{8}|lora_best")
        return sorted(p for p in self.path.iterdir() if names.fullmatch(p.name))

    def clear(self):
        """Removes the run in this folder: the DONE markers first, so that an
        interrupted clear leaves no checkpoint that looks complete."""
        files = self.run_files()
        for path in sorted(files, key=lambda p: not p.name.startswith("DONE_")):
            _remove(path)

    def checkpoint_paths(self, step):
        """(model, state, DONE marker) paths of the checkpoint of ``step``."""
        return (self.path / f"model_{step:08d}.bin", self.path / f"state_{step:08d}.bin",
                self.path / f"DONE_{step:08d}")

    def adapter_path(self, step):
        """The PEFT folder of a LoRA run's checkpoint of ``step``."""
        return self.path / f"lora_{step:08d}"

    def model_path(self, step, model):
        """Where the checkpoint of ``step`` keeps ``model``: its model file,
        or its adapters' PEFT folder in a LoRA run."""
        return self.checkpoint_paths(step)[0] if model.lora is None else self.adapter_path(step)

    def best_of(self, model):
        """Where --keep-best keeps ``model``: model_best.bin, or lora_best/."""
        return self.best_path if model.lora is None else self.best_adapter_path

    def completed_steps(self):
        """Steps with a DONE marker, ascending."""
        steps = []
        for marker in self.path.glob("DONE_*"):
            match = _DONE.fullmatch(marker.name)
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps)

    def save(self, step, model, optimizer, extra, keep=0):
        """model, then state, then the DONE marker: a checkpoint without its
        marker is incomplete and never resumed from. A save that fails
        removes what it wrote and raises WriteError. ``keep`` > 0 then
        removes all but the newest ``keep`` checkpoints."""
        _, state_path, done_path = self.checkpoint_paths(step)
        model_path = self.model_path(step, model)   # a LoRA run's: its adapters alone
        try:
            _save_model(model, model_path)
            write_state(state_path, step, optimizer.m, optimizer.v, extra)
            atomic_write(done_path, [b""])
        except OSError as e:
            for path in (done_path, state_path, model_path):
                _remove(path)
            if isinstance(e, WriteError):
                raise
            raise WriteError(e.errno, f"{e.filename or model_path}: {e.strerror or e}") from e
        if keep > 0:
            for old in self.completed_steps()[:-keep]:
                for path in (*reversed(self.checkpoint_paths(old)), self.adapter_path(old)):
                    _remove(path)   # the marker first

    def save_best(self, step, model, val_loss, measured_on):
        """The model as model_best.bin, then best.json saying its ``step``,
        ``val_loss`` and ``measured_on`` (what makes losses comparable: the
        validation data and batches). Each file is replaced atomically; a
        failure raises WriteError and leaves the earlier best whole."""
        _save_model(model, self.best_of(model))
        info = {"step": step, "val_loss": val_loss, "measured_on": measured_on}
        atomic_write(self.best_info_path, [json.dumps(info).encode()])

    def read_best(self):
        """best.json's dict, or None when there is none (or it is unreadable)."""
        try:
            info = json.loads(self.best_info_path.read_text())
        except (OSError, ValueError):
            return None
        if not (isinstance(info, dict) and isinstance(info.get("val_loss"), (int, float))
                and (self.best_path.is_file() or self.best_adapter_path.is_dir())):
            return None
        return info

    def read_state(self, step, num_params):
        """(m, v, extra) of the checkpoint of ``step``."""
        _, m, v, extra = read_state(self.checkpoint_paths(step)[1], num_params)
        return m, v, extra

    def remove_stale_temporaries(self):
        """Deletes the temporary files a killed save left; returns how many."""
        stale = [path for path in self.path.iterdir() if _TEMPORARY.fullmatch(path.name)]
        for path in stale:
            _remove(path)
        return len(stale)

    def truncate_log(self, step):
        """Drops the lines of steps after ``step`` from main.log (left by a run
        that went on past its last checkpoint), so a resumed run continues it."""
        if not self.log_path.exists():
            return
        kept = [line for line in self.log_path.read_text().splitlines(keepends=True)
                if not ((match := _STEP_LINE.match(line)) and int(match.group(1)) > step)]
        atomic_write(self.log_path, ["".join(kept).encode()])

    def truncate_metrics(self, step):
        """As truncate_log, for metrics.jsonl: keeps the measurements of steps
        up to ``step``, and drops a line a killed run left half written."""
        if not self.metrics_path.exists():
            return
        kept = [line for line in self.metrics_path.read_text().splitlines(keepends=True)
                if line.endswith("\n") and _metrics_step(line) <= step]
        atomic_write(self.metrics_path, ["".join(kept).encode()])

    def open_log(self, append):
        return open(self.log_path, "a" if append else "w")

    def open_metrics(self, append):
        return open(self.metrics_path, "a" if append else "w")


def _save_model(model, path):
    """The model file, or a LoRA model's adapters as a PEFT folder, replaced
    whole: written to a temporary folder first, then renamed."""
    if model.lora is None:
        model.save_checkpoint(path)
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _remove(temporary)
    try:
        model.save_lora(temporary)
        _remove(path)
        os.replace(temporary, path)
    finally:
        _remove(temporary)


def _remove(path):
    """Deletes a file or a folder (a PEFT one) if it is there."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
