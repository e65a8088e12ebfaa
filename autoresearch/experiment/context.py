"""What the loop tells its caller (`Event`), what one experiment carries through its steps (`Experiment`), where a slot works (`SlotContext`), and what a
slot hands back for settling (`Outcome`). Plain data: every step reads and fills these, none owns them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from autoresearch.proposers.cost import Usage
from autoresearch.errors import ArError
from autoresearch.slots import Slot
from autoresearch.gitops import GitRepo
from autoresearch.knobs import read_knobs
from autoresearch.records.layout import RunsLayout
from autoresearch.records.ledger import Row
from autoresearch.experiment.metrics import StepPoint
from autoresearch.records.queue import Spec
from autoresearch.experiment import evaluate, execute


@dataclass
class Event:
    """What the loop tells its caller: `info`/`warn` lines, `start` of an experiment, live `step`s, its `result`."""

    kind: str
    message: str = ""
    spec: Spec | None = None
    step: StepPoint | None = None
    row: Row | None = None
    time_budget: float | None = None


@dataclass
class Experiment:
    """One experiment in flight."""

    spec: Spec
    parent: str
    started_at: str
    stage: Path                      # runs/<tag>/<NNNN>-none: the proposal's files until there is a commit
    sha: str = ""
    description: str = ""
    changed: list[str] = field(default_factory=list)
    knobs: dict = field(default_factory=dict)
    time_budget: float | None = None
    seed: int | None = None
    exp_dir: Path | None = None
    mfu: float | None = None
    tail: deque = field(default_factory=deque)  # the run's last output lines
    val_bpb: float | None = None     # set only when the run counted (clean exit, summary, record confirmed)
    t_run: float = 0.0
    wall: float = 0.0
    row: Row | None = None           # set once the ledger has the row
    tampered: str | None = None      # what the run changed that it must not (.git, runs/, harness, data)
    outcome: execute.TrainOutcome | None = None   # ar's clock on the run
    verdict: evaluate.Verdict | None = None       # the trusted evaluator's record
    has_checkpoint: bool = False
    compiled_cold: bool = False                   # the run compiled from nothing (trial.Trial)
    agent_usage: Usage | None = None              # what the proposal's agent spent (recorded even when refused)
    trusted_code: bool = False                    # the user's commit or ar's knob edits of it (compile_cache.py)
    runs: list[float] = field(default_factory=list)   # each counted run's value (measure.py: several when asked)
    seeds: list[int] = field(default_factory=list)    # ar's seed for each of them
    fixed_seed: bool = False                      # different seeds gave the same value: train.py sets its own
    run_failed: str | None = None                 # why a later run did not count


@dataclass
class SlotContext:
    """Where one slot works: its tree (the repo itself, or a worktree of its own), the environment its runs
    get (CUDA_VISIBLE_DEVICES), its trusted evaluator server."""

    slot: Slot
    git: GitRepo
    env: dict[str, str]
    server: evaluate.Server
    separate: bool                   # a worktree of its own (reset before each experiment)

    @property
    def root(self) -> Path:
        return self.git.root

    def guard_dir(self, tag: str) -> Path:
        """runs/<tag> in this slot's tree: what the guards watch (a worktree's own, not the ledger's)."""
        return RunsLayout(self.root).tag(tag).dir


@dataclass
class Outcome:
    """What a slot hands back for settling: ran (with its run), rejected, missing (commit gone), skipped (the
    proposer had nothing), interrupted (a stop came before its run started) or held (prepared beside a baseline
    that was not kept: never run)."""

    kind: str
    reason: str = ""
    run: tuple = field(default_factory=tuple)    # (result, failure status or None, reason, metrics, budget, seed)


def safe_knobs(path: Path) -> dict:
    try:
        return read_knobs(path)
    except (ArError, OSError):
        return {}
