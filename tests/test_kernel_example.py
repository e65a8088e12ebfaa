"""examples/kernel end to end on a CPU: `ar run` with a scripted agent that proposes a correct speed-up, a wrong
result and a cheat (only the speed-up is kept); and the harness against the attacks a candidate can make from
inside kernel.py. The candidate runs in its own sandboxed process (the real sandbox, real subprocesses)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autoresearch.harness import sandbox
from autoresearch.records.ledger import read_results
from autoresearch.objective import Objective

EXAMPLE = Path(__file__).parents[1] / "examples" / "kernel"
AGENT = Path(__file__).parent / "fixtures" / "agents" / "kernel_agent.py"
needs_sandbox = pytest.mark.skipif(not sandbox.available()[0], reason="Landlock is not available here")


def _workspace(tmp_path: Path, block: int | None = None, extra: str = "") -> Path:
    root = tmp_path / "kern"
    shutil.copytree(EXAMPLE, root)
    k = root / "kernel.py"
    text = k.read_text()
    if block is not None:
        text = re.sub(r"^BLOCK_V = \d+", f"BLOCK_V = {block}", text, flags=re.M)
    k.write_text(text + extra)
    return root


def _git_init(root: Path) -> None:
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "kernel baseline"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True)


@pytest.mark.e2e
@pytest.mark.slow
def test_ar_run_keeps_the_speed_up_and_rejects_the_wrong_result_and_the_cheat(tmp_path):
    # The baseline's blocks are small (BLOCK_V 8: 512 blocks a row, ~18x slower than the speed-up's 2048 on this
    # machine), so that the keep holds on two timings taken while the other test worker loads the CPU.
    root = _workspace(tmp_path, block=8)
    (root / ".gitignore").write_text("runs/\n__pycache__/\n")
    _git_init(root)
    plan = json.dumps({"2": "speedup", "3": "wrong", "4": "skip"})
    agent = f"{sys.executable} {AGENT} '{plan}' {{prompt_file}}"
    run = subprocess.run([sys.executable, "-m", "autoresearch", "run", "--config", "ar.yaml", "--tag", "k",
                          "--max-experiments", "4", "--agent", agent], cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = read_results(root / "runs" / "k" / "results.tsv")
    assert [r.status.value for r in rows] == ["keep", "keep", "rejected", "crash"], [r.reason for r in rows]
    base, fast = rows[0].val_bpb, rows[1].val_bpb
    assert fast < 0.95 * base                                     # past the 5% noise of ar.yaml
    assert rows[2].reason.startswith("the correctness gate failed: FAIL:") and "against the reference" in rows[2].reason
    assert "differs from the reference" in rows[3].reason          # passed the gate's shapes, caught when timed
    assert "BLOCK_V = 2048" in (root / "kernel.py").read_text()   # the best kept, restored
    assert "best: " in run.stdout and " us_per_call at " in run.stdout
    gate_log = (root / "runs" / "k" / f"0003-{rows[2].commit}" / "gate.log").read_text()
    assert "FAIL:" in gate_log


@pytest.mark.integration
@needs_sandbox
def test_the_clock_the_metric_and_a_cache_are_out_of_the_candidates_reach(tmp_path):
    # The candidate stops the clocks of its own process and prints the metric it would like, on stdout (the
    # harness's pipe), on stderr, and at exit; it computes honestly, so only what it claims is false. It also
    # keeps an exact cache of its outputs by the inputs' bytes, and fails loudly if the cache ever hits: no
    # input may repeat (warm-up and timed windows included), or caching would pay.
    cheat = '''
import atexit, hashlib, sys, time
time.perf_counter = time.monotonic = time.time = lambda: 0.0
print('{"us_per_call": 0.001}')
sys.stderr.write('{"us_per_call": 0.001}\\n')
atexit.register(lambda: print('{"us_per_call": 0.001}'))
_cache, _honest = {}, softcap_ce
def softcap_ce(logits, targets, cap):
    key = hashlib.sha1(logits.float().numpy().tobytes() + targets.numpy().tobytes()).hexdigest()
    if key in _cache:
        raise RuntimeError("cache hit: an input was repeated")
    _cache[key] = out = _honest(logits, targets, cap)
    return out
'''
    root = _workspace(tmp_path, block=2048, extra=cheat)
    out = subprocess.run([sys.executable, "bench.py"], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    value = Objective(name="us_per_call", command=("x",), json_key="us_per_call").extract(out.stdout)
    assert value is not None and value > 100, out.stdout          # honest: milliseconds per call on a CPU
    assert "0.001" not in out.stdout


@pytest.mark.integration
@needs_sandbox
def test_the_candidate_cannot_reach_the_reference(tmp_path):
    # Return the reference's result: import it, or read it through the harness's working folder.
    cheat = '''
import glob, os
_tries = []
try:
    import reference as _ref
except Exception as e:
    _ref = None
    _tries.append(f"import: {type(e).__name__}")
for _pid in [os.getppid()] + [int(p) for p in os.listdir("/proc") if p.isdigit()]:
    if _ref is not None:
        break
    try:
        _src = open(f"/proc/{_pid}/cwd/reference.py").read()
        _ref = {}
        exec(_src, _ref)
        _ref = type("R", (), {"softcap_ce": staticmethod(_ref["softcap_ce"])})
    except Exception as e:
        _tries.append(type(e).__name__)
        _ref = None
if _ref is None:
    raise RuntimeError("reference unreachable: " + ", ".join(sorted(set(_tries))))
def softcap_ce(logits, targets, cap):
    return _ref.softcap_ce(logits, targets, cap).float()
'''
    root = _workspace(tmp_path, block=2048, extra=cheat)
    out = subprocess.run([sys.executable, "check.py"], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "reference unreachable: " in out.stdout and "import: ModuleNotFoundError" in out.stdout, out.stdout


@pytest.mark.integration
def test_a_candidate_that_exits_early_with_success_fails_the_gate(tmp_path):
    # os._exit(0) from inside the candidate: in a gate that imported it, that would be a pass.
    root = _workspace(tmp_path, block=2048, extra="\nimport os\nos._exit(0)\n")
    out = subprocess.run([sys.executable, "check.py"], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "FAIL:" in out.stdout and "the worker" in out.stdout, out.stdout + out.stderr
