"""One clock for a run: the deadline every phase draws on (bench.time_budget_s).

bench.time_budget_s is the wall time of one experiment, all of it: the matmul peaks, each
model's data, quality probes and rounds, time to target, and the report. The run holds one
`Budget`; each phase takes a part of what is left when it starts (`part`: a model's rounds
their share of the models still to come, ...), so that time one phase does not use passes to
the next (study.study_models). Trials and probes check the deadline between steps (and the
watchdog within a step), and a model's data building stops at its share (data.DataOutOfTime),
so a run ends within its budget plus about one step; the interpreter's exit after the report
is outside the clock (not measured or budgeted), and the console says when a run overran
(run.overrun_line).

The command's first run counts from the process's start (`count_from_process_start`): the
budget bounds what a user times, Python's start-up, torch's import and the config included.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

# Kept back from a run's budget for writing summary.csv, the plots and the report at its end.
REPORT_S, REPORT_SHARE = 8.0, 0.1


_process_start: list[float] = []  # the command's start, taken by its first run


def process_age_s() -> float:
    """Seconds since this process started (from /proc on Linux; 0 where it cannot be read)."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK"))  # starttime
    except (OSError, ValueError, IndexError):
        return 0.0


def count_from_process_start() -> None:
    """The command (not run() called from Python) counts its first run's budget from the
    process's start."""
    _process_start[:] = [time.perf_counter() - process_age_s()]


_startup_s: list[float] = []  # the command's first run: from the process's start to its start


def run_start() -> float:
    """When a run's clock starts, on time.perf_counter: the process's start for a command's
    first run (the seconds to now, Python's start-up and the imports, kept: startup_s), else
    now."""
    if not _process_start:
        return time.perf_counter()
    start = _process_start.pop()
    _startup_s[:] = [time.perf_counter() - start]
    return start


def startup_s() -> float | None:
    """The seconds from the process's start to its first run's (None outside the command)."""
    return _startup_s[0] if _startup_s else None


@dataclass
class Budget:
    """`seconds` of wall time from `start` on `clock` (None: no limit)."""

    seconds: Optional[float]
    clock: Callable[[], float] = time.perf_counter
    start: float = field(default=math.nan)

    def __post_init__(self):
        if self.start != self.start:  # NaN: starts now
            self.start = self.clock()

    @classmethod
    def of_run(cls, seconds: Optional[float], clock: Callable[[], float] = time.perf_counter,
               start: float = math.nan) -> "Budget":
        """A run's budget for measuring, from `start` on `clock` (default: now):
        bench.time_budget_s less what its report needs."""
        if seconds is None:
            return cls(None, clock, start)
        return cls(seconds - min(REPORT_S, REPORT_SHARE * seconds), clock, start)

    def spent(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        """Seconds left (inf without a limit; never below 0)."""
        return math.inf if self.seconds is None else max(0.0, self.seconds - self.spent())

    def over(self) -> bool:
        return self.seconds is not None and self.spent() >= self.seconds

    def part(self, share: float) -> "Budget":
        """A part of what is left, from now: `share` of it (0 < share <= 1)."""
        if self.seconds is None:
            return Budget(None, self.clock)
        return Budget(share * self.left(), self.clock)

    def cap(self, seconds: Optional[float]) -> "Budget":
        """This clock held to `seconds` from now, where that comes before its own end (None:
        this budget as it is)."""
        if seconds is None:
            return self
        return Budget(min(seconds, self.left()), self.clock)

    def limit(self, cap: Optional[float]) -> Optional[float]:
        """The seconds a step loop started now may take: `cap`, or what is left if less; None
        where neither limits it."""
        left = self.left()
        if cap is None:
            return None if math.isinf(left) else left
        return min(cap, left)
