"""Completion hooks: shell commands run on loop events, each at most once, never stopping the loop.

Each command for an event runs through the shell in its own process group, with the JSON payload on stdin
({"event": ..., "key": ..., **payload}) and AR_EVENT, AR_TAG, AR_EXP_ID, AR_COMMIT, AR_VAL_BPB, AR_STATUS
in its environment ('' when the payload lacks them). After `timeout` seconds its group gets SIGTERM, then
SIGKILL. A hook that fails, hangs or is killed is reported through `log` and the journal; `fire` never
raises. Processes a hook leaves running in the background after it exits are left alone.

Exactly once: runs/<tag>/hooks.jsonl gets a "start" line (fsync'd) before a command runs and an "end"
line after. Firing an (event, key) again, in this process or after a resume, runs only the commands
with no "start" line yet. If ar dies while a hook runs, the hook has a start without an end: it is
reported and NOT run again (at most once: a notification lost in a crash is better than a duplicate).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

from autoresearch import faults
from autoresearch.errors import ConfigError
from autoresearch.records.durable import append_line, is_json_object
from autoresearch.records.ledger import now_iso
from autoresearch.process import stop_processes

_logger = logging.getLogger(__name__)

EVENTS = ("run_started", "run_finished", "kept", "reverted", "crashed", "loop_finished")
_ENV_KEYS = {"AR_TAG": "tag", "AR_EXP_ID": "exp_id", "AR_COMMIT": "commit", "AR_VAL_BPB": "val_bpb",
             "AR_STATUS": "status"}
_TAIL_BYTES = 4096
_GRACE = 2.0


def _env_value(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6f}"
    if hasattr(v, "value"):  # an Enum such as ledger.Status
        return str(v.value)
    return str(v)


class Hooks:
    def __init__(self, commands: dict[str, list[str]], journal: Path, *, timeout: float = 30.0,
                 cwd: Path | None = None, log: Callable[[str], None] | None = None):
        unknown = sorted(set(commands) - set(EVENTS))
        if unknown:
            raise ConfigError(f"hooks: unknown event {unknown[0]!r}; use one of {', '.join(EVENTS)}")
        self.commands = {e: ([c] if isinstance(c, str) else [str(x) for x in c or []])
                         for e, c in commands.items()}
        self.journal = Path(journal)
        self.timeout = float(timeout)
        self.cwd = Path(cwd) if cwd is not None else None
        self._log = log or _logger.warning
        self._state: dict[tuple[str, str, int], str] = {}
        self._stat: tuple | None = None

    # -------------------------------------------------------------------------------------- journal
    def _load(self) -> dict[tuple[str, str, int], str]:
        try:
            st = os.stat(self.journal)
        except FileNotFoundError:
            self._state, self._stat = {}, None
            return self._state
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key == self._stat:
            return self._state
        state: dict[tuple[str, str, int], str] = {}
        text = self.journal.read_bytes().decode("utf-8", errors="replace")
        for line in text.split("\n"):
            try:
                ev = json.loads(line)
                k = (str(ev["event"]), str(ev["key"]), int(ev["i"]))
                phase = ev["phase"]
            except (ValueError, KeyError, TypeError):
                continue  # a garbage or partial line: that firing was not recorded
            if phase == "end" or state.get(k) != "end":
                state[k] = "end" if phase == "end" else "start"
        self._state, self._stat = state, key
        return state

    def _record(self, entry: dict) -> None:
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        append_line(self.journal, json.dumps(entry, separators=(",", ":"), default=str) + "\n",
                    is_whole=is_json_object, warn=self._log)

    def fired(self, event: str, key: str) -> bool:
        """Whether every command for (event, key) has been started already."""
        state = self._load()
        return all((event, str(key), i) in state for i in range(len(self.commands.get(event, []))))

    # ------------------------------------------------------------------------------------------ fire
    def fire(self, event: str, key: str, payload: dict) -> None:
        """Run the commands for `event` that have not run for `key`. Never raises."""
        if event not in EVENTS:
            raise ValueError(f"unknown hook event {event!r}")
        cmds = self.commands.get(event) or []
        key = str(key)
        for i, cmd in enumerate(cmds):
            try:
                state = self._load()
            except OSError as e:
                self._log(f"hook {event} not run: cannot read {self.journal}: {e.strerror}")
                return
            k = (event, key, i)
            if state.get(k) == "end":
                continue
            if state.get(k) == "start":
                self._log(f"hook {event} for {key} ({cmd!r}) was interrupted earlier (ar stopped while it "
                          "ran); not run again")
                continue
            base = {"event": event, "key": key, "i": i, "cmd": cmd}
            try:
                self._record({**base, "phase": "start", "at": now_iso()})
            except Exception as e:
                self._log(f"hook {event} for {key} not run: cannot record it in {self.journal}: {e}")
                continue
            try:
                outcome = self._run(cmd, event, key, payload)
            except Exception as e:  # never let a hook stop the loop
                outcome = {"result": f"error: {e}", "rc": None, "seconds": 0.0, "output": ""}
            if outcome["result"] != "ok":
                tail = outcome["output"].strip().splitlines()[-1:] or [""]
                self._log(f"hook {event} ({cmd!r}) {outcome['result']}" + (f": {tail[0][:200]}" if tail[0] else ""))
            try:
                self._record({**base, "phase": "end", "at": now_iso(), **outcome})
            except Exception as e:
                self._log(f"hook {event} for {key}: cannot record its end in {self.journal}: {e}")

    def _run(self, cmd: str, event: str, key: str, payload: dict) -> dict:
        t0 = time.monotonic()
        try:
            data = json.dumps({"event": event, "key": key, **payload}, default=_env_value).encode()
        except (TypeError, ValueError) as e:
            data = json.dumps({"event": event, "key": key, "error": f"payload not serialisable: {e}"}).encode()
        env = dict(os.environ)
        env["AR_EVENT"] = event
        for var, name in _ENV_KEYS.items():
            env[var] = _env_value(payload.get(name))
        try:
            proc = subprocess.Popen(cmd, shell=True, cwd=self.cwd, env=env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            return {"result": f"could not start: {e.strerror or e}", "rc": None, "seconds": 0.0, "output": ""}
        assert proc.stdin is not None and proc.stdout is not None
        faults.point("hook")
        tail: deque[bytes] = deque()
        done = threading.Event()
        threading.Thread(target=_feed, args=(proc.stdin, data), daemon=True).start()
        reader = threading.Thread(target=_drain, args=(proc.stdout.fileno(), tail, done), daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_processes(proc.pid, [], grace=_GRACE, leader=proc)
        except BaseException:  # Ctrl-C while a hook runs: stop it, then let the loop handle the interrupt
            stop_processes(proc.pid, [], grace=0, leader=proc)
            raise
        finally:
            reader.join(timeout=0.5)
            done.set()
            reader.join(timeout=0.5)
            if not reader.is_alive():
                proc.stdout.close()
        output = b"".join(tail)[-_TAIL_BYTES:].decode("utf-8", errors="replace")
        rc = proc.returncode
        if timed_out:
            result = f"timed out after {self.timeout:g}s (killed)"
        elif rc is not None and rc < 0:
            try:
                result = f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                result = f"killed by signal {-rc}"
        elif rc != 0:
            result = f"failed with exit code {rc}"
        else:
            result = "ok"
        return {"result": result, "rc": rc, "seconds": round(time.monotonic() - t0, 3), "output": output[-1000:]}


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
    except (BrokenPipeError, OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except (BrokenPipeError, OSError, ValueError):
            pass


def _drain(fd: int, tail: deque, done: threading.Event) -> None:
    """Keep the last _TAIL_BYTES of output; stop at EOF, or when told (a background process holds the pipe)."""
    size = 0
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], 0 if done.is_set() else 0.1)
            if not ready:
                if done.is_set():
                    break
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            tail.append(chunk)
            size += len(chunk)
            while size - len(tail[0]) >= _TAIL_BYTES:
                size -= len(tail.popleft())
            if done.is_set():
                break
    except (OSError, ValueError):
        pass
