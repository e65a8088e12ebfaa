"""Evaluate: start the trusted evaluator beside the training run, release it on the checkpoint, read its record.

The evaluator (harness/evaluator.py) starts when training starts, so its imports, the data hashes and the
sandboxed model worker's imports overlap training; it waits for "go". After the run, ar checks that the
package and the data still match the session's fingerprint, then says "go" (or closes the pipe when there is
no checkpoint to score). The record lands in the experiment's folder; the hold-out score goes to the tag's
private file, which no log or prompt shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..harness import sandbox
from ..request import RunRequest
from .execute import Workspace

_ENV = ("PATH", "LANG", "LC_ALL", "AR_GPU_MEMORY_GB")


@dataclass
class Verdict:
    val_bpb: float | None
    rejected: str | None          # the model or checkpoint disqualifies the run (a reason a user can read)
    error: str | None             # the evaluation itself failed (not the model's fault)
    record: dict
    holdout_bpb: float | None


def worker_policy(ws: Workspace) -> dict:
    p = sandbox.base_policy()
    p["read"] += [str(ws.src), str(ws.checkpoint)]
    p["write"] += [str(ws.job)]
    return p


class Evaluation:
    """One evaluator process for one experiment."""

    def __init__(self, req: RunRequest, ws: Workspace, manifest: dict, record: Path, private: Path):
        self.record, self.private, self.req = record, private, req
        doc = {"tok_dir": str(req.tok_dir), "dataset": req.dataset, "seq_len": req.profile.seq_len,
               "eval_tokens": req.eval_tokens, "holdout_tokens": req.holdout_tokens, "rows": req.eval_rows,
               "device": req.device, "manifest": manifest, "checkpoint": str(ws.checkpoint), "source": str(ws.src),
               "train_file": req.train_file, "job_dir": str(ws.job), "record": str(record), "private": str(private),
               "timeout": req.eval_allowance, "sandbox": req.sandbox, "policy": worker_policy(ws),
               "tolerance": 1e-3 if req.device == "cpu" else 2e-3, "env": {}}
        request = ws.root / "eval-request.json"      # outside the worker's reach (its folder is ws.job)
        request.write_text(json.dumps(doc))
        record.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if k in _ENV}
        env.update(req.slot_env, HOME=str(ws.job), PYTHONUNBUFFERED="1")
        self.log = open(ws.root / "evaluator.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-I", "-B", "-m", "autoresearch.harness.evaluator",
                                      str(request)], cwd=ws.job, env=env, stdin=subprocess.PIPE,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def finish(self, go: bool) -> Verdict:
        """Release the evaluator (go) or tell it there is nothing to score; wait; read the record."""
        try:
            self.proc.stdin.write(b"go\n" if go else b"stop\n")
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=self.req.eval_allowance + 60)
        except subprocess.TimeoutExpired:
            self.kill()
            return Verdict(None, None, "the evaluator did not finish in time", {}, None)
        finally:
            self.log.close()
        try:
            rec = json.loads(self.record.read_text())
        except (OSError, ValueError):
            return Verdict(None, None, f"the evaluator wrote no record (exit code {self.proc.returncode}); see "
                                       "evaluator.log", {}, None)
        try:
            private = json.loads(self.private.read_text())
            self.private.unlink()
        except (OSError, ValueError):
            private = {}
        return Verdict(rec.get("val_bpb"), rec.get("rejected"), rec.get("error"), rec, private.get("holdout_bpb"))

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, 9)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
