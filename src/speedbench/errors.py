"""Errors every layer may raise; imports nothing of speedbench."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator



class ConfigError(ValueError):
    """A user mistake in the config: printed as one line, exit status 2, no traceback."""


class OwnStop(BaseException):
    """speedbench's own BaseExceptions that are not stops (the watchdog's StepOverrun): past
    `except Exception` on purpose, and told from a model's own BaseException by this class
    (measure/isolation.py), never by a module's name."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a closed terminal), taken like Ctrl-C: a launched DDP trial's
    processes are killed and its temp folder removed on the way out (by default both signals
    end Python with no cleanup at all)."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum = signum


# A signal's KeyboardInterrupt, raised from its handler, is lost when it lands in a finalizer or
# a __del__ ("Exception ignored in ..."), or when the model's code catches it (a bare `except:`
# in a retry loop): so the handler also records the stop here, and the rounds loop raises it
# again before each trial. A run that was asked to stop stops.
_stop: list[KeyboardInterrupt] = []
_asked: list[KeyboardInterrupt] = []  # kept: whether this process was asked to stop at all


def ask_to_stop(exc: KeyboardInterrupt) -> KeyboardInterrupt:
    """Records why the run must stop (a signal handler's exception) and returns it."""
    _stop[:] = [exc]
    _asked[:] = [exc]
    return exc


def clear_stop() -> None:
    """A new run in this process starts with no stop asked for."""
    _stop.clear()
    _asked.clear()


def stop_if_asked() -> None:
    """Raises the recorded stop, once, if its first raise was lost."""
    if _stop:
        raise _stop.pop()


def stopping() -> KeyboardInterrupt | None:
    """The stop this process was asked for (a signal), even once it was raised; else None."""
    return _asked[0] if _asked else None


# While a file is written (results/atomic.py), a stop signal's action waits for the write to
# end: a KeyboardInterrupt raised between a temp file's creation and its cleanup would leave it
# behind. The handlers hand their action to `when_free`.
_holding = [0]
_after_hold: list[Callable[[], None]] = []


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Inside, a stop signal's action (when_free) waits; it runs as the outermost block ends."""
    _holding[0] += 1
    try:
        yield
    finally:
        _holding[0] -= 1
        if not _holding[0] and _after_hold:
            _after_hold.pop()()


def when_free(action: Callable[[], None]) -> None:
    """Runs a signal handler's `action` now, or when the signals_held block running ends (the
    latest action wins: a stop at once replaces a first signal's KeyboardInterrupt)."""
    if _holding[0]:
        _after_hold[:] = [action]
        return
    action()
