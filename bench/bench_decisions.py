"""Benchmark: how often `ar run`'s keep decision keeps noise and finds real gains, old rule beside new. Not a test.

A noisy objective with a known truth, run through `ar run` itself: the candidate is `candidate.py` (GAIN, how
much better than the start it truly is), the objective command prints `score = 1 - GAIN + noise`, the noise
normal with σ SIGMA and drawn afresh for every (candidate, seed) pair, as a changed train.py starts a new
trajectory. A scripted agent proposes, by experiment number, a null edit (a new commit, the same truth) three
times in four and a real gain of k σ once in four. Each rule runs its own session on the same proposal plan:

- single: the calibrated threshold (2 σ from the baseline's runs), one run decides (`keep_rule: single`);
- sequential: the default (decide.SequentialRule, experiment/measure.py).

Reported per rule and gain size: null edits kept, real gains kept, runs per proposal (every run of the
session, calibration and re-measures of the best included, over the proposals), and the rule's own simulated
chance beside the measured one.

    python bench/bench_decisions.py [--proposals 48] [--gains 0.5,1,1.5,2] [--sigma 0.02] [--rules single,sequential]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoresearch.decide import SequentialRule  # noqa: E402
from autoresearch.records.ledger import read_results  # noqa: E402

SCORE = '''import hashlib, json, os, random, re
src = open("candidate.py").read()
gain = float(re.search(r"^GAIN = (.*)$", src, re.M).group(1))
seed = int(os.environ.get("AR_SEED", "0"))
rng = random.Random(hashlib.sha256(f"{seed}:{src}".encode()).hexdigest())   # new per candidate and per seed
print(json.dumps({"score": 1.0 - gain + SIGMA * rng.gauss(0.0, 1.0)}))
'''

AGENT = '''import os, random, re, sys
from pathlib import Path
k, share = float(sys.argv[1]), float(sys.argv[2])
n = int(os.environ["AR_EXPERIMENT"])
p = Path("candidate.py")
src = p.read_text()
gain = float(re.search(r"^GAIN = (.*)$", src, re.M).group(1))
real = random.Random(f"plan:{n}").random() < share          # the same plan for every rule
if real:
    gain += k * SIGMA
p.write_text(f"GAIN = {gain!r}\\nNONCE = {n}\\n")
what = f"gain {k:g}σ" if real else "null"
Path(os.environ["AR_DESCRIPTION_FILE"]).write_text(f"{what} #{n}\\n")
'''


def session(work: Path, rule: str, k: float, sigma: float, proposals: int, share: float) -> dict:
    repo = work / f"{rule}-{k:g}"
    repo.mkdir(parents=True)
    (repo / "candidate.py").write_text("GAIN = 0.0\nNONCE = 0\n")
    (repo / "score.py").write_text(f"SIGMA = {sigma!r}\n" + SCORE)
    (repo / "agent.py").write_text(f"SIGMA = {sigma!r}\n" + AGENT)
    (repo / "program.md").write_text("# program\nLower the score.\n")
    (repo / ".gitignore").write_text("runs/\n")
    (repo / "ar.yaml").write_text(
        "objective:\n  name: score\n  direction: min\n  command: python score.py\n  metric: score\n  timeout: 60\n"
        f"allowed_paths: [candidate.py]\nkeep_rule: {rule}\nmax_consecutive_crashes: 1000\n")
    git = ["git", "-c", "user.name=b", "-c", "user.email=b@b"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "start"], cwd=repo, check=True)
    agent = f"{sys.executable} agent.py {k} {share}"
    t0 = time.time()
    n_exp = proposals * 4 + 8     # generous: the proposals are counted from the results
    proc = subprocess.Popen([sys.executable, "-m", "autoresearch", "run", "--config", "ar.yaml", "--tag", "b",
                             "--agent", agent, "--max-experiments", str(n_exp), "--calibrate-noise", "3"],
                            cwd=repo, stdout=open(repo.parent / f"{repo.name}.log", "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "COLUMNS": "200"})
    results = repo / "runs" / "b" / "results.tsv"
    while proc.poll() is None:        # stop once enough proposals are recorded
        time.sleep(1)
        if results.exists() and sum(1 for r in read_results(results)
                                    if r.description.startswith(("null", "gain"))) >= proposals:
            proc.terminate()
    proc.wait()
    if not results.exists():
        raise SystemExit(f"ar run wrote no results in {repo}:\n{(repo.parent / f'{repo.name}.log').read_text()[-3000:]}")
    return tally(repo, time.time() - t0)


def tally(repo: Path, seconds: float) -> dict:
    rows = read_results(repo / "runs" / "b" / "results.tsv")
    out = {"null": [0, 0], "gain": [0, 0], "runs": 0, "proposals": 0, "seconds": round(seconds)}
    for r in rows:
        if r.val_bpb is None and r.status.value not in ("keep", "discard"):
            continue
        runs = 1
        d = repo / "runs" / "b" / f"{r.exp_id:04d}-{r.commit}" / "decision.json"
        if d.exists():
            runs = len(json.loads(d.read_text())["runs"])
        out["runs"] += runs
        kind = "null" if r.description.startswith("null") else "gain" if r.description.startswith("gain") else None
        if kind and r.status.value in ("keep", "discard"):
            out["proposals"] += 1
            out[kind][1] += 1
            out[kind][0] += r.status.value == "keep"
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--proposals", type=int, default=48)
    ap.add_argument("--gains", default="0.5,1,1.5,2")
    ap.add_argument("--sigma", type=float, default=0.02)
    ap.add_argument("--share", type=float, default=0.25)
    ap.add_argument("--rules", default="single,sequential")
    a = ap.parse_args()
    gains = [float(g) for g in a.gains.split(",")]
    rules = a.rules.split(",")
    print(f"σ {a.sigma}, {a.share:.0%} real gains, {a.proposals} proposals a session; each row one `ar run`")
    print("| rule | real gain | null edits kept | real gains kept | runs per proposal | simulated keep chance "
          "(null / gain, the best on 3 runs) | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for k in gains:
            for rule in rules:
                t = session(Path(tmp), rule, k, a.sigma, a.proposals, a.share)
                sim = ""
                if rule == "sequential":
                    r = SequentialRule()
                    sim = f"{r.keep_chance(0, 1, 3):.1%} / {r.keep_chance(k, 1, 3):.1%}"
                n0, g0 = t["null"], t["gain"]
                print(f"| {rule} | {k:g}σ | {n0[0]}/{n0[1]} ({n0[0] / max(1, n0[1]):.0%}) | "
                      f"{g0[0]}/{g0[1]} ({g0[0] / max(1, g0[1]):.0%}) | {t['runs'] / max(1, t['proposals']):.2f} | "
                      f"{sim} | {t['seconds']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
