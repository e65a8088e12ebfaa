"""How long train.py takes to its first step when its compile caches are warm (run on the GPU host; not a test).

Runs the real train.py (bench_train.with_knobs) several times in a row on one pair of compile caches, each for a short
budget, and times its lines as they arrive: the model line (imports, data, model built) and the first step line
(compile from the caches, warm-up steps, one step). A series entry is NAME[:ENV=VALUE,...]; the first run of the series
fills the caches. TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=0 overrides train.py's own setting (torch reads that
variable over the code's), which shows what AOTAutograd's cache saves where the model holds an autograd.Function.

    python bench/bench_warm_start.py --series cold,off:TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=0,on
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import ROOT, with_knobs  # noqa: E402


def run(script: Path, env: dict, budget: float) -> dict:
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=dict(env, AR_TIME_BUDGET=str(budget)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = {"model_s": None, "first_step_s": None, "first_loss": None, "tail": []}
    for line in proc.stdout:
        now = time.time() - t0
        if line.startswith("model:") and out["model_s"] is None:
            out["model_s"] = round(now, 2)
        if line.startswith("step ") and out["first_step_s"] is None:
            out["first_step_s"] = round(now, 2)
            out["first_loss"] = line.split("loss")[1].split("|")[0].strip()
        out["tail"] = (out["tail"] + [line.rstrip()])[-3:]
    out["rc"], out["process_s"] = proc.wait(), round(time.time() - t0, 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--series", default="cold,off:TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=0,on,"
                                        "off:TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=0,on")
    ap.add_argument("--knobs", default="{}", help="train.py knob overrides, JSON")
    ap.add_argument("--budget", type=float, default=3.0)
    a = ap.parse_args()
    script = with_knobs(json.loads(a.knobs))
    caches = Path(tempfile.mkdtemp(prefix="warm-start-"))
    base = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
                TRITON_CACHE_DIR=str(caches / "triton"))
    base["PYTHONPATH"] = f"{ROOT}:{base.get('PYTHONPATH', '')}"
    for entry in a.series.split(","):
        name, _, extra = entry.partition(":")
        env = dict(base, **dict(kv.split("=", 1) for kv in extra.split(";") if kv))
        print(json.dumps({"run": name, "env": extra, "knobs": a.knobs, **run(script, env, a.budget)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
