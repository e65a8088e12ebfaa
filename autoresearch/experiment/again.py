"""What runs again, after settle.py recorded an experiment: one cut off by the user's stop (Ctrl-C or SIGTERM:
`interrupted`), or one that failed for a reason outside the proposal — the evaluator itself failed (its record's
`error`, never the model's fault), the package or data changed under it, ar's own slot failed — is queued once
more, as a new experiment with the same commit (or the same knob edit). Once: a re-run that is cut off or fails
so again is not queued again, and says so.

Other rules stay where they are: the baseline is queued again by Loop.open while none is kept, noise calibration
counts its runs, a sweep resumes its unfinished points, and a spec started without a result (ar killed mid-run)
runs again up to MAX_STARTS times (session/loop.py).
"""

from __future__ import annotations

from autoresearch.records.ledger import Row, Status
from autoresearch.records.queue import Spec
from autoresearch.experiment.context import Experiment

INTERRUPTED = "was interrupted (Ctrl-C or SIGTERM)"
HELD = "was not run (the baseline it waited for was not kept)"


def outside_the_proposal(lp, x: Experiment, row: Row) -> str | None:
    """Why a crash is not the proposal's doing (a phrase for `queue_again`), or None. Read from facts, in
    classify's order: the package or data changed under the run (the session halted on it); or the run exited 0
    with a checkpoint and touched nothing, and the evaluation failed (the evaluator's own error)."""
    if row.status is not Status.CRASH:
        return None
    if x.tampered and lp.halted == x.tampered:
        return f"failed outside the proposal: the package or data changed under it ({x.tampered})"
    out, verdict = x.outcome, x.verdict
    if (out is not None and verdict is not None and verdict.error and not verdict.rejected and not x.tampered
            and out.result.returncode == 0 and x.has_checkpoint):
        return f"failed outside the proposal: the evaluation failed ({verdict.error})"
    return None


def queue_again(lp, x: Experiment, what: str) -> Spec | None:
    """Queue x once more, said in one line (`what` it was: INTERRUPTED, or why it failed outside the proposal);
    None when it is not for this rule, or was a re-run already."""
    spec, command = x.spec, " ".join(lp.command.split()[:2])
    if spec.kind == "baseline" or spec.payload.get("calibrate"):
        return None                                   # Loop.open queues these again itself
    if spec.payload.get("again_of"):
        lp.say(f"experiment {spec.id:04d} (the re-run of {int(spec.payload['again_of']):04d}) {what} as well; not "
               f"run again", "warn")
        return None
    short_what = {INTERRUPTED: "was interrupted", HELD: "was not run"}.get(what, "failed outside the proposal")
    description = f"{x.description or spec.kind} (again: {spec.id:04d} {short_what})"
    if spec.kind in ("knobs", "rerun"):
        again = lp.queue.add(spec.kind, {**spec.payload, "description": description, "again_of": spec.id})
    elif x.sha and x.sha != x.parent:                 # a proposal or your commit, committed: that commit again
        again = lp.queue.add("commit", {"commit": x.sha, "description": description, "again_of": spec.id})
        lp.git.keep_ref(lp.tag, spec.id, x.sha)       # reachable (under the recorded one's ref) until it runs
    else:
        return None                                   # cut off before anything was committed: nothing to run
    when = f" at the next `{command}`" if lp.stopping.is_set() or lp.halted else ""
    lp.say(f"experiment {spec.id:04d} {what}: it runs again as experiment {again.id:04d}{when}")
    return again
