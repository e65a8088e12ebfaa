"""One trial of a committed proposal: fresh workspace → evaluator started → sandboxed training → checks → go.

The same function runs the trial on this machine (every slot) and on a Ray worker, so that the trust path is
one path. `after_run` is the caller's check once every process of the run is gone (what the run changed that it
may not); a reason there, or a changed package or data, means the checkpoint is not scored.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from autoresearch.gitops import GitRepo
from autoresearch.harness import checkpoint
from autoresearch.trust.integrity import Fingerprint
from autoresearch.experiment.request import RunRequest
from autoresearch.experiment import command, compile_cache, evaluate, execute
from autoresearch.records.durable import write_json


@dataclass
class Trial:
    outcome: execute.TrainOutcome
    verdict: evaluate.Verdict
    has_checkpoint: bool
    tampered: str | None            # what the run changed that it may not (then nothing was scored)
    integrity: str | None           # the package or the data changed: no later run can count either
    compiled_cold: bool = False     # it compiled from nothing: no compile store, an empty one, or it added to it


def run_trial(req: RunRequest, git: GitRepo, *, work_root: Path, exp_dir: Path, manifest: dict,
              fingerprint: Fingerprint | None, on_line: Callable[[str], str | None] | None = None,
              allowance=None, after_run: Callable[[], str | None] | None = None,
              server: evaluate.Server, turn=None, hold=None,
              trained: Callable[[execute.TrainOutcome, bool], None] | None = None) -> Trial:
    """`turn`: the slot's turn on a GPU that slots share (executors.local.GpuTurn), held from the training
    process's start to its exit; the evaluation runs after it is given back. `hold`: the baseline the run waits
    for (execute.TrainingRun). `trained(outcome, cold)` is told when the run trained cleanly, before its
    evaluation, once what it compiled is in the store (a baseline then lets the runs beside it start)."""
    if req.objective.custom:
        return _command_trial(req, git, work_root, exp_dir, fingerprint, on_line, after_run)
    t_prepare = time.time()
    ws, data_files = execute.make_workspace(git, req.commit, work_root, req.tok_dir,
                                            compile_cache.run_root(req.cache) if req.compile_store else None)
    seeded = execute.seed_compile_cache(req, ws)
    ev = evaluate.Evaluation(req, ws, manifest, exp_dir / "record.json", ws.root / "private.json", server)
    try:
        out = execute.run(req, ws, data_files, log_path=exp_dir / "train.log", on_line=on_line,
                          allowance=allowance, turn=turn, hold=hold, near_end=ev.prestart)
        # cold: nothing was there to warm it (clock.py: its start-up GPU seconds then hold the autotuning a new
        # shape pays too). Not "it added files": a warm run of the baseline still adds a few (16 on an H100, 2031
        # cold)
        cold = req.compile_store is None or not (seeded or out.phases.get("cache_seeded_late"))
        tampered, broken = _after_checks(after_run, fingerprint)
        tampered = tampered or _links_in(ws.checkpoint)
        meta = ws.checkpoint / checkpoint.MODEL_JSON
        has_ckpt = meta.is_file() and not meta.is_symlink()
        if has_ckpt and not tampered:   # what was built (repeats.same_build compares it); the weights stay out
            shutil.copyfile(meta, exp_dir / checkpoint.MODEL_JSON, follow_symlinks=False)
        ok = (out.result.returncode == 0 and not out.result.stop_reason and not out.over_budget and not tampered
              and has_ckpt)
        adopted = (compile_cache.adopt(ws.caches, req.compile_store)
                   if ok and req.trusted_code and req.compile_store else 0)
        if ok and trained is not None:
            trained(out, cold)
        t_eval = time.time()
        verdict = ev.finish(go=ok)
        t_scored = time.time()
        write_json(exp_dir / "timing.json", {
            "prepare": t_prepare, "process_start": out.started_at, **out.phases, "window_start": out.window_start,
            "checkpoint": out.checkpoint_at, "process_exit": out.started_at + out.result.wall_seconds,
            "eval_start": t_eval, "eval_done": t_scored, "done": time.time(), "cache_seeded_bytes": seeded,
            "cache_adopted_files": adopted, "trusted_code": req.trusted_code, "device": req.device,
            "gpu": req.slot_env.get("CUDA_VISIBLE_DEVICES", ""), "session": req.session})
    finally:
        for name, src in (("eval.log", ws.job / "eval.log"),):
            if src.is_file() and not src.is_symlink():     # the worker owns its folder: a link is not a log
                shutil.copyfile(src, exp_dir / name)
        execute.remove_workspace(ws)
    return Trial(out, verdict, has_ckpt, tampered, broken, cold)


def _links_in(folder: Path) -> str | None:
    """Why a checkpoint folder is refused: a symbolic link in it. The run may link to a file it cannot read
    itself; ar, which reads the checkpoint after it unsandboxed, would read that file through the link."""
    links = [os.path.relpath(os.path.join(d, n), folder) for d, dirs, files in os.walk(folder)
             for n in dirs + files if os.path.islink(os.path.join(d, n))]
    if not links:
        return None
    return (f"its checkpoint holds a symbolic link ({', '.join(sorted(links)[:3])}): a checkpoint is plain files, "
            "and nothing was read through it")


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
