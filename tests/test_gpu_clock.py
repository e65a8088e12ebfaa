"""The GPU clock (a CUDA GPU; skipped elsewhere): a run's start-up is charged in GPU seconds, as on the CPU in CPU
seconds. A real `ar run` of the default train.py: the baseline, an honest new shape (a cold compile: not charged),
then the attack (steps on text any run can read before asking ar's feed for its first batch), then the same steps
in a daemonized grandchild. Counted, not scored: the GPU seconds the attack reports for its own pre-window steps
(CUDA events) must come off its window, less what the baseline's allowance leaves free.

    pytest -m gpu tests/test_gpu_clock.py -s        (bench/gpu_clock.sh runs it as root and as an ordinary user)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from autoresearch.experiment import clock  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 10


def ar(*args, cwd, env, check=True):
    p = subprocess.run([sys.executable, "-m", "autoresearch", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if check and p.returncode:
        raise AssertionError(f"ar {' '.join(args)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def test_steps_before_the_window_are_paid_in_gpu_seconds_and_a_cold_compile_is_not(tmp_path):
    env = {**os.environ, "AR_CACHE": os.environ.get("AR_CACHE", str(tmp_path / "cache")), "PRE_STEPS": "20",
           "COLUMNS": "200"}
    ar("prepare", "builtin-site", "--vocab-size", "8192", "--max-bytes", "30000000", cwd=tmp_path, env=env)
    ws = tmp_path / "ws"
    ar("init", str(ws), cwd=tmp_path, env=env)
    (ws / "ar.yaml").write_text("dataset: builtin-site\nnoise: 5.0\n")   # one run each, nothing kept: each on the baseline
    agent = f"{sys.executable} {ROOT / 'bench' / 'agents' / 'gpu_clock_agent.py'}"
    out = ar("run", "--tag", "g", "--max-experiments", "4", "--time-budget", str(BUDGET), "--config", "ar.yaml",
             "--calibrate-noise", "0", "--agent", agent, cwd=ws, env=env, check=False)
    said = out.stdout + out.stderr
    keep = os.environ.get("AR_TEST_OUT")             # bench/gpu_clock.sh keeps the session's output and logs
    if keep:
        Path(keep, f"ar-run-uid{os.getuid()}.log").write_text(said)
        for log in (ws / "runs" / "g").glob("*/train.log"):
            Path(keep, f"uid{os.getuid()}-{log.parent.name}-train.log").write_text(log.read_text()[-20000:])
    print(said[-4000:])
    assert "GPU time is read per process" in said, said[-3000:]
    tag = ws / "runs" / "g"
    exps = sorted(d for d in tag.iterdir() if re.match(r"\d{4}-", d.name))
    assert len(exps) >= 4, [d.name for d in exps]
    m = [json.loads((d / "metrics.json").read_text()) for d in exps[:4]]
    credit = clock.load(tag)
    assert credit.gpu is not None and m[0]["startup_gpu"] > 0, (credit, m[0])
    t0 = json.loads((exps[0] / "timing.json").read_text())    # did the baseline find its kernels in the store?
    assert credit.gpu_cold == (t0["cache_seeded_bytes"] == 0), (credit, t0)
    allowed = clock.gpu_allowance(credit)
    print(f"credit {credit.gpu} GPU-s, {'cold' if credit.gpu_cold else 'warm'} (seeded "
          f"{t0['cache_seeded_bytes']} bytes, adopted {t0['cache_adopted_files']} files): {allowed:.2f} GPU-s free")
    for name, mm in zip(("baseline", "new shape", "attack", "grandchild"), m):
        print(f"{name:10} start-up {mm['startup_seconds']:.1f}s, {mm['startup_gpu']:.2f} GPU-s; window "
              f"{mm['window_seconds']:.2f}s; {mm['window_note'] or 'not charged'}")
    # the honest control: a new shape compiles cold (CPU work) and warms up like the baseline: its window whole
    assert m[1]["window_note"] is None and m[1]["window_seconds"] == pytest.approx(BUDGET, abs=1e-6), m[1]
    for i, what in ((2, r"before the first batch: (\S+) GPU-s"), (3, r"daemonized grandchild before the first "
                                                                       r"batch: (\S+) GPU-s")):
        log = (exps[i] / "train.log").read_text()
        got = re.search(what, log)
        assert got, log[-2000:]
        pre = float(got.group(1))       # what the attack measured of its own pre-window GPU work (CUDA events)
        assert m[i]["startup_gpu"] >= 0.9 * pre, (m[i], pre)          # ar saw it (its own warm-up comes on top)
        assert "GPU-s" in (m[i]["window_note"] or ""), m[i]
        cut = BUDGET - m[i]["window_seconds"]
        assert cut == pytest.approx(m[i]["startup_gpu"] - allowed, abs=0.01), (m[i], allowed)   # all past it paid
        # unpaid: the pre-window work less what came off the window; at most what is free, plus a tenth of the
        # work for the driver's sampling
        print(f"{('attack', 'grandchild')[i - 2]}: {pre:.2f} GPU-s before the window, {cut:.2f}s cut: "
              f"{pre - cut:.2f} GPU-s unpaid")
        assert pre - cut <= allowed + 0.1 * pre, (pre, m[i], allowed)
