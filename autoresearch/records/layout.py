"""Every path under a repository's runs/ folder, named once.

    runs/.ar.lock                      the repo lock (who runs, since when)
    runs/.work/<tag>-<NNNN>/           one experiment's fresh workspace (deleted after its run)
    runs/.work/<tag>-evaluator-<i>.log the trusted evaluator of slot i
    runs/<tag>/results.tsv             the ledger: one row per experiment (the commit point)
    runs/<tag>/queue.jsonl             the durable queue: added, started, done
    runs/<tag>/hooks.jsonl             which hook fired for what (exactly once)
    runs/<tag>/meta.json               branch, base commit, the settings results compare under
    runs/<tag>/data.json               the data the tag's results were scored on (its validation split's hash)
    runs/<tag>/noise.json              the calibrated keep threshold
    runs/<tag>/events.jsonl            what the session does, as it happens (events.py; `ar status`, `ar serve`)
    runs/<tag>/journal.md, journal.json the research journal (memory.py), derived from the records
    runs/<tag>/grid.png                a sweep's grid plot (`ar report`)
    runs/<tag>/<NNNN>-<sha7>/          one experiment's files (train.log, record.json, metrics.json, diff.patch)
    runs/<tag>/worktrees/slot-<i>/     a local slot's worktree
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autoresearch.gitops import RUNS_DIR as RUNS                    # the folder git is told to ignore
RESULTS, QUEUE, HOOKS, META, NOISE, EVENTS, DATA = (
    "results.tsv", "queue.jsonl", "hooks.jsonl", "meta.json", "noise.json", "events.jsonl", "data.json")
LOCK = ".ar.lock"
BOOKKEEPING = (RESULTS, QUEUE, HOOKS, NOISE, META, DATA)    # what a run may never change
JOURNAL, JOURNAL_JSON, GRID = "journal.md", "journal.json", "grid.png"
DERIVED = (JOURNAL, JOURNAL_JSON, GRID)                # views rewritten from the records at any time
LIVE = (EVENTS,)                                       # appended by ar itself while proposals and runs go on


def is_derived(name: str) -> bool:
    """A derived view or the event stream, or the temporary file it is being written through (`.NAME.<pid>.<thread>.tmp`): both may
    change under a running proposal without the proposal having touched them."""
    return name in DERIVED + LIVE or (name.startswith(".") and name.endswith(".tmp")
                               and any(name.startswith(f".{d}.") for d in DERIVED + LIVE))


@dataclass(frozen=True)
class RunsLayout:
    """runs/ of one repository."""

    root: Path

    @property
    def runs(self) -> Path:
        return Path(self.root) / RUNS

    @property
    def lock(self) -> Path:
        return self.runs / LOCK

    @property
    def work(self) -> Path:
        return self.runs / ".work"

    def tag(self, tag: str) -> "TagLayout":
        return TagLayout(self.runs / tag)

    def tags_with(self, name: str) -> list[Path]:
        """runs/*/<name> files that exist (the tags that have results, a status…)."""
        return [p for p in self.runs.glob(f"*/{name}") if p.is_file()] if self.runs.is_dir() else []


@dataclass(frozen=True)
class TagLayout:
    """runs/<tag>/ and the scratch files of its experiments (in runs/.work beside it)."""

    dir: Path

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def work(self) -> Path:
        return self.dir.parent / ".work"

    results = property(lambda self: self.dir / RESULTS)
    queue = property(lambda self: self.dir / QUEUE)
    hooks = property(lambda self: self.dir / HOOKS)
    meta = property(lambda self: self.dir / META)
    data = property(lambda self: self.dir / DATA)
    noise = property(lambda self: self.dir / NOISE)
    events = property(lambda self: self.dir / EVENTS)
    lock = property(lambda self: self.dir.parent / LOCK)     # the repo's lock (runs/.ar.lock)
    journal = property(lambda self: self.dir / JOURNAL)
    journal_json = property(lambda self: self.dir / JOURNAL_JSON)

    def exp_dir(self, exp_id: int, commit: str) -> Path:
        """An experiment's folder; `none` until it has a commit."""
        return self.dir / f"{int(exp_id):04d}-{commit[:7] or 'none'}"

    def worktree(self, slot: int) -> Path:
        return self.dir / "worktrees" / f"slot-{slot}"

    def workspace(self, exp_id: int) -> Path:
        return self.work / f"{self.name}-{int(exp_id):04d}"

    def evaluator_log(self, slot: int) -> Path:
        return self.work / f"{self.name}-evaluator-{slot}.log"
