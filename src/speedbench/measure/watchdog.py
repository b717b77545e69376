"""A hard time limit on a block of this process's code (`deadline`), and a backstop for code
that never comes back to Python.

Checks between steps cannot stop a step that is itself longer than the budget, nor one that
never ends. `deadline(seconds, what)` arms the process's real-time interval timer
(signal.setitimer, SIGALRM); its handler raises StepOverrun in the main thread. Python runs a
signal handler between bytecodes, so this interrupts time.sleep, model code written in Python,
and torch between two operators. The alarm fires once per deadline (once more only when its
exception was lost in a finalizer, "Exception ignored in ..."), never inside an import (it
waits for the import to end, which would otherwise stay half-made); `disarm()` stops it early,
so that the cleanup after the guarded work runs uninterrupted.

Deadlines nest: the earliest one due arms the timer, an outer one survives an inner one, and
when the outermost ends the SIGALRM handler and the timer that were there before are restored,
the time spent inside taken off the timer. Only SIGALRM is touched: SIGINT, SIGTERM and SIGHUP
(__main__.py) keep their handlers.

The backstop: code that never returns to the interpreter (a hang in C, SIGALRM blocked) cannot
be interrupted. A daemon thread waits for the deadline plus a grace (grace_s: at least
GRACE_MIN_S, half the deadline for long ones); if the block is still running then, it writes
one line to stderr naming what ran and its limit, dumps every thread's stack (faulthandler)
and ends the process with EXIT_STUCK. What was already written stays (trials.csv's rows are
appended whole); the run directory stays incomplete. A hang that holds the GIL stops that
thread too and is not caught.

No-op (nothing armed, no thread) when `seconds` is None or infinite, off the main thread, or
where the platform has no SIGALRM / setitimer.
"""
from __future__ import annotations

import faulthandler
import math
import os
import signal
import sys
import threading
import time
from typing import Optional

from speedbench.errors import OwnStop

EXIT_STUCK = 124  # the exit status of a process the backstop ended (as timeout(1)'s)
GRACE_MIN_S = 30.0  # the backstop waits at least this long past the deadline
SLACK_S = 0.002  # a timer that fires this early still counts as due
SOON_S = 1e-4  # the timer's delay for what is already due
# An overrun is not raised inside an import (it would leave the module half-made for the rest of
# the run: "module 'sympy' has no attribute 'logic'"): the alarm looks again this much later.
IMPORT_WAIT_S = 0.05


class StepOverrun(OwnStop):
    """A deadline passed. A BaseException, as KeyboardInterrupt is, so that code catching
    Exception (a fault kept in a row) does not swallow it: catch it outside the `with` block."""

    def __init__(self, deadline: "Deadline"):
        self.deadline = deadline
        self.elapsed_s = time.monotonic() - deadline.started
        super().__init__(f"{deadline.what}: past its deadline of {deadline.seconds:g} s "
                         f"(stopped after {self.elapsed_s:.1f} s)")


def grace_s(seconds: float) -> float:
    """How long after its deadline a block that does not return to Python is let run."""
    return max(GRACE_MIN_S, seconds / 2)


def usable() -> bool:
    """Whether a deadline can be armed here: POSIX timers, and this is the main thread."""
    return (hasattr(signal, "SIGALRM") and hasattr(signal, "setitimer")
            and threading.current_thread() is threading.main_thread())


_stack: list["Deadline"] = []  # the deadlines in force, outermost first
_outside: dict = {}  # what the outermost found: SIGALRM handler, timer, unraisable hook
_quiet = [0]  # > 0 while the stack is being changed: the handler then only re-arms


class Deadline:
    """One block's time limit; see the module's doc. `what` names it in the backstop's line
    ("model resnet, variant amp_fp16"); `limit` says where the seconds come from.

    With `step_s`, the deadline also waits for the step running when it falls due: it fires
    once `seconds` have passed *and* the current step has run `step_s`, so that a block of
    many steps each within `step_s` is never stopped. A step is what a function wrapped by
    `stepping` runs, or the time since `step_done()` was last called (the block's start first).
    """

    def __init__(self, seconds: Optional[float], what: str, limit: str = "",
                 grace: Optional[float] = None, step_s: Optional[float] = None):
        self.seconds, self.what, self.limit, self.step_s = seconds, what, limit, step_s
        self.active = seconds is not None and math.isfinite(seconds) and usable()
        self.grace = grace if grace is not None else grace_s(seconds) if self.active else 0.0
        self.fired = self.off = False
        self.started = self.due = self.last_step = self.end_by = math.nan
        self._ended = threading.Event()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def step_done(self) -> None:
        """A step (or a part of the block counted as one) ended: the next one starts now."""
        self.last_step = time.monotonic()

    def stepping(self, step):
        """`step`, marking its end (step_done); `step` itself where nothing is armed."""
        if not self.active or self.step_s is None:
            return step

        def marked(*args, **kwargs):
            try:
                return step(*args, **kwargs)
            finally:
                self.last_step = time.monotonic()
        return marked

    def disarm(self) -> None:
        """No alarm from this deadline from now on (the backstop stays until the block ends)."""
        if self.active and not self.off:
            with _changing():
                self.off = True

    def __enter__(self) -> "Deadline":
        self.started = time.monotonic()
        if not self.active:
            return self
        try:
            # the backstop starts while the handler is quiet: a deadline already due (a block
            # given no time) raises only once the block is entered, never in here, where the
            # `with` would not call __exit__ and a stale backstop would end the process later
            with _changing():
                if not _stack:
                    _save_outside()
                self.due, self.last_step = self.started + self.seconds, self.started
                self.end_by = self.due + self.grace
                _stack.append(self)
                threading.Thread(target=self._backstop, name="speedbench-watchdog",
                                 daemon=True).start()
        except BaseException:  # an alarm on the way out of _changing: nothing left behind
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> bool:
        if self.active:
            self._ended.set()
            with _changing():
                if self in _stack:
                    _stack.remove(self)
                if not _stack:
                    _restore_outside()
        return False

    def _backstop(self) -> None:
        # end_by moves on while the handler lets a step within step_s run past the deadline
        while not self._ended.wait(max(self.end_by - time.monotonic(), 0.01)):
            if time.monotonic() >= self.end_by:
                stuck(self)


def deadline(seconds: Optional[float], what: str, limit: str = "",
             grace: Optional[float] = None, step_s: Optional[float] = None) -> Deadline:
    """A context manager: StepOverrun is raised in the block once `seconds` have passed (and
    its current step has run `step_s`, if given); the process ends (stuck()) if the block is
    still running `grace` seconds after that."""
    return Deadline(seconds, what, limit, grace, step_s)


def stuck(d: Deadline) -> None:
    """The backstop: one line, every thread's stack, and the process ends (EXIT_STUCK)."""
    limit = f" ({d.limit})" if d.limit else ""
    line = (f"\nspeedbench: {d.what} is stuck in code that does not return to Python, "
            f"{d.elapsed_s:.0f} s after it started: past its hard limit of {d.seconds:g} s{limit} "
            f"and {d.grace:.0f} s of grace. Ending the process (exit status {EXIT_STUCK}); the "
            "trials already finished are kept, the run stays incomplete. Every thread's stack "
            "follows.\n")
    try:
        os.write(2, line.encode("utf-8", "replace"))
        faulthandler.dump_traceback(2, all_threads=True)
    finally:
        os._exit(EXIT_STUCK)


class _changing:
    """The stack and the timer change as one: the handler does not raise meanwhile, and the
    timer is armed again afterwards (at once, if a deadline fell due in between)."""

    def __enter__(self):
        _quiet[0] += 1

    def __exit__(self, *exc):
        _quiet[0] -= 1
        if _stack:
            _arm()
        return False


def _arm() -> None:
    """The timer set for the earliest of: a deadline in force, the timer found outside."""
    dues = [d.due for d in _stack if not d.off]
    if _outside.get("due") is not None:
        dues.append(_outside["due"])
    delay = min(dues, default=math.inf) - time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, 0 if delay == math.inf else max(delay, SOON_S))


def _on_alarm(signum, frame) -> None:
    if _quiet[0]:
        return  # _changing arms the timer again on its way out
    now = time.monotonic() + SLACK_S
    due = [d for d in _stack if not d.off and d.due <= now and not _step_goes_on(d, now)]
    if due and _importing(frame):
        for d in due:
            d.due = now + IMPORT_WAIT_S
        due = []
    for d in due:
        d.fired, d.due = True, math.inf
    outside = _outside.get("due")
    ring = not due and outside is not None and outside <= now  # the timer found outside
    if ring:
        _outside["due"] = None
    _arm()
    if due:
        raise StepOverrun(due[0])  # the outermost: it holds the others
    if ring and callable(_outside.get("handler")):
        _outside["handler"](signum, frame)


def _step_goes_on(d: Deadline, now: float) -> bool:
    """A deadline with step_s whose current step has not run step_s yet: due when it will have
    (the backstop's end moves on with it)."""
    if d.step_s is None or now - d.last_step >= d.step_s:
        return False
    d.due = d.last_step + d.step_s
    d.end_by = max(d.end_by, d.due + d.grace)
    return True


def _importing(frame) -> bool:
    """Whether the interrupted code runs inside an import (importlib's frames on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _on_unraisable(unraisable) -> None:
    """An overrun raised inside a finalizer is lost ("Exception ignored in ..."): raised again
    at once."""
    exc = unraisable.exc_value
    if isinstance(exc, StepOverrun) and any(d is exc.deadline for d in _stack):
        exc.deadline.due = time.monotonic()
        _arm()
        return
    (_outside.get("hook") or sys.__unraisablehook__)(unraisable)


def _save_outside() -> None:
    remaining, interval = signal.getitimer(signal.ITIMER_REAL)
    _outside.update(handler=signal.signal(signal.SIGALRM, _on_alarm),
                    due=time.monotonic() + remaining if remaining > 0 else None,
                    interval=interval, hook=sys.unraisablehook)
    sys.unraisablehook = _on_unraisable


def _restore_outside() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)
    handler = _outside.get("handler")
    signal.signal(signal.SIGALRM, signal.SIG_DFL if handler is None else handler)
    if sys.unraisablehook is _on_unraisable:
        sys.unraisablehook = _outside.get("hook") or sys.__unraisablehook__
    due, interval = _outside.get("due"), _outside.get("interval") or 0.0
    if due is not None:  # the timer found outside, less the time spent inside
        signal.setitimer(signal.ITIMER_REAL, max(due - time.monotonic(), SOON_S), interval)
    elif interval > 0:  # a periodic one that fell due inside: it goes on
        signal.setitimer(signal.ITIMER_REAL, interval, interval)
    _outside.clear()
