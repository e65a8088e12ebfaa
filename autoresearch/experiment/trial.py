"""One trial of a committed proposal: fresh workspace → evaluator started → sandboxed training → checks → go.

The same function runs the trial on this machine (every slot) and on a Ray worker, so that the trust path is
one path. `after_run` is the caller's check once every process of the run is gone (what the run changed that it
may not); a reason there, or a changed package or data, means the checkpoint is not scored.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..gitops import GitRepo
from ..harness import checkpoint
from ..integrity import Fingerprint
from ..request import RunRequest
from . import command, evaluate, execute


@dataclass
class Trial:
    outcome: execute.TrainOutcome
    verdict: evaluate.Verdict
    has_checkpoint: bool
    tampered: str | None            # what the run changed that it may not (then nothing was scored)
    integrity: str | None           # the package or the data changed: no later run can count either


def run_trial(req: RunRequest, git: GitRepo, *, work_root: Path, exp_dir: Path, manifest: dict,
              fingerprint: Fingerprint | None, on_line: Callable[[str], str | None] | None = None,
              allowance: float | None = None, after_run: Callable[[], str | None] | None = None,
              server: evaluate.Server) -> Trial:
    if req.objective.custom:
        return _command_trial(req, git, work_root, exp_dir, fingerprint, on_line, after_run)
    ws, data_files = execute.make_workspace(git, req.commit, work_root, req.tok_dir)
    ev = evaluate.Evaluation(req, ws, manifest, exp_dir / "record.json", ws.root / "private.json", server)
    try:
        out = execute.run(req, ws, data_files, log_path=exp_dir / "train.log", on_line=on_line, allowance=allowance)
        tampered, broken = _after_checks(after_run, fingerprint)
        has_ckpt = (ws.checkpoint / checkpoint.MODEL_JSON).is_file()
        ok = (out.result.returncode == 0 and not out.result.stop_reason and not out.over_budget and not tampered
              and has_ckpt)
        verdict = ev.finish(go=ok)
    finally:
        for name, src in (("eval.log", ws.job / "eval.log"),):
            if src.is_file() and not src.is_symlink():     # the worker owns its folder: a link is not a log
                shutil.copyfile(src, exp_dir / name)
        execute.remove_workspace(ws)
    return Trial(out, verdict, has_ckpt, tampered, broken)


def _command_trial(req: RunRequest, git: GitRepo, work_root: Path, exp_dir: Path, fingerprint: Fingerprint | None,
                   on_line, after_run) -> Trial:
    """A command objective: gate and command, each in a fresh workspace; the same after-run checks as training."""
    try:
        out, verdict = command.run(req, req.objective, git, work_root, exp_dir, on_line=on_line)
        tampered, broken = _after_checks(after_run, fingerprint)
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    ran = out.result.returncode == 0 and not out.result.stop_reason
    return Trial(out, verdict, ran, tampered, broken)


def _after_checks(after_run: Callable[[], str | None] | None, fingerprint: Fingerprint | None
                  ) -> tuple[str | None, str | None]:
    """Once every process of the run is gone: (what it changed that it may not, or None; the package or data
    change, or None). A package or data change is also the tampering reason."""
    tampered = after_run() if after_run else None
    broken = fingerprint.changes() if fingerprint else None
    return (f"the run changed what it may not: {broken}" if broken else tampered), broken
