"""`ar doctor --probe`: the fastest correct backend (attention, compile, batch), measured on this GPU.

Each candidate runs `train.probe_step` for a few steps in its own process (a compile can hang, a CUDA error
poisons the context) and is compared with an eager reference at its batch size; `choose` is a pure function
of the results, `run_probe` the budgeted search around an injected `execute`, and `probe` wires the real
subprocess to them and writes the choice where `harness/backend.py` reads it. Also what this machine's torch
and GPU are (`torch_facts`), which doctor's checklist reads too.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping

from autoresearch.errors import ArError
from autoresearch.harness import backend


# ---------------------------------------------------------------------------------------------------------
# This machine's torch, and a measuring process of its own
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]
    vram_mb: float


@dataclass(frozen=True)
class TorchFacts:
    version: str | None  # None: torch does not import
    cuda_build: str | None  # torch.version.cuda; None for a CPU-only build
    cuda_available: bool
    gpu: Gpu | None
    arch_list: tuple[str, ...]


def torch_facts() -> TorchFacts:
    try:
        import torch
    except ImportError:
        return TorchFacts(None, None, False, None, ())
    if not torch.cuda.is_available():
        return TorchFacts(torch.__version__, torch.version.cuda, False, None, ())
    p = torch.cuda.get_device_properties(0)
    gpu = Gpu(p.name, (p.major, p.minor), p.total_memory / 2**20)
    return TorchFacts(torch.__version__, torch.version.cuda, True, gpu, tuple(torch.cuda.get_arch_list()))


def run_script(script: str, args: list[str], timeout: float, cwd: Path | None = None) -> tuple[int | None, str]:
    """Run `python -c script args` in its own process group; (exit code or None on timeout, output)."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out or ""


def last_line(out: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no output"



# ---------------------------------------------------------------------------------------------------------
# Candidates, the pure choice, and the budgeted search
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    attention: str
    compile_model: bool
    compile_optimizer: bool
    device_batch: int

    @property
    def label(self) -> str:
        mode = lambda on: "compiled" if on else "eager"  # noqa: E731
        return (f"{self.attention}, {mode(self.compile_model)} model, {mode(self.compile_optimizer)} optimizer, "
                f"batch {self.device_batch}")


@dataclass
class ProbeResult:
    candidate: Candidate
    ok: bool
    error: str | None = None
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    mfu: float | None = None  # percent
    peak_vram_mb: float | None = None
    seconds: float | None = None
    skipped: str | None = None  # why it never ran


def compare(losses: list[float], reference: list[float], rtol: float = 2e-2, first_steps: int = 3,
            later_rtol: float = 0.1) -> tuple[bool, float | None, str]:
    """Do the losses match the reference's? (ok, largest relative difference, why not).

    Within `rtol` on each of the first steps, within `later_rtol` after them: a few full-LR steps on one batch
    drift apart chaotically (on an H200 a compiled model was 2.7 % off eager by step 4 at batch 128, 0.2 % at
    step 2), while a broken path is off from the first update on or never learns.
    """
    if not losses or len(losses) != len(reference):
        return False, None, f"{len(losses)} losses against the reference's {len(reference)}"
    diffs = []
    for i, (a, b) in enumerate(zip(losses, reference)):
        if not math.isfinite(a):
            return False, None, f"loss {a} at step {i}"
        diffs.append(abs(a - b) / max(abs(b), 1e-8))
    for i, d in enumerate(diffs):
        if d > (rtol if i < first_steps else later_rtol):
            return False, max(diffs), (f"loss off by {100 * d:.1f}% at step {i} "
                                       f"({losses[i]:.4f} vs {reference[i]:.4f})")
    return True, max(diffs), ""


def choose(results: list[ProbeResult], reference: ProbeResult | Mapping[int, ProbeResult], *,
           slow_fraction: float = 0.5, prefer: tuple[Candidate, ...] = (), tie: float = 0.02,
           **tolerance) -> tuple[Candidate | None, list[dict]]:
    """The fastest candidate whose losses match the reference at its batch size (`compare`, with `tolerance`),
    and one row per result. A candidate in `prefer` (the defaults) wins when within `tie` of the fastest: a
    difference that small is noise.

    Statuses: chosen, correct, alive but slow (correct, under slow_fraction of the best tokens/s), incorrect,
    failed, unverified (no working reference at that batch), skipped.
    """
    refs = {reference.candidate.device_batch: reference} if isinstance(reference, ProbeResult) else dict(reference)
    rows = []
    for r in results:
        row = {**asdict(r.candidate), "label": r.candidate.label, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu,
               "peak_vram_mb": r.peak_vram_mb, "max_loss_diff": None, "status": "", "note": "",
               "losses": [round(v, 4) for v in r.losses]}
        ref = refs.get(r.candidate.device_batch)
        if r.skipped:
            row.update(status="skipped", note=r.skipped)
        elif not r.ok:
            row.update(status="failed", note=r.error or "failed")
        elif ref is None or not ref.ok:
            row.update(status="unverified", note=f"no working reference at batch {r.candidate.device_batch}")
        else:
            good, diff, why = compare(r.losses, ref.losses, **tolerance)
            row.update(max_loss_diff=diff, status="correct" if good else "incorrect", note=why)
            if good and r.tokens_per_s is None:
                row.update(status="unverified", note="no tokens/s measured")
        rows.append(row)
    correct = [(row, r) for row, r in zip(rows, results) if row["status"] == "correct"]
    if not correct:
        return None, rows
    best_row, best = max(correct, key=lambda pair: pair[0]["tokens_per_s"])
    floor = (1 - tie) * best_row["tokens_per_s"]
    close = {r.candidate: (row, r) for row, r in correct if row["tokens_per_s"] >= floor}
    best_row, best = next((close[c] for c in prefer if c in close), (best_row, best))
    for row, _ in correct:
        if row["tokens_per_s"] < slow_fraction * best_row["tokens_per_s"]:
            row.update(status="alive but slow",
                       note=f"{100 * row['tokens_per_s'] / best_row['tokens_per_s']:.0f}% of the best tokens/s")
    best_row["status"] = "chosen"
    return best.candidate, rows


@dataclass
class ProbeReport:
    choice: Candidate | None
    rows: list[dict]
    notes: list[str]
    seconds: float
    path: Path | None = None  # the probe file written

    def as_dict(self) -> dict:
        return {"choice": asdict(self.choice) if self.choice else None, "rows": self.rows, "notes": self.notes,
                "seconds": round(self.seconds, 1), "file": str(self.path) if self.path else None}


def run_probe(execute: Callable[[Candidate, float], ProbeResult], default: Candidate, *, budget_s: float = 180,
              clock: Callable[[], float] = time.monotonic, attentions=("cudnn", "flash", "fa3"),
              last_attentions=("math",), per_run_cap: float = 150, min_start: float = 10,
              progress: Callable[[ProbeResult], None] | None = None) -> ProbeReport:
    """Measure candidates in stages within `budget_s`, each against an eager reference at its batch size.

    1. the reference (efficient attention, eager everything) and each attention backend, eager, at half the
       default batch; 2. compiled optimizer / compiled model with the best attention so far; 3. the best
       config at the default batch and twice it (capped), plus the defaults themselves; 4. `last_attentions`.
    A candidate that would start with less than `min_start` seconds left is skipped, and so says its row.
    `progress` is called with each result as it comes.
    """
    start = clock()
    results: list[ProbeResult] = []
    refs: dict[int, ProbeResult] = {}
    notes: list[str] = []

    def attempt(c: Candidate) -> ProbeResult:
        left = budget_s - (clock() - start)
        if left < min_start:
            return ProbeResult(c, ok=False, skipped=f"time budget of {budget_s:g} s spent")
        r = execute(c, min(left, per_run_cap))
        if not r.ok and left < per_run_cap and budget_s - (clock() - start) < 1:
            r = replace(r, skipped=f"cut short: the time budget of {budget_s:g} s ran out while it ran")
        return r

    def run(c: Candidate) -> ProbeResult:
        for r in results:
            if r.candidate == c:
                return r
        r = attempt(c)
        results.append(r)
        if progress is not None:
            progress(r)
        return r

    def reference_at(batch: int) -> ProbeResult:
        if batch not in refs:
            for attn in ("efficient", "math"):
                refs[batch] = run(Candidate(attn, False, False, batch))
                if refs[batch].ok or refs[batch].skipped:
                    break
        return refs[batch]

    base = max(1, default.device_batch // 2)
    prefer = (default, replace(default, device_batch=base))

    def best() -> Candidate | None:
        return choose(results, refs, prefer=prefer)[0]

    ref = reference_at(base)
    if not ref.ok:
        notes.append(f"the reference step failed ({ref.skipped or ref.error}): nothing can be verified")
    else:
        for a in attentions:
            run(Candidate(a, False, False, base))
        top = best() or ref.candidate
        for cm, co in ((False, True), (True, True), (True, False)):
            run(replace(top, compile_model=cm, compile_optimizer=co))
        top = best() or top
        for batch in sorted({default.device_batch, min(2 * default.device_batch, backend.MAX_AUTO_BATCH)} - {base}):
            if not reference_at(batch).ok:
                if not refs[batch].skipped:
                    why = (refs[batch].error or "failed")[:70]
                    notes.append(f"the eager reference does not run at batch {batch} ({why}): batches from "
                                 f"{batch} up cannot be verified, so none is chosen")
                break
            scaled = run(replace(top, device_batch=batch))
            if batch == default.device_batch:
                run(default)
            if not scaled.ok and not scaled.skipped:
                break
        if default.device_batch in refs and refs[default.device_batch].ok:
            run(default)
        for a in last_attentions:
            run(Candidate(a, False, False, base))
    if any(r.skipped and "budget" in r.skipped for r in results):
        notes.append(f"the {budget_s:g} s budget ran out: some candidates were skipped (raise --probe-budget)")
    choice, rows = choose(results, refs, prefer=prefer)
    return ProbeReport(choice, rows, notes, clock() - start)


# ---------------------------------------------------------------------------------------------------------
# The real execute: train.probe_step in a subprocess
# ---------------------------------------------------------------------------------------------------------
PROBE_SCRIPT = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("ar_probe_train", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
print("\nAR_PROBE " + json.dumps(mod.probe_step(**json.loads(sys.argv[2]))), flush=True)
"""


def subprocess_execute(train_path: Path) -> Callable[[Candidate, float], ProbeResult]:
    """Run train.probe_step for one candidate in a fresh process (a compile can hang, a CUDA error poisons)."""
    def execute(c: Candidate, timeout: float) -> ProbeResult:
        t0 = time.monotonic()
        rc, out = run_script(PROBE_SCRIPT, [str(train_path), json.dumps(asdict(c))], timeout, cwd=train_path.parent)
        took = time.monotonic() - t0
        if rc is None:
            return ProbeResult(c, ok=False, error=f"timed out after {timeout:.0f} s", seconds=took)
        for ln in reversed(out.splitlines()):
            if ln.startswith("AR_PROBE "):
                d = json.loads(ln[len("AR_PROBE "):])
                return ProbeResult(c, ok=bool(d.get("ok")), error=d.get("error"), losses=d.get("losses") or [],
                                   tokens_per_s=d.get("tokens_per_s"), mfu=d.get("mfu"),
                                   peak_vram_mb=d.get("peak_vram_mb"), seconds=took)
        return ProbeResult(c, ok=False, error=f"exit {rc}: {last_line(out)}", seconds=took)
    return execute


def probe(repo: Path, *, budget_s: float = 180, cache: Path | None = None, facts: TorchFacts | None = None,
          **search) -> ProbeReport | None:
    """Measure, choose and write the probe file (`search`: run_probe's options). None when there is no GPU."""
    facts = facts or torch_facts()
    if facts.gpu is None:
        return None
    train_path = Path(repo).resolve() / "train.py"
    if "def probe_step" not in (train_path.read_text() if train_path.is_file() else ""):
        raise ArError(f"{train_path} has no probe_step(); run the probe in a workspace whose train.py has one "
                      "(`ar init DIR` makes one)")
    d = backend.defaults(facts.gpu.capability, facts.gpu.vram_mb)
    default = Candidate(d["attention"], d["compile_model"], d["compile_optimizer"], d["device_batch"])
    report = run_probe(subprocess_execute(train_path), default, budget_s=budget_s, **search)
    if report.choice is not None:
        best = next(r for r in report.rows if r["status"] == "chosen")
        report.path = backend.write_choice(
            asdict(report.choice), device_name=facts.gpu.name, cache=cache, version=facts.version,
            measured={k: best[k] for k in ("tokens_per_s", "mfu", "peak_vram_mb")}, rows=report.rows)
    return report
