"""The harness's errors: the base of the one error family every part of ar raises (errors.py adds the runner's
own). Here because the harness imports nothing outside harness/; the CLI prints any of them in one line.

Each class carries its exit code (the table in docs/usage.md): 1 a failure, 2 bad input.
"""


class ArError(Exception):
    """A user-facing error: the message says what is wrong and what to do."""

    exit_code = 1


class ConfigError(ArError):
    """Bad config, sweep file, flag or knob value: bad input, like a click usage error."""

    exit_code = 2


class DataError(ArError):
    """Missing, empty or corrupt data; a download that failed."""
