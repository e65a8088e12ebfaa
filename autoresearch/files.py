"""The small record files (json, the journal's digests): written whole or not at all, so that a reader never
sees half a file. Slots write from their own threads: each its own temporary name."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


def write_json(path: Path, doc: dict) -> None:
    write_atomic(path, json.dumps(doc, indent=1, default=str) + "\n")


def write_atomic(path: Path, text: str) -> None:
    """A reader never sees half a file (slots write from their own threads: each its own temporary name)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
