"""CLI commands: report (being built)."""

from . import app  # noqa: F401
