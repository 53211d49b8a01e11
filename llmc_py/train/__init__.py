"""Training: the optimizer (optimizer.py), the learning-rate schedule
(schedule.py), the run folder (run_folder.py), one step with hooks (loop.py)
and the command line that sequences a run (cli.py; ``python -m llmc_py.train``)."""
from .cli import build_parser, config_from_depth, lr_at, main, run
from .loop import StepResult, Trainer, evaluate, perplexity
from .optimizer import AdamW
from .run_folder import RunFolder
from .schedule import LRSchedule

__all__ = ["AdamW", "LRSchedule", "RunFolder", "Trainer", "StepResult", "evaluate", "perplexity", "main",
           "run", "build_parser", "config_from_depth", "lr_at"]
