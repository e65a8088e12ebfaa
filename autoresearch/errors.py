"""One error family. Library code raises these; only the CLI catches them and prints one line.

Each class carries its exit code (the table in docs/usage.md): 1 a failure, 2 bad input, 3 the lock is held. The base,
ConfigError and DataError are the harness's (harness/errors.py: the harness imports nothing of the runner).
"""

from autoresearch.harness.errors import ArError, ConfigError, DataError

__all__ = ["ArError", "ConfigError", "DataError", "GitError", "LockHeld", "GpuError"]


class GitError(ArError):
    """The repository is not in a state ar can work with (dirty tree, no commits, …)."""


class LockHeld(ArError):
    """Another ar process holds the lock; the message names the holder."""

    exit_code = 3


class GpuError(ArError):
    """An unknown GPU or a GPU setup that cannot run."""
