"""Steps 6-9 of one experiment: classify the run (only ar's clock and the trusted evaluator's record count),
decide against the best *now* (decide.py, a pure function), reset the branch unless kept, append the ledger
row (the commit point), mark the spec done, fire the hooks. Classifying runs in the slot; the rest runs in
the scheduler's thread, one experiment at a time, in dispatch order.

Every function takes the session (`lp`, a Loop) for its settings and records, and the experiment (`x`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from autoresearch import faults
from autoresearch.decide import Decision, decide, noise_from_repeats
from autoresearch.gitops import short
from autoresearch.harness import gpus
from autoresearch.harness.env import default_cache
from autoresearch.records.ledger import Row, Status, now_iso
from autoresearch.experiment.metrics import parse_log_file, recompute_mfu
from autoresearch.trust.repeats import built_config, same_build
from autoresearch.process import STOP_INTERRUPTED
from autoresearch.experiment import clock, measure
from autoresearch.records.durable import write_json
from autoresearch.experiment.context import Event, Experiment, SlotContext


def note_credit(lp, x: Experiment, out, cold: bool) -> None:
    """A clean run of the baseline commit: its start-up is what every later run gets free (clock.json; noting
    the same run twice changes nothing)."""
    if (x.spec.kind == "baseline" or x.spec.payload.get("calibrate")) and out.startup is not None and \
            out.result.returncode == 0 and not out.over_budget:
        lp.allowance = clock.note_baseline(lp.tag_dir, out.startup, out.startup_cpu, *out.finish, gpu=out.startup_gpu,
                                           cold=cold)


def baseline_trained(lp, x: Experiment, out, cold: bool) -> None:
    """The baseline trained cleanly (trial.run_trial, before its evaluation): its credit is noted, then the runs
    waiting beside it may start (scheduler.BaselineGate); they are called off if it is then not kept."""
    note_credit(lp, x, out, cold)
    lp.gate.trained()


def classify(lp, ctx: SlotContext, x: Experiment, result, stopped_by: Status | None, budget: float):
    """(failure status or None when the run counts, reason, metrics). Only ar's clock and the trusted
    evaluator's record decide; what the run printed is shown, never believed."""
    lp.events.phase(x, "settling")
    m = parse_log_file(result.log_path)
    faults.point("parse")
    out, verdict = x.outcome, x.verdict
    m.val_bpb = verdict.val_bpb                      # the evaluator's, never the printed one
    m.training_seconds = round(out.trained, 3)       # ar's clock
    m.total_seconds = round(result.wall_seconds, 3)
    write_json(x.exp_dir / "metrics.json", {k: v for k, v in m.to_dict().items() if k != "steps"} |
               {"wall_seconds": result.wall_seconds, "startup_seconds": out.startup, "startup_cpu": out.startup_cpu,
                "startup_gpu": out.startup_gpu,
                "window_seconds": out.window, "window_note": out.window_note, "tail_cpu": out.tail_cpu,
                "finish_seconds": out.finish[0], "finish_cpu": out.finish[1],
                "returncode": result.returncode, "stop_reason": result.stop_reason,
                "log_truncated": result.log_truncated, "sandboxed": out.sandboxed})
    x.mfu = _mfu(lp, m)
    note_credit(lp, x, out, x.compiled_cold)
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
    if verdict.rejected and lp.cfg.objective.custom:   # the correctness gate said no: no metric counts
        return Status.REJECTED, verdict.rejected, m
    if result.returncode != 0:
        if m.fail_message:
            return Status.CRASH, m.fail_message, m
        last = last_output_line(result.log_path)
        why = result.stop_reason or f"exit code {result.returncode}"
        return Status.CRASH, f"{why}: {last[:300]}; see train.log" if last else f"{why}; see train.log", m
    if not x.has_checkpoint:
        return Status.CRASH, "train.py exited without saving a checkpoint (autoresearch.harness.checkpoint.save)", m
    if verdict.rejected:
        return Status.REJECTED, f"the evaluator rejected the model: {verdict.rejected}", m
    if verdict.error:
        return Status.CRASH, f"evaluation failed: {verdict.error}", m
    if m.val_bpb is None or not math.isfinite(m.val_bpb):
        if lp.cfg.objective.custom:
            return Status.CRASH, f"no {lp.cfg.objective.name} from the command", m
        return Status.CRASH, "no val_bpb from the evaluator (did train.py save a checkpoint?)", m
    return None, "", m


def stale_win(lp, x: Experiment, status: Status | None, m) -> str | None:
    """Why x would be kept although its parent is no longer the best (another slot's win came first)."""
    if status is not None or x.spec.kind in ("rerun", "baseline") or x.parent == lp.best_sha:
        return None
    step = measure.judge(lp, x)
    if step is not None:
        return step.reason if step.action == "keep" else None
    best = lp.ledger.best_kept()
    d = _decide(lp, best.val_bpb if best else None, m.val_bpb)
    return d.reason if d.keep else None


def record_stale(lp, x: Experiment, m, budget: float, seed: int, why: str) -> Row:
    """A win on a parent that is no longer the best: recorded `stale`; with rerun, queued on the new best."""
    x.time_budget, x.seed, x.val_bpb = budget, seed, m.val_bpb
    reason = f"{why}, but its parent {short(x.parent)} is no longer the best ({short(lp.best_sha)} is)"
    if lp.cfg.stale_policy == "rerun":
        p = x.spec.payload
        if x.spec.kind == "knobs":
            again = lp.queue.add("knobs", {**p, "replay_of": x.spec.id})
        else:
            again = lp.queue.add("propose", {"proposer": p.get("proposer"), "replay": x.sha,
                                               "replay_of": x.spec.id, "description": x.description})
        reason += f"; re-run on top of it as experiment {again.id:04d}"
    else:
        reason += "; not merged (stale_policy: record)"
    lp.git.reset_hard(lp.best_sha)
    return record_as(lp, x, Status.STALE, m=m, reason=reason)


def decide_and_record(lp, x: Experiment, result, status: Status | None, reason: str, m, budget: float,
                      seed: int) -> Row:
    """Steps 7-9, serial and in dispatch order. The main tree ends at the best kept commit."""
    spec = x.spec
    x.time_budget, x.seed = budget, seed
    x.val_bpb = m.val_bpb if status is None else None
    if spec.kind == "rerun":
        status, reason = Status.VALIDATION, (f"failed: {reason}" if status else "validation re-run")
    elif status is None and x.outcome is not None and not lp.cfg.objective.custom and \
            (short := clock.short_window_note(x.outcome.window, budget)):              # ar's window was too short
        status = Status.DISCARD
        reason = f"val_bpb {m.val_bpb:.6f}, but {short}" if m.val_bpb is not None else short
        if x.outcome is not None and x.outcome.window_note:
            reason = f"{reason}; {x.outcome.window_note}"
    elif status is None:                                                              # 7
        best = lp.ledger.best_kept()
        step = measure.judge(lp, x)       # several runs against the best's mean, or (None) one run past a threshold
        d = _decide(lp, best.val_bpb if best else None, m.val_bpb) if step is None else \
            Decision(step.action == "keep", step.reason)
        if step is not None:
            measure.record(lp, x, step)
        status, reason = (Status.KEEP if d.keep else Status.DISCARD), d.reason
        same = same_build(lp.exp_dir_of(best), best.knobs, x.exp_dir, x.knobs) if d.keep and best else None
        if same:
            status, reason = Status.DISCARD, f"{d.reason}, but {same}"
        elif d.keep and best is not None and not _holds_out(lp, x.sha, best.commit):
            status, reason = Status.DISCARD, f"{d.reason}, but the gain did not hold on the private hold-out slice"
        speed = _throughput_ratio(lp, x, best, m) if status is Status.KEEP and best is not None else None
        if status is Status.KEEP and best is not None and step is None and (lp.cfg.confirm_new_best or speed):
            status, reason = _confirm(lp, x, best.val_bpb, m.val_bpb, budget, seed)
            if speed:
                reason = f"the same model as the best ran at {speed:.1f}x its tokens/s, so {reason}"
        late = x.outcome.window_note if x.outcome is not None else None
        if late:
            reason = f"{reason}; {late}"
    for note in (_slow_transfer(x), epochs_note(x)):
        if note:
            reason = f"{reason}; {note}"
    faults.point("decide")
    if status is Status.KEEP:
        lp.best_sha = x.sha
    lp.git.reset_hard(lp.best_sha)   # inline: HEAD is there already when kept; from a slot: the branch moves
    faults.point("revert")
    row = record_as(lp, x, status, m=m, reason=reason)                                  # 8, 9
    if status in (Status.KEEP, Status.DISCARD):
        measure.top_up(lp)           # the best's mean from unselected runs, more of them the longer it stands
    return row


def epochs(x: Experiment) -> tuple[float, int]:
    """(epochs of the training split its window was served, the split's tokens; 0 where unknown): ar's feed
    counts them."""
    p = x.outcome.phases if x.outcome is not None else {}
    served, split = p.get("feed_tokens") or 0, p.get("train_tokens") or 0
    return (served / split if split else 0.0), split


def epochs_note(x: Experiment) -> str | None:
    """A window that served more than one epoch of the training split: on repeated data seeds spread far more
    widely, and a gain is hard to tell from one."""
    n, split = epochs(x)
    if n <= 1:
        return None
    return (f"its window trained {n:.1f} epochs of the {split / 1e6:.1f} M-token training split: "
            "results on repeated data spread widely; use a bigger corpus or a shorter budget")


def _slow_transfer(x: Experiment) -> str | None:
    """A GPU evaluation whose logits came through the host (CUDA IPC failed): said, with why, in the row."""
    rec = x.verdict.record if x.verdict is not None else {}
    if rec.get("transfer") != "host" or not rec.get("transfer_note"):
        return None
    return f"the evaluation fell back to host transfer, much slower ({rec['transfer_note'][:160]})"


THROUGHPUT_RATIO = 1.5   # a would-be best that ran this much faster or slower than the best, same model: confirm it


def _throughput_ratio(lp, x: Experiment, best: Row, m) -> float | None:
    """tokens/s against the best's when x built the same model and ran very much faster or slower (a loaded
    machine gives one run 3x the steps of another): its gain may be the machine's, so it is confirmed by a
    re-run before it is kept. None otherwise, and with several slots (a confirmation holds the only one)."""
    if len(lp.slots) != 1 or not best.tokens_per_s or not m.tokens_per_s:
        return None
    built = built_config(lp.exp_dir_of(best))
    if built is None or built != built_config(x.exp_dir):
        return None
    ratio = m.tokens_per_s / best.tokens_per_s
    return None if 1 / THROUGHPUT_RATIO <= ratio <= THROUGHPUT_RATIO else ratio


def _confirm(lp, x: Experiment, best: float, first: float, budget: float, seed: int) -> tuple[Status, str]:
    """Re-run a would-be new best with another seed; keep when the mean of both still clears the noise."""
    mfu = x.mfu
    ctx = lp.slot_context(lp.slots[0])      # one slot only (checked at open): nothing else runs now
    with measure.another_run(x.exp_dir, "confirm", ("train.log", "record.json", "metrics.json", "timing.json")):
        result, _ = lp.executor.train(lp, ctx, x, budget, seed + 1)
        status, why, m = classify(lp, ctx, x, result, None, budget)
    x.mfu = mfu
    if status is not None:
        return Status.DISCARD, f"confirmation re-run failed ({status.value}: {why})"
    mean = (first + m.val_bpb) / 2
    d = _decide(lp, best, mean)
    return (Status.KEEP if d.keep else Status.DISCARD), (f"confirmed by a re-run with seed {seed + 1} "
                                                         f"({m.val_bpb:.6f}): mean {d.reason}")


def _decide(lp, best: float | None, candidate: float | None):
    """decide.py's pure rule with the session's objective: its name, direction and threshold."""
    obj = lp.cfg.objective
    return decide(best, candidate, obj.threshold(lp.noise, best), name=obj.name, sign=obj.sign)


def interrupted(lp, x: Experiment, m=None, reason: str = "interrupted (Ctrl-C or SIGTERM)") -> Row:
    lp.git.reset_hard(lp.best_sha)
    return record_as(lp, x, Status.INTERRUPTED, m=m, reason=reason)


def record(lp, x: Experiment, row: Row) -> Row:
    lp.ledger.append(row)                                                           # 8
    faults.point("recorded")
    x.row = row
    lp.queue.done(x.spec.id, row.status.value)
    faults.point("done")
    lp.events.settled(x, row)
    fire(lp, row)                                                                   # 9
    lp.emit(Event("result", row.reason, spec=x.spec, row=row))
    if x.spec.payload.get("calibrate") and not any(s.payload.get("calibrate") for s in lp.queue.pending()):
        finish_calibration(lp)
        measure.top_up(lp)
        said = measure.describe(lp)
        if said:
            lp.say(said)
    return row


def record_as(lp, x: Experiment, status: Status, *, m=None, reason: str = "") -> Row:
    """Record x with this status (and its metrics, when it ran)."""
    return record(lp, x, _row(lp, x, status, m=m, reason=reason))


def _row(lp, x: Experiment, status: Status, *, m=None, reason: str = "") -> Row:
    if not lp.sandboxed:
        reason = f"unsandboxed; {reason}" if reason else "unsandboxed"
    if getattr(lp, "val_readable", False):
        reason = f"validation text readable; {reason}" if reason else "validation text readable"
    return Row(commit=short(x.sha) if x.sha else "", val_bpb=x.val_bpb,
               memory_gb=None if m is None or m.memory_gb is None else round(m.memory_gb, 1), status=status,
               description=x.description or x.spec.kind, exp_id=x.spec.id, tag=lp.tag,
               parent=short(x.parent), mfu=x.mfu, tokens_per_s=m.tokens_per_s if m else None,
               training_seconds=m.training_seconds if m else None, total_seconds=m.total_seconds if m else None,
               num_steps=m.num_steps if m else None, total_tokens_M=m.total_tokens_M if m else None,
               time_budget=x.time_budget if x.sha and not lp.cfg.objective.custom else None,  # a command: no budget
               seed=x.seed if x.sha else None,
               knobs=x.knobs, reason=reason, started_at=x.started_at,
               sweep=dict(x.spec.payload.get("sweep") or {}),  # a sweep point's identity, from its spec
               agent_tokens=x.agent_usage.tokens if x.agent_usage else None,
               agent_usd=x.agent_usage.usd if x.agent_usage else None)


def fire(lp, row: Row) -> None:
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
        fire_event(lp, event, row.exp_id, row.to_dict())


def fire_event(lp, event: str, exp_id, payload: dict) -> None:
    if lp.cfg.hooks.get(event):
        with lp.hook_lock:   # run_started fires from the slots
            lp.hooks.fire(event, str(exp_id), payload)


def take(lp, x: Experiment, trial) -> None:
    """A finished trial's facts onto the experiment (here or from a Ray worker)."""
    x.outcome, x.verdict, x.has_checkpoint = trial.outcome, trial.verdict, trial.has_checkpoint
    x.compiled_cold = trial.compiled_cold
    x.wall = trial.outcome.result.wall_seconds
    x.tampered = trial.tampered
    if trial.integrity:   # cannot be put back: this run is a crash, and the loop stops after recording it
        lp.halted = trial.tampered


def keep_private(lp, x: Experiment, holdout: float) -> None:
    """The hold-out score: kept where no log, report or prompt shows it."""
    path = private_path(lp)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"exp_id": x.spec.id, "commit": x.sha, "holdout_bpb": holdout}) + "\n")


def _holds_out(lp, sha: str, best_commit: str) -> bool:
    """A would-be new best must also beat the best on the private hold-out slice (when both have one)."""
    cand, best = _holdout(lp, sha), _holdout(lp, best_commit)
    return cand is None or best is None or cand < best


def _holdout(lp, sha: str) -> float | None:
    try:
        lines = private_path(lp).read_text().splitlines()
    except OSError:
        return None
    found = [json.loads(ln)["holdout_bpb"] for ln in lines
             if ln.strip() and json.loads(ln)["commit"].startswith(sha)]
    return found[-1] if found else None


def finish_calibration(lp) -> None:
    values = lp.base_values()
    if len(values) < 2:
        lp.say("noise calibration: fewer than 2 clean runs of the baseline; threshold unchanged", "warn")
        return
    noise = noise_from_repeats(values)
    write_json(lp.paths.noise, {"noise": noise, "values": values, "commit": lp.base_sha, "written_at": now_iso()})
    if lp.cfg.noise is None:
        lp.noise = noise
        lp.events.settings(noise=noise)   # `ar status` and the dashboard show the threshold now in use
    lp.say(f"noise calibration: {len(values)} runs of the baseline, spread {noise:.6f} {lp.cfg.objective.name} -> "
           f"runs/{lp.tag}/noise.json" + ("" if lp.cfg.noise is None else
                                          f" (the configured noise {lp.cfg.noise:g} still applies)"))


def _mfu(lp, m) -> float | None:
    if not m.gpu or m.gpu.lower() == "cpu":
        return None
    peak = gpus.lookup(m.gpu)
    if peak.warning and m.gpu not in lp.peak_warned:
        lp.peak_warned.add(m.gpu)
        lp.say(peak.warning, "warn")
    return recompute_mfu(m, peak)


def private_path(lp) -> Path:
    """Where hold-out scores live: in the cache, outside the repo, never in a log or prompt."""
    key = hashlib.sha256(str(lp.tag_dir.resolve()).encode()).hexdigest()[:16]
    return default_cache() / "private" / f"{key}.jsonl"


def last_output_line(log: Path) -> str:
    """The run's last line of its own output (not ar's notes): the crash reason's context, read from the log
    so that every executor gives the same."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return next((ln.strip() for ln in reversed(lines) if ln.strip() and not ln.startswith("[ar]")), "")
