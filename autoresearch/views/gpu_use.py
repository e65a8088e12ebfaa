"""How busy each GPU was: its training windows, the idle time between them, and what that time waited for.

Every run leaves `timing.json` (experiment/trial.py; a decision's further runs `timing-<suffix>.json`): when its
experiment was ready to run (`prepare`: proposed, committed, its workspace begun), its first batch
(`window_start`) and its last step (`last_step`). Per GPU, in order of first batch:

- a gap is one window's last step to the next one's first batch;
- of it, the time the GPU waited for the next experiment to exist at all (its proposal, its commit, or a slot
  still busy scoring) is `for_proposal`; the rest is the hand-over (the other's save and exit, the next one's
  start-up where a head start did not hide it).

When the GPU mostly waited for proposals, more slots on it would have fed it (`advice`): with two slots, a
slot has one window of the other's to be scored, to have its agent think and to start up in; with three it has
two. CPU runs are not counted: CPU slots train side by side, so their windows have no gaps to speak of.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

ADVISE_AFTER = 3          # gaps seen before any advice
WAITED = 1.0              # seconds: a gap in which the GPU waited this long for a proposal counts as one


@dataclass(frozen=True)
class Window:
    exp: int
    gpu: str              # CUDA_VISIBLE_DEVICES of the run's slot ("" for the one GPU of a run without slots)
    session: str          # the `ar run` it was part of: a resumed tag's first window is no gap after the last
    ready: float          # wall clock: the experiment was proposed and committed
    first_batch: float
    last_step: float


@dataclass(frozen=True)
class Gap:
    exp: int              # the experiment whose window ends the gap
    seconds: float
    for_proposal: float   # of which the GPU waited for that experiment to exist


def load(tag_dir: Path) -> list[Window]:
    """The GPU windows of one tag's runs; a run that never trained, a CPU run or an unreadable file is skipped."""
    out = []
    for exp_dir in sorted(Path(tag_dir).glob("[0-9][0-9][0-9][0-9]-*")):
        for f in sorted(exp_dir.glob("timing*.json")):
            try:
                t = json.loads(f.read_text())
                if t.get("device") == "cuda" and t.get("window_start") and t.get("last_step"):
                    out.append(Window(int(exp_dir.name[:4]), str(t.get("gpu") or ""), str(t.get("session") or ""),
                                      float(t["prepare"]), float(t["window_start"]), float(t["last_step"])))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return out


def _runs(windows: list[Window]) -> dict[tuple[str, str], list[Window]]:
    """Each GPU's windows per session, in the order they trained."""
    out: dict[tuple[str, str], list[Window]] = {}
    for w in sorted(windows, key=lambda w: w.first_batch):
        out.setdefault((w.gpu, w.session), []).append(w)
    return out


def gaps(windows: list[Window]) -> dict[str, list[Gap]]:
    """Per GPU, the gaps between its windows in the order they trained, within each session."""
    out: dict[str, list[Gap]] = {}
    for (gpu, _), ws in _runs(windows).items():
        out.setdefault(gpu, []).extend(
            Gap(b.exp, max(0.0, b.first_batch - a.last_step),
                min(max(0.0, b.ready - a.last_step), max(0.0, b.first_batch - a.last_step)))
            for a, b in zip(ws, ws[1:]))
    return out


def advice(gs: list[Gap]) -> str | None:
    """What would have fed this GPU better, or None: only where it mostly waited for proposals."""
    if len(gs) < ADVISE_AFTER:
        return None
    waited = [g.for_proposal for g in gs]
    late = sum(w >= WAITED for w in waited)
    if 2 * late < len(gs):
        return None
    return (f"the GPU waited for the next proposal in {late} of {len(gs)} gaps (median "
            f"{statistics.median(waited):.1f} s): give it one more slot (--gpus 0,0 for two, 0,0,0 for three, the "
            f"most), so that a slot is scored and proposes while the others train, or a longer budget")


def summarize(windows: list[Window]) -> list[dict]:
    """One dict per GPU: windows, busy share (windows over first batch → last step), gaps and their medians,
    and the advice."""
    out = []
    runs = _runs(windows)
    for gpu, gs in sorted(gaps(windows).items()):
        sessions = [ws for (g, _), ws in runs.items() if g == gpu]
        span = sum(max(w.last_step for w in ws) - ws[0].first_batch for ws in sessions)
        busy = sum(w.last_step - w.first_batch for ws in sessions for w in ws)
        out.append({"gpu": gpu, "windows": sum(map(len, sessions)),
                    "busy": min(1.0, busy / span) if span > 0 else None,     # a last step may overlap a head start
                    "gaps": [round(g.seconds, 3) for g in gs],
                    "median_gap": statistics.median(g.seconds for g in gs) if gs else None,
                    "median_for_proposal": statistics.median(g.for_proposal for g in gs) if gs else None,
                    "advice": advice(gs)})
    return out
