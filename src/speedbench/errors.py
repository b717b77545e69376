"""Errors every layer may raise; imports nothing of speedbench."""


class ConfigError(ValueError):
    """A user mistake in the config: printed as one line, exit status 2, no traceback."""


# A signal's KeyboardInterrupt, raised from its handler, is lost when it lands in a finalizer or
# a __del__ ("Exception ignored in ..."), and the handler ignores later signals so that they
# cannot cut the cleanup short: so the handler also records the stop here, and the rounds loop
# raises it again before each trial. A run that was asked to stop stops.
_stop: list[KeyboardInterrupt] = []


def ask_to_stop(exc: KeyboardInterrupt) -> KeyboardInterrupt:
    """Records why the run must stop (a signal handler's exception) and returns it."""
    _stop[:] = [exc]
    return exc


def clear_stop() -> None:
    """A new run in this process starts with no stop asked for."""
    _stop.clear()


def stop_if_asked() -> None:
    """Raises the recorded stop, once, if its first raise was lost."""
    if _stop:
        raise _stop.pop()
