"""From a training log to Metrics: step lines, the summary block, the FAIL line; None where missing.

The format is harness/logfmt.py's. The LAST summary block counts (a `---` line followed by `key: value`
lines); a value `unknown` is None; a non-finite number is None. `has_summary` needs the keys upstream's
summary has (training_seconds ... depth); `gpu` and `peak_tflops` are optional. Everything here is what the run
says of itself: shown, never trusted — a printed val_bpb is ignored (the trusted evaluator's counts) and the
runner times the run with its own clock.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autoresearch.harness import gpus
from autoresearch.harness.logfmt import FAIL_PREFIX, STEP_RE, SUMMARY_KEYS, SUMMARY_LINE_RE, UNKNOWN

REQUIRED_KEYS = ("training_seconds", "total_seconds", "peak_vram_mb", "mfu_percent",
                 "total_tokens_M", "num_steps", "num_params_M", "depth")
_INT_KEYS = ("num_steps", "depth")
WARMUP_STEPS = 10  # steps numbered below this are left out of tokens/s (upstream leaves them out of the budget)


@dataclass
class StepPoint:
    step: int
    pct: float
    loss: float
    tokens_per_s: float
    mfu: float | None
    dt_ms: int
    remaining_s: int


@dataclass
class Metrics:
    val_bpb: float | None = None
    training_seconds: float | None = None
    total_seconds: float | None = None
    peak_vram_mb: float | None = None
    mfu_percent: float | None = None
    total_tokens_M: float | None = None
    num_steps: int | None = None
    num_params_M: float | None = None
    depth: int | None = None
    gpu: str | None = None
    peak_tflops: float | None = None
    has_summary: bool = False
    steps: list[StepPoint] = field(default_factory=list)
    fail_message: str | None = None
    tokens_per_s: float | None = None

    @property
    def memory_gb(self) -> float | None:
        return None if self.peak_vram_mb is None else self.peak_vram_mb / 1024

    @property
    def last_step(self) -> StepPoint | None:
        return self.steps[-1] if self.steps else None

    def to_dict(self) -> dict:
        """Plain JSON-able data (a NaN loss becomes None)."""
        return _finite(asdict(self))


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def parse_step(line: str) -> StepPoint | None:
    m = STEP_RE.match(line.strip())
    if not m:
        return None
    mfu = m["mfu"]
    try:
        return StepPoint(step=int(m["step"]), pct=float(m["pct"]), loss=float(m["loss"]),
                         tokens_per_s=float(m["tps"]), mfu=None if mfu == UNKNOWN else float(mfu.rstrip("%")),
                         dt_ms=int(m["dt"]), remaining_s=int(m["remaining"]))
    except ValueError:
        return None


def _value(key: str, raw: str):
    raw = raw.strip()
    if raw == UNKNOWN or raw == "":
        return None
    if key == "gpu":
        return raw
    try:
        v = float(raw)
    except ValueError:
        return None
    if not math.isfinite(v):
        return None
    return int(v) if key in _INT_KEYS else v


def _summary(lines: list[str]) -> dict[str, str] | None:
    """The raw key/values of the last `---` block that has any summary key, or None. One pass."""
    last: dict[str, str] | None = None
    current: dict[str, str] | None = None
    for line in lines:
        line = line.strip()
        if line == "---":
            if current:
                last = current
            current = {}
        elif current is not None and ":" in line:
            m = SUMMARY_LINE_RE.match(line)
            if m and m["key"] in SUMMARY_KEYS and m["key"] not in current:
                current[m["key"]] = m["value"]
    return current or last


def median_tokens_per_s(steps: list[StepPoint], warmup_steps: int = WARMUP_STEPS) -> float | None:
    after = [p.tokens_per_s for p in steps if p.step >= warmup_steps] or [p.tokens_per_s for p in steps[1:]]
    if not after and steps:
        after = [steps[0].tokens_per_s]
    return float(statistics.median(after)) if after else None


def parse_log(text: str) -> Metrics:
    lines = text.replace("\r\n", "\n").split("\n")
    m = Metrics()
    for line in lines:
        line = line.strip()
        if line.startswith("step "):
            p = parse_step(line)
            if p is not None:
                m.steps.append(p)
        elif line.startswith(FAIL_PREFIX) and m.fail_message is None:
            m.fail_message = line[len(FAIL_PREFIX):].strip()
    raw = _summary(lines)
    if raw is not None:
        for key, value in raw.items():
            setattr(m, key, _value(key, value))
        m.has_summary = all(k in raw for k in REQUIRED_KEYS)
    m.tokens_per_s = median_tokens_per_s(m.steps)
    return m


def parse_log_file(path: Path) -> Metrics:
    return parse_log(Path(path).read_bytes().decode("utf-8", errors="replace"))


def recompute_mfu(m: Metrics, peak: "gpus.Peak", flops_per_token: float | None = None) -> float | None:
    """MFU in percent against the table's peak: from tokens/s when FLOPs per token are known, else the
    printed MFU rescaled by printed peak / table peak. None when either peak is unknown."""
    if peak.tflops is None:
        return None
    if flops_per_token:
        return gpus.mfu_percent(m.tokens_per_s, flops_per_token, peak.tflops)
    if m.mfu_percent is None or not m.peak_tflops:
        return None
    return m.mfu_percent * m.peak_tflops / peak.tflops


class DegradedWatch:
    """Fed step points live; says why to stop when the run stays under a floor after warm-up.

    Warm-up is by step number (steps numbered below warmup_steps are ignored); patience counts consecutive step lines
    (train.py may print fewer lines than steps). An unknown MFU is not evidence either way.
    """

    def __init__(self, *, min_mfu: float | None, min_tokens_per_s: float | None, warmup_steps: int = 10,
                 patience: int = 20):
        self.min_mfu, self.min_tokens_per_s = min_mfu, min_tokens_per_s
        self.warmup_steps, self.patience = warmup_steps, max(1, patience)
        self._low = 0

    def feed(self, p: StepPoint) -> str | None:
        if p.step < self.warmup_steps:
            return None
        why = None
        if self.min_tokens_per_s is not None and p.tokens_per_s < self.min_tokens_per_s:
            why = f"tokens/s {p.tokens_per_s:.0f} under the floor {self.min_tokens_per_s:g}"
        elif self.min_mfu is not None and p.mfu is not None and p.mfu < self.min_mfu:
            why = f"MFU {p.mfu:.1f}% under the floor {self.min_mfu:g}%"
        if why is None:
            self._low = 0
            return None
        self._low += 1
        if self._low >= self.patience:
            return f"degraded: {why} for {self._low} step lines after warm-up (step {p.step})"
        return None
