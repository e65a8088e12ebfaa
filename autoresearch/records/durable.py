"""Every file under runs/ is written one of two ways, both here: a line appended whole (results.tsv, queue.jsonl,
hooks.jsonl, events.jsonl's rare events), or a file replaced whole (the json records, clock.json, the lock's
holder, the journal's digests, events.jsonl compacted); and a record a proposal or a run changed is put back in
place (`put_back`). A reader never sees half a line or half a file; a kill mid-write leaves the old content or
a partial last line that the next append drops."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Callable

from autoresearch import faults
from autoresearch.errors import ArError

log = logging.getLogger(__name__)

Warn = Callable[[str], None]


class LedgerError(ArError):
    """A results, queue or journal file under runs/ that cannot be read or written."""


def write_json(path: Path, doc: dict) -> None:
    write_atomic(path, json.dumps(doc, indent=1, default=str) + "\n")


def write_atomic(path: Path, text: str, *, sync: bool = False) -> None:
    """Replace a file's whole content at once: written to a temporary name of this process and thread (slots
    write from their own threads), renamed over `path`. `sync`: fsync'd first, and the folder after, so that a
    power cut keeps the old content or the new. On an error the temporary file is removed and the error raised."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(text.encode("utf-8"))
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if sync:
        _fsync_dir(path.parent)


def is_json_object(line: str) -> bool:
    """Whether a journal line (queue.jsonl, hooks.jsonl) is whole: one JSON object."""
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def put_back(path: Path, data: bytes, *, sync: bool = False) -> None:
    """Write a record's earlier bytes back into the same file (the same inode, unlike `write_atomic`), so that a
    handle ar holds open on it keeps pointing at the file it reads: what the guards do after a proposal or a run
    changed a record it must not. `sync`: fsync'd."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _last_line_start(fd: int, size: int) -> int:
    """Offset just after the last newline before `size` (0 if none)."""
    pos = size
    while pos > 0:
        step = min(1 << 16, pos)
        pos -= step
        chunk = os.pread(fd, step, pos)
        i = chunk.rfind(b"\n")
        if i >= 0:
            return pos + i + 1
    return 0


def append_line(path: Path, line: str, *, header: str | None = None,
                is_whole: Callable[[str], bool] | None = None, warn: Warn | None = None) -> None:
    """Append one complete line (ending in a newline) with a single write, then fsync.

    If the file does not end with a newline, its last line was cut short by a kill mid-write: it is kept
    (a newline added) when `is_whole(line)` says it is complete, otherwise cut off with a warning, so the
    partial line is never glued to the new one. `header` is written first into an empty file. On a write
    error (full or read-only disk) the file is put back to its previous length and LedgerError is raised.
    """
    assert line.endswith("\n") and "\n" not in line[:-1], "one complete line"
    warn = warn or log.warning
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as e:
        raise LedgerError(f"cannot open {path} for writing: {e.strerror}; check the disk and permissions") from e
    created = False
    size = 0
    try:
        size = os.fstat(fd).st_size
        created = size == 0
        prefix = b""
        if size and os.pread(fd, 1, size - 1) != b"\n":
            start = _last_line_start(fd, size)
            partial = os.pread(fd, size - start, start).decode("utf-8", errors="replace")
            if is_whole is not None and is_whole(partial):
                prefix = b"\n"
            else:
                os.ftruncate(fd, start)
                os.fsync(fd)
                size = start
                warn(f"{path.name}: dropped a partial last line (cut off by a kill mid-write): {partial[:80]!r}")
        data = prefix + ((header or "") if size == 0 else "").encode() + line.encode("utf-8")
        faults.point(f"append.{path.stem}", lambda: os.write(fd, data[:len(data) // 2]))
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except OSError as e:
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass
        raise LedgerError(f"cannot write {path}: {e.strerror or e}; free disk space or fix permissions, "
                          "then run again (nothing recorded was lost)") from e
    finally:
        os.close(fd)
    if created:
        _fsync_dir(path.parent)
