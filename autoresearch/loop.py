"""The loop: one tag's session (lock, branch, baseline, noise, queue, ledger) and the path of one experiment.

The path of one experiment (the scheduler, scheduler.py, drives it; `Loop.prepare_and_run` runs in a slot):
 1. start: take the next spec from the queue; mark it started                     (Loop.start, here)
 2. propose: the proposer edits the slot's tree (agent command, or a knob rewrite) (prepare_and_run, slot)
 3. check the change (guards, integrity) -> else record `rejected`
 4. commit
 5. execute + evaluate: the executor runs train.py in a fresh sandboxed workspace on ar's clock, then the
    trusted evaluator scores the checkpoint (experiment/trial.py)                 (executor.train, slot)
 6. classify: ar's clock and the evaluator's record decide; what the run printed is shown, never believed
 7. decide (pure function, against the best *now*); `git reset --hard <best>` unless kept  (settle, here)
 8. append the row to the ledger (the commit point), then mark the spec done in the queue
 9. fire the hooks for the events of this experiment

Resume (`Loop.open`): a spec started without a ledger row is run again; a ledger row whose spec is not
marked done is marked done (its hooks fired if they were not), never run again. The working tree and the
branch go back to the best kept commit; refs of half-made experiment commits are removed.

Spec kinds: "baseline" (train.py as it is), "propose" (ask the proposer), "knobs" ({"knobs": {...},
"time_budget": s|None, "seed": int|None, "description": str}: a knob edit committed like any proposal),
"rerun" ({"commit": sha, "seed": int, "time_budget": s|None}: the same commit with another seed, recorded
as `validation`, never changing the best). A sweep enqueues knob specs with `Loop.enqueue_knobs` inside
`with Loop(...)`, then calls `run()`; `monitor_factory(spec)` gives a per-step callback whose reason stops a
run as `pruned`.

What `ar run` builds around a Loop (proposer, profile, data) and what `ar status` reads back are in session.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import faults, guards
from .config import RunConfig
from .decide import decide, noise_from_repeats
from .errors import ArError, ConfigError, GitError
from .gitops import GitRepo, branch_name, check_tag, default_tag, short
from .harness import gpus
from .harness.env import default_cache, resolve_profile
from .hooks import Hooks
from .knobs import read_knobs, set_knobs
from .ledger import Ledger, Row, Status, now_iso
from .layout import RunsLayout
from .lock import RepoLock
from .metrics import DegradedWatch, StepPoint, parse_log_file, parse_step, recompute_mfu
from .proposers import Context, Proposal, ProposalFailed, Proposer
from .proposers.search import describe_change
from .queue import ExperimentQueue, Spec
from .experiment import evaluate, execute
from .experiment.trial import run_trial
from .harness import sandbox
from .harness.data import check_prepared
from .integrity import Fingerprint, no_bytecode
from .request import RunRequest
from .executors import Slot
from .executors.local import InlineExecutor, clean_worktree
from .runner import STOP_INTERRUPTED
from .scheduler import Outcome, Scheduler, file_error, make_executor, session_id

Monitor = Callable[[StepPoint], "str | None"]
DIFF_CAP = 1 << 20
TAIL_LINES = 64
MAX_STARTS = 3      # a spec started this often without a result is recorded, not run again
BUILTIN_PROPOSERS = ("grid", "random", "strategy")


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
class Summary:
    tag: str
    branch: str
    experiments: int            # run by this invocation
    kept: int
    best: Row | None
    stop_reason: str
    results: Path
    counts: dict[str, int] = field(default_factory=dict)
    failed: bool = False        # stopped by failures (baseline, --max-consecutive-crashes), not by a limit
    interrupted: bool = False


class Loop:
    def __init__(self, cfg: RunConfig, repo: str | Path, tag: str | None = None, proposer: Proposer | None = None,
                 *, on_event: Callable[[Event], None] | None = None, monitor_factory: Callable[[Spec], Monitor] |
                 None = None, baseline: bool = True, calibrate_noise: int = 0, command: str = "ar run", executor=None):
        self.cfg, self.proposer, self.monitor_factory = cfg, proposer, monitor_factory
        self.executor = executor or make_executor(cfg)
        self.git = GitRepo(repo)
        self.root = self.git.root
        self.tag = check_tag(tag or default_tag())
        self.branch = branch_name(self.tag)
        self.paths = RunsLayout(self.root).tag(self.tag)
        self.tag_dir = self.paths.dir
        self.train_file = "train.py" if "train.py" in cfg.allowed_paths else cfg.allowed_paths[0]
        self._emit = on_event or (lambda e: None)
        if cfg.noise is not None:   # a configured threshold is the user's call: nothing to calibrate
            calibrate_noise = 0
        self.baseline, self.calibrate_noise, self.command = baseline, calibrate_noise, command
        if calibrate_noise == 1:
            raise ConfigError("--calibrate-noise K needs K >= 2 runs of the baseline to measure a spread")
        self.profile = resolve_profile(None if cfg.profile == "auto" else cfg.profile)
        self.eval_tokens = cfg.eval_tokens or self.profile.eval_tokens
        self._lock = RepoLock(RunsLayout(self.root).lock, tag=self.tag, command=command)
        self._open = False
        self._peak_warned: set[str] = set()
        self._status_doc: dict = {}
        self._status_lock = threading.Lock()
        self.halted: str | None = None  # the harness or data changed under a run: no further run can count
        self._contexts: dict[int, SlotContext] = {}   # slot index -> its tree, environment and evaluator
        self.flying: dict[int, tuple[dict, str]] = {}  # spec id -> (knobs, description) of proposals in flight
        self.stopping = threading.Event()              # Ctrl-C: a slot starts no run after this
        self._propose_lock = threading.Lock()
        self._hook_lock = threading.Lock()

    # ----------------------------------------------------------------------------------- open / close
    def say(self, message: str, kind: str = "info") -> None:
        self._emit(Event(kind, message))

    def __enter__(self) -> "Loop":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        """Take the lock, check out the branch, reconcile queue and ledger, restore the best commit."""
        if self._open:
            return
        self.git.ensure_commits()
        self._lock.acquire()
        try:
            self._open_locked()
        except OSError as e:
            self._lock.release()
            raise file_error(e) from e
        except BaseException:
            self._lock.release()
            raise
        try:
            self.executor.open(self)
            if self.cfg.confirm_new_best and len(self.slots) > 1:
                raise ConfigError("confirm_new_best is not available with several slots yet; set it to false or "
                                  "run on one slot")
        except BaseException:
            self.executor.close()
            self._lock.release()
            raise
        self._open = True
        if self.multi:
            self.say(f"{len(self.slots)} slots ({', '.join(s.label for s in self.slots)}) on the "
                     f"{self.executor.name} executor; a win on a stale parent is "
                     f"{'re-run' if self.cfg.stale_policy == 'rerun' else 'recorded'}")
            self._write_status(slots=[_slot_doc(s) for s in self.slots])

    @property
    def slots(self) -> list[Slot]:
        return self.executor.slots

    @property
    def multi(self) -> bool:
        """Whether status.json shows slots (several, or a separate worktree) rather than one experiment."""
        return not isinstance(self.executor, InlineExecutor)

    def close(self) -> None:
        for ctx in self._contexts.values():
            ctx.server.close()
        self._contexts.clear()
        if self._open:
            self.executor.close()
            self._write_status(state="stopped", experiment=None, step=None)
            self._lock.release()
            self._open = False

    def _open_locked(self) -> None:
        self._trust()
        self.git.ensure_ignored()
        self.tag_dir.mkdir(parents=True, exist_ok=True)
        warn = lambda m: self.say(m, "warn")  # noqa: E731
        self.ledger = Ledger(self.tag_dir, warn=warn)
        self.queue = ExperimentQueue(self.paths.queue, warn=warn)
        self.hooks = Hooks(self.cfg.hooks, self.paths.hooks, timeout=self.cfg.hook_timeout,
                           cwd=self.root, log=warn)
        rows = self.ledger.rows()
        recorded = {r.exp_id: r for r in rows if r.exp_id is not None}
        in_flight = [s for s in self.queue.pending() if self.queue.is_started(s.id) and s.id not in recorded]
        self._prepare_tree(resume=bool(in_flight))
        faults.point("resume")
        for spec in self.queue.pending():           # a row whose spec is not marked done: mark it, fire its hooks
            if spec.id in recorded:
                self.queue.done(spec.id, recorded[spec.id].status.value)
                self._fire(recorded[spec.id])
        if rows and rows[-1].exp_id is not None:     # hooks of the last row, if ar died before firing them
            self._fire(rows[-1])
        self.best_sha = self._restore_best()
        for spec in in_flight:
            self.say(f"experiment {spec.id:04d} ({spec.kind}) was cut short by a stop of ar; it runs again")
        if self.baseline and self.ledger.best_kept() is None and not any(
                s.kind == "baseline" for s in self.queue.pending()):
            self.queue.add("baseline", {})
        self._enqueue_calibration()
        self.noise, source = self.cfg.noise_threshold(self.tag_dir)
        self.say(f"keep threshold {self.noise:g} val_bpb ({source})")
        self._write_status(state="running", experiment=None, step=None)

    def _trust(self) -> None:
        """The session's trust anchors: the prepared data, the package and data fingerprint, the sandbox."""
        no_bytecode()   # from here on only something foreign changes the installed package's files
        self.tok_dir = check_prepared(default_cache(), self.cfg.dataset, self.profile.vocab_size)
        if not getattr(self, "fingerprint", None):
            self.fingerprint = Fingerprint.take(self.tok_dir)
        ok, why = sandbox.available()
        if not ok and self.cfg.sandbox:
            raise ConfigError(f"cannot sandbox proposal code: {why}; fix that, or pass --unsandboxed to run without "
                              "it (every result of the tag is then marked unsandboxed)")
        self.sandboxed = ok and self.cfg.sandbox
        if not self.sandboxed:
            self.say(f"proposal code runs WITHOUT the sandbox ({why if not ok else '--unsandboxed'}); every result "
                     "of this session is marked unsandboxed", "warn")
        self.allowance = self.cfg.startup_allowance   # tightened once the baseline's startup is measured

    def _prepare_tree(self, resume: bool) -> None:
        """Check out the branch; a dirty tree is refused unless it is the leftover of a cut-short experiment."""
        on_branch = self.git.current_branch() == self.branch
        if resume and on_branch:
            if self.git.clear_stale_index_lock():
                self.say("removed a stale .git/index.lock left by the stopped run", "warn")
            if self.git.dirty_paths():
                self.say("discarding the half-made change of the cut-short experiment", "warn")
        else:
            self.git.ensure_clean()
        created = self.git.checkout_branch(self.tag)
        meta = self.paths.meta
        settings = self._comparable()
        if created or not meta.exists():
            head = self.git.head_sha()
            _write_json(meta, {"tag": self.tag, "branch": self.branch, "base": head, "created_at": now_iso(),
                               "settings": settings})
            self.say(f"branch {self.branch} {'created' if created else 'adopted'} at {short(head)}; results "
                     f"in runs/{self.tag}/")
        else:
            doc = json.loads(meta.read_text())
            for key, now in settings.items():
                was = (doc.get("settings") or {}).get(key, now)
                if was != now and not (key == "time_budget" and self.command.startswith("ar sweep")):
                    raise ConfigError(f"tag {self.tag} was run with {key} {was}, this run asks for {now}: their "
                                      f"results are not comparable; pick a new tag (--tag) or the same {key}")
            n = len(self.ledger.rows())
            self.say(f"resuming tag {self.tag} on {self.branch}: {n} result{'s' * (n != 1)} so far")
        self.base_sha = json.loads(meta.read_text())["base"]
        self._adopt_fix(meta)

    def _comparable(self) -> dict:
        """What must stay the same for a tag's results to compare."""
        return {"time_budget": self._budget(None), "dataset": self.cfg.dataset, "profile": self.profile.name,
                "eval_tokens": self.eval_tokens}

    def _adopt_fix(self, meta: Path) -> None:
        """Nothing kept yet (a crashed baseline, say) and the user committed a fix on the branch: start from it
        rather than reset it away."""
        if self.ledger.best_kept() is not None or self.git.dirty_paths():
            return
        head = self.git.head_sha()
        if head == self.base_sha or "\nar: tag " in self.git.repo.commit(head).message:
            return
        doc = json.loads(meta.read_text())
        _write_json(meta, {**doc, "base": head, "previous_base": self.base_sha})
        self.say(f"no result was kept yet: starting from your current HEAD {short(head)} "
                 f"(not {short(self.base_sha)})")
        self.base_sha = head

    def _restore_best(self) -> str:
        """Reset the branch and tree to the best kept commit; drop refs of experiments without a row."""
        best = self.ledger.best_kept()
        sha = self.git.resolve(best.commit) if best else self.base_sha
        if self.git.head_sha() != sha or self.git.dirty_paths():
            self.git.reset_hard(sha)
            self.say(f"train.py restored to the best kept commit {short(sha)}")
        recorded = {r.exp_id for r in self.ledger.rows()}
        for exp_id in self.git.exp_refs(self.tag):
            if exp_id not in recorded:
                self.git.delete_ref(self.tag, exp_id)
        return sha

    def _enqueue_calibration(self) -> None:
        k = self.calibrate_noise
        if k < 2:
            return
        have = len(self._base_values())
        queued = [s for s in self.queue.pending() if s.payload.get("calibrate")]
        baseline_pending = any(s.kind == "baseline" for s in self.queue.pending())
        missing = max(0, k - have - len(queued) - int(baseline_pending))
        for i in range(missing):
            self.queue.add("rerun", {"commit": self.base_sha, "seed": self.cfg.seed + have + i + 1,
                                     "calibrate": True, "description": "noise calibration: baseline again"})
        if missing or queued or baseline_pending:
            self.say(f"noise calibration: {k} runs of the baseline ({have} done, {missing + len(queued)} queued)")
        elif not self.paths.noise.exists():  # ar stopped between the last run and writing the file
            self._finish_calibration()

    def _base_values(self) -> list[float]:
        return [r.val_bpb for r in self.ledger.rows() if r.commit == short(self.base_sha) and r.val_bpb is not None
                and r.status in (Status.KEEP, Status.DISCARD, Status.VALIDATION)]

    # ------------------------------------------------------------------------------------------ queue
    def enqueue_knobs(self, knobs: dict, *, time_budget: float | None = None, seed: int | None = None,
                      description: str = "") -> Spec:
        """Queue a knob edit (checked against train.py's knobs now). Call inside `with loop:`."""
        assert self._open, "enqueue inside `with Loop(...)` so the queue is written under the lock"
        known = read_knobs(self.root / self.train_file)
        unknown = sorted(set(knobs) - set(known))
        if unknown:
            raise ConfigError(f"unknown knob {unknown[0]} in {self.train_file}; its knobs: {', '.join(known)}")
        return self.queue.add("knobs", {"knobs": dict(knobs), "time_budget": time_budget, "seed": seed,
                                        "description": description})

    def enqueue_rerun(self, commit: str, seed: int, description: str = "") -> Spec:
        assert self._open, "enqueue inside `with Loop(...)`"
        return self.queue.add("rerun", {"commit": self.git.resolve(commit), "seed": seed, "description": description})

    # -------------------------------------------------------------------------------------------- run
    def run(self, max_experiments: int | None = None, max_hours: float | None = None) -> Summary:
        """Run specs (proposing new ones when the queue is empty and there is a proposer) until a limit."""
        opened_here = not self._open
        self.open()
        session = session_id()
        old_term = _sigterm_as_interrupt()
        sched = Scheduler(self, max_experiments, max_hours)
        stop, failed, interrupted = "", False, False
        try:
            stop, failed, interrupted = sched.run()
        finally:
            _restore_sigterm(old_term)
            self._wind_up(session, stop, sched.n, sched.kept, opened_here)
        return self._summary(sched.n, sched.kept, stop, failed, interrupted)

    def _wind_up(self, session: str, stop: str, n: int, kept: int, opened_here: bool) -> None:
        """Say why the loop stopped, fire loop_finished once, and release the repo if this call opened it."""
        if stop:
            self.say(f"stopped: {stop}")
            best = self.ledger.best_kept()
            self.hooks.fire("loop_finished", session, {"tag": self.tag, "experiments": n, "kept": kept,
                                                       "stop_reason": stop,
                                                       **({"best": best.to_dict()} if best else {})})
        if opened_here:
            self.close()

    def _summary(self, n: int, kept: int, stop: str, failed: bool, interrupted: bool) -> "Summary":
        counts: dict[str, int] = {}
        for r in self.ledger.rows():
            counts[r.status.value] = counts.get(r.status.value, 0) + 1
        return Summary(self.tag, self.branch, n, kept, self.ledger.best_kept(), stop, self.ledger.path, counts,
                       failed, interrupted)

    # ------------------------------------------------------------------- the path of one experiment
    def start(self, spec: Spec) -> "_Exp":
        """Step 1 (here): mark the spec started, or record it when it keeps taking ar down with it."""
        for d in self.tag_dir.glob(f"{spec.id:04d}-*"):
            shutil.rmtree(d, ignore_errors=True)
        x = _Exp(spec, parent=self.best_sha, started_at=now_iso(), stage=self.ledger.exp_dir(spec.id, ""))
        if self.queue.starts(spec.id) >= MAX_STARTS:
            x.description = spec.payload.get("description") or spec.kind
            self.record(x, self.row(x, Status.INTERRUPTED, reason=f"ar stopped during this experiment "
                                                                  f"{MAX_STARTS} times; not run again"))
            return x
        self.queue.start(spec.id)
        faults.point("start")
        self._emit(Event("start", spec.payload.get("description") or "", spec=spec))
        return x

    def slot_context(self, slot: Slot) -> "SlotContext":
        """Where slot `slot` works: its tree (the repo itself for the inline executor), environment, evaluator."""
        ctx = self._contexts.get(slot.index)
        if ctx is None:
            git = self.executor.worktree(self, slot)
            server = evaluate.Server(self.paths.evaluator_log(slot.index), slot.env)
            ctx = SlotContext(slot, git, dict(slot.env), server, separate=git is not self.git)
            self._contexts[slot.index] = ctx
        return ctx

    def prepare_and_run(self, ctx: "SlotContext", x: "_Exp") -> Outcome:
        """Steps 2-6, in the slot (alongside other slots): prepare (propose or apply knobs, guard, commit),
        then execute and evaluate. Deciding and recording are the scheduler's, in order."""
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
            return self._run_committed(ctx, x)
        if spec.kind == "baseline":
            x.sha, x.description = x.parent, spec.payload.get("description") or "baseline"
            return self._run_committed(ctx, x)
        snap = guards.snapshot(ctx.git, x.parent, ctx.guard_dir(self.tag))
        self.status_exp(ctx, x, "proposing")
        if spec.payload.get("replay"):
            proposal = self._replay(ctx, x)
        else:   # built-in proposers one at a time, each seeing the others' points in flight as tried
            builtin = self.proposer is not None and self.proposer.name in BUILTIN_PROPOSERS
            with self._propose_lock if builtin else contextlib.nullcontext():
                proposal = self._propose(ctx, x)                                           # 2
                if proposal is not None and not isinstance(proposal, str):
                    self.flying[spec.id] = (_safe_knobs(ctx.root / self.train_file), x.description)
        faults.point("propose")
        if proposal is None:
            return Outcome("skipped")
        reason = self._integrity_after_proposal() or (                                     # 3
            proposal if isinstance(proposal, str) else self._check(ctx, x, snap))
        if reason or self.stopping.is_set():
            try:
                x.stage.mkdir(parents=True, exist_ok=True)
                (x.stage / "diff.patch").write_text(ctx.git.diff(x.parent)[:DIFF_CAP])
            except (GitError, OSError):
                pass
            guards.restore(ctx.git, snap, ctx.guard_dir(self.tag))
            return Outcome("rejected", reason) if reason else Outcome("interrupted")
        x.sha = ctx.git.commit([*x.changed] or [self.train_file], _message(x, self.tag),   # 4
                               allow_empty=not x.changed)
        faults.point("commit")
        return self._run_committed(ctx, x)

    def _run_committed(self, ctx: "SlotContext", x: "_Exp") -> Outcome:
        if self.stopping.is_set():      # Ctrl-C came while this one was being prepared: do not start its run
            return Outcome("interrupted")
        return Outcome("ran", run=self._train_and_classify(ctx, x))

    def _propose(self, ctx: "SlotContext", x: "_Exp") -> Proposal | str | None:
        """Edit the slot's tree for spec x. A str is a reason to reject; None: nothing left to try."""
        spec = x.spec
        train = ctx.root / self.train_file
        before = read_knobs(train)
        if spec.kind == "knobs":
            knobs = spec.payload.get("knobs") or {}
            x.seed, x.time_budget = spec.payload.get("seed"), spec.payload.get("time_budget")
            proposal = Proposal(spec.payload.get("description") or describe_change(before, knobs), knobs=knobs)
        elif self.proposer is None:
            return None
        else:
            ctx_ = Context(ctx.root, self.train_file, before, self.ledger.best_kept(), self._rows_in_flight(),
                           spec.id, x.stage, self.tag, self.profile, self._budget(None), self.eval_tokens, self.noise,
                           list(self.cfg.allowed_paths), self._agent_policy())
            try:
                proposal = self.proposer.propose(ctx_)
            except ProposalFailed as e:
                x.description = f"{self.proposer.name} proposal"
                return str(e)
            if proposal is None:
                return None
        x.description = proposal.description
        if proposal.knobs:
            try:
                set_knobs(train, proposal.knobs)
            except ConfigError as e:
                return str(e)
        return proposal

    def _rows_in_flight(self) -> list[Row]:
        """The ledger as a proposer sees it: every result, then the proposals still in flight in other slots
        (no val_bpb, reason `in flight`), so that two slots do not try the same point."""
        extra = [Row(commit="", val_bpb=None, memory_gb=None, status=Status.DISCARD, exp_id=i,
                     description=f"(in flight) {desc}", knobs=knobs, reason="in flight")
                 for i, (knobs, desc) in sorted(dict(self.flying).items())]
        return self.ledger.rows() + extra

    def _agent_policy(self) -> dict | None:
        """The agent's sandbox: no reading the dataset (validation text, token bytes) or the private hold-out
        scores, no changing the installed package; everything else as the user."""
        if not self.sandboxed:
            return None
        return {"deny": [str(self.tok_dir.parent), str(self._private_path().parent)],
                "read_only": [str(self.fingerprint.package_dir)], "network": True}

    def _private_path(self) -> Path:
        """Where hold-out scores live: in the cache, outside the repo, never in a log or prompt."""
        import hashlib
        key = hashlib.sha256(str(self.tag_dir.resolve()).encode()).hexdigest()[:16]
        return default_cache() / "private" / f"{key}.jsonl"

    def _integrity_after_proposal(self) -> str | None:
        """The proposer runs outside the sandbox: did it change the installed package or the data?"""
        broken = self.fingerprint.changes()
        if broken:
            self.halted = f"the proposal changed what it may not: {broken}"
            return self.halted
        return None

    def _check(self, ctx: "SlotContext", x: "_Exp", snap: guards.Snapshot) -> str | None:
        changed, reason = guards.check_scope(ctx.git, snap, self.cfg.allowed_paths, ctx.guard_dir(self.tag),
                                             exclude_prefix=x.stage.name + "/")
        x.changed = changed
        if reason:
            return reason
        if not changed and x.spec.kind == "propose":
            return "the proposal changed nothing"
        return guards.check_files(ctx.git, x.parent, changed)

    def _replay(self, ctx: "SlotContext", x: "_Exp") -> Proposal | str:
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

    def _train_and_classify(self, ctx: "SlotContext", x: "_Exp"):
        """Steps 5-6 for a committed experiment: (result, failure status or None, reason, metrics, budget, seed)."""
        spec = x.spec
        x.exp_dir = self.ledger.exp_dir(spec.id, x.sha)
        if x.stage.exists() and x.stage != x.exp_dir:
            for f in x.stage.iterdir():
                os.replace(f, x.exp_dir / f.name)
            x.stage.rmdir()
        if x.sha != x.parent and spec.kind != "rerun":
            ctx.git.keep_ref(self.tag, spec.id, x.sha)
            (x.exp_dir / "diff.patch").write_text(ctx.git.diff(x.parent, x.sha)[:DIFF_CAP])
        x.knobs = _safe_knobs(ctx.root / self.train_file)
        budget = self._budget(x.time_budget)
        seed = self.cfg.seed if x.seed is None else int(x.seed)
        _write_json(x.exp_dir / "spec.json", {"id": spec.id, "kind": spec.kind, "payload": spec.payload,
                                              "commit": x.sha, "parent": x.parent, "time_budget": budget,
                                              "seed": seed, "eval_tokens": self.eval_tokens,
                                              "profile": self.profile.name, "description": x.description})
        self._fire_event("run_started", spec.id, {"tag": self.tag, "exp_id": spec.id, "commit": short(x.sha),
                                                  "description": x.description, "time_budget": budget})
        result, stopped_by = self.executor.train(self, ctx, x, budget, seed)                 # 5
        status, reason, m = self._classify(ctx, x, result, stopped_by, budget)               # 6
        return result, status, reason, m, budget, seed

    # -------------------------------------------------------------------- settling (here, in order)
    def stale_win(self, x: "_Exp", status: Status | None, m) -> str | None:
        """Why x would be kept although its parent is no longer the best (another slot's win came first)."""
        if status is not None or x.spec.kind in ("rerun", "baseline") or x.parent == self.best_sha:
            return None
        best = self.ledger.best_kept()
        d = decide(best.val_bpb if best else None, m.val_bpb, self.noise)
        return d.reason if d.keep else None

    def record_stale(self, x: "_Exp", m, budget: float, seed: int, why: str) -> Row:
        """A win on a parent that is no longer the best: recorded `stale`; with rerun, queued on the new best."""
        x.time_budget, x.seed, x.val_bpb = budget, seed, m.val_bpb
        reason = f"{why}, but its parent {short(x.parent)} is no longer the best ({short(self.best_sha)} is)"
        if self.cfg.stale_policy == "rerun":
            p = x.spec.payload
            if x.spec.kind == "knobs":
                again = self.queue.add("knobs", {**p, "replay_of": x.spec.id})
            else:
                again = self.queue.add("propose", {"proposer": p.get("proposer"), "replay": x.sha,
                                                   "replay_of": x.spec.id, "description": x.description})
            reason += f"; re-run on top of it as experiment {again.id:04d}"
        else:
            reason += "; not merged (stale_policy: record)"
        self.git.reset_hard(self.best_sha)
        return self.record(x, self.row(x, Status.STALE, m=m, reason=reason))

    def decide_and_record(self, x: "_Exp", result, status: Status | None, reason: str, m, budget: float,
                          seed: int) -> Row:
        """Steps 7-9, serial and in dispatch order. The main tree ends at the best kept commit."""
        spec = x.spec
        x.time_budget, x.seed = budget, seed
        x.val_bpb = m.val_bpb if status is None else None
        if spec.kind == "rerun":
            status, reason = Status.VALIDATION, (f"failed: {reason}" if status else "validation re-run")
        elif status is None:                                                              # 7
            best = self.ledger.best_kept()
            d = decide(best.val_bpb if best else None, m.val_bpb, self.noise)
            status, reason = (Status.KEEP if d.keep else Status.DISCARD), d.reason
            if d.keep and best is not None and not self._holds_out(x.sha, best.commit):
                status, reason = Status.DISCARD, f"{d.reason}, but the gain did not hold on the private hold-out slice"
            if status is Status.KEEP and best is not None and self.cfg.confirm_new_best:
                status, reason = self._confirm(x, best.val_bpb, m.val_bpb, budget, seed)
        faults.point("decide")
        if status is Status.KEEP:
            self.best_sha = x.sha
        self.git.reset_hard(self.best_sha)   # inline: HEAD is there already when kept; from a slot: the branch moves
        faults.point("revert")
        return self.record(x, self.row(x, status, m=m, reason=reason))                   # 8, 9

    def request(self, ctx: "SlotContext", x: "_Exp", budget: float, seed: int) -> RunRequest:
        """Step 3: everything this experiment's run needs, in one place."""
        holdout = self.cfg.holdout_tokens if self.cfg.holdout_tokens is not None else self.eval_tokens // 8
        return RunRequest(
            tag=self.tag, exp_id=x.spec.id, commit=x.sha, time_budget=budget, seed=seed, profile=self.profile,
            dataset=self.cfg.dataset, cache=default_cache(), tok_dir=self.tok_dir,
            train_command=tuple(self.cfg.train_command), train_file=self.train_file, eval_tokens=self.eval_tokens,
            holdout_tokens=holdout, startup_allowance=self.cfg.startup_allowance,
            eval_allowance=self.cfg.eval_allowance,
            untimed_steps=self.cfg.untimed_steps if self.cfg.untimed_steps is not None else (
                10 if self.profile.name == "gpu" else 2),
            max_log_bytes=int(self.cfg.max_log_mb * 2**20), sandbox=self.sandboxed, slot_env=dict(ctx.env))

    def train_here(self, ctx: "SlotContext", x: "_Exp", budget: float, seed: int):
        """Step 5 on this machine (the local executors' train): train in a fresh sandboxed workspace on ar's
        clock, then the slot's trusted evaluator scores the checkpoint. Returns (run result, the status that
        stopped it early or None)."""
        req = self.request(ctx, x, budget, seed)
        watch = (DegradedWatch(min_mfu=self.cfg.min_mfu, min_tokens_per_s=self.cfg.min_tokens_per_s,
                               warmup_steps=self.cfg.degraded_warmup_steps, patience=self.cfg.degraded_patience)
                 if self.cfg.min_mfu is not None or self.cfg.min_tokens_per_s is not None else None)
        monitor = self.monitor_factory(x.spec) if self.monitor_factory and x.spec.kind != "rerun" else None
        stopped_by: list[Status] = []
        x.tail = deque(maxlen=TAIL_LINES)
        self.status_exp(ctx, x, "training", budget=budget)

        def on_line(line: str) -> str | None:
            x.tail.append(line)
            p = parse_step(line) if line.startswith("step ") else None
            if p is None:
                return None
            self._emit(Event("step", spec=x.spec, step=p, time_budget=budget))
            faults.point("train")
            self.status_step(ctx, p)
            for status, check in ((Status.DEGRADED, watch and watch.feed), (Status.PRUNED, monitor)):
                why = check(p) if check else None
                if why:
                    stopped_by.append(status)
                    return why
            return None

        x.t_run = time.time()
        scratch = ctx.guard_dir(self.tag)  # a slot's own copy in its worktree, else the ledger's folder
        guard = guards.watch_run(ctx.git, scratch)

        def after_run() -> str | None:
            changed = guards.run_changes(ctx.git, guard, scratch, x.exp_dir.name)
            if changed:  # put .git and the records back before anything reads them
                guards.undo_run_changes(ctx.git, guard, scratch)
            return changed

        trial = run_trial(req, ctx.git, work_root=self.paths.workspace(x.spec.id),
                          exp_dir=x.exp_dir, manifest=self.fingerprint.eval_files, fingerprint=self.fingerprint,
                          on_line=on_line, allowance=self.allowance, after_run=after_run, server=ctx.server)
        self.take(x, trial)
        out = trial.outcome
        if x.verdict.holdout_bpb is not None:
            self.keep_private(x, x.verdict.holdout_bpb)
        result = out.result
        if result.log_truncated:  # the cap dropped the end of the output: keep its last lines (the summary)
            with open(result.log_path, "a", encoding="utf-8", errors="replace") as f:
                tail = "".join(ln[:400] + "\n" for ln in x.tail)
                f.write(f"[ar] the last {len(x.tail)} lines of the output:\n{tail}")
        return result, (stopped_by[0] if stopped_by else None)

    def take(self, x: "_Exp", trial) -> None:
        """A finished trial's facts onto the experiment (here or from a Ray worker)."""
        x.outcome, x.verdict, x.has_checkpoint = trial.outcome, trial.verdict, trial.has_checkpoint
        x.wall = trial.outcome.result.wall_seconds
        x.tampered = trial.tampered
        if trial.integrity:   # cannot be put back: this run is a crash, and the loop stops after recording it
            self.halted = trial.tampered

    def keep_private(self, x: "_Exp", holdout: float) -> None:
        """The hold-out score: kept where no log, report or prompt shows it."""
        path = self._private_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"exp_id": x.spec.id, "commit": x.sha, "holdout_bpb": holdout}) + "\n")

    def _holds_out(self, sha: str, best_commit: str) -> bool:
        """A would-be new best must also beat the best on the private hold-out slice (when both have one)."""
        cand, best = self._holdout(sha), self._holdout(best_commit)
        return cand is None or best is None or cand < best

    def _holdout(self, sha: str) -> float | None:
        try:
            lines = self._private_path().read_text().splitlines()
        except OSError:
            return None
        found = [json.loads(ln)["holdout_bpb"] for ln in lines
                 if ln.strip() and json.loads(ln)["commit"].startswith(sha)]
        return found[-1] if found else None

    def _classify(self, ctx: "SlotContext", x: "_Exp", result, stopped_by: Status | None, budget: float):
        """(failure status or None when the run counts, reason, metrics). Only ar's clock and the trusted
        evaluator's record decide; what the run printed is shown, never believed."""
        self.status_exp(ctx, x, "measuring", budget=budget)
        m = parse_log_file(result.log_path)
        faults.point("parse")
        out, verdict = x.outcome, x.verdict
        m.val_bpb = verdict.val_bpb                      # the evaluator's, never the printed one
        m.training_seconds = round(out.trained, 3)       # ar's clock
        m.total_seconds = round(result.wall_seconds, 3)
        _write_json(x.exp_dir / "metrics.json", {k: v for k, v in m.to_dict().items() if k != "steps"} |
                    {"wall_seconds": result.wall_seconds, "startup_seconds": out.startup,
                     "returncode": result.returncode, "stop_reason": result.stop_reason,
                     "log_truncated": result.log_truncated, "sandboxed": out.sandboxed})
        x.mfu = self._mfu(m)
        if x.spec.kind == "baseline" and out.startup is not None and result.returncode == 0:
            self.allowance = min(self.cfg.startup_allowance, 1.5 * out.startup + 10)
        if result.stop_reason == STOP_INTERRUPTED:
            return Status.INTERRUPTED, "interrupted", m
        if x.tampered:
            return Status.CRASH, x.tampered, m
        if stopped_by is not None:
            return stopped_by, result.stop_reason, m
        if result.timed_out:
            return Status.TIMEOUT, (f"no checkpoint after {result.wall_seconds:.0f}s (budget {budget:g}s + "
                                    f"allowances); the process group was killed"), m
        if out.over_budget:
            return Status.TIMEOUT, out.over_budget, m
        if result.returncode != 0:
            if m.fail_message:
                return Status.CRASH, m.fail_message, m
            last = _last_output_line(result.log_path)
            why = result.stop_reason or f"exit code {result.returncode}"
            return Status.CRASH, f"{why}: {last[:300]}; see train.log" if last else f"{why}; see train.log", m
        if not x.has_checkpoint:
            return Status.CRASH, "train.py exited without saving a checkpoint (autoresearch.harness.checkpoint.save)", m
        if verdict.rejected:
            return Status.REJECTED, f"the evaluator rejected the model: {verdict.rejected}", m
        if verdict.error:
            return Status.CRASH, f"evaluation failed: {verdict.error}", m
        if m.val_bpb is None or not math.isfinite(m.val_bpb):
            return Status.CRASH, "no val_bpb from the evaluator (did train.py save a checkpoint?)", m
        return None, "", m

    def _confirm(self, x: "_Exp", best: float, first: float, budget: float, seed: int) -> tuple[Status, str]:
        """Re-run a would-be new best with another seed; keep when the mean of both still clears the noise."""
        names = ("train.log", "record.json", "metrics.json")
        for n in names:  # the first run's files keep their names; the confirmation's get a -confirm suffix
            os.replace(x.exp_dir / n, x.exp_dir / f"first-{n}")
        mfu = x.mfu
        ctx = self.slot_context(self.slots[0])      # one slot only (checked at open): nothing else runs now
        result, _ = self.executor.train(self, ctx, x, budget, seed + 1)
        status, why, m = self._classify(ctx, x, result, None, budget)
        x.mfu = mfu
        for n in names:
            stem, ext = n.split(".")
            if (x.exp_dir / n).exists():
                os.replace(x.exp_dir / n, x.exp_dir / f"{stem}-confirm.{ext}")
            os.replace(x.exp_dir / f"first-{n}", x.exp_dir / n)
        if status is not None:
            return Status.DISCARD, f"confirmation re-run failed ({status.value}: {why})"
        mean = (first + m.val_bpb) / 2
        d = decide(best, mean, self.noise)
        return (Status.KEEP if d.keep else Status.DISCARD), (f"confirmed by a re-run with seed {seed + 1} "
                                                             f"({m.val_bpb:.6f}): mean {d.reason}")

    def interrupted(self, x: "_Exp", m=None) -> Row:
        self.git.reset_hard(self.best_sha)
        return self.record(x, self.row(x, Status.INTERRUPTED, m=m, reason="interrupted (Ctrl-C or SIGTERM)"))

    def record(self, x: "_Exp", row: Row) -> Row:
        self.ledger.append(row)                                                           # 8
        faults.point("recorded")
        x.row = row
        self.queue.done(x.spec.id, row.status.value)
        faults.point("done")
        self._fire(row)                                                                   # 9
        self._emit(Event("result", row.reason, spec=x.spec, row=row))
        if x.spec.payload.get("calibrate") and not any(s.payload.get("calibrate") for s in self.queue.pending()):
            self._finish_calibration()
        self._write_status(experiment=None, step=None)
        return row

    def _finish_calibration(self) -> None:
        values = self._base_values()
        if len(values) < 2:
            self.say("noise calibration: fewer than 2 clean runs of the baseline; threshold unchanged", "warn")
            return
        noise = noise_from_repeats(values)
        _write_json(self.paths.noise, {"noise": noise, "values": values, "commit": self.base_sha,
                                                  "written_at": now_iso()})
        if self.cfg.noise is None:
            self.noise = noise
        self.say(f"noise calibration: {len(values)} runs of the baseline, spread {noise:.6f} val_bpb -> "
                 f"runs/{self.tag}/noise.json" + ("" if self.cfg.noise is None else
                                                  f" (the configured noise {self.cfg.noise:g} still applies)"))

    # --------------------------------------------------------------------------------------- helpers
    def _budget(self, spec_budget: float | None) -> float:
        return float(spec_budget or self.cfg.time_budget or self.profile.time_budget)

    def _mfu(self, m) -> float | None:
        if not m.gpu or m.gpu.lower() == "cpu":
            return None
        peak = gpus.lookup(m.gpu)
        if peak.warning and m.gpu not in self._peak_warned:
            self._peak_warned.add(m.gpu)
            self.say(peak.warning, "warn")
        return recompute_mfu(m, peak)

    def row(self, x: "_Exp", status: Status, *, m=None, reason: str = "") -> Row:
        if not self.sandboxed:
            reason = f"unsandboxed; {reason}" if reason else "unsandboxed"
        return Row(commit=short(x.sha) if x.sha else "", val_bpb=x.val_bpb,
                   memory_gb=None if m is None or m.memory_gb is None else round(m.memory_gb, 1), status=status,
                   description=x.description or x.spec.kind, exp_id=x.spec.id, tag=self.tag,
                   parent=short(x.parent), mfu=x.mfu, tokens_per_s=m.tokens_per_s if m else None,
                   training_seconds=m.training_seconds if m else None, total_seconds=m.total_seconds if m else None,
                   num_steps=m.num_steps if m else None, total_tokens_M=m.total_tokens_M if m else None,
                   time_budget=x.time_budget if x.sha else None, seed=x.seed if x.sha else None,
                   knobs=x.knobs, reason=reason, started_at=x.started_at,
                   sweep=dict(x.spec.payload.get("sweep") or {}))  # a sweep point's identity, from its spec

    def exp_dir_of(self, row: Row) -> Path:
        return self.paths.exp_dir(row.exp_id, row.commit)

    def _fire(self, row: Row) -> None:
        events = []
        if row.status is not Status.REJECTED:
            events.append("run_finished")
        if row.status is Status.KEEP:
            events.append("kept")
        elif row.status in (Status.CRASH, Status.TIMEOUT):
            events.append("crashed")
        elif row.status not in (Status.VALIDATION, Status.INTERRUPTED):
            events.append("reverted")
        for event in events:
            self._fire_event(event, row.exp_id, row.to_dict())

    def _fire_event(self, event: str, exp_id, payload: dict) -> None:
        if self.cfg.hooks.get(event):
            with self._hook_lock:   # run_started fires from the slots
                self.hooks.fire(event, str(exp_id), payload)

    # ------------------------------------------------------------------------------------ status.json
    def status_exp(self, ctx: "SlotContext", x: "_Exp", phase: str, budget: float | None = None) -> None:
        doc = {"id": x.spec.id, "kind": x.spec.kind, "phase": phase, "description": x.description,
               "commit": short(x.sha) if x.sha else "", "started_at": x.started_at, "time_budget": budget}
        if self.multi:
            self.status_slot(ctx.slot, experiment=doc, step=None)
        else:
            self._write_status(experiment=doc, step=None)

    def status_step(self, ctx: "SlotContext", p: StepPoint, node: str | None = None) -> None:
        now = time.monotonic()
        if now - ctx.status_at < 0.5:
            return
        ctx.status_at = now
        if self.multi:
            self.status_slot(ctx.slot, step=p.__dict__, node=node)
        else:
            self._write_status(step=p.__dict__)

    def status_idle(self, slot: Slot) -> None:
        if self.multi:
            self.status_slot(slot, experiment=None, step=None)

    def status_slot(self, slot: Slot, node: str | None = None, **changes) -> None:
        """Update one slot's entry (its experiment, its step, the node it runs on)."""
        with self._status_lock:
            slots = list(self._status_doc.get("slots") or [_slot_doc(s) for s in self.slots])
            doc = dict(slots[slot.index])
            doc.update(changes)
            if node:
                doc["node"] = node
            slots[slot.index] = doc
            self._write_status_locked({"slots": slots})

    def _write_status(self, **changes) -> None:
        with self._status_lock:
            self._write_status_locked(changes)

    def _write_status_locked(self, changes: dict) -> None:
        doc = self._status_doc
        if not doc:
            doc.update(tag=self.tag, branch=self.branch, pid=os.getpid(), host=socket.gethostname(),
                       profile=self.profile.name)
        doc.update(changes)
        best = self.ledger.best_kept() if hasattr(self, "ledger") else None
        doc["best"] = None if best is None else {"commit": best.commit, "val_bpb": best.val_bpb,
                                                 "exp_id": best.exp_id, "description": best.description}
        doc["updated_at"] = now_iso()
        try:
            _write_json(self.paths.status, doc)
        except OSError:
            pass  # the live view is best-effort; the ledger is what counts


@dataclass
class SlotContext:
    """Where one slot works: its tree (the repo itself, or a worktree of its own), the environment its runs
    get (CUDA_VISIBLE_DEVICES), its trusted evaluator server."""

    slot: Slot
    git: GitRepo
    env: dict[str, str]
    server: evaluate.Server
    separate: bool                   # a worktree of its own (reset before each experiment)
    status_at: float = 0.0

    @property
    def root(self) -> Path:
        return self.git.root

    def guard_dir(self, tag: str) -> Path:
        """runs/<tag> in this slot's tree: what the guards watch (a worktree's own, not the ledger's)."""
        return RunsLayout(self.root).tag(tag).dir


def _slot_doc(slot: Slot) -> dict:
    return {"slot": slot.index, "label": slot.label, "gpu": slot.gpu, "kind": slot.kind, "experiment": None,
            "step": None}


@dataclass
class _Exp:
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
    outcome: "execute.TrainOutcome | None" = None   # ar's clock on the run
    verdict: "evaluate.Verdict | None" = None       # the trusted evaluator's record
    has_checkpoint: bool = False


def _message(x: _Exp, tag: str) -> str:
    return f"{x.description or x.spec.kind}\n\nar: tag {tag}, experiment {x.spec.id:04d} ({x.spec.kind})"


def _last_output_line(log: Path) -> str:
    """The run's last line of its own output (not ar's notes): the crash reason's context, read from the log
    so that every executor gives the same."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return next((ln.strip() for ln in reversed(lines) if ln.strip() and not ln.startswith("[ar]")), "")


def _safe_knobs(path: Path) -> dict:
    try:
        return read_knobs(path)
    except (ArError, OSError):
        return {}


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _sigterm_as_interrupt():
    """SIGTERM stops the loop like Ctrl-C (recorded as `interrupted`); only from the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, handler)


def _restore_sigterm(old) -> None:
    if old is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, old)
