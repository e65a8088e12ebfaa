"""Diagnostic (GPU): what the driver's per-process utilization samples (NVML) say of known GPU work. Not a test.

    python bench/diag_gpu_time.py watch OUT.json [PATTERN ...]     # one burner per PATTERN, side by side
    python bench/diag_gpu_time.py burn PATTERN                     # one burner (what `watch` starts)

A PATTERN is phases `duty:seconds` joined by commas: `1:3,0:2,0.5:3` = busy 3 s, idle 2 s, half busy 3 s. A burner
measures its own busy time with CUDA events; `watch` polls nvmlDeviceGetProcessUtilization every 50 ms, keeps every
sample, and prints, per burner, what the samples integrate to next to what the burner measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def burn(pattern: str) -> None:
    import torch
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    busy = 0.0
    out = []
    for phase in pattern.split(","):
        duty, secs = (float(x) for x in phase.split(":"))
        end, spent = time.monotonic() + secs, 0.0
        while time.monotonic() < end:
            if duty <= 0:
                time.sleep(0.01)
                continue
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
            e.record()
            e.synchronize()
            ms = s.elapsed_time(e) / 1000
            spent += ms
            if duty < 1:
                time.sleep(ms * (1 - duty) / duty)
        out.append({"duty": duty, "seconds": secs, "busy": round(spent, 3)})
        busy += spent
    print(json.dumps({"pid": os.getpid(), "busy": round(busy, 3), "phases": out}), flush=True)


def watch(path: str, patterns: list[str]) -> None:
    import pynvml as nv
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(int(os.environ.get("GPU", "0")))
    info = {"uid": os.getuid(), "driver": nv.nvmlSystemGetDriverVersion()}
    try:
        info["accounting_mode"] = nv.nvmlDeviceGetAccountingMode(h)
    except nv.NVMLError as e:
        info["accounting_mode"] = f"error {e}"
    procs = [subprocess.Popen([sys.executable, __file__, "burn", p], stdout=subprocess.PIPE, text=True)
             for p in patterns]
    samples, errors, last = [], {}, 0
    t0 = time.time()
    while any(p.poll() is None for p in procs):
        try:
            for s in nv.nvmlDeviceGetProcessUtilization(h, last):
                samples.append((s.pid, s.timeStamp, s.smUtil, s.memUtil))
                last = max(last, s.timeStamp)
        except nv.NVMLError as e:
            errors[str(e)] = errors.get(str(e), 0) + 1
        time.sleep(0.05)
    burners = [json.loads(p.stdout.read().strip().splitlines()[-1]) for p in procs]
    report = {"info": info, "errors": errors, "wall": round(time.time() - t0, 2), "burners": []}
    for b in burners:
        mine = sorted((ts, sm) for pid, ts, sm, _ in samples if pid == b["pid"])
        gaps = [(b2 - a2) / 1e6 for (a2, _), (b2, _) in zip(mine, mine[1:])]
        period = sorted(gaps)[len(gaps) // 2] if gaps else None
        integ_gap = sum(sm / 100 * min(g, 1.0) for (_, sm), g in zip(mine[1:], gaps))
        integ_period = sum(sm / 100 * period for _, sm in mine) if period else 0
        report["burners"].append({"pattern": patterns[burners.index(b)], "measured_busy": b["busy"],
                                  "phases": b["phases"], "samples": len(mine), "median_gap": period,
                                  "gap_min": min(gaps) if gaps else None, "gap_max": max(gaps) if gaps else None,
                                  "integrated_by_gap": round(integ_gap, 3),
                                  "integrated_by_period": round(integ_period, 3)})
    report["raw"] = samples
    with open(path, "w") as f:
        json.dump(report, f)
    print(json.dumps({k: v for k, v in report.items() if k != "raw"}, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "burn":
        burn(sys.argv[2])
    else:
        watch(sys.argv[2], sys.argv[3:])
