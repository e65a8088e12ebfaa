"""What `ar status` reads back: the lock holder, the fold of runs/<tag>/events.jsonl checked against the lock,
the best kept result by the tag's objective, and the counts of results.tsv."""

from __future__ import annotations

from pathlib import Path

from autoresearch import objective
from autoresearch.records import events, tags
from autoresearch.errors import ArError
from autoresearch.gitops import GitRepo
from autoresearch.records.layout import EVENTS, RESULTS, RunsLayout
from autoresearch.records.ledger import Ledger
from autoresearch.records.lock import read_holder


def read_status(repo: str | Path, tag: str | None = None) -> dict:
    """What `ar status` shows: the lock holder, the running (or last) experiment and step, the best so far; of
    `tag` when given, else of the tag tags.py's rule reads (the branch you are on, else today's, else the newest),
    as report, journal and serve take it."""
    root = GitRepo(repo).root
    runs = RunsLayout(root)
    holder = read_holder(runs.lock) if runs.lock.exists() else None
    if tag is not None and not runs.tag(tag).dir.is_dir():
        have = sorted(p.parent.name for p in runs.tags_with(RESULTS))
        raise ArError(f"no tag {tag!r} under {runs.runs}; " + (f"tags: {', '.join(have)}" if have else
                                                               "run `ar run` first"))
    choice = tags.for_reading(root, tag, have=(EVENTS, RESULTS))
    tag = choice.tag if choice.exists else None
    if holder and holder.get("tag") != tag:
        holder = None     # the lock is another tag's: this one is not running
    out: dict = {"repo": str(root), "holder": holder, "tag": tag, "tag_from": choice.why, "status": None,
                 "best": None, "counts": {}}
    if tag is None:
        return out
    out["status"] = events.against_lock(events.fold(events.read(runs.tag(tag).events)), holder)
    obj = objective.load(runs.tag(tag).dir)
    ledger = Ledger(runs.tag(tag).dir, sign=obj.sign)
    rows, best = ledger.rows(), ledger.best_kept()
    out["best"] = best.to_dict() if best else None
    out["objective"] = obj.describe()
    for r in rows:
        out["counts"][r.status.value] = out["counts"].get(r.status.value, 0) + 1
    out["budgets"] = sorted({r.time_budget for r in rows if r.time_budget is not None})  # what the rows ran at
    out["running"] = holder is not None
    return out
