"""ar — an autoresearch loop runner."""

__version__ = "0.1.0"
