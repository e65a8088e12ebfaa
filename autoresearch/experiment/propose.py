"""Steps 2-4 of one experiment, in its slot (alongside other slots): the proposal edits the slot's tree (an
agent, a built-in proposer, a queued knob edit, or a stale win replayed on the new best), the change is checked
(scope, files, the package and data fingerprint) and committed. The committed experiment then goes to the
executor (step 5) and is classified (step 6); deciding and recording are the scheduler's, in order.

Every function takes the session (`lp`, a Loop) for its settings and records, the slot it works in (`ctx`)
and the experiment it fills in (`x`).
"""

from __future__ import annotations

import contextlib
import os

from autoresearch import faults
from autoresearch.trust import guards
from autoresearch.errors import ConfigError, GitError
from autoresearch.gitops import short
from autoresearch.harness.data import hidden_sources
from autoresearch.harness.env import default_cache
from autoresearch.knobs import read_knobs, set_knobs
from autoresearch.records.ledger import Row, Status
from autoresearch.proposers import Context, Proposal, ProposalFailed
from autoresearch.proposers.search import describe_change
from autoresearch.trust.repeats import built_config, find_repeat
from autoresearch.executors.local import clean_worktree
from autoresearch.experiment import clock, compile_cache, measure, settle
from autoresearch.records.durable import write_json
from autoresearch.experiment.context import Experiment, Outcome, SlotContext, safe_knobs

DIFF_CAP = 1 << 20
BUILTIN_PROPOSERS = ("grid", "random", "strategy")


def propose_and_run(lp, ctx: SlotContext, x: Experiment) -> Outcome:
    """Steps 2-6 in the slot: prepare (propose or apply knobs, guard, commit), then execute and classify."""
    spec = x.spec
    if ctx.separate:
        clean_worktree(ctx.git, x.parent)
    if spec.kind == "rerun":
        p = spec.payload
        x.seed, x.time_budget = p.get("seed"), p.get("time_budget")
        try:
            x.sha = ctx.git.resolve(str(p.get("commit")))
        except GitError:
            x.description = f"re-run of {p.get('commit')}"
            return Outcome("missing", f"commit {p.get('commit')} not found")
        x.description = p.get("description") or f"re-run of {short(x.sha)} with seed {x.seed}"
        if ctx.separate:
            clean_worktree(ctx.git, x.sha)
        else:
            ctx.git.checkout_paths(x.sha, ["."])  # only allowed paths differ between experiment commits
        return _run_committed(lp, ctx, x)
    if spec.kind == "baseline":
        x.sha, x.description = x.parent, spec.payload.get("description") or "baseline"
        return _run_committed(lp, ctx, x)
    if spec.kind == "commit":   # the user's own commit, found on the branch: run as it is, decided as a proposal
        return _users_commit(lp, ctx, x)
    snap = guards.snapshot(ctx.git, x.parent, ctx.guard_dir(lp.tag))
    lp.events.phase(x, "proposing")
    if spec.payload.get("replay"):
        proposal = _replay(ctx, x)
    else:   # built-in proposers one at a time, each seeing the others' points in flight as tried
        builtin = lp.proposer is not None and lp.proposer.name in BUILTIN_PROPOSERS
        with lp.propose_lock if builtin else contextlib.nullcontext():
            proposal = _propose(lp, ctx, x)                                                # 2
            if proposal is not None and not isinstance(proposal, str):
                lp.flying[spec.id] = (safe_knobs(ctx.root / lp.train_file), x.description)
    faults.point("propose")
    if proposal is None:
        return Outcome("skipped")
    lp.events.phase(x, "committing", description=x.description)     # checks, then the commit
    reason = _integrity_after_proposal(lp) or (                                          # 3
        proposal if isinstance(proposal, str) else _check(lp, ctx, x, snap)) or (
        find_repeat(ctx.git, lp.tag_dir, x.parent, lp.train_file, lp.ledger.rows(),    # research memory
                    same_change=not proposal.knobs) if spec.kind == "propose" and not spec.payload.get("replay")
        else None)
    if reason or lp.stopping.is_set():
        try:
            x.stage.mkdir(parents=True, exist_ok=True)
            (x.stage / "diff.patch").write_text(ctx.git.diff(x.parent)[:DIFF_CAP])
        except (GitError, OSError):
            pass
        guards.restore(ctx.git, snap, ctx.guard_dir(lp.tag))
        return Outcome("rejected", reason) if reason else Outcome("interrupted")
    x.sha = ctx.git.commit([*x.changed] or [lp.train_file], commit_message(x, lp.tag),   # 4
                           allow_empty=not x.changed)
    faults.point("commit")
    return _run_committed(lp, ctx, x)


def _users_commit(lp, ctx: SlotContext, x: Experiment) -> Outcome:
    """The same content checks as any proposal's (scope was checked when it was found), on the commit itself."""
    p = x.spec.payload
    x.description = p.get("description") or f"your commit {short(str(p.get('commit')))}"
    try:
        x.sha = ctx.git.resolve(str(p.get("commit")))
    except GitError:
        return Outcome("rejected", f"commit {p.get('commit')} not found")
    x.changed = ctx.git.paths_between(x.parent, x.sha)
    outside = [f for f in x.changed if not guards.allowed(f, lp.cfg.allowed_paths)]
    reason = (f"it changes {', '.join(outside[:3])}, which an experiment may not change" if outside else
              _check_committed(ctx, x))
    if reason:
        return Outcome("rejected", reason)
    if ctx.separate:
        clean_worktree(ctx.git, x.sha)
    else:
        ctx.git.checkout_paths(x.sha, ["."])   # HEAD stays at the best until the decision
    return _run_committed(lp, ctx, x)


def _check_committed(ctx: SlotContext, x: Experiment) -> str | None:
    for path in x.changed:
        if not path.endswith(".py"):
            continue
        try:
            text = ctx.git.file_at(x.sha, path)
        except GitError:      # deleted
            continue
        try:
            before = ctx.git.file_at(x.parent, path)
        except GitError:
            before = None
        reason = guards.check_source(text, path, before) or guards.check_payload(text, before, path)
        if reason:
            return reason
    return None


def commit_message(x: Experiment, tag: str) -> str:
    return f"{x.description or x.spec.kind}\n\nar: tag {tag}, experiment {x.spec.id:04d} ({x.spec.kind})"


def _run_committed(lp, ctx: SlotContext, x: Experiment) -> Outcome:
    beside = x.spec.kind != "baseline"       # prepared beside the baseline: runs once it has trained cleanly
    if beside and not lp.executor.holds(lp, ctx):    # (else its training run waits, its launcher started)
        if not lp.gate.is_open():
            lp.events.phase(x, "waiting", commit=short(x.sha) if x.sha else None, description=x.description)
        if not lp.gate.wait() and not lp.stopping.is_set():
            return Outcome("held", "not run: the baseline it waited for was not kept")
    if lp.stopping.is_set():      # Ctrl-C came while this one was being prepared: do not start its run
        return Outcome("interrupted")
    ran = _train_and_classify(lp, ctx, x)
    if beside and lp.gate.called_off():
        return Outcome("held", "not run to its end: the baseline it waited for was not kept")
    return Outcome("ran", run=ran)


def _propose(lp, ctx: SlotContext, x: Experiment) -> Proposal | str | None:
    """Edit the slot's tree for spec x. A str is a reason to reject; None: nothing left to try."""
    spec = x.spec
    train = ctx.root / lp.train_file
    before = read_knobs(train)
    if spec.kind == "knobs":
        knobs = spec.payload.get("knobs") or {}
        x.seed, x.time_budget = spec.payload.get("seed"), spec.payload.get("time_budget")
        proposal = Proposal(spec.payload.get("description") or describe_change(before, knobs), knobs=knobs)
    elif lp.proposer is None:
        return None
    else:
        seen = Context(ctx.root, lp.train_file, before, lp.ledger.best_kept(), _rows_in_flight(lp),
                       spec.id, x.stage, lp.tag, lp.profile, lp.budget(None), lp.eval_tokens, lp.noise,
                       list(lp.cfg.allowed_paths), _agent_policy(lp), lp.cfg.objective, built=_built(lp))
        try:
            proposal = lp.proposer.propose(seen)
        except ProposalFailed as e:
            x.description, x.agent_usage = f"{lp.proposer.name} proposal", e.usage
            return str(e)
        if proposal is None:
            return None
        x.agent_usage = proposal.usage      # spent whatever becomes of the proposal (rejected included)
    x.description = proposal.description
    if proposal.knobs:
        try:
            set_knobs(train, proposal.knobs)
        except ConfigError as e:
            return str(e)
    return proposal


def _built(lp) -> dict | None:
    """The model the best kept experiment built (its checkpoint's config), for a proposer to read."""
    best = lp.ledger.best_kept()
    return built_config(lp.exp_dir_of(best)) if best is not None and best.exp_id is not None else None


def _rows_in_flight(lp) -> list[Row]:
    """The ledger as a proposer sees it: every result, then the proposals still in flight in other slots
    (no val_bpb, reason `in flight`), so that two slots do not try the same point."""
    extra = [Row(commit="", val_bpb=None, memory_gb=None, status=Status.DISCARD, exp_id=i,
                 description=f"(in flight) {desc}", knobs=knobs, reason="in flight")
             for i, (knobs, desc) in sorted(dict(lp.flying).items())]
    return lp.ledger.rows() + extra


def _agent_policy(lp) -> dict | None:
    """The agent's sandbox: no reading the dataset (validation text, token bytes) or the private hold-out
    scores, no changing the installed package; everything else as the user."""
    if not lp.sandboxed:
        return None
    data = [str(lp.tok_dir.parent), *hidden_sources(lp.tok_dir)] if lp.tok_dir is not None else []   # None: a command
    store = str(compile_cache.store_dir(default_cache()).parent)            # what trusted runs compiled
    return {"deny": [*data, str(settle.private_path(lp).parent), store],
            "read_only": [str(lp.fingerprint.package_dir)], "network": True}


def _integrity_after_proposal(lp) -> str | None:
    """The proposer runs outside the sandbox: did it change the installed package or the data?"""
    broken = lp.fingerprint.changes()
    if broken:
        lp.halted = f"the proposal changed what it may not: {broken}"
        return lp.halted
    return None


def _check(lp, ctx: SlotContext, x: Experiment, snap: guards.Snapshot) -> str | None:
    changed, reason = guards.check_scope(ctx.git, snap, lp.cfg.allowed_paths, ctx.guard_dir(lp.tag),
                                         exclude_prefix=x.stage.name + "/")
    x.changed = changed
    if reason:
        return reason
    if not changed and x.spec.kind == "propose":
        return "the proposal changed nothing"
    return guards.check_files(ctx.git, x.parent, changed)


def _replay(ctx: SlotContext, x: Experiment) -> Proposal | str:
    """A stale win again, on top of the new best: apply the same diff; a str (the reason to reject) when it
    does not apply."""
    p = x.spec.payload
    x.description = p.get("description") or f"replay of {short(p['replay'])}"
    try:
        ctx.git._git("cherry-pick", "--no-commit", "--strategy=recursive", "-X", "theirs", p["replay"])
    except GitError as e:
        if (ctx.git.git_dir / "CHERRY_PICK_HEAD").exists():
            ctx.git._git("cherry-pick", "--abort")
        return f"the change of {short(p['replay'])} does not apply on the new best: {e}"
    ctx.git._git("reset", "--quiet")          # unstaged, like an agent's edit
    return Proposal(x.description)


def trusted_code(lp, x: Experiment) -> bool:
    """Whether x's tree is code the runner trusts (then what its run compiles may be kept for later runs):
    the user's baseline commit (or a commit of theirs on a trusted best), a re-run of a trusted commit, or ar's own knob edit (a queued knob point, the
    grid/random/strategy proposers) of a trusted parent. An agent's commit and everything built on it are not.
    A trusted commit joins the session's set, so a knob edit of a knob edit stays trusted."""
    spec, trusted = x.spec, lp.trusted_commits
    if spec.kind in ("baseline", "rerun"):
        ok = x.sha in trusted
    elif spec.kind == "commit":             # the user's own commit, on top of the best; a re-run of any commit
        ok = x.sha in trusted if spec.payload.get("again_of") else x.parent in trusted   # (again.py): as trusted as it was
    elif spec.kind == "knobs" or (spec.kind == "propose" and spec.payload.get("proposer") in BUILTIN_PROPOSERS
                                  and lp.proposer is not None and lp.proposer.name in BUILTIN_PROPOSERS):
        replayed = spec.payload.get("replay")
        ok = x.parent in trusted and (replayed is None or replayed in trusted)
    else:
        ok = False
    if ok:
        trusted.add(x.sha)
    return ok


def _train_and_classify(lp, ctx: SlotContext, x: Experiment):
    """Steps 5-6 for a committed experiment: (result, failure status or None, reason, metrics, budget, seed)."""
    spec = x.spec
    x.exp_dir = lp.ledger.exp_dir(spec.id, x.sha)
    if x.stage.exists() and x.stage != x.exp_dir:
        for f in x.stage.iterdir():
            os.replace(f, x.exp_dir / f.name)
        x.stage.rmdir()
    if x.sha != x.parent and spec.kind != "rerun":
        ctx.git.keep_ref(lp.tag, spec.id, x.sha)
        (x.exp_dir / "diff.patch").write_text(ctx.git.diff(x.parent, x.sha)[:DIFF_CAP])
    x.knobs = safe_knobs(ctx.root / lp.train_file)
    x.trusted_code = trusted_code(lp, x)
    budget = lp.budget(x.time_budget)
    seed = lp.cfg.seed if x.seed is None else int(x.seed)
    write_json(x.exp_dir / "spec.json", {"id": spec.id, "kind": spec.kind, "payload": spec.payload,
                                         "commit": x.sha, "parent": x.parent, "time_budget": budget,
                                         "seed": seed, "eval_tokens": lp.eval_tokens,
                                         "profile": lp.profile.name, "description": x.description})
    settle.fire_event(lp, "run_started", spec.id, {"tag": lp.tag, "exp_id": spec.id, "commit": short(x.sha),
                                                   "description": x.description, "time_budget": budget})
    result, stopped_by = lp.executor.train(lp, ctx, x, budget, seed)                     # 5
    status, reason, m = settle.classify(lp, ctx, x, result, stopped_by, budget)          # 6
    if status is None and spec.kind in ("propose", "knobs", "commit") and not spec.payload.get("sweep") and not \
            _short(lp, x, budget):                                                     # a sweep validates its own
        lp.gate.wait_decided()         # a run started beside the baseline: its runs are weighed against the best
        measure.more_runs(lp, ctx, x, m, budget, seed, lambda s, n: _run_again(lp, ctx, x, budget, s, n))
        if x.tampered:
            status, reason = Status.CRASH, x.tampered
    return result, status, reason, m, budget, seed


def _short(lp, x: Experiment, budget: float) -> str | None:
    """Why x's training window was too short to count (settle decides on it alone); a command has no window."""
    if lp.cfg.objective.custom or x.outcome is None:
        return None
    return clock.short_window_note(x.outcome.window, budget)


def _run_again(lp, ctx: SlotContext, x: Experiment, budget: float, seed: int, n: int) -> tuple[float | None, str]:
    """Run n of x (the sequential rule asked for it): its value, or None and why it does not count. The first
    run's facts stay on x (the row shows them); this run's files get a -run<n> suffix."""
    first = (x.outcome, x.verdict, x.has_checkpoint, x.mfu, x.wall)
    try:
        with measure.another_run(x.exp_dir, f"run{n}"):
            result, stopped_by = lp.executor.train(lp, ctx, x, budget, seed)
            status, why, m = settle.classify(lp, ctx, x, result, stopped_by, budget)
            short = _short(lp, x, budget)
    finally:
        x.outcome, x.verdict, x.has_checkpoint, x.mfu, x.wall = first
    if status is not None:
        return None, f"{status.value}: {why}"
    return (None, short) if short else (m.val_bpb, "")
