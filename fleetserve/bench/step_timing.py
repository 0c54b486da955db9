"""Per-step engine-core timers for `bench offline`: where a step's wall time goes.

`StepTimers.attach(llm)` wraps the engine core's scheduler (`schedule`, `update_from_output`)
and the worker's `execute_model` with `perf_counter` accumulators, so that a run reports, per
step, in µs: the engine core's own work (schedule + update), the forward on the worker (which
under async scheduling runs on the worker thread, overlapped with that work), and the wall time
between steps. Synchronously wall ≈ core + forward (+ the front end); with async scheduling the
core's share hides behind the forward, which is the point of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepTimers"]


@dataclass
class _Timer:
    seconds: float = 0.0
    calls: int = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


@dataclass
class StepTimers:
    """Accumulated time of the engine core's schedule/update and of the worker's steps."""

    schedule: _Timer = field(default_factory=_Timer)
    update: _Timer = field(default_factory=_Timer)
    forward: _Timer = field(default_factory=_Timer)

    @classmethod
    def attach(cls, llm: Any) -> StepTimers:
        """Wrap `llm`'s scheduler and in-process worker (the 'uni' executor's)."""
        timers = cls()
        scheduler = llm.engine_core.scheduler
        scheduler.schedule = timers.schedule.wrap(scheduler.schedule)
        scheduler.update_from_output = timers.update.wrap(scheduler.update_from_output)
        worker = getattr(llm.engine_core.executor, "worker", None)
        if worker is not None:
            worker.execute_model = timers.forward.wrap(worker.execute_model)
        return timers

    def reset(self) -> None:
        """Zero the counts (the wrappers keep their timers)."""
        for timer in (self.schedule, self.update, self.forward):
            timer.seconds, timer.calls = 0.0, 0

    def describe(self, wall_seconds: float) -> str:
        """One line: µs per step of the core's work, the forward and the wall (per forward)."""
        steps = max(self.forward.calls, 1)
        core_us = 1e6 * (self.schedule.seconds + self.update.seconds) / steps
        return (
            f"{self.forward.calls} steps; per step: engine core {core_us:.0f} µs "
            f"(schedule {1e6 * self.schedule.seconds / steps:.0f}, update "
            f"{1e6 * self.update.seconds / steps:.0f}), forward "
            f"{1e6 * self.forward.seconds / steps:.0f} µs, wall {1e6 * wall_seconds / steps:.0f} µs"
        )
