"""One training subprocess that the runner can always stop.

- Own process group (start_new_session) and a unique AR_RUN_ID in its environment.
- stdout + stderr go through a pipe to a reader thread that writes the log, capped at `max_log_bytes`
  (the rest is counted and dropped, and a note says so); it keeps draining, so the child never blocks.
- The wall-clock timeout is kept by the calling thread, whatever the output does.
- On timeout, on a stop reason from `on_line`, or on Ctrl-C: SIGTERM to the group and to every
  descendant seen, SIGKILL after `grace`. Descendants that left the group (setsid, double fork) are found
  through a process-tree snapshot taken every second and through the AR_RUN_ID marker in their
  environment. Whatever is still alive after the child exits normally is stopped the same way.
- On Linux the child also gets SIGKILL if ar itself dies (PR_SET_PDEATHSIG), so a kill -9 of `ar run` does
  not leave training holding the GPU; `stop_marked(run_id)` sweeps anything else a dead run left.

Ctrl-C (KeyboardInterrupt) during the run is not re-raised: the run is stopped and the result says
stop_reason="interrupted"; the caller records it and decides whether to go on. A second Ctrl-C while
stopping skips the grace period.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import psutil

from autoresearch.errors import ArError

RUN_ID_VAR = "AR_RUN_ID"
STOP_TIMEOUT = "timeout"
STOP_INTERRUPTED = "interrupted"
_MAX_LINE = 1 << 16  # longer "lines" are cut before they reach on_line
_TRACK_EVERY = 1.0

if sys.platform.startswith("linux"):
    try:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover
        _LIBC = None
else:  # pragma: no cover
    _LIBC = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class RunResult:
    returncode: int | None     # None: could not start, or would not die
    timed_out: bool
    stop_reason: str | None    # "timeout", "interrupted", an on_line reason, or None if it ended by itself
    wall_seconds: float
    log_path: Path
    log_truncated: bool
    run_id: str = ""
    dropped_bytes: int = 0
    leftovers_killed: list[str] = field(default_factory=list)  # "pid 123 (python)" stopped after the run


# ------------------------------------------------------------------------------------ process helpers

def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def find_marked(run_id: str, *, since: float = 0.0) -> list[psutil.Process]:
    """Live processes (other than this one) whose environment carries AR_RUN_ID=run_id."""
    me, out = os.getpid(), []
    for p in psutil.process_iter(["create_time"]):
        if p.pid == me or (p.info.get("create_time") or 0) < since - 1:
            continue
        try:
            if p.environ().get(RUN_ID_VAR) == run_id and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def _group_alive(pgid: int) -> bool:
    """Whether the process group has a member that is not a zombie."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for p in psutil.process_iter():  # zombies count as members until reaped, which may be never
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue
    return False


def _signal_all(pgid: int | None, procs: Iterable[psutil.Process], sig: int) -> None:
    if pgid is not None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.send_signal(sig)  # psutil checks the pid was not reused
        except psutil.Error:
            pass


def stop_processes(pgid: int | None, procs: Iterable[psutil.Process], *, grace: float,
                   leader: subprocess.Popen | None = None, marker: str | None = None,
                   since: float = 0.0) -> list[str]:
    """SIGTERM the group and the processes, SIGKILL whatever is left after `grace`.

    Returns 'pid N (name)' for each process signalled besides the leader and its group.

    A second Ctrl-C while waiting skips the rest of the grace period.
    """
    procs = {p.pid: p for p in procs if _alive(p)}
    if marker:
        procs.update({p.pid: p for p in find_marked(marker, since=since)})
    if leader is not None:
        procs.pop(leader.pid, None)
    group = pgid is not None and _group_alive(pgid)
    leader_alive = leader is not None and leader.poll() is None
    if not (procs or group or leader_alive):
        return []
    labels = {pid: _label(p) for pid, p in procs.items()}
    _signal_all(pgid if group else None, procs.values(), signal.SIGTERM)
    try:
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            leader_alive = leader is not None and leader.poll() is None
            if not leader_alive and not any(_alive(p) for p in procs.values()) and not (
                    pgid is not None and _group_alive(pgid)):
                break
            time.sleep(0.02)
    except KeyboardInterrupt:
        pass
    if marker:  # anything started during the grace period
        procs.update({p.pid: p for p in find_marked(marker, since=since) if p.pid not in procs})
        if leader is not None:
            procs.pop(leader.pid, None)
    labels.update({pid: _label(p) for pid, p in procs.items() if pid not in labels})
    _signal_all(pgid if pgid is not None and _group_alive(pgid) else None, procs.values(), signal.SIGKILL)
    if leader is not None and leader.poll() is None:
        try:
            leader.kill()
            leader.wait(timeout=30)
        except (subprocess.TimeoutExpired, OSError):
            pass
    _wait_gone(procs.values(), 1.0)
    return [labels[pid] for pid in procs]


def _wait_gone(procs: Iterable[psutil.Process], timeout: float) -> None:
    """Wait until none runs (a zombie whose parent does not reap it counts as gone)."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.01)


def stop_marked(run_id: str, *, grace: float = 2.0) -> list[str]:
    """Stop every process left from a run (e.g. after ar itself was killed). Returns 'pid N (name)'."""
    return stop_processes(None, find_marked(run_id), grace=grace)


def _label(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid} ({p.name()})"
    except psutil.Error:
        return f"pid {p.pid}"


# ------------------------------------------------------------------------------------------- the pump

class _Pump(threading.Thread):
    """Reads the child's output: writes the capped log and hands complete lines to on_line."""

    def __init__(self, fd: int, log, max_bytes: int, on_line: Callable[[str], str | None] | None):
        super().__init__(daemon=True, name="ar-log-pump")
        self.fd, self.log, self.max_bytes, self.on_line = fd, log, max_bytes, on_line
        self.written = 0
        self.dropped = 0
        self.stop_reason: str | None = None
        self.error: BaseException | None = None
        self.wake = threading.Event()
        self.finish = threading.Event()  # set by the main thread: drain what is there, then exit
        self._buf = b""

    def run(self) -> None:
        extra = 0  # chunks read after `finish`: bounded, in case something unkillable keeps writing
        try:
            while extra < 64:
                finishing = self.finish.is_set()
                try:
                    ready, _, _ = select.select([self.fd], [], [], 0 if finishing else 0.2)
                    if not ready:
                        if finishing:
                            break
                        continue
                    chunk = os.read(self.fd, 1 << 16)
                except (OSError, ValueError):
                    break
                if not chunk:
                    break
                extra += finishing
                self._write(chunk)
                if self.on_line is not None and self.stop_reason is None and self.error is None:
                    self._lines(chunk)
            if self._buf and self.on_line is not None and self.stop_reason is None and self.error is None:
                self._line(self._buf)
        except OSError as e:  # the log's disk is full or gone: stop the run rather than lose its output
            self.error = e
        finally:
            self.wake.set()

    def _write(self, chunk: bytes) -> None:
        room = self.max_bytes - self.written
        if room > 0:
            part = chunk[:room]
            self.log.write(part)
            self.written += len(part)
        self.dropped += max(0, len(chunk) - max(room, 0))

    def _lines(self, chunk: bytes) -> None:
        data = self._buf + chunk
        if b"\n" not in chunk:
            self._buf = data[-_MAX_LINE:]
            return
        *lines, self._buf = data.split(b"\n")
        self._buf = self._buf[-_MAX_LINE:]
        for raw in lines:
            if self.stop_reason is not None or self.error is not None:
                return
            self._line(raw[-_MAX_LINE:])

    def _line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace").rstrip("\r")
        if "\r" in text:  # a progress bar redrawn in place: its last state counts
            text = text.rsplit("\r", 1)[-1]
        try:
            reason = self.on_line(text)
        except Exception as e:  # a bug in the caller's callback: stop the run and re-raise it later
            self.error = e
            self.wake.set()
            return
        if reason:
            self.stop_reason = str(reason)
            self.wake.set()


# ---------------------------------------------------------------------------------------- run_training

def run_training(cmd: list[str], *, cwd: Path, env: dict, log_path: Path, timeout: float,
                 on_line: Callable[[str], str | None] | None = None, max_log_bytes: int = 50 * 2**20,
                 grace: float = 5.0, run_id: str | None = None, gate: Callable[[subprocess.Popen], bool] | None = None,
                 pass_fds: tuple[int, ...] = (), on_start: Callable[[subprocess.Popen], None] | None = None,
                 called_off: Callable[[], str | None] | None = None, clock=time) -> RunResult:
    """Run `cmd` to completion or until stopped; see the module docstring. Never leaves processes behind.

    `on_line` runs in the reader thread for each output line (without its newline); returning a string
    stops the run with that reason. An exception from it stops the run and is re-raised here afterwards.
    An OSError writing the log (disk full) also stops the run and is re-raised. `gate(proc)`, when given, is
    called once the process has started and returns when it may go on (False: stop it, as interrupted); the
    timeout and the wall time count from its return (harness/launcher.py). `on_start(proc)` is called once the
    process has started (before `gate`). `called_off()`, polled while it runs, returns a reason to stop it (what
    it was for no longer counts). `clock` times the timeout and the wall time (the `time` module, or a clock a
    test moves).
    """
    run_id = run_id or uuid.uuid4().hex
    env = {str(k): str(v) for k, v in env.items()}
    env[RUN_ID_VAR] = run_id
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = clock.monotonic()
    since = time.time()
    log = open(log_path, "wb", buffering=0)
    try:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent if _LIBC is not None else None, bufsize=0,
            pass_fds=pass_fds)
    except OSError as e:
        log.write(f"[ar] could not start {cmd[0]!r}: {e.strerror or e}\n".encode())
        log.close()
        return RunResult(None, False, f"could not start {cmd[0]!r}: {e.strerror or e}",
                         clock.monotonic() - t0, log_path, False, run_id)
    assert proc.stdout is not None
    pump = _Pump(proc.stdout.fileno(), log, max_log_bytes, on_line)
    pump.start()
    tracked: dict[int, psutil.Process] = {}
    try:
        tracked[proc.pid] = psutil.Process(proc.pid)
    except psutil.Error:
        pass

    if on_start is not None:
        on_start(proc)
    stop: str | None = None
    timed_out = False
    if gate is not None:
        try:
            if not gate(proc):
                stop = STOP_INTERRUPTED
        except KeyboardInterrupt:
            stop = STOP_INTERRUPTED
        t0 = clock.monotonic()
    deadline = t0 + timeout
    next_track = 0.0
    try:
        while not stop:
            if proc.poll() is not None:
                break
            if pump.stop_reason is not None:
                stop = pump.stop_reason
                break
            if pump.error is not None:
                stop = f"stopped: {pump.error}"
                break
            if called_off is not None:
                stop = called_off()
                if stop:
                    break
            now = clock.monotonic()
            if now >= deadline:
                stop, timed_out = STOP_TIMEOUT, True
                break
            if now >= next_track:
                tracked.update({p.pid: p for p in _descendants(proc.pid)})
                next_track = now + _TRACK_EVERY
            pump.wake.wait(min(0.05, max(0.0, deadline - now)))
    except KeyboardInterrupt:
        stop = STOP_INTERRUPTED

    # Stop the child (if still running) and everything it started, shielded from a second Ctrl-C.
    try:
        if proc.poll() is None:
            tracked.update({p.pid: p for p in _descendants(proc.pid)})
        exited_itself = proc.poll() is not None
        tracked.pop(proc.pid, None)
        killed = stop_processes(proc.pid, tracked.values(), grace=grace if stop else min(grace, 1.0),
                                leader=proc, marker=run_id, since=since)
    except KeyboardInterrupt:
        stop = stop or STOP_INTERRUPTED
        exited_itself = False
        killed = stop_processes(proc.pid, tracked.values(), grace=0, leader=proc, marker=run_id, since=since)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    wall = clock.monotonic() - t0

    pump.join(timeout=2.0)
    pump.finish.set()
    pump.join(timeout=2.0)
    if not pump.is_alive():  # else leave the pipe open rather than close it under the reader
        proc.stdout.close()
    notes = []
    if pump.dropped:
        notes.append(f"[ar] log capped at {max_log_bytes} bytes: {pump.dropped} more bytes of output were dropped")
    if stop:
        notes.append(f"[ar] run stopped ({stop}) after {wall:.1f}s: SIGTERM to its process group, "
                     f"SIGKILL after {grace:g}s")
    labels = killed
    if labels and exited_itself and not stop:
        notes.append(f"[ar] stopped processes left running after the run: {', '.join(labels)}")
    try:
        if notes:
            log.write(("\n" + "\n".join(notes) + "\n").encode())
    except OSError:
        pass
    finally:
        log.close()
    if isinstance(pump.error, OSError):
        raise ArError(f"cannot write {log_path}: {pump.error.strerror or pump.error}; free disk space or fix "
                      "permissions, then run again") from pump.error
    if pump.error is not None:
        raise pump.error
    return RunResult(proc.returncode, timed_out, stop, wall, log_path, pump.dropped > 0, run_id,
                     pump.dropped, labels if not stop else [])
