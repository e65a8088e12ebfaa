"""One error family. Library code raises these; only the CLI catches them and prints one line.

Each class carries its exit code (the README's table): 1 a failure, 2 bad input, 3 the lock is held.
"""


class ArError(Exception):
    """A user-facing error: the message says what is wrong and what to do."""

    exit_code = 1


class ConfigError(ArError):
    """Bad config, sweep file, flag or knob value: bad input, like a click usage error."""

    exit_code = 2


class DataError(ArError):
    """Missing, empty or corrupt data; a download that failed."""


class GitError(ArError):
    """The repository is not in a state ar can work with (dirty tree, no commits, …)."""


class LockHeld(ArError):
    """Another ar process holds the lock; the message names the holder."""

    exit_code = 3


class GpuError(ArError):
    """An unknown GPU or a GPU setup that cannot run."""
