"""Range checks for the numeric flags of every command line: each flag's
allowed values in a table, checked after parsing, with a one-line error
naming the flag (argparse's own errors print the usage first)."""
import math
from dataclasses import dataclass

from .errors import UsageError


@dataclass(frozen=True)
class Range:
    """Allowed values: lo <= x (lo < x when lo_open), x <= hi (x < hi when
    hi_open); None leaves that side open. Every value must be finite."""
    lo: float = None
    hi: float = None
    lo_open: bool = False
    hi_open: bool = False
    text: str = None             # how an error names the range, if not by its bounds

    def holds(self, x):
        if not math.isfinite(x):
            return False
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        if self.hi is not None and (x >= self.hi if self.hi_open else x > self.hi):
            return False
        return True

    def describe(self):
        if self.text:
            return self.text
        parts = []
        if self.lo is not None:
            parts.append(("> " if self.lo_open else ">= ") + f"{self.lo:g}")
        if self.hi is not None:
            parts.append(("< " if self.hi_open else "<= ") + f"{self.hi:g}")
        return " and ".join(parts) if parts else "finite"


POSITIVE = Range(lo=0, lo_open=True, text="positive")
NON_NEGATIVE = Range(lo=0, text=">= 0")
FRACTION = Range(lo=0, hi=1, text="in [0, 1]")
SEED = Range(lo=0, hi=2**32 - 1, text="in [0, 2^32 - 1]")


def flag_name(dest):
    return "--" + dest.replace("_", "-")


def check_flags(args, table, name=flag_name):
    """Raises UsageError for the first flag in ``table`` ({dest: Range})
    whose value in ``args`` is outside its range, naming it ``name(dest)``;
    None values are skipped (an unset optional flag). A pair of values
    (nargs=2) checks each."""
    for dest, allowed in table.items():
        value = getattr(args, dest)
        for x in (value if isinstance(value, (list, tuple)) else [value]):
            if x is not None and not allowed.holds(x):
                raise UsageError(f"{name(dest)} must be {allowed.describe()}, got {x}")
