"""GPU benchmark of the training workload (run on the GPU host; not a test).

Runs the real train.py as a subprocess several times and reads its step lines as they arrive, timestamped:
- steady-state MFU and tokens/s (median over timed steps) at TOTAL_BATCH_SIZE 2**19 and 2**17,
- per-step time spread (p10 / median / p90),
- startup seconds (process start to the first timed step) with a cold and a warm compile cache,
- final-eval seconds (last step line to the summary), peak VRAM,
- the RTX 5090 profile: 32 GB emulated with AR_GPU_MEMORY_GB=32 and DEVICE_BATCH_SIZE "auto".

    python bench/bench_train.py --dataset builtin-site --budget 30 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoresearch.harness import logfmt  # noqa: E402

UNTIMED = 10


def with_knobs(overrides: dict) -> Path:
    """A copy of train.py with some knob assignments replaced (top-level `NAME = value` lines)."""
    text = (ROOT / "train.py").read_text()
    for name, value in overrides.items():
        text, n = re.subn(rf"^{name} = [^#\n]*?(\s*#|$)", lambda m: f"{name} = {value!r}{m.group(1)}", text,
                          count=1, flags=re.M)
        assert n == 1, name
    path = Path(tempfile.mkdtemp()) / "train.py"
    path.write_text(text)
    return path


def run(label: str, overrides: dict, env_extra: dict, budget: float) -> dict:
    script = with_knobs(overrides)
    env = dict(os.environ, AR_TIME_BUDGET=str(budget), PYTHONUNBUFFERED="1", **env_extra)
    env["PYTHONPATH"] = f"{ROOT}:{env.get('PYTHONPATH', '')}"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    steps, lines, first_timed, last_step_at = [], [], None, None
    for line in proc.stdout:
        now = time.time() - t0
        lines.append(line.rstrip())
        m = logfmt.STEP_RE.match(line.strip())
        if m:
            step = int(m["step"])
            steps.append((step, int(m["tps"]), int(m["dt"]), m["mfu"]))
            if step == UNTIMED and first_timed is None:
                first_timed = now
            last_step_at = now
    proc.wait()
    total = time.time() - t0
    summary = {}
    if "---" in lines:
        for line in lines[lines.index("---") + 1:]:
            m = logfmt.SUMMARY_LINE_RE.match(line)
            if m:
                summary[m["key"]] = m["value"]
    timed = [s for s in steps if s[0] > UNTIMED]
    dts = sorted(s[2] for s in timed)
    mfus = [float(s[3].rstrip("%")) for s in timed if s[3] != "unknown"]
    out = dict(
        label=label, returncode=proc.returncode, budget=budget, steps=len(steps),
        tokens_per_s=statistics.median([s[1] for s in timed]) if timed else None,
        mfu=statistics.median(mfus) if mfus else None,
        step_ms_p10=dts[len(dts) // 10] if dts else None, step_ms_median=statistics.median(dts) if dts else None,
        step_ms_p90=dts[(9 * len(dts)) // 10] if dts else None,
        startup_s=first_timed, eval_s=(total - last_step_at) if last_step_at else None, wall_s=total,
        summary=summary, model_line=next((ln for ln in lines if ln.startswith("model:")), ""),
        tail=lines[-8:] if proc.returncode else [],
    )
    print(json.dumps({k: v for k, v in out.items() if k != "tail"}), flush=True)
    if proc.returncode:
        print("\n".join(out["tail"]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=30)
    ap.add_argument("--out", default="bench-train.json")
    ap.add_argument("--only", default="", help="comma list of run labels")
    args = ap.parse_args()
    plan = [
        ("2**19 cold-cache", {"TOTAL_BATCH_SIZE": 2**19}, {}),
        ("2**17", {"TOTAL_BATCH_SIZE": 2**17}, {}),
        ("2**19 warm-cache", {"TOTAL_BATCH_SIZE": 2**19}, {}),
        ("5090-32GB auto", {"TOTAL_BATCH_SIZE": 2**19, "DEVICE_BATCH_SIZE": "auto"}, {"AR_GPU_MEMORY_GB": "32"}),
    ]
    only = set(filter(None, args.only.split(",")))
    results = [run(label, ov, env, args.budget) for label, ov, env in plan if not only or label in only]
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{'run':<18}{'rc':>3}{'MFU %':>8}{'tok/s':>12}{'step ms p10/med/p90':>22}{'startup s':>11}"
          f"{'eval s':>8}{'VRAM MB':>10}{'val_bpb':>10}")
    for r in results:
        s = r["summary"]
        spread = f"{r['step_ms_p10']}/{r['step_ms_median']}/{r['step_ms_p90']}"
        print(f"{r['label']:<18}{r['returncode']:>3}{r['mfu'] or float('nan'):>8.1f}{r['tokens_per_s'] or 0:>12,.0f}"
              f"{spread:>22}{r['startup_s'] or float('nan'):>11.1f}{r['eval_s'] or float('nan'):>8.1f}"
              f"{s.get('peak_vram_mb', '-'):>10}{s.get('val_bpb', '-'):>10}")


if __name__ == "__main__":
    main()
