"""One loop per repo (and per GPU): an OS-level lock plus holder metadata beside it.

The lock is `flock` on the lock file (through the filelock library). The kernel drops it when the holder
dies, kill -9 included, so a dead holder never blocks the next run. The metadata (`<lock>.json`: pid, host,
since, tag, command) only names the holder in messages; it counts only while the OS lock is held, so the
stale file a kill -9 leaves behind is ignored.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from datetime import datetime
from pathlib import Path

import filelock
import psutil

from autoresearch.errors import ArError, LockHeld
from autoresearch.records.durable import write_atomic

# A competitor that probes the lock (read_holder) holds it for microseconds; waiting this long before
# giving up keeps such a probe from turning into a false "already running".
_ACQUIRE_WAIT = 0.25
# How long to wait for a fresh holder to write its metadata before naming it anyway.
_METADATA_WAIT = 1.0


def metadata_path(lock_path: Path) -> Path:
    lock_path = Path(lock_path)
    return lock_path.with_name(lock_path.name + ".json")


def gpu_lock_path(cache: Path, gpu_index: int) -> Path:
    """The machine-wide lock for one GPU: <cache>/locks/gpu<N>.lock (directory created)."""
    d = Path(cache) / "locks"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"gpu{int(gpu_index)}.lock"


def _proc_started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _read_metadata(lock_path: Path) -> dict | None:
    try:
        data = json.loads(metadata_path(lock_path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_current(meta: dict) -> bool:
    """Whether metadata describes a live process (on this host; another host's cannot be checked)."""
    if meta.get("host") != socket.gethostname():
        return True
    pid, started = meta.get("pid"), meta.get("pid_started")
    if not isinstance(pid, int):
        return False
    now_started = _proc_started(pid)
    if now_started is None:
        return False
    return started is None or abs(now_started - float(started)) < 0.5


def _os_lock(lock_path: Path) -> filelock.BaseFileLock:
    return filelock.FileLock(str(lock_path), timeout=0, thread_local=False)


def read_holder(lock_path: Path) -> dict | None:
    """The holder's metadata, or None when nobody holds the OS lock. Safe from any process, any time.

    When the lock is held but its metadata is not (yet) readable, returns {"pid": None, ...} with what is
    known. Checking briefly takes the lock when it is free; RepoLock.acquire tolerates that.
    """
    lock_path = Path(lock_path)
    if not lock_path.exists():
        return None
    probe = _os_lock(lock_path)
    try:
        probe.acquire()
    except filelock.Timeout:
        return _holder_metadata(lock_path)
    except OSError:  # cannot take the lock to check (e.g. another user's repo): trust live metadata
        meta = _read_metadata(lock_path)
        return meta if meta is not None and _is_current(meta) else None
    probe.release()
    return None


def _holder_metadata(lock_path: Path) -> dict:
    deadline = time.monotonic() + _METADATA_WAIT
    while True:
        meta = _read_metadata(lock_path)
        if meta is not None and _is_current(meta):
            return meta
        if time.monotonic() >= deadline:
            return {"pid": None, "host": None, "since": None, "tag": None, "command": None}
        time.sleep(0.05)


def describe(meta: dict | None) -> str:
    """'pid 123 on host x since 2026-11-30 04:50 (tag nov30, `ar run`)', or what is known of it."""
    if not meta or meta.get("pid") is None:
        return "another process (its details are not readable yet)"
    since = meta.get("since") or ""
    try:
        since = datetime.fromisoformat(since).strftime("%Y-%m-%d %H:%M")
    except ValueError:
        pass
    what = ", ".join(x for x in (f"tag {meta['tag']}" if meta.get("tag") else "",
                                 f"`{meta['command']}`" if meta.get("command") else "") if x)
    return f"pid {meta['pid']} on host {meta.get('host')} since {since}" + (f" ({what})" if what else "")


def refuse_if_held(lock_path: Path, label: str = "here") -> None:
    """LockHeld now when another ar holds the lock: a command checks before it says or makes anything (the
    lock itself is taken later, and checked again then)."""
    holder = read_holder(lock_path)
    if holder is not None:
        raise LockHeld(f"ar is already running {label}: {describe(holder)}; wait for it or stop it")


class RepoLock:
    """Exclusive, non-blocking lock: `with RepoLock(runs / ".ar.lock", tag=..., command="ar run"):`."""

    def __init__(self, lock_path: Path, *, tag: str, command: str, extra: dict | None = None,
                 label: str = "here"):
        self.lock_path = Path(lock_path)
        self.tag, self.command, self.extra, self.label = tag, command, dict(extra or {}), label
        self._lock: filelock.BaseFileLock | None = None
        self._token = ""

    @property
    def held(self) -> bool:
        return self._lock is not None

    def acquire(self) -> None:
        """Take the lock or raise LockHeld naming the holder. Does not wait for a live holder."""
        if self._lock is not None:
            return
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = _os_lock(self.lock_path)
        deadline = time.monotonic() + _ACQUIRE_WAIT
        while True:
            try:
                lock.acquire()
                break
            except filelock.Timeout:
                if time.monotonic() >= deadline:
                    holder = _holder_metadata(self.lock_path)
                    raise LockHeld(f"ar is already running {self.label}: {describe(holder)}; "
                                   "wait for it or stop it") from None
                time.sleep(0.02)
            except OSError as e:  # after Timeout, which is an OSError too
                raise ArError(f"cannot take the lock {self.lock_path}: {e.strerror or e}; runs/ must be writable "
                              "(a read-only or full disk?)") from e
        self._lock = lock
        self._token = uuid.uuid4().hex
        meta = {
            "pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.now().astimezone().isoformat(timespec="seconds"),
            "tag": self.tag, "command": self.command, "pid_started": _proc_started(os.getpid()),
            "token": self._token, **self.extra,
        }
        try:
            write_atomic(metadata_path(self.lock_path), json.dumps(meta, default=str))
        except OSError:  # the lock is what counts; a holder without metadata is still a holder
            pass

    def release(self) -> None:
        if self._lock is None:
            return
        meta = _read_metadata(self.lock_path)
        if meta is not None and meta.get("token") == self._token:
            try:
                metadata_path(self.lock_path).unlink()
            except OSError:
                pass
        lock, self._lock = self._lock, None
        lock.release(force=True)

    def __enter__(self) -> "RepoLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
