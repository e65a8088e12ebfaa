"""The session around the loop: what `ar run` builds (proposer, profile, each choice said in one line after
the tag's), and what `ar status` reads back: the fold of runs/<tag>/events.jsonl, checked against the lock.

The path of one experiment and the loop around it live in loop.py; this module only sets a loop up and
reads what it left behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from . import events
from .config import RunConfig
from .errors import ConfigError
from .gitops import GitRepo
from .layout import EVENTS, RESULTS, RunsLayout
from .ledger import Ledger, Status
from .lock import read_holder
from .loop import Event, Loop
from . import objective
from .objective import shown


def build(cfg: RunConfig, repo: str | Path, *, tag: str | None = None, on_event: Callable[[Event], None] | None = None,
          calibrate_noise: int = 0, command: str = "ar run") -> Loop:
    """The loop `ar run` runs: proposer, profile and data chosen from the config, each default said in one line."""
    from .proposers import make_proposer
    say = (lambda m: on_event(Event("info", m))) if on_event else (lambda m: None)
    custom = cfg.objective.custom
    if not custom and not (Path(repo) / "train.py").exists() and cfg.train_command[-1:] == ["train.py"]:
        raise ConfigError(f"no train.py in {Path(repo).resolve()}; run `ar init DIR` for a workspace, or pass --repo")
    if custom and cfg.proposer in (None, "strategy") and not cfg.agent:
        raise ConfigError("the objective needs a proposer: --agent claude|codex|aider|'COMMAND {prompt_file}', or "
                          "proposer grid or random with a search_space of the file's knobs")
    proposer = make_proposer(cfg)
    loop = Loop(cfg, repo, tag, proposer, on_event=on_event, calibrate_noise=calibrate_noise, command=command)
    if cfg.proposer is None and proposer.name == "strategy":
        say("no agent configured: proposing with the built-in strategy proposer (one knob at a time from the best)")
    if custom:
        say(f"objective {cfg.objective.label()}: gate {shown(cfg.objective.gate) or '(none)'}, then "
            f"{shown(cfg.objective.command)}")
    elif cfg.profile == "auto":
        what = "a CUDA GPU" if loop.profile.name == "gpu" else "no CUDA GPU"
        say(f"{what}: {loop.profile.name} profile ({loop.budget(None):g}s budget, {loop.eval_tokens} eval tokens)")
    return loop


def read_status(repo: str | Path) -> dict:
    """What `ar status` shows: the lock holder, the running (or last) experiment and step, the best so far."""
    root = GitRepo(repo).root
    runs = RunsLayout(root)
    holder = read_holder(runs.lock) if runs.lock.exists() else None
    tag = holder.get("tag") if holder else None
    if not tag:
        docs = sorted(runs.tags_with(EVENTS) or runs.tags_with(RESULTS), key=lambda p: p.stat().st_mtime)
        tag = docs[-1].parent.name if docs else None
    out: dict = {"repo": str(root), "holder": holder, "tag": tag, "status": None, "best": None, "counts": {}}
    if tag is None:
        return out
    out["status"] = events.against_lock(events.fold(events.read(runs.tag(tag).events)), holder)
    obj = objective.load(runs.tag(tag).dir)
    rows = Ledger(runs.tag(tag).dir, sign=obj.sign).rows()
    best = obj.best([r for r in rows if r.status is Status.KEEP])
    out["best"] = best.to_dict() if best else None
    out["objective"] = obj.describe()
    for r in rows:
        out["counts"][r.status.value] = out["counts"].get(r.status.value, 0) + 1
    out["running"] = holder is not None
    return out
