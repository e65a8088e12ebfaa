"""`ar run`, `ar status`, `ar try` and `ar eval` from the command line, and the config they load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from autoresearch.cli import app
from autoresearch.config import DEFAULT_NOISE, RunConfig, load_config
from autoresearch.errors import ConfigError
from autoresearch.records.ledger import Status, read_results

from test_loop import no_ar_settings  # noqa: F401  (a fixture, asked for by name)
from fixtures.cli import git, run_ar

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True)
def _isolated(prepared_cache, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    for var in ("AR_PROFILE", "AR_TIME_BUDGET", "AR_SEED"):
        monkeypatch.delenv(var, raising=False)


def make_repo(tmp_path: Path, train: Path = FIXTURES / "fake_train.py") -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "train.py").write_text(train.read_text())
    (root / "program.md").write_text("# program\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "start"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True)
    return root


def config_file(tmp_path: Path, **kw) -> Path:
    base = dict(profile="cpu", time_budget=0.5, startup_allowance=10, eval_allowance=30, prepare_data=False,
                eval_tokens=2048, noise=0.002)        # a configured noise: no calibration runs of the baseline
    base.update(kw)
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump(base))
    return f


def ar(*args, cwd):
    return subprocess.run([sys.executable, "-m", "autoresearch", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


# ------------------------------------------------------------------------------------------------ config

def test_flags_beat_the_file_which_beats_defaults(tmp_path):
    f = config_file(tmp_path, time_budget=7, agent_timeout=60, hooks={"kept": "echo kept"})
    cfg = load_config(f, {"time_budget": 3, "agent": None})
    assert cfg.time_budget == 3.0 and cfg.agent_timeout == 60.0 and cfg.seed == 42
    assert cfg.hooks == {"kept": ["echo kept"]}
    assert load_config(None).train_command == [sys.executable, "train.py"]


@pytest.mark.parametrize("content, message", [
    ({"bogus": 1}, "unknown key 'bogus'"),
    ({"time_budget": "abc"}, "time_budget in"),
    ({"time_budget": -1}, "must be positive"),
    ({"proposer": "magic"}, "proposer in"),
    ({"hooks": {"on_fire": "x"}}, "unknown hook event 'on_fire'"),
    ({"allowed_paths": ["../x"]}, "inside the repo"),
    ({"gpus": "zero"}, "must be GPU indices"),
    ({"proposer": "grid"}, "search_space"),
    ({"proposer": "agent"}, "needs an agent"),
])
def test_bad_config_names_the_key_and_file(tmp_path, content, message):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(content))
    with pytest.raises(ConfigError, match=message) as e:
        load_config(f)
    if "key" in message or "in" in message.split()[-1]:
        assert "c.yaml" in str(e.value) or "proposer" in str(e.value)


def test_noise_layers(tmp_path):
    tag_dir = tmp_path / "t"
    tag_dir.mkdir()
    assert RunConfig().noise_threshold(tag_dir) == (DEFAULT_NOISE, "default")
    (tag_dir / "noise.json").write_text('{"noise": 0.004}')
    assert RunConfig().noise_threshold(tag_dir)[0] == 0.004
    assert RunConfig(noise=0.01).noise_threshold(tag_dir) == (0.01, "config")


def test_the_example_config_loads():
    cfg = load_config(ROOT / "configs" / "run.yaml")
    assert cfg.max_consecutive_crashes == 5


# ----------------------------------------------------------------------------------------------- the CLI

def test_help_lists_the_flags():
    out = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).output
    for flag in ("--repo", "--tag", "--proposer", "--agent", "--max-experiments", "--max-hours", "--time-budget",
                 "--config", "--calibrate-noise", "--max-consecutive-crashes"):
        assert flag in out


@pytest.mark.e2e
@pytest.mark.parametrize("args, message, code", [
    (["--proposer", "magic"], "proposer in the command line must be one of", 2),
    (["--agent", "no-such-agent-xyz"], "not found on PATH", 2),
    (["--tag", "Bad/Tag"], "tag 'Bad/Tag'", 1),
    (["--config", "missing.yaml"], "config file missing.yaml does not exist", 2),
])
def test_bad_flags_are_one_line_errors(tmp_path, args, message, code):
    root = make_repo(tmp_path)
    r = ar("run", "--repo", str(root), *args, cwd=tmp_path)
    assert r.returncode == code and message in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 2


@pytest.mark.e2e
def test_unknown_config_key_from_the_command_line(tmp_path):
    root = make_repo(tmp_path)
    f = tmp_path / "c.yaml"
    f.write_text("time_budget: 1\nbudjet: 2\n")
    r = ar("run", "--repo", str(root), "--config", str(f), cwd=tmp_path)
    assert r.returncode == 2 and "unknown key 'budjet'" in r.stderr and str(f) in r.stderr


@pytest.mark.e2e
def test_not_a_repo_or_no_train_py(tmp_path):
    r = ar("run", "--repo", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "no train.py in" in r.stderr
    (tmp_path / "train.py").write_text("DEPTH = 1\n")
    r = ar("run", "--repo", str(tmp_path), "--proposer", "strategy", cwd=tmp_path)
    assert r.returncode == 1 and "not a git repository" in r.stderr


@pytest.mark.e2e
def test_run_then_status(tmp_path):
    root = make_repo(tmp_path)
    runner = CliRunner()
    assert "no ar loop is running" in runner.invoke(app, ["status", "--repo", str(root)]).output
    r = runner.invoke(app, ["run", "--repo", str(root), "--tag", "t", "--config", str(config_file(tmp_path)),
                            "--max-experiments", "3"])
    assert r.exit_code == 0, r.output
    out = r.output
    assert "no agent configured" in out and "branch autoresearch/t starts at" in out
    assert "0001 keep" in out and "0003 keep" in out and "stopped: reached --max-experiments 3" in out
    best = min(r.val_bpb for r in read_results(root / "runs" / "t" / "results.tsv"))
    assert f"best: {best:.6f} val_bpb" in out
    st = runner.invoke(app, ["status", "--repo", str(root)]).output
    assert "no ar loop is running" in st and "last tag: t" in st and "now: idle" in st
    assert f"best: {best:.6f}" in st and "3 keep" in st


@pytest.mark.e2e
def test_failures_stop_with_exit_code_1(tmp_path):
    root = make_repo(tmp_path)
    (root / "train.py").write_text((root / "train.py").read_text().replace('FAIL_MODE = "none"', 'FAIL_MODE = "nan"'))
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "nan"], cwd=root, check=True)
    r = ar("run", "--repo", str(root), "--tag", "t", "--config", str(config_file(tmp_path)), cwd=tmp_path)
    assert r.returncode == 1 and "the baseline did not run cleanly" in r.stdout


@pytest.mark.e2e
def test_zero_config_first_run(tmp_path, monkeypatch):
    """No config, no GPU, no prepared data, no agent: the builtin corpus is prepared, the CPU profile and the
    strategy proposer are chosen, each said in one line, and the best result ends the output."""
    import autoresearch.harness.data as data
    from autoresearch.errors import DataError
    calls = []

    def check_prepared(cache, name, vocab_size):
        if not calls:
            raise DataError("not prepared")
        return Path(cache)

    # `ar run`'s data check sees no data and "prepares" it; the loop then trains on the shared tiny dataset,
    # linked as `builtin` in this test's cache (test_zero_config_with_the_real_train_py prepares for real)
    monkeypatch.setattr(data, "check_prepared", check_prepared)
    monkeypatch.setattr(data, "prepare", lambda source, **kw: calls.append((source, kw["vocab_size"])))
    monkeypatch.setattr("autoresearch.harness.env.cuda_available", lambda: False)
    root = make_repo(tmp_path)
    r = CliRunner().invoke(app, ["run", "--repo", str(root), "--max-experiments", "3", "--time-budget", "0.5"])
    assert r.exit_code == 0, r.output
    assert calls == [("builtin", 2048)]
    lines = r.output.splitlines()
    assert any(ln.startswith("no agent configured: proposing with the built-in strategy proposer") for ln in lines)
    assert any(ln.startswith("no CUDA GPU: cpu profile") for ln in lines)
    assert any(ln.startswith("no prepared data: preparing the builtin corpus") for ln in lines)
    # the default noise calibration: the baseline and two re-runs of it
    rows = read_results(next((root / "runs").glob("*/results.tsv")))
    assert [r.status.value for r in rows] == ["keep", "validation", "validation"]
    # the best result ends the output: after the stop line (long lines may wrap at the runner's width)
    stop = max(i for i, ln in enumerate(lines) if ln.startswith("stopped:"))
    assert any(ln.startswith(f"best: {rows[0].val_bpb:.6f} val_bpb") for ln in lines[stop + 1:]), lines[stop:]


@pytest.mark.e2e
@pytest.mark.slow
def test_zero_config_with_the_real_train_py(tmp_path):
    """The README's main job for real, on CPU: prepares the builtin corpus into an empty cache and trains."""
    root = make_repo(tmp_path, ROOT / "train.py")
    env = {**os.environ, "AR_CACHE": str(tmp_path / "empty-cache")}      # not the prepared one
    # an 8-s budget: one CPU step beside a busy test worker took 10.4 s, 6.5 s past a 4-s window (a timeout)
    r = subprocess.run([sys.executable, "-m", "autoresearch", "run", "--repo", str(root), "--max-experiments", "1",
                        "--time-budget", "8"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "preparing the builtin corpus" in r.stdout and "cpu profile" in r.stdout
    assert "best: " in r.stdout and "val_bpb" in r.stdout


# ------------------------------------------------------------------- ar try, ar eval, a mistyped key, the status line


@pytest.mark.e2e
def test_ar_try_scores_the_working_tree_against_the_best_and_commits_nothing(tmp_path, prepared_cache, monkeypatch):
    from autoresearch.gitops import GitRepo
    from autoresearch.knobs import set_knobs
    from autoresearch.records.ledger import read_results
    from autoresearch.session.loop import Loop
    from test_loop import cfg, make_repo

    for var in ("AR_PROFILE", "AR_TIME_BUDGET", "AR_SEED", "AR_DATASET", "AR_TOK_DIR", "AR_CHECKPOINT_DIR"):
        monkeypatch.delenv(var, raising=False)
    root = make_repo(tmp_path)
    Loop(cfg(noise=0.002), root, "t", None).run()                          # the tag's best: the baseline
    head, results = GitRepo(root).head_sha(), (root / "runs" / "t" / "results.tsv").read_bytes()
    set_knobs(root / "train.py", {"TOTAL_BATCH_SIZE": 2**18})              # a hand edit, not committed
    edited = (root / "train.py").read_text()
    r = run_ar("try", cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[-3].startswith("trial 0001, working tree (train.py changed) on %s: val_bpb " % head[:7]), r.stdout
    assert "would be kept: val_bpb" in lines[-3] and "beats the best" in lines[-3]
    assert lines[-2].startswith("tag t: best ") and "keep threshold 0.002" in lines[-2]
    (trial,) = read_results(root / "runs" / "t" / "trials.tsv")
    assert trial.status is Status.TRIAL and trial.val_bpb is not None and trial.time_budget == 0.5
    assert (root / "runs" / "t" / f"trial-0001-{trial.commit}" / "record.json").is_file()
    # nothing committed, no branch moved, the tree as the user left it, the tag's records untouched
    assert GitRepo(root).head_sha() == head and (root / "train.py").read_text() == edited
    assert (root / "runs" / "t" / "results.tsv").read_bytes() == results
    assert git(root, "status", "--porcelain") == "M train.py"


@pytest.mark.e2e
def test_ar_noise_trains_the_best_at_each_budget_with_ars_seeds_and_recommends_one(tmp_path, prepared_cache,
                                                                                   monkeypatch):
    from autoresearch.gitops import GitRepo
    from autoresearch.session.loop import Loop
    from test_loop import cfg, make_repo

    for var in ("AR_PROFILE", "AR_TIME_BUDGET", "AR_SEED", "AR_DATASET", "AR_TOK_DIR", "AR_CHECKPOINT_DIR"):
        monkeypatch.delenv(var, raising=False)
    root = make_repo(tmp_path, SEED_NOISE=0.05)          # val_bpb moves with the seed, not with the budget
    Loop(cfg(noise=0.002), root, "t", None).run()
    head, results = GitRepo(root).head_sha(), (root / "runs" / "t" / "results.tsv").read_bytes()
    bad = run_ar("noise", "--budgets", "0.5,soon", cwd=root)
    assert bad.returncode == 2 and "is not a list of budgets" in bad.stderr and "Traceback" not in bad.stderr
    r = run_ar("noise", "--budgets", "2,0.5", "--runs", "2", cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    said = [ln for ln in r.stdout.splitlines() if ln.startswith(("budget ", "recommended", "σ from"))]
    assert said[0].startswith("budget 0.5 s: val_bpb ") and said[1].startswith("budget 2 s: val_bpb "), r.stdout
    assert "smallest gain kept 4 in 5" in said[0]
    # the same seeds at both budgets and a stand-in whose score ignores the budget: the same noise, so the
    # cheaper run wins
    assert said[2].startswith("recommended: --time-budget 0.5 "), r.stdout
    assert said[3].startswith("σ from 2 runs is rough"), said
    trials = read_results(root / "runs" / "t" / "trials.tsv")
    assert [(t.time_budget, t.seed) for t in trials] == [(0.5, 42), (0.5, 43), (2.0, 42), (2.0, 43)]
    assert all(t.status is Status.TRIAL and t.commit == head[:7] for t in trials)
    assert trials[0].val_bpb != trials[1].val_bpb and trials[0].val_bpb == pytest.approx(trials[2].val_bpb)
    doc = json.loads((root / "runs" / "t" / "noise-budgets.json").read_text())
    assert [x["budget"] for x in doc["budgets"]] == [0.5, 2.0] and doc["lines"][-2] == said[2]
    assert GitRepo(root).head_sha() == head and (root / "runs" / "t" / "results.tsv").read_bytes() == results


@pytest.mark.e2e
def test_a_hand_run_of_train_py_says_how_to_score_it_and_ar_eval_scores_its_checkpoint(tmp_path, prepared_cache,
                                                                                      monkeypatch):
    import os
    import shutil
    from autoresearch.session.loop import Loop
    from autoresearch.workspace import init_workspace
    from test_loop import cfg, make_repo

    for var in ("AR_PROFILE", "AR_TIME_BUDGET", "AR_SEED", "AR_DATASET", "AR_TOK_DIR", "AR_CHECKPOINT_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert "checkpoint/" in (init_workspace(tmp_path / "ws").path / ".gitignore").read_text().split()
    root = make_repo(tmp_path)
    Loop(cfg(noise=0.002), root, "t", None).run()                          # a tag with a best to compare with
    shutil.copy(ROOT / "train.py", root / "train.py")                      # the real model, edited by hand
    (root / ".gitignore").write_text("runs/\n__pycache__/\ncheckpoint/\n")
    env = {**os.environ, "AR_PROFILE": "cpu", "AR_TIME_BUDGET": "2"}
    hand = subprocess.run([sys.executable, "train.py"], cwd=root, capture_output=True, text=True, env=env,
                          timeout=300)
    assert hand.returncode == 0, hand.stdout[-2000:] + hand.stderr[-2000:]
    assert hand.stdout.splitlines()[-1].startswith("to score it: `ar eval checkpoint`"), hand.stdout[-500:]
    assert (root / "checkpoint" / "model.json").is_file()
    r = run_ar("eval", "checkpoint", cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    first, best = r.stdout.splitlines()[-3:-1]
    assert first.startswith("eval 0001, checkpoint ") and " val_bpb " in first and "not decided" in first, r.stdout
    assert best.startswith("tag t: best ")
    missing = run_ar("eval", "nowhere", cwd=root)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "is not a checkpoint" in missing.stderr


@pytest.mark.e2e
@pytest.mark.usefixtures("no_ar_settings")
def test_ar_eval_refuses_a_folder_without_weights_before_numbering_and_its_hint_is_true(tmp_path, prepared_cache):
    from autoresearch.session.loop import Loop
    from test_loop import cfg, make_repo

    root = make_repo(tmp_path)
    Loop(cfg(noise=0.002), root, "t", None).run(max_experiments=1)
    (exp,) = [d for d in (root / "runs" / "t").iterdir() if d.name.startswith("0001-")]
    assert (exp / "model.json").is_file()                                     # the built config, no weights
    r = run_ar("eval", exp, cwd=root)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert "weights.safetensors" in r.stderr and "python train.py" in r.stderr, r.stderr
    assert "pass the folder a run saved" not in r.stderr
    assert not (root / "runs" / "t" / "trials.tsv").exists() and not list((root / "runs" / "t").glob("eval-*"))


@pytest.mark.e2e
def test_a_mistyped_config_key_gets_a_suggestion_and_the_run_limits_are_keys(tmp_path, prepared_cache):
    from autoresearch.config import load_config
    from autoresearch.errors import ConfigError
    from autoresearch.records.ledger import read_results
    from test_loop import make_repo

    bad = tmp_path / "bad.yaml"
    bad.write_text("max_experiment: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert "did you mean 'max_experiments'?" in str(e.value) and "known keys" not in str(e.value)
    assert load_config(None, {"max_hours": 2.0}).max_hours == 2.0
    root = make_repo(tmp_path)
    (tmp_path / "run.yaml").write_text("profile: cpu\ntime_budget: 0.5\neval_tokens: 2048\nnoise: 0.002\n"
                                       "max_experiments: 1\n")
    r = run_ar("run", "--tag", "t", "--config", tmp_path / "run.yaml", cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stopped: reached --max-experiments 1" in r.stdout
    assert len(read_results(root / "runs" / "t" / "results.tsv")) == 1
    lines = r.stdout.splitlines()
    assert sum("results in runs/t/" in ln for ln in lines) == 1, r.stdout     # the tag named once
    assert any(ln.startswith("branch autoresearch/t starts at ") for ln in lines), r.stdout
    st = json.loads(run_ar("status", "--tag", "t", "--json", cwd=root).stdout)
    assert st["tag"] == "t" and st["counts"] == {"keep": 1}
    missing = run_ar("status", "--tag", "nope", cwd=root)
    assert missing.returncode == 1 and "no tag 'nope'" in missing.stderr and "tags: t" in missing.stderr


@pytest.mark.usefixtures("no_ar_settings")
def test_status_says_what_the_experiment_is_doing_in_words():
    from autoresearch.cli.run import _experiment_line

    def line(kind, phase, **x):
        return _experiment_line({"running": True, "status": {"experiment": {
            "id": 4, "kind": kind, "phase": phase, "description": "strategy: LR_MULT 1.0 -> 1.5", **x},
            "step": {"step": 5, "pct": 40.0, "loss": 3.2, "tokens_per_s": 4000, "mfu": None, "remaining_s": 12}}})
    got = line("propose", "training")
    assert got.startswith("now: experiment 0004, a proposal, is training: strategy: LR_MULT 1.0 -> 1.5"), got
    assert "(propose, training)" not in got and "step 5, 40.0%" in got
    assert line("propose", "proposing").startswith("now: experiment 0004, a proposal, is being written by the "
                                                   "proposer")
    assert "the baseline, is being scored by the evaluator" in line("baseline", "evaluating")
    assert "a re-run of a commit, is training" in line("rerun", "training")
    assert "is being checked and committed" in line("knobs", "committing")
    assert "is being decided and recorded" in line("commit", "settling")
