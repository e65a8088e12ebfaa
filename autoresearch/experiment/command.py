"""Execute + evaluate for a command objective (objective.py): the correctness gate, then the command, each in a
fresh workspace of its own, in the sandbox, under one time limit on ar's clock. The metric is read from the
command's output by ar; the gate's verdict is its exit code.

The proposal cannot change the gate or the command (config.py refuses an objective whose command lies in
allowed_paths, and the guards refuse a commit outside them), so both run as committed at the session's start;
anything they spawn runs under the same sandbox and is killed with them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from autoresearch.harness import sandbox
from autoresearch.objective import Objective
from autoresearch.experiment.request import RunRequest
from autoresearch.process import run_training
from autoresearch.records.durable import write_json
from autoresearch.experiment import execute
from autoresearch.experiment.evaluate import Verdict
from autoresearch.experiment.execute import TrainOutcome, Workspace
from autoresearch.experiment.settle import last_output_line


def policy(ws: Workspace) -> dict:
    p = sandbox.base_policy()
    p["write"] += [str(ws.src), str(ws.scratch)]
    return p


def run(req: RunRequest, obj: Objective, git, work_root: Path, exp_dir: Path, *,
        on_line=None) -> tuple[TrainOutcome, Verdict]:
    """Gate, then command, each in a workspace of its own (the commit's tree exported afresh, an empty scratch
    folder for HOME and TMPDIR): the candidate runs inside the gate, and nothing it leaves there — a rewritten
    benchmark, a planted sitecustomize.py — may reach the command. (The outcome of the last process run, the
    verdict on it.)"""
    deadline = time.monotonic() + obj.timeout
    record: dict = {"objective": obj.name, "unit": obj.unit, "direction": obj.direction}
    steps = [("gate", obj.gate, exp_dir / "gate.log")] if obj.gate else []
    steps.append(("command", obj.command, exp_dir / "train.log"))
    for name, cmd, log in steps:
        ws, _ = execute.make_workspace(git, req.commit, work_root / name, None)
        try:
            env = req.to_environ(tok_view=ws.data, checkpoint_dir=ws.checkpoint, scratch=ws.scratch)
            wrap: list[str] = []
            if req.sandbox and obj.sandbox == "ar":   # "command": the gate and the command sandbox the candidate
                (ws.root / "policy.json").write_text(json.dumps(policy(ws)))
                wrap = [sys.executable, "-I", "-B", "-m", "autoresearch.harness.sandbox", str(ws.root / "policy.json"),
                        "--"]
            result = run_training([*wrap, *cmd], cwd=ws.src, env=env, log_path=log,
                                  timeout=max(1.0, deadline - time.monotonic()), on_line=on_line,
                                  max_log_bytes=req.max_log_bytes)
        finally:
            execute.remove_workspace(ws)
        record[f"{name}_seconds"] = round(result.wall_seconds, 3)
        record[f"{name}_exit"] = result.returncode
        if result.returncode != 0 or result.stop_reason:
            break
    outcome = TrainOutcome(result, None, result.wall_seconds, None, None, req.sandbox)
    value, rejected, error = None, None, None
    if name == "gate" and result.returncode not in (0, None) and not result.stop_reason:
        rejected = f"the correctness gate failed: {last_output_line(log)[:300] or f'exit code {result.returncode}'}"
    elif name == "command" and result.returncode == 0 and not result.stop_reason:
        value = obj.extract(log.read_text(errors="replace"))
        if value is None:
            how = f"JSON key {obj.json_key!r}" if obj.json_key else f"regex {obj.regex!r}"
            error = f"the command printed no {obj.name} ({how}); see train.log"
    record.update(value=value, rejected=rejected, error=error)
    write_json(exp_dir / "record.json", record)
    return outcome, Verdict(value, rejected, error, record, None)

