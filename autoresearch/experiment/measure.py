"""How many runs a candidate gets, and what they say (decide.SequentialRule, fed from the tag's records).

One run of a changed train.py is one draw. Once the tag's noise is measured (the baseline's calibration runs),
a candidate that is not clearly worse runs again, in its own slot and with seeds from ar, until the evidence
keeps or discards it. The best is the mean of its runs; after a keep it is measured TOP_UP times more and then
judged by those runs alone, since the runs that kept it were chosen for being good (a winner's curse that
otherwise raises the bar for everything after it); and once more for every GROW candidates judged against it, up
to CAP runs, since a best whose runs were lucky is the one that stands longest. Where the noise is a threshold the user stated (`noise:`), or
`keep_rule: single`, one run decides against that threshold, as before.

Every run of a candidate but the first leaves its files as train-run2.log, record-run2.json, ... beside the
first's; decision.json holds the runs, their seeds, the best's runs and the rule's numbers.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics

from autoresearch.decide import Evidence, SequentialRule, Step, pooled_sigma
from autoresearch.records.durable import write_json
from autoresearch.records.ledger import Row, Status

TOP_UP = 3                 # runs of the best after its keep (the calibration's count for the baseline)
GROW, CAP = 4, 6           # then one run more for every GROW candidates judged against it, up to CAP runs: a best
                           # whose runs were lucky stands longest, and blocks real gains, unless it is measured again
FRESH_DF = 6               # σ from the best's fresh runs alone once they have this many degrees of freedom
COUNTED = (Status.KEEP, Status.DISCARD, Status.VALIDATION)
DECISION = "decision.json"
_FILES = ("train.log", "record.json", "metrics.json", "timing.json", "eval.log")


def rule(lp) -> SequentialRule | None:
    """The sequential rule when it decides this session: measured noise, no stated threshold, a spread > 0."""
    cfg, obj = lp.cfg, lp.cfg.objective
    if cfg.keep_rule != "sequential" or cfg.noise is not None or obj.noise is not None or \
            obj.noise_share is not None or not lp.paths.noise.exists():
        return None
    s = sigma(lp)
    return SequentialRule(alpha=cfg.false_keep, min_gain=cfg.min_gain) if s else None


def _rows_of(commit: str, rows: list[Row]) -> list[Row]:
    """The rows of one commit (full or short sha) that have a value."""
    return [r for r in rows if r.commit and commit.startswith(r.commit) and r.val_bpb is not None]


def runs_of(lp, commit: str, rows: list[Row] | None = None) -> list[float]:
    """Every counted run of one commit in this tag: a row's own runs (decision.json), else its value."""
    return [v for r in _rows_of(commit, lp.ledger.rows() if rows is None else rows) if r.status in COUNTED
            for v in _row_runs(lp, r)]


def best_runs(lp, commit: str) -> list[float]:
    """The runs the best is judged by. The runs that kept it were chosen for being good (a keep is a lucky draw as
    often as a real one): once TOP_UP runs measured after the keep exist, only those count; until then, all."""
    rows = _rows_of(commit, lp.ledger.rows())
    kept = [r for r in rows if r.status is Status.KEEP]
    chosen = [v for r in kept if _decided(lp, r) for v in _row_runs(lp, r)]
    fresh = [r.val_bpb for r in kept if not _decided(lp, r)] + \
        [r.val_bpb for r in rows if r.status is Status.VALIDATION]          # the baseline's own run is unselected
    return fresh if len(fresh) >= TOP_UP or not chosen else chosen + fresh


def _decided(lp, r: Row) -> bool:
    return (lp.exp_dir_of(r) / DECISION).exists()


def _row_runs(lp, r: Row) -> list[float]:
    try:
        runs = json.loads((lp.exp_dir_of(r) / DECISION).read_text())["runs"]
        return [float(v) for v in runs]
    except (OSError, ValueError, KeyError, TypeError):
        return [r.val_bpb]


def sigma(lp) -> float | None:
    """The noise of one run, from runs measured apart from any decision: per commit, the baseline's calibration
    and the best measured again. A candidate's runs were chosen by the rule that stopped them (kept when they
    agreed on a gain, discarded when one was bad), so their spread reads low (σ 0.019 for a true 0.02 in
    bench_decisions): they join only while the others have fewer than FRESH_DF degrees of freedom."""
    rows = lp.ledger.rows()
    fresh: dict = {}
    decided: list[list[float]] = []
    for r in rows:
        if r.commit and r.val_bpb is not None and r.status in COUNTED:
            if _decided(lp, r):
                decided.append(_row_runs(lp, r))
            else:
                fresh.setdefault(r.commit, []).append(r.val_bpb)
    groups = list(fresh.values())
    if sum(len(g) - 1 for g in groups if len(g) > 1) < FRESH_DF:
        groups += decided
    return pooled_sigma(groups) or None


def evidence(lp, runs: list[float]) -> Evidence | None:
    best = lp.ledger.best_kept()
    s = sigma(lp)
    if best is None or not s:
        return None
    return Evidence(tuple(best_runs(lp, best.commit)), tuple(runs), s, lp.cfg.objective.sign)


def more_runs(lp, ctx, x, m, budget: float, seed: int, again) -> None:
    """In the slot, after the first run counted: run x again (seed + 1, + 2, ...) while the rule says so.
    `again(seed, n)` runs it once more and gives (value or None, why). Sets x.runs, x.seeds, x.fixed_seed."""
    x.runs, x.seeds = [m.val_bpb], [seed]
    sr = rule(lp)
    while sr is not None:
        ev = evidence(lp, x.runs)
        if ev is None or sr.step(ev, name=lp.cfg.objective.name).action != "more":
            break
        s = seed + len(x.runs)
        value, why = again(s, len(x.runs) + 1)
        if value is None:
            x.run_failed = why
            break
        x.runs.append(value)
        x.seeds.append(s)
        if len({round(v, 6) for v in x.runs}) == 1:     # different seeds, the same result: the seed is not ar's
            x.fixed_seed = True
            break
    m.val_bpb = statistics.fmean(x.runs)


def judge(lp, x) -> Step | None:
    """The decision on x's runs against the best now (None: the single-run rule decides)."""
    sr = rule(lp)
    runs = x.runs
    if sr is None or not runs:
        return None
    ev = evidence(lp, runs)
    if ev is None:
        return None
    name = lp.cfg.objective.name
    if x.fixed_seed:
        return Step("discard", f"discarded: its runs with seeds {', '.join(map(str, x.seeds))} gave the same {name} "
                               f"{runs[0]:.6f}: train.py does not use the seed ar gives each run (AR_SEED), so a "
                               f"lucky seed is all it measures")
    st = sr.step(ev, name=name)
    if st.action == "more":      # the best moved while it ran, or a run failed: not enough evidence either way
        failed = x.run_failed
        why = f"run {len(runs) + 1} failed ({failed})" if failed else "the best changed while it ran"
        return Step("discard", f"{st.reason.replace('; the keep bar', f'; {why}; the keep bar', 1)}"
                    .replace(", run again", ""), st.z, st.bar)
    return st


def record(lp, x, st: Step) -> None:
    """decision.json: what a person needs to check the decision."""
    best = lp.ledger.best_kept()
    write_json(x.exp_dir / DECISION, {
        "rule": "sequential", "runs": [round(v, 6) for v in x.runs], "seeds": x.seeds, "best": best.commit if best else None,
        "best_runs": best_runs(lp, best.commit) if best else [], "sigma": sigma(lp), "z": st.z, "bar": st.bar,
        "false_keep": lp.cfg.false_keep, "min_gain": lp.cfg.min_gain, "decision": st.action})


def top_up(lp) -> None:
    """Queue re-runs of the best until it has TOP_UP runs measured apart from its keep, and one more for every
    GROW candidates judged against it since, up to CAP (seeds after its own)."""
    best = lp.ledger.best_kept()
    if best is None or rule(lp) is None:
        return
    rows = lp.ledger.rows()
    mine = _rows_of(best.commit, rows)
    have = sum(1 for r in mine if r.status is Status.VALIDATION or (r.status is Status.KEEP and not _decided(lp, r)))
    since = max((r.exp_id for r in mine if r.status is Status.KEEP), default=0)
    judged = sum(1 for r in rows if r.exp_id > since and r.status in (Status.KEEP, Status.DISCARD) and _decided(lp, r))
    want = min(CAP, TOP_UP + judged // GROW)
    queued = sum(1 for s in lp.queue.pending() if s.kind == "rerun" and s.payload.get("top_up"))
    base = best.seed if best.seed is not None else lp.cfg.seed
    used = len(runs_of(lp, best.commit, rows))       # seeds after every run it had
    for i in range(want - have - queued):
        lp.queue.add("rerun", {"commit": lp.git.resolve(best.commit), "seed": base + used + queued + i,
                               "top_up": True, "description": "the best measured again"})


@contextlib.contextmanager
def another_run(exp_dir, suffix: str, files: tuple[str, ...] = _FILES):
    """Around a further run of one experiment: the first run's files keep their names, this run's get a suffix
    (train-run2.log, record-confirm.json, ...)."""
    names = [f for f in files if (exp_dir / f).exists()]
    for f in names:
        os.replace(exp_dir / f, exp_dir / f"first-{f}")
    try:
        yield
    finally:
        for f in files:
            stem, ext = f.split(".")
            if (exp_dir / f).exists():
                os.replace(exp_dir / f, exp_dir / f"{stem}-{suffix}.{ext}")
        for f in names:
            os.replace(exp_dir / f"first-{f}", exp_dir / f)


def describe(lp) -> str | None:
    """What this session can see, in one line (and in `ar status` through the event log): the noise of one run
    and the smallest gain kept 4 times in 5. None while the sequential rule does not decide."""
    sr = rule(lp)
    best = lp.ledger.best_kept()
    if sr is None or best is None:
        return None
    s, nb = sigma(lp), max(2, len(best_runs(lp, best.commit)))
    det = sr.detectable(s, nb)
    lp.events.settings(sigma=s, detectable=det, false_keep=sr.alpha, keep_rule="sequential")
    name = lp.cfg.objective.name
    return (f"noise: σ {s:.6f} {name} a run; against the best's {nb} runs a gain of {det:.6f} is kept 4 times in 5, "
            f"a change that gains nothing at most {sr.alpha:.0%} of the time (up to {sr.max_runs} runs a candidate)")
