"""The sequential keep decision through `ar run`, on a noisy command objective whose truth is known: the score is
1 - GAIN plus noise drawn from (ar's seed, the candidate's text). A clear loser costs one run; a real gain is
kept on several runs, each with its own seed from ar, against the mean of the best's runs; a candidate that
fixes its own seed gives the same value on every run and is discarded with the reason; the new best is
measured three times more and judged by those runs alone. The pure rule's table is in test_decide.py; its false-keep and find rates in bench_decisions.py."""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from autoresearch.harness import sandbox
from autoresearch.records.ledger import read_results
from fixtures.cli import committed_repo, run_ar

SCORE = '''import hashlib, json, os, random, re
src = open("candidate.py").read()
gain = float(re.search(r"^GAIN = (.*)$", src, re.M).group(1))
seed = 7 if "FIXED = 1" in src else int(os.environ["AR_SEED"])     # FIXED: the candidate picks its own seed
rng = random.Random(hashlib.sha256(f"{seed}:{src}".encode()).hexdigest())
print(json.dumps({"score": 1.0 - gain + 0.01 * rng.gauss(0.0, 1.0)}))
'''
AGENT = '''import json, os, sys
from pathlib import Path
plan = json.loads(sys.argv[1]).get(os.environ["AR_EXPERIMENT"], ["nothing", 0.0, 0])
what, gain, fixed = plan
Path("candidate.py").write_text(f"GAIN = {gain!r}\\nFIXED = {fixed}\\nNONCE = {os.environ['AR_EXPERIMENT']}\\n")
Path(os.environ["AR_DESCRIPTION_FILE"]).write_text(what + "\\n")
'''


@pytest.mark.e2e
@pytest.mark.skipif(not sandbox.available()[0], reason="Landlock is not available here")
def test_sequential_decisions_through_ar_run(tmp_path):
    root = committed_repo(tmp_path / "noisy", {
        "candidate.py": "GAIN = 0.0\nFIXED = 0\nNONCE = 0\n", "score.py": SCORE, "agent.py": AGENT,
        "program.md": "# program\nLower the score.\n", ".gitignore": "runs/\n",
        "ar.yaml": "objective:\n  name: score\n  direction: min\n  command: python score.py\n  metric: score\n"
                   "  timeout: 60\nallowed_paths: [candidate.py]\n"})
    # 1 baseline, 2-3 its calibration runs; 4 a loser; 5 a winner (10 σ); 6-8 the winner measured again;
    # 9 a winner that fixes its seed; 10 a null edit
    plan = {"4": ["loser", -0.1, 0], "5": ["winner", 0.1, 0], "9": ["fixed seed", 0.2, 1], "10": ["null", 0.1, 0]}
    agent = f"{sys.executable} agent.py '{json.dumps(plan)}' {{prompt_file}}"
    r = run_ar("run", "--config", "ar.yaml", "--tag", "n", "--max-experiments", "10", "--agent", agent, cwd=root,
               timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = read_results(root / "runs" / "n" / "results.tsv")
    by = {row.description: row for row in rows}
    assert [row.status.value for row in rows[:3]] == ["keep", "validation", "validation"], [x.reason for x in rows]

    def decision(row) -> dict:
        return json.loads((root / "runs" / "n" / f"{row.exp_id:04d}-{row.commit}" / "decision.json").read_text())

    loser = by["loser"]
    assert loser.status.value == "discard" and "worse than the best" in loser.reason, loser.reason
    assert decision(loser)["runs"] == [loser.val_bpb] and decision(loser)["seeds"] == [42]      # one run

    winner = by["winner"]
    d = decision(winner)
    assert winner.status.value == "keep" and winner.reason.startswith("kept: "), winner.reason
    assert len(d["runs"]) >= 2 and d["seeds"] == list(range(42, 42 + len(d["runs"])))          # ar's seeds
    assert len(set(d["runs"])) == len(d["runs"])                                                 # each its own draw
    assert winner.val_bpb == pytest.approx(statistics.fmean(d["runs"]), abs=1e-6)              # the mean is the row's
    assert d["best_runs"] == [rows[0].val_bpb, rows[1].val_bpb, rows[2].val_bpb]               # the baseline's three
    assert d["z"] >= d["bar"] and d["sigma"] > 0
    exp = root / "runs" / "n" / f"{winner.exp_id:04d}-{winner.commit}"
    assert (exp / "record.json").exists() and (exp / "record-run2.json").exists()              # each run's record

    again = rows[rows.index(winner) + 1:rows.index(winner) + 4]   # measured 3 times more, before the next proposal
    n = len(d["runs"])
    assert [(a.status.value, a.commit, a.description, a.seed) for a in again] == [
        ("validation", winner.commit, "the best measured again", 42 + n + i) for i in range(3)], again
    fixed_d = decision(by["fixed seed"])    # judged by those 3 runs alone, not the ones chosen for being good
    assert fixed_d["best_runs"] == [a.val_bpb for a in again], fixed_d

    fixed = by["fixed seed"]
    assert fixed.status.value == "discard" and "does not use the seed ar gives each run" in fixed.reason, fixed.reason
    assert len(decision(fixed)["runs"]) == 2

    null = by["null"]                         # kept or not on its evidence, which the row and decision.json give
    assert null.status.value in ("keep", "discard") and " SE (σ " in null.reason, null.reason
    assert decision(null)["decision"] == null.status.value
    assert f"over {len(decision(null)['runs'])} run" in null.reason
    assert "best: " in r.stdout


@pytest.mark.e2e      # `ar run` as a process (refused before any session)
def test_calibrate_noise_0_without_a_noise_is_refused_in_one_line(tmp_path):
    root = committed_repo(tmp_path / "ws", {"train.py": "print('x')\n"})
    r = run_ar("run", "--calibrate-noise", "0", "--max-experiments", "1", cwd=root, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "--calibrate-noise 0" in ln]
    assert len(lines) == 1 and "set noise: in the config" in lines[0], r.stdout + r.stderr
    assert not (root / "runs").exists() or not any((root / "runs").rglob("results.tsv"))        # nothing ran
