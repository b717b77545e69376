"""Errors every layer may raise; imports nothing of speedbench."""


class ConfigError(ValueError):
    """A user mistake in the config: printed as one line, exit status 2, no traceback."""
