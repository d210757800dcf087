"""The time budget of a training run: ``schedule.max_minutes`` becomes a step count once the first steps
are timed, and ``eval.every_minutes`` asks for an evaluation each time the training time crosses a
multiple of it. Training time counts optimiser steps only (evaluations and checkpoints excluded), so a
resumed run, which restores it, keeps both clocks where the interrupted run left them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["BUDGET_PROBE_STEPS", "UNRESOLVED_STEPS", "StepBudget", "EvalClock"]

BUDGET_PROBE_STEPS = 6  # with schedule.max_minutes, steps 2..6 are timed to resolve the step count
UNRESOLVED_STEPS = 10**9  # the step count until then


@dataclass
class StepBudget:
    """``max_minutes`` -> a step count from the mean time of steps 2..BUDGET_PROBE_STEPS (the first pays
    one-off costs). ``resolved`` is what a checkpoint keeps: ``max_minutes``, ``measured_step_s``,
    ``timed_steps``, ``resolved_steps``."""

    max_minutes: float | None
    resolved: dict | None = None
    step_times: list[float] = field(default_factory=list)
    measured_step_s: float | None = None  # unrounded, in the run that timed it

    @property
    def pending(self) -> bool:
        """A budget whose step count is not known yet."""
        return self.max_minutes is not None and self.resolved is None

    def total_steps(self, planned: int) -> int:
        """The run's step count: ``planned`` without a budget, else the resolved one (or UNRESOLVED_STEPS)."""
        if self.max_minutes is None:
            return planned
        return self.resolved["resolved_steps"] if self.resolved else UNRESOLVED_STEPS

    def record(self, seconds: float, mean_over_ranks: Callable[[float], float] = lambda s: s) -> bool:
        """Time one step (this run's, not a resumed one's); True when this step resolved the step count."""
        if not self.pending:
            return False
        self.step_times.append(seconds)
        if len(self.step_times) < BUDGET_PROBE_STEPS:
            return False
        timed = self.step_times[1:]
        step_s = self.measured_step_s = mean_over_ranks(sum(timed) / len(timed))
        steps = max(BUDGET_PROBE_STEPS, int(self.max_minutes * 60 / step_s))
        self.resolved = {"max_minutes": self.max_minutes, "measured_step_s": round(step_s, 5),
                         "timed_steps": len(timed), "resolved_steps": steps}
        return True


@dataclass
class EvalClock:
    """One evaluation each time the training time crosses a multiple of ``every_minutes`` (None: never)."""

    every_minutes: float | None
    crossed: int = 0  # multiples already evaluated

    def restore(self, train_s: float) -> None:
        if self.every_minutes is not None:
            self.crossed = int(train_s // (self.every_minutes * 60))

    def due(self, train_s: float) -> bool:
        if self.every_minutes is None:
            return False
        crossed = int(train_s // (self.every_minutes * 60))
        if crossed <= self.crossed:
            return False
        self.crossed = crossed
        return True
