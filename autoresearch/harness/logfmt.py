"""The log format train.py prints and the runner parses: one source for both sides.

Step line:  step 00042 | 14.0% | loss 4.123456 | tok/s 1234567 | mfu 41.2% | dt 312ms | remaining 258s
Summary:    a line `---`, then aligned `key: value` lines (SUMMARY_KEYS, in order).
"""

from __future__ import annotations

import re

SUMMARY_KEYS = (                     # what the run says of itself: advisory, never a result (the evaluator's is)
    "training_seconds", "total_seconds", "peak_vram_mb", "mfu_percent",
    "total_tokens_M", "num_steps", "num_params_M", "depth", "gpu", "peak_tflops",
)
UNKNOWN = "unknown"

STEP_RE = re.compile(
    r"^step (?P<step>\d+) \| (?P<pct>[\d.]+)% \| loss (?P<loss>\S+) \| tok/s (?P<tps>\d+) \| "
    r"mfu (?P<mfu>[\d.]+%|unknown) \| dt (?P<dt>\d+)ms \| remaining (?P<remaining>\d+)s$"
)
SUMMARY_LINE_RE = re.compile(r"^(?P<key>[A-Za-z_]+):\s+(?P<value>.*?)\s*$")
FAIL_PREFIX = "FAIL:"


def format_step(step: int, pct: float, loss: float, tokens_per_s: float, mfu: float | None,
                dt_s: float, remaining_s: float) -> str:
    mfu_s = UNKNOWN if mfu is None else f"{mfu:.1f}%"
    return (f"step {step:05d} | {pct:.1f}% | loss {loss:.6f} | tok/s {int(tokens_per_s)} | mfu {mfu_s} | "
            f"dt {int(dt_s * 1000)}ms | remaining {max(0, int(remaining_s))}s")


def step_clock_slack(budget_s: float) -> float:
    """How far a step line's `remaining` and the budget share its percentage leaves may disagree from the line's
    own rounding alone: seconds truncated (under 1 s) and the percentage rounded to 0.1 % (budget · 0.0005 s)."""
    return 1.0 + budget_s * 0.0005


def _fmt(v, digits: int) -> str:
    if v is None:
        return UNKNOWN
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def format_summary(*, training_seconds: float, total_seconds: float, peak_vram_mb: float | None,
                   mfu_percent: float | None, total_tokens_M: float, num_steps: int, num_params_M: float,
                   depth: int, gpu: str, peak_tflops: float | None) -> str:
    values = dict(
        training_seconds=_fmt(float(training_seconds), 1),
        total_seconds=_fmt(float(total_seconds), 1),
        peak_vram_mb=_fmt(None if peak_vram_mb is None else float(peak_vram_mb), 1),
        mfu_percent=_fmt(None if mfu_percent is None else float(mfu_percent), 2),
        total_tokens_M=_fmt(float(total_tokens_M), 6), num_steps=str(int(num_steps)),   # a token, as results.tsv
        num_params_M=_fmt(float(num_params_M), 1), depth=str(int(depth)), gpu=gpu,
        peak_tflops=_fmt(None if peak_tflops is None else float(peak_tflops), 1),
    )
    return "\n".join(["---"] + [f"{k + ':':<18}{values[k]}" for k in SUMMARY_KEYS])
