"""How busy each GPU was: its training windows, the idle time between them, and what that time waited for.

Every run leaves `timing.json` (experiment/trial.py; a decision's further runs `timing-<suffix>.json`): when its
experiment was ready to run (`prepare`: proposed, committed, its workspace begun), its first batch
(`window_start`) and its last step (`last_step`). Per GPU, in order of first batch:

- a gap is one window's last step to the next one's first batch;
- of it, `late` is what the next experiment's lateness cost: to follow at once, it had to be ready (its
  proposal made and committed, its slot done scoring the last one) its workspace and its start-up before that
  last step; every second later is a second of gap. The rest is the hand-over (the other's save and exit, and the
  start-up where a head start did not hide it although the run was ready).

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
WAITED = 1.0              # seconds: a gap whose lateness is this long counts as one that waited for a proposal


@dataclass(frozen=True)
class Window:
    exp: int
    gpu: str              # CUDA_VISIBLE_DEVICES of the run's slot ("" for the one GPU of a run without slots)
    session: str          # the `ar run` it was part of: a resumed tag's first window is no gap after the last
    ready: float          # wall clock: the experiment was proposed and committed
    first_batch: float
    last_step: float
    startup: float = 0.0  # its process start → first batch, less any wait for the turn (a head start's)
    prep: float = 0.0     # ready → its launcher spawned: its workspace (the launcher then may wait for the turn)


@dataclass(frozen=True)
class Gap:
    exp: int              # the experiment whose window ends the gap
    seconds: float
    late: float           # of which that experiment's lateness cost (ready later than its workspace + start-up)


def load(tag_dir: Path, device: str = "cuda") -> list[Window]:
    """The GPU windows of one tag's runs; a run that never trained, a run on another device (the CPU) or an
    unreadable file is skipped. `device="cpu"`: the CPU's, for a stand-in of slots taking turns (bench/)."""
    out = []
    for exp_dir in sorted(Path(tag_dir).glob("[0-9][0-9][0-9][0-9]-*")):
        for f in sorted(exp_dir.glob("timing*.json")):
            try:
                t = json.loads(f.read_text())
                if t.get("device") == device and t.get("window_start") and t.get("last_step"):
                    first = float(t["window_start"])
                    go, ready = float(t.get("process_start") or first), float(t["prepare"])
                    startup = first - go - float(t.get("turn_wait") or 0)
                    prep = float(t.get("spawned") or ready) - ready
                    out.append(Window(int(exp_dir.name[:4]), str(t.get("gpu") or ""), str(t.get("session") or ""),
                                      ready, first, float(t["last_step"]), max(0.0, startup), max(0.0, prep)))
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
        out.setdefault(gpu, []).extend(_gap(a, b) for a, b in zip(ws, ws[1:]))
    return out


def _gap(a: Window, b: Window) -> Gap:
    """`b` had to be ready its workspace and its own start-up before `a`'s last step (at least: its launcher's
    interpreter and imports are not counted, so lateness is never overstated)."""
    gap = max(0.0, b.first_batch - a.last_step)
    return Gap(b.exp, gap, min(gap, max(0.0, b.ready + b.prep + b.startup - a.last_step)))


def advice(gs: list[Gap]) -> str | None:
    """What would have fed this GPU better, or None: only where it mostly waited for proposals."""
    if len(gs) < ADVISE_AFTER:
        return None
    waited = [g.late for g in gs]
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
                    "median_late": statistics.median(g.late for g in gs) if gs else None,
                    "advice": advice(gs)})
    return out
