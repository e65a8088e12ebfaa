"""One error family. Library code raises these; only the CLI catches them and prints one line."""


class ArError(Exception):
    """A user-facing error: the message says what is wrong and what to do."""

    exit_code = 1


class ConfigError(ArError):
    """Bad config, sweep file, flag or knob value."""


class DataError(ArError):
    """Missing, empty or corrupt data; a download that failed."""


class GitError(ArError):
    """The repository is not in a state ar can work with (dirty tree, no commits, …)."""


class LockHeld(ArError):
    """Another ar process holds the lock; the message names the holder."""

    exit_code = 3


class GpuError(ArError):
    """An unknown GPU or a GPU setup that cannot run."""
