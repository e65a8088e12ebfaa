"""CLI commands: sweep (being built)."""

from . import app  # noqa: F401
