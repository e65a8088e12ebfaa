"""CLI commands: prepare (being built)."""

from . import app  # noqa: F401
