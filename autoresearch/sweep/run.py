"""Running a sweep: one experiment (one commit) per point of a sweep file, through the Loop.

The sweep file, its points and the dry-run plan are sweep/file.py. Here: the early-stopping and successive
halving decisions and --validate-top (pure; the seed statistics are records/rows.py's), the EarlyStopper that feeds the first to
the Loop, and `run_sweep`, the one function that drives the Loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from autoresearch.records.layout import QUEUE, RESULTS, RunsLayout, TagLayout
from autoresearch.records.rows import FINISHED_STATUSES, SeedStats, _num, seed_stats, show_number, status_of, verdicts  # noqa: F401
from autoresearch.sweep.file import EarlyStop, Plan, Point, describe, identity, point_states, rows_by_point


# ---------------------------------------------------------------- early stopping (pure)

Curve = Sequence[tuple[float, float]]  # (pct, loss), pct ascending


def loss_at(curve: Curve, pct: float) -> float | None:
    """Loss at progress `pct`, linearly interpolated; None outside the curve."""
    if not curve or pct < curve[0][0] or pct > curve[-1][0]:
        return None
    lo = 0
    hi = len(curve) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if curve[mid][0] <= pct:
            lo = mid
        else:
            hi = mid
    (p0, l0), (p1, l1) = curve[lo], curve[hi]
    if pct <= p0 or p1 == p0:
        return l0
    return l0 + (l1 - l0) * (pct - p0) / (p1 - p0)


def prune_decision(references: Sequence[Curve], pct: float, loss: float, strikes: int,
                   settings: EarlyStop) -> tuple[int, str | None]:
    """One step line of a running point against the finished points of the same budget.

    Returns (strikes, reason): strikes counts consecutive step lines clearly worse than the best loss
    at the same progress; once it reaches `patience` the reason says where and by how much."""
    if pct < settings.min_pct or not math.isfinite(loss):  # a NaN loss is train.py's to fail on
        return 0, None
    known = [x for x in (loss_at(c, pct) for c in references) if x is not None]
    if not known:
        return 0, None
    best = min(known)
    if loss - best <= settings.margin * abs(best):
        return 0, None
    strikes += 1
    return strikes, (_reason(pct, loss, best, settings) if strikes >= settings.patience else None)


def _reason(pct: float, loss: float, best: float, s: EarlyStop) -> str:
    return (f"early stop at {pct:.1f}%: loss {loss:.4f} vs best {best:.4f} at equal progress "
            f"(+{(loss - best) / abs(best):.1%} > {s.margin:.0%} margin)")


def halving_verdict(config: tuple, budget: float | None, finished: Sequence[tuple[tuple, float | None, float | None]],
                    keep_fraction: float) -> str | None:
    """Successive halving over budgets: skip `config` at `budget` when, at the largest smaller budget it ran
    at, it did not rank in the top `keep_fraction` of the configs run there.
    `finished` holds (config, budget, val_bpb or None for pruned/crashed) of points already run."""
    if budget is None or keep_fraction >= 1:
        return None
    lower = [b for c, b, _ in finished if c == config and b is not None and b < budget]
    if not lower:
        return None
    at = max(lower)
    scores: dict[tuple, float] = {}
    for c, b, v in finished:
        if b == at:
            scores[c] = min(scores.get(c, math.inf), math.inf if v is None else v)
    ranked = sorted(scores, key=lambda c: scores[c])
    keep = max(1, math.ceil(len(ranked) * keep_fraction))
    rank = ranked.index(config) + 1
    if rank <= keep:
        return None
    return f"halving: ranked {rank} of {len(ranked)} at budget {show_number(at)}s (top {keep} go on)"


# ---------------------------------------------------------------- validation re-runs (pure)

# ---------------------------------------------------------------- the run

@dataclass
class SweepResult:
    ran: int = 0                                    # experiments the loop ran for this call
    skipped: int = 0                                # points already recorded
    crashed: int = 0                                # crashed points left alone (no --retry-crashed)
    halved: list[tuple[Point, str]] = field(default_factory=list)
    best: Any = None                                # the best ledger row of the sweep's points
    validation: list[tuple[SeedStats, str]] = field(default_factory=list)
    stop_reason: str = ""
    interrupted: bool = False                       # Ctrl-C or SIGTERM
    failed: bool = False                            # the loop gave up (too many crashes in a row)

    def lines(self) -> list[str]:
        out = [f"ran {self.ran} experiment(s); {self.skipped} point(s) were already done"
               + (f", {self.crashed} crashed left alone" if self.crashed else "")
               + (f", {len(self.halved)} left out by successive halving" if self.halved else "")]
        if self.best is not None:
            b = self.best
            out.append(f"best: {b.commit[:7]} val_bpb {b.val_bpb:.6f} — {b.description}")
        for s, verdict in self.validation:
            out.append(f"  {s.label}: {s.mean:.6f} ± {s.spread:.6f} over {len(s.values)} seed(s) — {verdict}")
        return out


class EarlyStopper:
    """monitor_factory for the Loop: each knob point is compared, step line by step line, with the finished
    points of the same budget (their train.log curves), and stopped once clearly worse."""

    def __init__(self, tag_dir: Path, settings: EarlyStop):
        self.tag_dir = Path(tag_dir)
        self.settings = settings
        self._curves: dict[Path, list[tuple[float, float]]] = {}

    def references(self, budget: float | None) -> list[Curve]:
        from autoresearch.records.ledger import read_results

        out = []
        for r in read_results(self.tag_dir / RESULTS):
            if status_of(r) in FINISHED_STATUSES and _num(r.time_budget) == _num(budget) and r.exp_id is not None:
                curve = self.curve(TagLayout(self.tag_dir).exp_dir(r.exp_id, r.commit) / "train.log")
                if curve:
                    out.append(curve)
        return out

    def curve(self, log: Path) -> list[tuple[float, float]]:
        if log not in self._curves:
            from autoresearch.harness.logfmt import STEP_RE

            pts = []
            try:
                with open(log, encoding="utf-8", errors="replace") as f:
                    for line in f:
                        m = STEP_RE.match(line.strip())
                        if m and math.isfinite(float(m["loss"])):
                            pts.append((float(m["pct"]), float(m["loss"])))
            except OSError:
                return []
            pts.sort(key=lambda x: x[0])
            self._curves[log] = pts
        return self._curves[log]

    def __call__(self, spec) -> Callable[[Any], str | None]:
        if spec.kind != "knobs":
            return lambda point: None
        refs = self.references(spec.payload.get("time_budget"))
        strikes = 0

        def monitor(point) -> str | None:
            nonlocal strikes
            strikes, reason = prune_decision(refs, point.pct, point.loss, strikes, self.settings)
            return reason
        return monitor


def check_tree(p: Plan) -> None:
    """Before the plan is shown: a dirty tree is refused, naming `ar sweep`, unless it is the sweep's own branch
    (the Loop then discards what a cut-short point left, and refuses anything else the same way)."""
    from autoresearch.gitops import GitRepo, branch_name
    git = GitRepo(p.repo)
    if git.current_branch() != branch_name(p.tag):
        git.ensure_clean(command="ar sweep")


def run_sweep(p: Plan, cfg, *, early_stop: bool = False, validate_top: int = 0, on_event=None,
              command: str = "ar sweep") -> SweepResult:
    """Run what the plan has left through the Loop (lock, commit, subprocess, record, hooks, durable queue).

    Rounds: every point at once, or with early stopping one round per budget so that successive halving
    can leave the losers of a smaller budget out of the next. Specs queued by an earlier, interrupted call
    run first and nothing is queued twice. Then --validate-top re-runs the best K points with other seeds."""
    from autoresearch import config
    from autoresearch.gitops import GitRepo, branch_name
    from autoresearch.records.lock import RepoLock

    cfg = config.replace(cfg, profile=p.profile)
    git = GitRepo(p.repo)
    # one lock from the branch to the last run: nothing touches the repo before it is held (an `ar run` may own it),
    # and no other ar takes the repo between the sweep's rounds
    with RepoLock(RunsLayout(git.root).lock, tag=p.tag, command=command) as held:
        if not git.branch_exists(p.tag):
            git.ensure_clean(command="ar sweep")
            git.repo.create_head(branch_name(p.tag), p.base)
        return _run_locked(p, cfg, held, early_stop=early_stop, validate_top=validate_top, on_event=on_event,
                           command=command)


def _run_locked(p: Plan, cfg, held, *, early_stop: bool, validate_top: int, on_event, command: str) -> SweepResult:
    """run_sweep under its lock (`held`, lent to every Loop it opens)."""
    from autoresearch import config
    from autoresearch.session.loop import Event, Loop

    say = (lambda line: on_event(Event("info", line))) if on_event else (lambda line: None)
    monitor = EarlyStopper(p.tag_dir, p.sweep.early_stop) if early_stop else None
    result = SweepResult()

    def loop(budget: float | None = None) -> Loop:
        c = cfg if budget is None else config.replace(cfg, time_budget=budget)
        return Loop(c, p.repo, p.tag, None, on_event=on_event, monitor_factory=monitor, baseline=False,
                    command=command, lock=held)

    def drain(open_loop: Loop | None = None) -> bool:
        """Run the queue empty; False when the loop stopped for another reason (Ctrl-C, crashes). A re-run
        takes its budget from the run config, so consecutive re-runs of one budget share a Loop set to it."""
        while pending := _pending(p):
            budget = next((s.payload.get("time_budget") for s in pending if s.kind == "rerun"), None)
            n = next((i for i, s in enumerate(pending) if s.kind == "rerun" and
                      s.payload.get("time_budget") != budget), len(pending))
            runner = open_loop if open_loop is not None and budget is None else loop(budget)
            summary = runner.run(max_experiments=n if n < len(pending) else None)
            result.ran += summary.experiments
            result.stop_reason = summary.stop_reason
            result.interrupted, result.failed = summary.interrupted, summary.failed
            if summary.interrupted or summary.failed or summary.experiments < n:
                return False
        return True

    ok = drain()  # what an earlier, interrupted call left queued
    with loop() as lp:   # opening it prepares the data when missing, under the lock
        for group in rounds(p.points, early_stop) if ok else []:
            rows = lp.ledger.rows()
            states = point_states(p.points, rows, p.base, retry_crashed=p.retry_crashed)
            found = rows_by_point(p.points, rows, p.base)
            finished = [(q.config_key(), q.time_budget, _val(found[q.index])) for q in p.points if q.index in found]
            for q in group:
                if states[q.index] != "todo":
                    result.skipped += states[q.index] == "done"
                    result.crashed += states[q.index] == "crashed"
                    continue
                verdict = halving_verdict(q.config_key(), q.time_budget, finished,
                                          p.sweep.early_stop.keep_fraction) if early_stop else None
                if verdict:
                    result.halved.append((q, verdict))
                    say(f"left out {q.label}: {verdict}")
                    continue
                _enqueue_point(p, lp, q)
            if not (ok := drain(lp)):
                break
        if ok and validate_top > 0:
            _enqueue_validation(p, lp, validate_top)
    if ok and validate_top > 0:
        drain()
    from autoresearch.records.ledger import read_results
    rows = read_results(p.tag_dir / RESULTS)
    done = [r for r in rows_by_point(p.points, rows, p.base).values() if _val(r) is not None]
    result.best = min(done, key=lambda r: r.val_bpb) if done else None
    if validate_top > 0:
        points = {q.index: q for q in p.points}
        labels = {r.commit: points[i].label for i, r in rows_by_point(p.points, rows, p.base).items()}
        result.validation = verdicts(seed_stats(rows, _top_commits(p, rows, validate_top), labels))
    return result


def _enqueue_point(p: Plan, lp, q: Point) -> None:
    """A `knobs` spec for point q; its `sweep` (the point's identity) becomes the row's `sweep` column."""
    lp.enqueue_knobs(q.knobs, time_budget=q.time_budget, seed=q.seed, description=describe(p.sweep, q),
                     sweep=identity(p.sweep, q, p.base))


def _pending(p: Plan) -> list:
    from autoresearch.records.queue import ExperimentQueue
    return ExperimentQueue(p.tag_dir / QUEUE, warn=lambda m: None).pending()


def _enqueue_validation(p: Plan, lp, k: int) -> None:
    """A `rerun` spec per validation seed not yet recorded for each of the best k points, grouped by budget.
    The payload carries the point's budget (the Loop that runs it is set to the same budget)."""
    rows = lp.ledger.rows()
    have = {(r.commit, r.seed) for r in rows if status_of(r) in FINISHED_STATUSES | {"validation"}}
    top = {r.commit: r for r in rows_by_point(p.points, rows, p.base).values() if r.commit in _top_commits(p, rows, k)}
    for commit, r in sorted(top.items(), key=lambda cr: cr[1].time_budget or 0.0):
        for seed in p.sweep.validate_seeds:
            if (commit, seed) not in have:
                lp.queue.add("rerun", {"commit": lp.git.resolve(commit), "seed": seed, "time_budget": r.time_budget,
                                       "description": f"sweep {p.sweep.name}: validation of {commit} seed {seed}",
                                       "sweep": r.sweep})  # a seed of the same point


def rounds(points: Sequence[Point], early_stop: bool) -> list[list[Point]]:
    if not early_stop:
        return [list(points)] if points else []
    out: list[list[Point]] = []
    for q in points:
        if out and out[-1][-1].time_budget == q.time_budget:
            out[-1].append(q)
        else:
            out.append([q])
    return out


def _val(row) -> float | None:
    return row.val_bpb if status_of(row) in FINISHED_STATUSES and row.val_bpb is not None else None


def _top_commits(p: Plan, rows: Sequence, k: int) -> list[str]:
    found = rows_by_point(p.points, rows, p.base)
    done = sorted((r for r in found.values() if _val(r) is not None), key=lambda r: r.val_bpb)
    return [r.commit for r in done[:k]]
