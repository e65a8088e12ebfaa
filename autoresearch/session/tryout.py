"""`ar try` and `ar eval`: score a hand edit without an `ar run`.

`ar try` trains the working tree once, exactly as an experiment of the tag would run (the tag's budget, profile,
dataset and eval tokens; the sandbox, ar's clock, the trusted evaluator: the executor's `train`, the one trust
path), and shows the score against the tag's best and its noise. Nothing is committed and no branch moves: the
tree is snapshotted as a commit object (`git stash create`) that no ref holds, so `git archive` can export it
like any experiment's commit. The trial is recorded in runs/<tag>/trials.tsv (status `trial`), never in
results.tsv: it is not a keep, and the loop, the report and the journal do not see it.

`ar eval CHECKPOINT` scores a checkpoint that something else trained (`python train.py` by hand writes
./checkpoint): the same evaluator and sandboxed worker, with the working tree's train.py to rebuild the model.
It was not trained on ar's clock nor in the sandbox, so it is shown beside the best, never decided against it.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from autoresearch import budgets as budgets_mod
from autoresearch import config as config_mod
from autoresearch.records import tags
from autoresearch.config import RunConfig
from autoresearch.errors import ConfigError
from autoresearch.records.events import EventLog
from autoresearch.experiment import evaluate, execute, settle
from autoresearch.experiment.context import Event, Experiment
from autoresearch.records.durable import write_json
from autoresearch.gitops import GitRepo, short
from autoresearch.harness import checkpoint
from autoresearch.records.layout import RunsLayout
from autoresearch.records.ledger import Ledger, Row, Status, now_iso
from autoresearch.records.queue import Spec
from autoresearch.session.loop import Loop, check_repo

TRIALS = "trials.tsv"
_SETTINGS = ("time_budget", "dataset", "profile", "eval_tokens")   # what makes a score compare with the tag's


@dataclass
class TryResult:
    tag: str
    what: str                 # the working tree on top of <sha7>, or the checkpoint's folder
    val_bpb: float | None
    status: Status | None     # a failure (crash, timeout, rejected …), or None: it ran and was scored
    reason: str               # why it failed, or how it compares with the best
    best: Row | None
    noise: float
    folder: Path              # its train.log, record.json, metrics.json
    kept_would_be: bool = False
    seconds: float | None = None   # wall time from the run's start to its score
    epochs: float = 0.0            # epochs of the training split its window was served

    def lines(self) -> list[str]:
        head = (f"{self.what}: val_bpb {self.val_bpb:.6f}" if self.val_bpb is not None else
                f"{self.what}: {self.status.value if self.status else 'no score'}")
        out = [f"{head} ({self.reason})" if self.reason else head]
        if self.best is not None:
            out.append(f"tag {self.tag}: best {self.best.val_bpb:.6f} at {self.best.commit} "
                       f"({self.best.description}); keep threshold {self.noise:g}")
        else:
            out.append(f"tag {self.tag} has no kept result yet to compare with (`ar run` measures a baseline)")
        out.append(f"files: {self.folder}")
        return out


def pick_tag(repo: Path, cfg: RunConfig, tag: str | None) -> tags.Choice:
    """The tag a trial is compared with, by the rule of every command (tags.py): the one asked for, else the
    branch you are on (not a sweep's), else today's as `ar run` takes it."""
    return tags.for_run(repo, lambda: tags.of_config(cfg), tag, compare=False)


def tag_config(cfg: RunConfig, runs: RunsLayout, tag: str) -> RunConfig:
    """cfg with the tag's comparable settings (budget, dataset, profile, eval tokens), when it has them."""
    import json
    try:
        was = json.loads(runs.tag(tag).meta.read_text()).get("settings") or {}
    except (OSError, ValueError):
        return cfg
    return config_mod.replace(cfg, **{k: was[k] for k in _SETTINGS if was.get(k) is not None})


class Tryout(Loop):
    """A session that runs one trial: the lock, the trust anchors, the tag's ledger for its best and noise; no
    branch checked out, nothing reset, nothing queued."""

    def __init__(self, cfg: RunConfig, repo: str | Path, tag: str, *, on_event=None, command: str = "ar try"):
        super().__init__(cfg, repo, tag, None, on_event=on_event, baseline=False, command=command)
        self.events = EventLog(self.tag_dir / ".trials" / "events.jsonl")   # not the tag's: `ar status` is the loop's

    def _first_line(self, choice) -> str:
        return ""      # tryout.run says which tag, and why

    def _open_locked(self) -> None:
        warn = self._open_records()
        self.trials = Ledger(self.tag_dir, warn=warn, sign=self.cfg.objective.sign)
        self.trials.path = self.tag_dir / TRIALS
        self._check_data(self.ledger.rows(), pin=False)
        self.noise, _ = self.cfg.noise_threshold(self.tag_dir)
        self.best_sha = self.git.head_sha()

    def say(self, message: str, kind: str = "info") -> None:
        if message:
            super().say(message, kind)

    # ------------------------------------------------------------------------------------------- try
    def _next(self, stem: str) -> tuple[int, Experiment]:
        n = 1 + max((r.exp_id or 0 for r in self.trials.rows()), default=0)
        x = Experiment(Spec(n, "trial", {}), parent=self.best_sha, started_at=now_iso(),
                       stage=self.tag_dir / f"{stem}-{n:04d}-none")
        return n, x

    def try_tree(self) -> TryResult:
        """Train the working tree once on the tag's settings, sandboxed, scored by the trusted evaluator."""
        if self.cfg.objective.custom:
            raise ConfigError("ar try scores val_bpb; a command objective's tag is tried with `ar run`")
        changed = self.git.tracked_changes(self.best_sha)
        sha = self.git._git("stash", "create", "ar try") or self.best_sha     # the tree as a commit, no ref
        what = (f"working tree ({', '.join(changed[:3])}{' …' if len(changed) > 3 else ''} changed) on "
                f"{short(self.best_sha)}" if changed else f"{short(self.best_sha)} as committed")
        return self._trial(sha, what, self.budget(None), self.cfg.seed)

    def noise_run(self, budget: float, seed: int) -> TryResult:
        """Train the tag's best as committed once at `budget` with `seed` (`ar noise`): a trial like `ar try`'s."""
        if self.cfg.objective.custom:
            raise ConfigError("ar noise measures val_bpb; a command objective's noise is measured by `ar run`'s "
                              "calibration")
        return self._trial(self.best_sha, f"noise: {short(self.best_sha)} at {budget:g} s, seed {seed}", budget, seed)

    def _trial(self, sha: str, description: str, budget: float, seed: int) -> TryResult:
        n, x = self._next("trial")
        x.sha, x.description = sha, description
        x.exp_dir = self.tag_dir / f"trial-{n:04d}-{short(x.sha)}"   # beside the experiments: the guards' own
        x.exp_dir.mkdir(parents=True, exist_ok=True)
        ctx = self.slot_context(self.slots[0])
        write_json(x.exp_dir / "spec.json", {"id": n, "kind": "trial", "commit": x.sha, "parent": x.parent,
                                             "time_budget": budget, "seed": seed, "eval_tokens": self.eval_tokens,
                                             "profile": self.profile.name, "description": x.description})
        (x.exp_dir / "diff.patch").write_text(self.git.diff(self.best_sha, x.sha))
        self.emit(Event("start", x.description, spec=x.spec))
        t0 = time.monotonic()
        result, stopped_by = self.executor.train(self, ctx, x, budget, seed)
        status, reason, m = settle.classify(self, ctx, x, result, stopped_by, budget)
        seconds = time.monotonic() - t0
        x.time_budget, x.seed = budget, seed
        x.val_bpb = m.val_bpb if status is None else None
        best = self.ledger.best_kept()
        would = False
        if status is None:
            d = settle._decide(self, best.val_bpb if best else None, m.val_bpb)
            would = d.keep and best is not None
            reason = (f"would be kept: {d.reason}" if would else d.reason if best is not None else "")
        if not self.sandboxed:   # as the loop marks its rows
            reason = f"unsandboxed; {reason}" if reason else "unsandboxed"
        row = Row(commit=short(x.sha), val_bpb=x.val_bpb, memory_gb=None if m.memory_gb is None else
                  round(m.memory_gb, 1), status=status or Status.TRIAL, description=x.description, exp_id=n,
                  tag=self.tag, parent=short(x.parent), mfu=x.mfu, tokens_per_s=m.tokens_per_s,
                  training_seconds=m.training_seconds, total_seconds=m.total_seconds, num_steps=m.num_steps,
                  total_tokens_M=m.total_tokens_M, time_budget=budget, seed=seed, knobs=dict(x.knobs),
                  reason=reason, started_at=x.started_at)
        self.trials.append(row)
        return TryResult(self.tag, f"trial {n:04d}, {x.description}", x.val_bpb, status, reason, best,
                         self.noise, x.exp_dir, would, seconds, settle.epochs(x)[0])

    # ------------------------------------------------------------------------------------------ eval
    def eval_checkpoint(self, folder: Path) -> TryResult:
        """Score a checkpoint folder with the trusted evaluator (the working tree's train.py rebuilds it)."""
        folder = check_checkpoint(folder)
        n, x = self._next("eval")                  # numbered only once the folder is a checkpoint
        x.sha = self.git._git("stash", "create", "ar eval") or self.best_sha
        x.description = f"checkpoint {folder}"
        x.exp_dir = self.tag_dir / f"eval-{n:04d}-{short(x.sha)}"
        x.exp_dir.mkdir(parents=True, exist_ok=True)
        ctx = self.slot_context(self.slots[0])
        req = self.request(ctx, x, self.budget(None), self.cfg.seed)
        ws, _ = execute.make_workspace(self.git, x.sha, self.paths.workspace(n), req.tok_dir)
        try:
            shutil.copytree(folder, ws.checkpoint, dirs_exist_ok=True)
            ev = evaluate.Evaluation(req, ws, self.fingerprint.eval_files, x.exp_dir / "record.json",
                                     ws.root / "private.json", ctx.server)
            broken = self.fingerprint.changes()
            verdict = ev.finish(go=not broken)
        finally:
            execute.remove_workspace(ws)
        best = self.ledger.best_kept()
        status, reason = None, "trained outside ar's clock and sandbox: shown beside the best, not decided"
        if broken:
            status, reason = Status.CRASH, f"the package or data changed: {broken}"
        elif verdict.rejected:
            status, reason = Status.REJECTED, f"the evaluator rejected the model: {verdict.rejected}"
        elif verdict.error or verdict.val_bpb is None:
            status, reason = Status.CRASH, f"evaluation failed: {verdict.error or 'no val_bpb'}"
        x.val_bpb = verdict.val_bpb if status is None else None
        self.trials.append(Row(commit=short(x.sha), val_bpb=x.val_bpb, memory_gb=None, status=status or Status.TRIAL,
                               description=x.description, exp_id=n, tag=self.tag, parent=short(x.parent),
                               reason=reason, started_at=x.started_at))
        return TryResult(self.tag, f"eval {n:04d}, {x.description}", x.val_bpb, status, reason, best, self.noise,
                         x.exp_dir)


def check_checkpoint(folder: Path) -> Path:
    """The folder, when it holds a whole checkpoint (model.json and the weights); else a one-line ConfigError
    that says where one comes from. An experiment's folder under runs/ keeps only the model's model.json."""
    folder = Path(folder)
    missing = [name for name in (checkpoint.MODEL_JSON, checkpoint.WEIGHTS) if not (folder / name).is_file()]
    if not missing:
        return folder
    what = ("only the config of the model an experiment built, not its weights: ar keeps no experiment's weights"
            if missing == [checkpoint.WEIGHTS] else f"no {' and no '.join(missing)}")
    raise ConfigError(f"{folder} is not a checkpoint ({what}); `python train.py` writes one (model.json + "
                      f"{checkpoint.WEIGHTS}) to ./checkpoint: train by hand, then `ar eval checkpoint`")


def run(cfg: RunConfig, repo: Path, tag: str | None, action: Callable[[Tryout], TryResult], *, on_event=None,
        command: str) -> TryResult:
    """Open a Tryout on the tag (its settings applied), run `action`, close."""
    git = GitRepo(check_repo(repo))
    choice = pick_tag(git.root, cfg, tag)
    if choice.why != "--tag" and on_event is not None:
        on_event(Event("info", choice.line()))                  # which tag, and why
    cfg = tag_config(cfg, RunsLayout(git.root), choice.tag)
    with Tryout(cfg, git.root, choice.tag, on_event=on_event, command=command) as t:
        return action(t)


def measure_budgets(t: Tryout, budgets: list[float], runs: int, on_run=None) -> list[budgets_mod.BudgetNoise]:
    """`ar noise`: the tag's best trained `runs` times at each budget (shortest first), seeds from ar (the
    tag's seed + 0, 1, ...): the same seeds at every budget, so the budgets differ in nothing else."""
    out = []
    for budget in sorted(budgets):
        b = budgets_mod.BudgetNoise(budget)
        out.append(b)
        for i in range(runs):
            r = t.noise_run(budget, t.cfg.seed + i)
            if r.status is None and r.val_bpb is not None:
                b.values.append(r.val_bpb)
            else:
                b.failed.append(f"seed {t.cfg.seed + i}: {r.status.value if r.status else 'no score'} ({r.reason})")
            if r.seconds and (out[0] is not b or i or runs == 1):   # the first run also starts the evaluator
                b.seconds.append(r.seconds)                             # and fills the compile cache: not timed
            b.epochs = max(b.epochs, r.epochs)
            if on_run is not None:
                on_run(budget, i, r)
    return out
