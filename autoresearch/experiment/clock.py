"""The session's startup credit: how long a run may take before its budget starts, fixed by the session.

A run's whole life, process start → checkpoint written, must fit credit + budget + a last-step slack (execute.py).
The credit is measured on the baseline commit, never on a candidate: the smallest startup (process start → the
arrival of its first timed step line) of the baseline and its noise-calibration reruns in this tag, never more
than the configured `startup_allowance`. Before the baseline has run, the credit is `startup_allowance`. It is
kept in runs/<tag>/clock.json so that a resumed session keeps it.

The limit adds to the credit a load tolerance, `tolerance(credit)` = 1 s + a quarter of the credit (slots that
run side by side start slower than a baseline that ran alone): that much moved out of the timed window is the
most a candidate can gain, about 1% of a 300-s budget after a 15-s warm start.

What a candidate does before its first timed step (imports, compilation, silent optimizer steps, bigger
warm-up steps) is therefore paid from its budget: moving compute out of the timed window buys nothing, and a
candidate that starts later than the baseline trains that much less (train.py stops by `RunEnv.deadline`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE = "clock.json"


def tolerance(credit: float) -> float:
    """How much later than the credit a run may start without its whole life counting as over (load jitter)."""
    return 1.0 + 0.25 * credit


def late_note(startup: float | None, credit: float | None) -> str | None:
    """Why a run got less training: it reached its first timed step well after the baseline did."""
    if startup is None or credit is None or startup <= credit + tolerance(credit):
        return None
    return (f"started {startup - credit:.1f}s later than the baseline (first timed step at {startup:.1f}s, the "
            f"session's startup credit {credit:.1f}s): that time came off its training")


def load_credit(tag_dir: Path, allowance: float) -> float:
    """The tag's startup credit: the baseline's smallest startup so far, or `allowance` before there is one."""
    try:
        doc = json.loads((Path(tag_dir) / FILE).read_text())
        return min(float(allowance), float(doc["credit"]))
    except (OSError, ValueError, KeyError, TypeError):
        return float(allowance)


def note_baseline(tag_dir: Path, startup: float, allowance: float) -> float:
    """Record one startup of the baseline commit; returns the credit from now on (only ever tightens)."""
    credit = min(load_credit(tag_dir, allowance), float(startup))
    tmp = Path(tag_dir) / f".{FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"credit": round(credit, 3)}))
    os.replace(tmp, Path(tag_dir) / FILE)
    return credit
