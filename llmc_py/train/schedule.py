"""The learning-rate schedule: linear warmup, then cosine, linear or constant
decay to a final fraction of the peak (llm.c's train_gpt2.cu schedulers)."""
import math
from dataclasses import dataclass


SCHEDULES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class LRSchedule:
    peak: float                  # the learning rate after warmup
    total_steps: int             # the step the decay ends at
    warmup_steps: int = 0        # steps of linear warmup from 0 (step 1 gets peak / warmup)
    kind: str = "cosine"         # SCHEDULES
    final_fraction: float = 0.1  # the rate at total_steps, as a fraction of peak

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule {self.kind!r}: expected one of {', '.join(SCHEDULES)}")
        if not (math.isfinite(self.peak) and self.peak > 0):
            raise ValueError(f"the peak learning rate must be positive and finite, got {self.peak}")
        if not 0 <= self.final_fraction <= 1:
            raise ValueError(f"the final learning-rate fraction must be in [0, 1], got "
                             f"{self.final_fraction}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(f"warmup_steps must be >= 0 and total_steps >= 1, got "
                             f"{self.warmup_steps}, {self.total_steps}")

    def __call__(self, step):
        """The learning rate for optimizer step ``step`` (1-based)."""
        peak, final = self.peak, self.peak * self.final_fraction
        if step <= self.warmup_steps:
            return peak * step / self.warmup_steps
        if self.kind == "constant":
            return peak
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        if self.kind == "linear":
            return peak + (final - peak) * progress
        return final + 0.5 * (peak - final) * (1.0 + math.cos(math.pi * progress))
