"""Any objective: a command + metric + correctness gate instead of val_bpb. Parsing and extraction as pure
functions; the loop end to end through the real CLI on a tiny objective to maximise (no torch, so it is fast)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoresearch.config import load_config
from autoresearch.decide import decide
from autoresearch.errors import ConfigError
from autoresearch.records.ledger import read_results
from autoresearch.objective import Objective, parse

GOOD = {"name": "score", "command": "python score.py", "metric": {"regex": r"score: (-?[0-9.]+)"}}


@pytest.mark.parametrize("raw, message", [
    ("score", "must be a mapping"),
    ({"command": "x", "metric": "k"}, "needs name"),
    ({**GOOD, "name": "two words"}, "must be a word"),
    ({**GOOD, "direction": "up"}, "min or max"),
    ({**GOOD, "metric": {"regex": "score: [0-9]+"}}, "needs a group"),
    ({**GOOD, "metric": {"regex": "score: ([0-9]+"}}, "not a valid regex"),
    ({**GOOD, "metric": {"xpath": "a"}}, "JSON key"),
    ({**GOOD, "noise": "five%"}, "percentage"),
    ({**GOOD, "noise": -1}, "percentage"),
    ({**GOOD, "timeout": 0}, "positive number"),
    ({**GOOD, "command": []}, "needs command"),
    ({**GOOD, "colour": "red"}, "unknown key 'colour'"),
    ({**GOOD, "sandbox": "none"}, "must be ar .* or command"),
])
def test_bad_objectives_are_one_line_errors(raw, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse(raw, "ar.yaml")
    assert "\n" not in str(e.value)


def test_objective_parsing_and_python_is_ars_interpreter():
    o = parse({**GOOD, "direction": "max", "unit": "pts", "gate": ["python3", "gate.py"], "noise": "5%"}, "f")
    assert o.custom and o.sign == -1 and o.noise_share == pytest.approx(0.05) and o.noise is None
    assert o.command == (sys.executable, "score.py") and o.gate == (sys.executable, "gate.py")
    assert o.threshold(0.002, 200.0) == pytest.approx(10.0)          # a share of the best
    assert parse({**GOOD, "noise": 0.25}, "f").threshold(0.002, 200.0) == 0.25
    assert o.better(3.0, 2.0) and not o.better(1.0, 2.0)


def test_extraction_takes_the_commands_last_word_and_nothing_else():
    j = Objective(name="us", command=("x",), json_key="us")
    text = '{"us": 1.0}\nworker: {"us": 0.001}\n  {"us": 12.5}  \n{"other": 3}\nnot json {\n'
    assert j.extract(text) == 12.5                     # the last JSON line with the key; prefixed lines ignored
    assert j.extract('{"us": true}') is None and j.extract('{"us": "nan"}') is None and j.extract("") is None
    r = Objective(name="s", command=("x",), regex=r"score: (-?[0-9.]+)")
    assert r.extract("score: 1\nscore: -2.5\n") == -2.5 and r.extract("no score") is None


def test_decide_follows_the_direction():
    assert decide(10.0, 12.0, 1.0, name="score", sign=-1).keep
    assert not decide(10.0, 10.5, 1.0, name="score", sign=-1).keep     # within the noise
    d = decide(10.0, 8.0, 1.0, name="score", sign=-1)
    assert not d.keep and "score 8.000000 is worse than the best 10.000000" in d.reason
    assert decide(10.0, 8.0, 1.0).keep                                    # val_bpb: lower is better


def _config(root: Path, **extra) -> Path:
    import yaml
    doc = {"objective": {"name": "score", "unit": "pts", "direction": "max", "command": "python score.py",
                         "metric": {"regex": r"score: (-?[0-9.]+)"}, "gate": "python gate.py", "timeout": 60,
                         "noise": 0.5},
           "allowed_paths": ["solution.py"], **extra}
    (root / "ar.yaml").write_text(yaml.safe_dump(doc))
    return root / "ar.yaml"


def test_a_command_inside_allowed_paths_is_refused(tmp_path):
    path = _config(tmp_path, allowed_paths=["score.py"])
    with pytest.raises(ConfigError, match="keep what measures out of what is measured"):
        load_config(path)
    doc = json.loads(json.dumps(__import__("yaml").safe_load(path.read_text())))
    del doc["allowed_paths"]
    path.write_text(__import__("yaml").safe_dump(doc))
    with pytest.raises(ConfigError, match="needs allowed_paths"):
        load_config(path)


def _repo(tmp_path: Path) -> Path:
    root = tmp_path / "obj"
    root.mkdir()
    (root / "solution.py").write_text("SCORE = 1  # what the search changes\n")
    # the command runs the candidate in a process of its own, so nothing the candidate prints can pose as it
    (root / "score.py").write_text(
        "import subprocess, sys\n"
        "out = subprocess.run([sys.executable, '-c', 'import solution; print(solution.SCORE)'],\n"
        "                     capture_output=True, text=True, check=True).stdout.split()[-1]\n"
        "print(f'score: {10 * float(out)}')\n")
    (root / "gate.py").write_text("import sys, solution\n"
                                  "sys.exit('FAIL: SCORE must not be negative' if solution.SCORE < 0 else 0)\n")
    (root / "program.md").write_text("Raise the score.\n")
    (root / ".gitignore").write_text("runs/\n__pycache__/\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "start"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True)
    return root


@pytest.mark.e2e
def test_an_objective_to_maximise_with_a_gate_end_to_end(tmp_path):
    root = _repo(tmp_path)
    _config(root, proposer="grid", search_space={"SCORE": [3, 2, 5, -1]}, profile="cpu")
    subprocess.run(["git", "add", "ar.yaml"], cwd=root, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "config"], cwd=root,
                   check=True)
    run = subprocess.run([sys.executable, "-m", "autoresearch", "run", "--config", "ar.yaml", "--tag", "t",
                          "--max-experiments", "5"], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "keep threshold 0.5 score (objective.noise)" in run.stdout
    assert "best: 50.000000 score at" in run.stdout
    rows = read_results(root / "runs" / "t" / "results.tsv")
    assert [(r.status.value, r.val_bpb) for r in rows] == [
        ("keep", 10.0), ("keep", 30.0), ("discard", 20.0), ("keep", 50.0), ("rejected", None)]
    assert "score 20.000000 is worse than the best 30.000000" in rows[2].reason
    assert rows[4].reason == "the correctness gate failed: FAIL: SCORE must not be negative"
    assert "SCORE = 5" in (root / "solution.py").read_text()                # the best kept, restored
    rep = subprocess.run([sys.executable, "-m", "autoresearch", "report", "--json"], cwd=root, capture_output=True,
                         text=True, timeout=120)
    data = json.loads(rep.stdout)
    assert {k: data["objective"][k] for k in ("name", "unit", "direction")} == {
        "name": "score", "unit": "pts", "direction": "max"}
    assert data["best"]["val_bpb"] == 50.0 and [e["val_bpb"] for e in data["top"]] == [50.0, 30.0, 20.0, 10.0]
    table = subprocess.run([sys.executable, "-m", "autoresearch", "report"], cwd=root, capture_output=True,
                           text=True, timeout=120).stdout
    assert "score (pts, higher is better)" in table and "best:" in table and "score 50.000000 pts" in table


@pytest.mark.e2e
def test_the_gate_cannot_plant_anything_for_the_command(tmp_path):
    # The candidate runs inside the gate: there it rewrites the benchmark in its working copy and plants a
    # sitecustomize.py in the user site of its HOME, both of which would make the command print score 1000.
    root = _repo(tmp_path)
    (root / "solution.py").write_text(
        "SCORE = 1\n"
        "import os, site, sys\n"
        "if 'gate.py' in sys.argv[0]:\n"
        "    open('score.py', 'w').write(\"print('score: 1000')\\n\")\n"
        "    d = site.getusersitepackages()\n"
        "    os.makedirs(d, exist_ok=True)\n"
        "    open(os.path.join(d, 'sitecustomize.py'), 'w').write(\n"
        "        \"import atexit; atexit.register(lambda: print('score: 1000'))\\n\")\n")
    _config(root, proposer="grid", search_space={"SCORE": [2]}, profile="cpu")
    for args in (["add", "-A"], ["commit", "-qm", "planting solution"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True)
    run = subprocess.run([sys.executable, "-m", "autoresearch", "run", "--config", "ar.yaml", "--tag", "t",
                          "--max-experiments", "2"], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = read_results(root / "runs" / "t" / "results.tsv")
    assert [(r.status.value, r.val_bpb) for r in rows] == [("keep", 10.0), ("keep", 20.0)], [r.reason for r in rows]


def test_the_agents_prompt_speaks_of_the_objective(tmp_path):
    from autoresearch.harness.env import resolve_profile
    from autoresearch.proposers import Context
    from autoresearch.proposers.agent import render_prompt
    obj = parse({**GOOD, "unit": "pts", "direction": "max", "gate": "python gate.py", "noise": "5%"}, "f")
    ctx = Context(tmp_path, "solution.py", {"SCORE": 1}, None, [], 2, tmp_path / "x", "t", resolve_profile("cpu"),
                  20, 100, 0.002, ["solution.py"], None, obj)
    text = render_prompt(ctx, program="# raise the score", last_n=5, description_file=tmp_path / "d")
    assert "the correctness gate `python gate.py` must pass" in text and "score (pts, higher is better)" in text
    assert "improves by more than 5% of the best" in text and "Knobs of the current solution.py" in text
    assert "val_bpb" not in text and "training" not in text.split("## Rules")[0]


@pytest.mark.e2e
def test_a_bad_objective_from_the_command_line_is_one_line_and_exit_2(tmp_path):
    root = _repo(tmp_path)
    (root / "ar.yaml").write_text("objective:\n  name: score\n  command: python score.py\n  metric: {regex: 'no group'}\n"
                                  "allowed_paths: [solution.py]\n")
    run = subprocess.run([sys.executable, "-m", "autoresearch", "run", "--config", "ar.yaml"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    out = (run.stdout + run.stderr).strip()
    assert run.returncode == 2 and "Traceback" not in out and len(out.splitlines()) == 1, out
    assert "needs a group around the number" in out
