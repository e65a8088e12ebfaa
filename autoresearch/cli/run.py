"""CLI commands: run (being built)."""

from . import app  # noqa: F401
