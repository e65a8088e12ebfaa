"""Evaluate: start the trusted evaluator beside the training run, release it on the checkpoint, read its record.

The evaluator (harness/evaluator.py) starts when training starts, so its imports, the data hashes and the
sandboxed model worker's imports overlap training; it waits for "go". After the run, ar checks that the
package and the data still match the session's fingerprint, then says "go" (or "stop" when there is no
checkpoint to score). On a GPU it says "prestart" first, a few seconds before the training window ends, so that the
model workers' CUDA contexts and buffers are ready at "go" (they load nothing of the proposal before it). The record lands in the experiment's folder; the hold-out score goes to the tag's
private file, which no log or prompt shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from autoresearch.harness import sandbox
from autoresearch.harness.data import hidden_sources
from autoresearch.harness.env import KEPT_ENV
from autoresearch.experiment.request import RunRequest
from autoresearch.experiment.execute import Workspace, tree_pids

_ENV = KEPT_ENV + ("AR_GPU_MEMORY_GB", "LD_LIBRARY_PATH")


@dataclass
class Verdict:
    val_bpb: float | None
    rejected: str | None          # the model or checkpoint disqualifies the run (a reason a user can read)
    error: str | None             # the evaluation itself failed (not the model's fault)
    record: dict
    holdout_bpb: float | None


def worker_policy(ws: Workspace, job: Path | None = None, tok_dir: Path | None = None) -> dict:
    """A model worker's sandbox: it reads the proposal's tree and the checkpoint, writes its own job folder."""
    p = sandbox.base_policy()
    p["read"] += [str(ws.src), str(ws.checkpoint)]
    p["write"] += [str(job or ws.job)]
    p["hide"] = hidden_sources(tok_dir)
    return p


def fresh_job(ws: Workspace) -> Path:
    """The folder of the fresh worker that scores a secret sample again (beside the main worker's, not in it)."""
    return ws.root / "eval-fresh"


class Server:
    """A session's evaluator process (`evaluator serve`), started on first use, restarted when it dies.
    One per slot: each serves one experiment at a time; its model fork server is its child."""

    def __init__(self, log_path: Path, slot_env: dict[str, str] | None = None):
        self.log_path, self.slot_env = log_path, dict(slot_env or {})
        self.proc: subprocess.Popen | None = None
        self.next_id = 0

    def ensure(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            env = {k: v for k, v in os.environ.items() if k in _ENV}
            env.update(self.slot_env, HOME=str(self.log_path.parent), PYTHONUNBUFFERED="1")
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-I", "-B", "-m", "autoresearch.harness.evaluator", "serve"], cwd="/", env=env,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True, bufsize=0)
        return self.proc

    def pids(self) -> set[int]:
        """The evaluator's processes now: the server, its fork server and the model workers (none when stopped)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return set()
        return tree_pids(proc)

    def send(self, line: str) -> bool:
        try:
            self.ensure().stdin.write(line.encode() + b"\n")
            return True
        except OSError:
            return False

    def wait_done(self, rid: int, timeout: float) -> bool:
        import select
        proc = self.proc
        deadline = time.monotonic() + timeout
        buf = b""
        while proc is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                self.close()
                return False
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                self.close()
                return False
            buf += chunk
            if f"done {rid}\n".encode() in buf:
                return True
        return False

    def close(self) -> None:
        """Stop the server; it stops its fork server, which kills and reaps every model worker. When this
        returns no process of the session is left, not even a zombie: a read-only remount or an unmount of
        runs/ right after `ar` exits must not find the workspace's inodes still held."""
        if self.proc is None:
            return
        pid = self.proc.pid      # end of input: it stops its fork server and exits by itself; the last resort
        sandbox.stop_on_end_of_input(self.proc, grace=10, kill=lambda: os.killpg(pid, 9))   # shares its group
        self.proc = None


class Evaluation:
    """One experiment's evaluation on a session's server: submitted when training starts, released after."""

    def __init__(self, req: RunRequest, ws: Workspace, manifest: dict, record: Path, private: Path, server: Server):
        self.record, self.private, self.req, self.server = record, private, req, server
        server.next_id += 1
        self.rid = server.next_id
        doc = {"id": self.rid, "tok_dir": str(req.tok_dir), "dataset": req.dataset, "seq_len": req.profile.seq_len,
               "eval_tokens": req.eval_tokens, "holdout_tokens": req.holdout_tokens, "rows": req.eval_rows,
               "device": req.device, "manifest": manifest, "checkpoint": str(ws.checkpoint), "source": str(ws.src),
               "train_file": req.train_file, "job_dir": str(ws.job), "record": str(record), "private": str(private),
               "timeout": req.eval_allowance, "sandbox": req.sandbox, "policy": worker_policy(ws, tok_dir=req.tok_dir),
               "fresh_job_dir": str(fresh_job(ws)), "fresh_policy": worker_policy(ws, fresh_job(ws), req.tok_dir),
               "fresh_rows": req.eval_rows if req.device == "cuda" else min(req.eval_rows, 4),
               "tolerance": 1e-3 if req.device == "cpu" else 2e-3}
        record.unlink(missing_ok=True)
        self.submitted = server.send(json.dumps(doc))

    def prestart(self) -> None:
        """Training is near its end: the evaluator may start its model workers (trusted work only until "go")."""
        proc = self.server.proc
        if self.submitted and proc is not None and proc.poll() is None:   # never to a restarted server
            self.server.send(f"prestart {self.rid}")

    def finish(self, go: bool) -> Verdict:
        """Release the evaluator (go) or tell it there is nothing to score; wait; read the record."""
        if not self.submitted or not self.server.send(f"{'go' if go else 'stop'} {self.rid}") or \
                not self.server.wait_done(self.rid, self.req.eval_allowance + 60):
            return Verdict(None, None, "the evaluator stopped or did not finish in time; see evaluator.log", {}, None)
        try:
            rec = json.loads(self.record.read_text())
        except (OSError, ValueError):
            return Verdict(None, None, "the evaluator wrote no record; see evaluator.log", {}, None)
        try:
            private = json.loads(self.private.read_text())
            self.private.unlink()
        except (OSError, ValueError):
            private = {}
        return Verdict(rec.get("val_bpb"), rec.get("rejected"), rec.get("error"), rec, private.get("holdout_bpb"))
