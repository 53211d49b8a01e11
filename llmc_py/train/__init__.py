"""Training: the optimizer (optimizer.py), the learning-rate schedule
(schedule.py), the run folder (run_folder.py), one step with hooks (loop.py),
a whole run from a specification (spec.py's RunSpec, runner.py's Run and
``run(spec)``, hooks.py) and the command line that parses one (cli.py;
``python -m llmc_py.train``)."""
from ..model.presets import config_from_depth
from .cli import build_parser, lr_at, main
from .loop import StepResult, Trainer, evaluate, perplexity
from .optimizer import AdamW
from .run_folder import RunFolder
from .runner import Run, run
from .schedule import LRSchedule
from .spec import RunSpec

__all__ = ["AdamW", "LRSchedule", "RunFolder", "Trainer", "StepResult", "evaluate",
           "perplexity", "main", "run", "Run", "RunSpec", "build_parser", "config_from_depth",
           "lr_at"]
