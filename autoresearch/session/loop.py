"""The session: one tag's loop — lock, branch, baseline, noise calibration, queue, ledger — and the start of
each experiment. The scheduler (scheduler.py) drives the experiments; each one's path is a step per file:

 1. start: take the next spec from the queue; mark it started                         (Loop.start, here)
 2-4. propose, check, commit in the slot's tree                                        (experiment/propose.py)
 5. the executor trains in a fresh sandboxed workspace on ar's clock; the trusted evaluator scores the
    checkpoint                                                          (executors/, experiment/trial.py)
 6-9. classify, decide, reset, record, hooks                                           (experiment/settle.py)

Resume (`Loop.open`): a spec started without a ledger row is run again (MAX_STARTS times; the baseline always);
a ledger row whose spec is not marked done is marked done (its hooks fired if they were not), never run again;
an `interrupted` row (Ctrl-C) queued its experiment once more when it was recorded (experiment/again.py).
Which tag, and whether its settings and data still compare: tags.py. The working tree and the
branch go back to the best kept commit; refs of half-made experiment commits are removed.

Spec kinds: "baseline" (train.py as it is), "propose" (ask the proposer), "knobs" ({"knobs": {...},
"time_budget": s|None, "seed": int|None, "description": str}: a knob edit committed like any proposal),
"rerun" ({"commit": sha, "seed": int, "time_budget": s|None}: the same commit with another seed, recorded
as `validation`, never changing the best), "commit" ({"commit": sha, "description": str}: the user's own
commit found on the branch at open, run as it is and decided like a proposal). A sweep enqueues knob specs with
`Loop.enqueue_knobs` inside `with Loop(...)`, then calls `run()`; `monitor_factory(spec)` gives a per-step callback whose reason stops a
run as `pruned`.

`build` (at the end) is what `ar run` makes of its config: the proposer, the profile, each default said in one
line. What `ar status` reads back is in views/status.py.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from autoresearch import faults
from autoresearch.trust import guards
from autoresearch.records import tags
from autoresearch.config import RunConfig
from autoresearch.errors import ConfigError, DataError, GitError
from autoresearch.records.events import EventLog, slot_fields
from autoresearch.gitops import GitRepo, branch_name, short
from autoresearch.experiment import clock, compile_cache, headstart
from autoresearch.harness import gputime, sandbox
from autoresearch.harness import data
from autoresearch.harness.data import check_prepared
from autoresearch.harness.env import default_cache, resolve_profile
from autoresearch.session.hooks import Hooks
from autoresearch.trust.integrity import Fingerprint, no_bytecode
from autoresearch.knobs import read_knobs
from autoresearch.records.layout import RunsLayout
from autoresearch.records.ledger import Ledger, Row, Status, now_iso
from autoresearch.records.lock import RepoLock, refuse_if_held
from autoresearch.experiment.metrics import StepPoint
from autoresearch.objective import shown
from autoresearch.proposers import Proposer
from autoresearch.records.queue import ExperimentQueue, Spec
from autoresearch.experiment.request import RunRequest
from autoresearch.slots import Slot, turns_on_one_gpu
from autoresearch.executors.local import InlineExecutor
from autoresearch.experiment import evaluate, measure, settle
from autoresearch.experiment.context import Event, Experiment, SlotContext
from autoresearch.records.durable import write_json
from autoresearch.session.scheduler import BaselineGate, Scheduler, file_error, make_executor, session_id

Monitor = Callable[[StepPoint], "str | None"]
MAX_STARTS = 3      # a spec started this often without a result is recorded, not run again (the baseline is)
__all__ = ["Event", "Loop", "Summary"]


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
    objective: str = "val_bpb"  # what the best's value is


class Loop:
    def __init__(self, cfg: RunConfig, repo: str | Path, tag: str | None = None, proposer: Proposer | None = None,
                 *, on_event: Callable[[Event], None] | None = None, monitor_factory: Callable[[Spec], Monitor] |
                 None = None, baseline: bool = True, calibrate_noise: int = 0, command: str = "ar run", executor=None,
                 lock: RepoLock | None = None, require_noise: bool = False):
        """`require_noise`: refuse to decide on the default threshold (`ar run`): a tag with no measured noise
        and no configured one must calibrate first."""
        self.cfg, self.proposer, self.monitor_factory = cfg, proposer, monitor_factory
        self.executor = executor or make_executor(cfg)
        self.session = ""                   # the current run()'s id (session_id)
        self.git = GitRepo(repo)
        self.root = self.git.root
        self.train_file = "train.py" if "train.py" in cfg.allowed_paths else cfg.allowed_paths[0]
        self.emit = on_event or (lambda e: None)
        if cfg.noise is not None or cfg.objective.noise is not None or cfg.objective.noise_share is not None:
            # a configured threshold is the user's call: nothing to calibrate
            calibrate_noise = 0
        self.baseline, self.calibrate_noise, self.command = baseline, calibrate_noise, command
        if calibrate_noise == 1:
            raise ConfigError("--calibrate-noise K needs K >= 2 runs of the baseline to measure a spread")
        self.profile = resolve_profile(None if cfg.profile == "auto" else cfg.profile)
        self.eval_tokens = cfg.eval_tokens or self.profile.eval_tokens
        self.choice = tags.for_run(self.root, self._comparable, tag)   # refused here, before data or lock
        self.tag = self.choice.tag
        self.branch = branch_name(self.tag)
        self.paths = RunsLayout(self.root).tag(self.tag)
        self.tag_dir = self.paths.dir
        configured = cfg.noise is not None or cfg.objective.noise is not None or cfg.objective.noise_share is not None
        if require_noise and calibrate_noise < 2 and not configured and not self.paths.noise.exists():
            raise ConfigError(f"--calibrate-noise {calibrate_noise} leaves tag {self.tag} without a measured noise, "
                              "and a keep would rest on an invented threshold: drop the flag (3 runs of the "
                              "baseline measure it), or set noise: in the config")
        self.say(self._first_line(self.choice))
        # the repo lock; a caller that holds it across several Loops (ar sweep) lends it, and keeps it between them
        self._owns_lock = lock is None
        self._lock = lock or RepoLock(RunsLayout(self.root).lock, tag=self.tag, command=command)
        self._open = False
        self.peak_warned: set[str] = set()
        self.events = EventLog(self.paths.events)
        self.halted: str | None = None  # the harness or data changed under a run: no further run can count
        self._contexts: dict[int, SlotContext] = {}   # slot index -> its tree, environment and evaluator
        self.flying: dict[int, tuple[dict, str]] = {}  # spec id -> (knobs, description) of proposals in flight
        self.stopping = threading.Event()              # Ctrl-C: a slot starts no run after this
        self.propose_lock = threading.Lock()
        self.gate = BaselineGate(self.stopping)        # runs prepared beside the baseline wait until it trained
        self.hook_lock = threading.Lock()
        self.trusted_commits: set[str] = set()         # code the user wrote, or ar's knob edits of it
        # set by open(), which every use of a Loop goes through (`with Loop(...)`): the records, the commits the
        # session compares against, and what it trusts (the data, the sandbox, the clock's allowance)
        self.ledger: Ledger
        self.queue: ExperimentQueue
        self.hooks: Hooks
        self.base_sha: str                             # the user's commit the session started from
        self.best_sha: str                             # the best kept commit: what every candidate is decided against
        self.noise: float                              # the keep threshold, until a calibration replaces it
        self.tok_dir: Path | None                      # the prepared data (None: a command objective's own)
        self.fingerprint: Fingerprint                  # the package and data as the session found them
        self.sandboxed: bool
        self.val_readable: bool                        # proposal code could read the validation text: results say so
        self.allowance: clock.Credit                   # the baseline's start-up and finish so far (clock.json)

    # ----------------------------------------------------------------------------------- open / close
    def say(self, message: str, kind: str = "info") -> None:
        self.emit(Event(kind, message))

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
            self._release_lock()
            raise file_error(e) from e
        except BaseException:
            self._release_lock()
            raise
        try:
            self.executor.open(self)
            if self.cfg.confirm_new_best and len(self.slots) > 1:
                raise ConfigError("confirm_new_best is not available with several slots yet; set it to false or "
                                  "run on one slot")
        except BaseException:
            self.executor.close()
            self._release_lock()
            raise
        self._open = True
        self.events.session_started(tag=self.tag, branch=self.branch, profile=self.profile.name, by_slot=self.multi,
                                    slots=[slot_fields(s) for s in self.slots], budget=self.session_budget(),
                                    noise=self.noise)
        if self.multi:
            gpus = [s.gpu for s in self.slots if s.gpu is not None]
            shared = self.executor.name == "local" and len(set(gpus)) < len(gpus)
            head = headstart.asked(self.cfg.head_start, self.profile.device)
            self.say(f"{len(self.slots)} slots ({', '.join(s.label for s in self.slots)}) on the "
                     f"{self.executor.name} executor; a win on a stale parent is "
                     f"{'re-run' if self.cfg.stale_policy == 'rerun' else 'recorded'}"
                     + ("; on a shared GPU the next run starts in the running window's last seconds where the "
                        "memory holds both and its GPU time is read (head_start)" if shared and head else ""))

    def _release_lock(self) -> None:
        if self._owns_lock:
            self._lock.release()

    @property
    def slots(self) -> list[Slot]:
        return self.executor.slots

    @property
    def multi(self) -> bool:
        """Whether the views show slots (several, or a separate worktree) rather than one experiment."""
        return not isinstance(self.executor, InlineExecutor)

    def close(self) -> None:
        for ctx in self._contexts.values():
            ctx.server.close()
        self._contexts.clear()
        if self._open:
            self.executor.close()
            self.events.session_stopped()
            self._release_lock()
            self._open = False

    def _open_records(self) -> Callable[[str], None]:
        """Under the lock, what every session opens first: the trust anchors, runs/ ignored, the tag's folder and
        its ledger. Returns the warning printer the records use."""
        self._trust()
        self.git.ensure_ignored()
        self.tag_dir.mkdir(parents=True, exist_ok=True)
        warn = lambda m: self.say(m, "warn")  # noqa: E731
        self.ledger = Ledger(self.tag_dir, warn=warn, sign=self.cfg.objective.sign)
        return warn

    def _open_locked(self) -> None:
        warn = self._open_records()
        self.queue = ExperimentQueue(self.paths.queue, warn=warn)
        self.hooks = Hooks(self.cfg.hooks, self.paths.hooks, timeout=self.cfg.hook_timeout,
                           cwd=self.root, log=warn)
        rows = self.ledger.rows()
        self._check_data(rows)
        recorded = {r.exp_id: r for r in rows if r.exp_id is not None}
        in_flight = [s for s in self.queue.pending() if self.queue.is_started(s.id) and s.id not in recorded]
        self._prepare_tree(resume=bool(in_flight))
        faults.point("resume")
        for spec in self.queue.pending():           # a row whose spec is not marked done: mark it, fire its hooks
            if spec.id in recorded:
                self.queue.done(spec.id, recorded[spec.id].status.value)
                settle.fire(self, recorded[spec.id])
        if rows and rows[-1].exp_id is not None:     # hooks of the last row, if ar died before firing them
            settle.fire(self, rows[-1])
        yours = self._take_users_commit()
        self.best_sha = self._restore_best(quiet=yours)
        self.trusted_commits = {self.base_sha}   # the user's commit; the session adds ar's own knob edits of it
        if self.cfg.compile_cache:    # made now, so that the agent's sandbox denies it as it is (prepare.py)
            compile_cache.store_dir(default_cache()).mkdir(parents=True, exist_ok=True)
        for spec in in_flight:
            self.say(f"experiment {spec.id:04d} ({spec.kind}) was cut short by a stop of ar; it runs again")
        if self.baseline and self.ledger.best_kept() is None and not any(
                s.kind == "baseline" for s in self.queue.pending()):
            self.queue.add("baseline", {})
        self._enqueue_calibration()
        self.noise, source = self.cfg.noise_threshold(self.tag_dir)
        if self.calibrate_noise >= 2 and not self.paths.noise.exists():
            source = f"{source} until the calibration measures the baseline's spread"
        obj = self.cfg.objective
        if obj.noise_share is not None:
            self.say(f"keep threshold {obj.noise_share:.1%} of the best {obj.name} (objective.noise)")
        else:
            noise, source = (obj.noise, "objective.noise") if obj.noise is not None else (self.noise, source)
            said = measure.describe(self)
            self.say(said or f"keep threshold {noise:g} {obj.name} ({source})")
            measure.top_up(self)   # a tag calibrated before: its best re-measured if it has too few runs

    def _check_data(self, rows: list[Row], pin: bool = True) -> None:
        """The tag's results were scored on one validation split: refuse another (a cache prepared again with a
        new split key, say); `pin`: record it while the tag has no result yet (tags.check_data)."""
        tags.check_data(self.tag_dir, self.tok_dir, bool(rows), data.key_path(default_cache()), pin=pin)

    def _ensure_data(self) -> None:
        """Prepare `builtin` when it is missing (under the lock: a second `ar run` beside a running one is
        refused at once, not after minutes of preparing data it cannot use)."""
        if not self.cfg.prepare_data:
            return
        try:
            data.check_prepared(default_cache(), self.cfg.dataset, self.profile.vocab_size)
        except DataError as e:
            if self.cfg.dataset != "builtin":
                raise
            stale = "another version of the harness" in str(e)
            self.say(f"{'the prepared builtin corpus is from an older harness (another split)' if stale else 'no prepared data'}: "
                     f"preparing the builtin corpus for vocab {self.profile.vocab_size} in {default_cache()} (once)")
            data.prepare("builtin", cache=default_cache(), vocab_size=self.profile.vocab_size, progress=self.say)

    def _trust(self) -> None:
        """The session's trust anchors: the prepared data, the package and data fingerprint, the sandbox."""
        custom = self.cfg.objective.custom          # a command objective reads no prepared data
        if not custom:
            self._ensure_data()
        no_bytecode()   # from here on only something foreign changes the installed package's files
        self.tok_dir = None if custom else check_prepared(default_cache(), self.cfg.dataset, self.profile.vocab_size)
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
        self.val_readable = data.validation_readable(self.tok_dir)
        if self.val_readable:
            self.say(f"the validation text of dataset {self.cfg.dataset!r} comes from files proposal code can read "
                     "(this Python has no Lib/test to draw it from); every result of this session is marked "
                     "`validation text readable`", "warn")
        self.allowance = clock.load(self.paths.dir)         # the baseline's start-up so far (clock.py)
        if self.profile.name == "gpu" and not custom:        # what a start-up on the GPU is charged in (clock.py)
            meter, why = gputime.open_meter()
            if meter is not None:
                self.say("GPU time is read per process from the driver (NVML): a start-up is charged in GPU seconds")
            else:
                self.say(f"GPU time cannot be read ({why}): a start-up on the GPU is bounded by wall time only, the "
                         f"baseline's + max({clock.BLIND_ROOM:g} s, a quarter of it), so a new shape's cold compile "
                         "may cost part of its window", "warn")

    def _prepare_tree(self, resume: bool) -> None:
        """Check out the branch; a dirty tree is refused unless it is the leftover of a cut-short experiment."""
        was = self.git.current_branch()
        on_branch = was == self.branch
        if resume and on_branch:
            if self.git.clear_stale_index_lock():
                self.say("removed a stale .git/index.lock left by the stopped run", "warn")
            if self.git.dirty_paths():
                self.say("discarding the half-made change of the cut-short experiment", "warn")
        else:
            self.git.ensure_clean(command=" ".join(self.command.split()[:2]))
        created = self.git.checkout_branch(self.tag)
        if was and was != self.branch and not created:    # `ar sweep` leaves its branch checked out, say
            self.say(f"switched from branch {was} to {self.branch}")
        meta = self.paths.meta
        settings = self._comparable()
        if created or not meta.exists():
            head = self.git.head_sha()
            write_json(meta, {"tag": self.tag, "branch": self.branch, "base": head, "created_at": now_iso(),
                               "kind": "sweep" if self.command.startswith("ar sweep") else "run",
                               "settings": settings, "objective": self.cfg.objective.describe()})
            where = f"the HEAD of {was}" if was else "a detached HEAD"
            if was and was.startswith("autoresearch/sweep-"):
                where += " (a sweep's branch: `git checkout` another first to start elsewhere)"
            self.say(f"branch {self.branch} starts at {short(head)}, {where}" if created else
                     f"branch {self.branch} adopted at {short(head)}; results in runs/{self.tag}/")
        else:
            tags.refuse_incomparable(self.root, self.tag, settings)   # checked at start, again under the lock
        self.base_sha = json.loads(meta.read_text())["base"]
        self._adopt_fix(meta)

    def _comparable(self) -> dict:
        """What must stay the same for this session's results to compare with the tag's (tags.py)."""
        return tags.of_config(self.cfg, self.command)

    def _first_line(self, choice: tags.Choice) -> str:
        return tags.first_line(self.root, choice.tag, choice.note)

    def _adopt_fix(self, meta: Path) -> None:
        """Nothing kept yet (a crashed baseline, say) and the user committed a fix on the branch: start from it
        rather than reset it away."""
        if self.ledger.best_kept() is not None or self.git.dirty_paths():
            return
        head = self.git.head_sha()
        if head == self.base_sha or "\nar: tag " in self.git.repo.commit(head).message:
            return
        doc = json.loads(meta.read_text())
        write_json(meta, {**doc, "base": head, "previous_base": self.base_sha})
        self.say(f"no result was kept yet: starting from your current HEAD {short(head)} "
                 f"(not {short(self.base_sha)})")
        self.base_sha = head

    def _take_users_commit(self) -> bool:
        """A commit on the branch that is no recorded experiment is the user's own work (the dirty-tree refusal
        told them to commit): it is queued to run as a proposal, against the best, rather than reset over. One
        that changes what experiments may not change is refused, with the way to keep it."""
        best = self.ledger.best_kept()
        if best is None or self.git.dirty_paths():
            return False
        head, best_sha = self.git.head_sha(), self.git.resolve(best.commit)
        if (self.git.is_ancestor(head, best_sha) or short(head) in {r.commit for r in self.ledger.rows()}
                or "\nar: tag " in self.git.repo.commit(head).message
                or any(s.payload.get("commit") == head for s in self.queue.pending() if s.kind == "commit")):
            return False
        outside = [p for p in self.git.paths_between(best_sha, head) if not guards.allowed(p, self.cfg.allowed_paths)]
        if outside:
            raise GitError(f"your commit {short(head)} on {self.branch} is not a recorded experiment and changes "
                           f"{', '.join(outside[:3])}, which an experiment may not change, so it cannot run as one; "
                           f"keep it on a branch of its own and go back to the best (git branch my-work "
                           f"{short(head)} && git reset --hard {short(best_sha)}), then `ar run` again")
        subject = self.git.repo.commit(head).summary.strip()[:120]
        spec = self.queue.add("commit", {"commit": head, "description": f"your commit {short(head)}: {subject}"})
        self.git.keep_ref(self.tag, spec.id, head)    # reachable whatever becomes of the branch meanwhile
        self.say(f"your commit {short(head)} on {self.branch} is not a recorded experiment: it runs as experiment "
                 f"{spec.id:04d}, a proposal against the best {short(best_sha)} (kept only if it beats it)")
        return True

    def _restore_best(self, quiet: bool = False) -> str:
        """Reset the branch and tree to the best kept commit; drop refs of experiments without a row. `quiet`:
        the user's commit was just queued (and said so); it is not dropped."""
        best = self.ledger.best_kept()
        sha = self.git.resolve(best.commit) if best else self.base_sha
        if self.git.head_sha() != sha or self.git.dirty_paths():
            self.git.reset_hard(sha)
            if not quiet:
                self.say(f"train.py restored to the best kept commit {short(sha)}")
        recorded = {r.exp_id for r in self.ledger.rows()} | {s.id for s in self.queue.pending() if s.kind == "commit"}
        for exp_id in self.git.exp_refs(self.tag):
            if exp_id not in recorded:
                self.git.delete_ref(self.tag, exp_id)
        return sha

    def _enqueue_calibration(self) -> None:
        k = self.calibrate_noise
        if k < 2:
            return
        have = len(self.base_values())
        queued = [s for s in self.queue.pending() if s.payload.get("calibrate")]
        baseline_pending = any(s.kind == "baseline" for s in self.queue.pending())
        missing = max(0, k - have - len(queued) - int(baseline_pending))
        for i in range(missing):
            self.queue.add("rerun", {"commit": self.base_sha, "seed": self.cfg.seed + have + i + 1,
                                     "calibrate": True, "description": "noise calibration: baseline again"})
        if missing or queued or baseline_pending:
            self.say(f"noise calibration: {k} runs of the baseline ({have} done, {missing + len(queued)} queued)")
        elif not self.paths.noise.exists():  # ar stopped between the last run and writing the file
            settle.finish_calibration(self)

    def base_values(self) -> list[float]:
        return [r.val_bpb for r in self.ledger.rows() if r.commit == short(self.base_sha) and r.val_bpb is not None
                and r.status in (Status.KEEP, Status.DISCARD, Status.VALIDATION)]

    # ------------------------------------------------------------------------------------------ queue
    def enqueue_knobs(self, knobs: dict, *, time_budget: float | None = None, seed: int | None = None,
                      description: str = "", sweep: dict | None = None) -> Spec:
        """Queue a knob edit (checked against train.py's knobs now). Call inside `with loop:`. `sweep`: a sweep
        point's identity, recorded in the row's `sweep` column."""
        assert self._open, "enqueue inside `with Loop(...)` so the queue is written under the lock"
        known = read_knobs(self.root / self.train_file)
        unknown = sorted(set(knobs) - set(known))
        if unknown:
            raise ConfigError(f"unknown knob {unknown[0]} in {self.train_file}; its knobs: {', '.join(known)}")
        return self.queue.add("knobs", {"knobs": dict(knobs), "time_budget": time_budget, "seed": seed,
                                        "description": description, **({"sweep": sweep} if sweep else {})})

    def enqueue_rerun(self, commit: str, seed: int, description: str = "") -> Spec:
        assert self._open, "enqueue inside `with Loop(...)`"
        return self.queue.add("rerun", {"commit": self.git.resolve(commit), "seed": seed, "description": description})

    # -------------------------------------------------------------------------------------------- run
    def run(self, max_experiments: int | None = None, max_hours: float | None = None) -> Summary:
        """Run specs (proposing new ones when the queue is empty and there is a proposer) until a limit."""
        opened_here = not self._open
        self.open()
        session = self.session = session_id()
        old_term = _sigterm_as_interrupt()
        sched = Scheduler(self, max_experiments, max_hours)
        stop, failed, interrupted = "", False, False
        try:
            stop, failed, interrupted = sched.run()
        finally:
            _restore_sigterm(old_term)
            self._wind_up(session, stop, sched.limits.n, sched.limits.kept, opened_here)
        return self._summary(sched.limits.n, sched.limits.kept, stop, failed, interrupted)

    def _wind_up(self, session: str, stop: str, n: int, kept: int, opened_here: bool) -> None:
        """Say why the loop stopped, fire loop_finished once, and release the repo if this call opened it."""
        if stop:
            self.say(f"stopped: {stop}")
            self.events.stopping(stop)
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
                       failed, interrupted, self.cfg.objective.name)

    # ------------------------------------------------------------------- the path of one experiment
    def start(self, spec: Spec) -> Experiment:
        """Step 1 (here): mark the spec started, or record it when it keeps taking ar down with it."""
        for d in self.tag_dir.glob(f"{spec.id:04d}-*"):
            shutil.rmtree(d, ignore_errors=True)
        x = Experiment(spec, parent=self.best_sha, started_at=now_iso(), stage=self.ledger.exp_dir(spec.id, ""))
        starts = self.queue.starts(spec.id)
        if starts >= MAX_STARTS and spec.kind == "baseline":    # every result is measured against it: never given up
            self.say(f"the baseline was cut short {starts} times (ar was stopped or killed while it ran); it runs "
                     "again: no experiment of the tag can be decided without it", "warn")
        elif starts >= MAX_STARTS:
            x.description = spec.payload.get("description") or spec.kind
            why = f"ar stopped during this experiment {MAX_STARTS} times; not run again"
            settle.record_as(self, x, Status.INTERRUPTED, reason=why)
            return x
        self.queue.start(spec.id)
        faults.point("start")
        self.emit(Event("start", spec.payload.get("description") or "", spec=spec))
        return x

    def slot_context(self, slot: Slot) -> SlotContext:
        """Where slot `slot` works: its tree (the repo itself for the inline executor), environment, evaluator."""
        ctx = self._contexts.get(slot.index)
        if ctx is None:
            git = self.executor.worktree(self, slot)
            server = evaluate.Server(self.paths.evaluator_log(slot.index), slot.env)
            ctx = SlotContext(slot, git, dict(slot.env), server, separate=git is not self.git)
            self._contexts[slot.index] = ctx
        return ctx

    def request(self, ctx: SlotContext, x: Experiment, budget: float, seed: int) -> RunRequest:
        """Everything this experiment's run needs, in one place (every executor's train starts here)."""
        holdout = self.cfg.holdout_tokens if self.cfg.holdout_tokens is not None else self.eval_tokens // 8
        return RunRequest(
            tag=self.tag, exp_id=x.spec.id, commit=x.sha, time_budget=budget, seed=seed, profile=self.profile,
            dataset=self.cfg.dataset, cache=default_cache(), tok_dir=self.tok_dir,
            train_command=tuple(self.cfg.train_command), train_file=self.train_file, eval_tokens=self.eval_tokens,
            holdout_tokens=holdout, startup_allowance=self.cfg.startup_allowance,
            eval_allowance=self.cfg.eval_allowance, eval_prestart=self.eval_prestart,
            untimed_steps=self.cfg.untimed_steps if self.cfg.untimed_steps is not None else (
                3 if self.profile.name == "gpu" else 0),
            max_log_bytes=int(self.cfg.max_log_mb * 2**20), sandbox=self.sandboxed, slot_env=dict(ctx.env),
            objective=self.cfg.objective, trusted_code=x.trusted_code,
            compile_store=compile_cache.store_dir(default_cache()) if self.cfg.compile_cache else None,
            head_start=self.cfg.head_start, session=self.session)

    # --------------------------------------------------------------------------------------- helpers
    @property
    def eval_prestart(self) -> float:
        """A GPU worker's CUDA context and buffers take seconds to make, so by default they are made in the
        window's last 10 s; on the CPU a worker starts in a fraction of a second and would take cores from it."""
        if self.cfg.eval_prestart is not None:
            return self.cfg.eval_prestart
        return 10.0 if self.profile.name == "gpu" else 0.0

    def session_budget(self) -> float | None:
        """The budget every experiment of the session runs at; None for a sweep, whose points carry their own."""
        return None if self.command.startswith("ar sweep") else self.budget(None)

    def budget(self, spec_budget: float | None) -> float:
        return float(spec_budget or self.cfg.time_budget or self.profile.time_budget)

    def exp_dir_of(self, row: Row) -> Path:
        return self.paths.exp_dir(row.exp_id, row.commit)


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


def check_repo(repo: str | Path) -> Path:
    """The repository's root, once it is known to be one with a commit and no other ar holds its lock: what every
    command that runs experiments checks before it says or makes anything."""
    git = GitRepo(repo)
    git.ensure_commits()
    refuse_if_held(RunsLayout(git.root).lock)
    return git.root


def build(cfg: RunConfig, repo: str | Path, *, tag: str | None = None, on_event: Callable[[Event], None] | None = None,
          calibrate_noise: int = 0, command: str = "ar run", require_noise: bool = False) -> Loop:
    """The loop `ar run` runs: proposer, profile and data chosen from the config, each default said in one line."""
    from autoresearch.proposers import make_proposer
    say = (lambda m: on_event(Event("info", m))) if on_event else (lambda m: None)
    custom = cfg.objective.custom
    if not custom and not (Path(repo) / "train.py").exists() and cfg.train_command[-1:] == ["train.py"]:
        raise ConfigError(f"no train.py in {Path(repo).resolve()}; run `ar init DIR` for a workspace, or pass --repo")
    if custom and cfg.proposer in (None, "strategy") and not cfg.agent:
        raise ConfigError("the objective needs a proposer: --agent claude|codex|aider|'COMMAND {prompt_file}', or "
                          "proposer grid or random with a search_space of the file's knobs")
    check_repo(repo)   # not a repository, or another ar holds it: said before anything else is
    proposer = make_proposer(cfg)
    turns = None
    if (proposer.name == "agent" and cfg.gpus is None and cfg.executor != "ray" and not custom
            and not cfg.confirm_new_best        # not with several slots yet (Loop.open says so)
            and resolve_profile(None if cfg.profile == "auto" else cfg.profile).name == "gpu"):
        turns = turns_on_one_gpu()     # an agent on one GPU: two slots take turns, the agent thinks meanwhile
        cfg = dataclasses.replace(cfg, gpus=turns) if turns else cfg
    loop = Loop(cfg, repo, tag, proposer, on_event=on_event, calibrate_noise=calibrate_noise, command=command,
                require_noise=require_noise)
    if turns:
        say(f"one GPU and an agent: two slots take turns on GPU {turns.split(',')[0]} (--gpus {turns}), so the "
            f"agent proposes and the last run is scored while the GPU trains; --gpus {turns.split(',')[0]} for "
            "one experiment at a time")
    if cfg.proposer is None and proposer.name == "strategy":
        say("no agent configured: proposing with the built-in strategy proposer (one knob at a time from the best)")
    if custom:
        say(f"objective {cfg.objective.label()}: gate {shown(cfg.objective.gate) or '(none)'}, then "
            f"{shown(cfg.objective.command)}")
    elif cfg.profile == "auto":
        what = "a CUDA GPU" if loop.profile.name == "gpu" else "no CUDA GPU"
        say(f"{what}: {loop.profile.name} profile ({loop.budget(None):g}s budget, {loop.eval_tokens} eval tokens)")
    return loop
