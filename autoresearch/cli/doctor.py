"""CLI commands: doctor (being built)."""

from . import app  # noqa: F401
