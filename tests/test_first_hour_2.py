"""Regression tests for the first hour, second round (issue 21): one truth about the best, a user's commit on the
tag's branch, small token counts, the settings `ar status` reports, plain output into a pipe, the Ray extra's
name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoresearch import memory
from autoresearch.views import report as rep
from autoresearch.ledger import Ledger, Row, Status

ROOT = Path(__file__).resolve().parent.parent


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def ar(*args, cwd, timeout=180):
    return subprocess.run([sys.executable, "-m", "autoresearch", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def quick_start_rows() -> list[Row]:
    """The quick start's ledger: a kept baseline, its calibration re-runs, then a discard that scored lower than
    the best but inside the noise."""
    def row(i, commit, val, status, desc, reason=""):
        return Row(commit=commit, val_bpb=val, memory_gb=None, status=status, description=desc, exp_id=i, tag="dec1",
                   time_budget=20.0, seed=42, num_steps=9, total_tokens_M=0.036864, reason=reason)
    return [row(1, "75a7ff5", 2.727349, Status.KEEP, "baseline"),
            row(2, "75a7ff5", 2.911, Status.VALIDATION, "noise calibration: baseline again"),
            row(3, "75a7ff5", 2.774, Status.VALIDATION, "noise calibration: baseline again"),
            row(4, "f509726", 2.699725, Status.DISCARD, "strategy: LR_MULT 1.0 -> 0.666667",
                "val_bpb 2.699725 is better than the best 2.727349 by 0.027624, within the noise threshold 0.198")]


def test_the_best_of_a_run_is_its_best_kept_result_in_report_status_and_journal(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "train.py").write_text("X = 1\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "start")
    ledger = Ledger(root / "runs" / "dec1")
    for r in quick_start_rows():
        ledger.append(r)
    data = rep.build(ledger.rows(), ["dec1"])
    assert data["best"]["commit"] == "75a7ff5" and data["best"]["val_bpb"] == 2.727349
    assert data["best"]["command"].startswith("git checkout 75a7ff5 ")
    assert data["top"][0]["commit"] == "f509726" and data["top"][0]["status"] == "discard"  # ranked, not the best
    out = ar("report", "--repo", root, "--json", cwd=root)
    assert json.loads(out.stdout)["best"]["commit"] == "75a7ff5", out.stdout + out.stderr
    table = ar("report", "--repo", root, cwd=root).stdout
    assert "best: 75a7ff5  val_bpb 2.727349" in table and "git checkout 75a7ff5" in table, table
    status = json.loads(ar("status", "--repo", root, "--json", cwd=root).stdout)
    assert status["best"]["commit"] == "75a7ff5"
    j = memory.build(ledger.rows(), tag="dec1", source="t", noise=0.198, noise_source="t")
    assert j.best.commit == "75a7ff5"


def test_small_token_counts_survive_results_tsv(tmp_path):
    ledger = Ledger(tmp_path / "t")
    ledger.append(quick_start_rows()[3])                     # 9 steps of 4,096 tokens
    (row,) = ledger.rows()
    assert row.total_tokens_M == pytest.approx(0.036864)
    assert rep._tokens(rep.experiment(row, 1)) == "36.9K"


def test_status_reports_the_calibrated_noise_and_a_sweeps_own_budgets(tmp_path, prepared_cache):
    from autoresearch.session import Loop
    from autoresearch.views.status import read_status
    from test_loop import cfg, make_repo

    root = make_repo(tmp_path, SEED_NOISE=0.01)
    Loop(cfg(), root, "t", None, calibrate_noise=2).run(max_experiments=2)
    calibrated = json.loads((root / "runs" / "t" / "noise.json").read_text())["noise"]
    assert calibrated != 0.002
    st = read_status(root)["status"]
    assert st["noise"] == pytest.approx(calibrated), st
    with Loop(cfg(), root, "s", None, baseline=False, command="ar sweep s.yaml") as lp:
        lp.enqueue_knobs({"LR_MULT": 2.0}, time_budget=0.3, description="sweep s: LR_MULT=2.0")
        lp.run()
    got = read_status(root)
    assert got["tag"] == "s" and got["status"]["budget"] is None and got["budgets"] == [0.3], got


BOX = set("─│┃━┏┓┗┛╭╮╰╯┌┐└┘├┤┬┴┼")


def test_help_and_a_sweeps_plan_into_a_pipe_are_plain_lines(tmp_path):
    from test_loop import make_repo

    r = ar("run", "--help", cwd=tmp_path)
    assert r.returncode == 0 and not BOX & set(r.stdout), r.stdout
    assert "--max-consecutive-crashes" in r.stdout and "autoresearch-ar[ray]" in r.stdout
    assert max(map(len, r.stdout.splitlines())) > 100                     # not wrapped at 80 columns
    root = make_repo(tmp_path)
    (root / "s.yaml").write_text("name: lr\nprofile: cpu\naxes: {LR_MULT: [1.0, 2.0]}\n")
    r = ar("sweep", "s.yaml", "--dry-run", cwd=root)
    assert r.returncode == 0, r.stderr
    assert not BOX & set(r.stdout), r.stdout
    assert "plan (listed)" in r.stdout and "#\tstate\tbudget\tpoint" in r.stdout


def test_flags_in_rich_help_take_no_value(tmp_path):
    import os
    import re
    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "150"}          # Rich's help, as on a terminal
    r = subprocess.run([sys.executable, "-m", "autoresearch", "run", "-h"], cwd=tmp_path, capture_output=True,
                       text=True, env=env, timeout=60)
    text = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout)
    lines = {ln.split()[1]: ln for ln in text.splitlines() if ln.startswith("│ --")}
    assert "<bool>" not in lines["--unsandboxed"] and "<bool>" not in lines["--help"], text
    assert "<path>" in lines["--repo"] and "autoresearch-ar[ray]" in text


def test_every_pip_install_of_an_extra_names_the_package():
    import re
    import tomllib
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "configs").glob("*.yaml"),
             *(ROOT / "autoresearch").rglob("*.py")]
    found = {(p.name, m) for p in texts
             for m in re.findall(r"pip install\s+(?:-e\s+)?[\"']?([A-Za-z0-9_.-]+)\\{0,2}\[", p.read_text())}
    assert found and all(m in (name, ".") for _, m in found), sorted(found)


def test_a_users_commit_on_the_branch_runs_as_a_proposal_and_is_never_reset_over(tmp_path, prepared_cache):
    from autoresearch.gitops import GitRepo
    from autoresearch.knobs import set_knobs
    from autoresearch.ledger import read_results
    from autoresearch.session import Loop
    from test_loop import cfg, make_repo

    root = make_repo(tmp_path)
    Loop(cfg(noise=0.002), root, "t", None).run()                         # the baseline, kept
    set_knobs(root / "train.py", {"TOTAL_BATCH_SIZE": 2**18})             # the user's hand edit, committed
    git(root, "commit", "-qam", "my batch size")
    mine = GitRepo(root).head_sha()
    said = []
    s = Loop(cfg(noise=0.002), root, "t", None, on_event=lambda e: said.append(e.message)).run()
    rows = read_results(s.results)
    assert len(rows) == 2 and rows[-1].commit == mine[:7], rows
    assert rows[-1].description == "your commit %s: my batch size" % mine[:7] and rows[-1].val_bpb is not None
    assert rows[-1].status is Status.KEEP and rows[-1].parent == rows[0].commit   # 2**18 is nearer the bowl's floor
    assert GitRepo(root).head_sha() == mine                                # kept: the branch holds it
    assert any("your commit" in m and "runs as experiment 0002" in m for m in said), said
    assert not any("restored to the best kept commit" in m for m in said), said


def test_a_users_commit_that_loses_stays_reachable_and_one_outside_scope_is_refused(tmp_path, prepared_cache):
    from autoresearch.errors import GitError
    from autoresearch.gitops import GitRepo
    from autoresearch.knobs import set_knobs
    from autoresearch.ledger import read_results
    from autoresearch.session import Loop
    from test_loop import cfg, make_repo

    root = make_repo(tmp_path)
    Loop(cfg(noise=0.002), root, "t", None).run()
    best = GitRepo(root).head_sha()
    set_knobs(root / "train.py", {"LR_MULT": 3.0})                        # worse
    git(root, "commit", "-qam", "a big learning rate")
    mine = GitRepo(root).head_sha()
    s = Loop(cfg(noise=0.002), root, "t", None).run()
    row = read_results(s.results)[-1]
    assert row.commit == mine[:7] and row.status is Status.DISCARD
    assert GitRepo(root).head_sha() == best
    assert git(root, "rev-parse", "refs/ar/t/0002") == mine               # measured, recorded, still reachable
    (root / "program.md").write_text("# my own program\n")
    git(root, "commit", "-qam", "my program")
    theirs = GitRepo(root).head_sha()
    with pytest.raises(GitError, match=r"changes program.md.*git branch my-work"):
        Loop(cfg(noise=0.002), root, "t", None).run()
    assert GitRepo(root).head_sha() == theirs                             # refused, not reset over


def test_ar_try_scores_the_working_tree_against_the_best_and_commits_nothing(tmp_path, prepared_cache, monkeypatch):
    from autoresearch.gitops import GitRepo
    from autoresearch.knobs import set_knobs
    from autoresearch.ledger import read_results
    from autoresearch.session import Loop
    from test_loop import cfg, make_repo

    for var in ("AR_PROFILE", "AR_TIME_BUDGET", "AR_SEED", "AR_DATASET", "AR_TOK_DIR", "AR_CHECKPOINT_DIR"):
        monkeypatch.delenv(var, raising=False)
    root = make_repo(tmp_path)
    Loop(cfg(noise=0.002), root, "t", None).run()                          # the tag's best: the baseline
    head, results = GitRepo(root).head_sha(), (root / "runs" / "t" / "results.tsv").read_bytes()
    set_knobs(root / "train.py", {"TOTAL_BATCH_SIZE": 2**18})              # a hand edit, not committed
    edited = (root / "train.py").read_text()
    r = ar("try", cwd=root)
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


def test_a_hand_run_of_train_py_says_how_to_score_it_and_ar_eval_scores_its_checkpoint(tmp_path, prepared_cache,
                                                                                      monkeypatch):
    import os
    import shutil
    from autoresearch.session import Loop
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
    r = ar("eval", "checkpoint", cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    first, best = r.stdout.splitlines()[-3:-1]
    assert first.startswith("eval 0001, checkpoint ") and " val_bpb " in first and "not decided" in first, r.stdout
    assert best.startswith("tag t: best ")
    missing = ar("eval", "nowhere", cwd=root)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "is not a checkpoint" in missing.stderr


# ------------------------------------------------------------------------------ two knob values, one model

def test_the_strategy_proposer_does_not_shrink_a_size_the_profile_built_at_one():
    from autoresearch.harness.env import PROFILES
    from autoresearch.proposers import Context
    from autoresearch.proposers.search import StrategyProposer

    knobs = {"DEPTH": 7, "LR_MULT": 1.0, "TOTAL_BATCH_SIZE": 2**19}

    def ctx(built):
        return Context(root=Path("/tmp"), train_file="train.py", knobs=knobs, best=None, rows=[], exp_id=1,
                       exp_dir=Path("/tmp/exp"), tag="t", profile=PROFILES["cpu"], time_budget=20.0,
                       eval_tokens=2**15, noise=0.002, built=built)

    moves = StrategyProposer().candidates(ctx({"depth": 1, "width": 64}))   # CPU: DEPTH 7 builds depth 1
    assert ("DEPTH", 6) not in moves and ("DEPTH", 8) in moves
    assert ("DEPTH", 6) in StrategyProposer().candidates(ctx({"depth": 2}))
    assert ("DEPTH", 6) in StrategyProposer().candidates(ctx(None))         # nothing known of the build


def test_same_build_compares_the_checkpoints_config_and_the_knobs_it_does_not_explain(tmp_path):
    from autoresearch.repeats import same_build

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "model.json").write_text(json.dumps({"format": 1, "factory": "f", "config": {"depth": 1, "width": 64}}))
    why = same_build(a, {"DEPTH": 7, "LR_MULT": 1.0}, b, {"DEPTH": 6, "LR_MULT": 1.0})
    assert why and "same model" in why and "depth 1" in why and "DEPTH" in why
    assert same_build(a, {"DEPTH": 7, "LR_MULT": 1.0}, b, {"DEPTH": 7, "LR_MULT": 2.0}) is None  # trains otherwise
    (b / "model.json").write_text(json.dumps({"format": 1, "factory": "f", "config": {"depth": 2, "width": 128}}))
    assert same_build(a, {"DEPTH": 7}, b, {"DEPTH": 8}) is None
    assert same_build(a, {"DEPTH": 7}, tmp_path / "nowhere", {"DEPTH": 6}) is None


def test_a_win_that_built_the_same_model_as_the_best_is_not_kept(tmp_path, prepared_cache):
    from autoresearch.ledger import read_results
    from autoresearch.session import Loop
    from test_loop import cfg, make_repo

    root = make_repo(tmp_path, DEPTH=7)
    text = (root / "train.py").read_text()
    for old, new in (("return b + 0.01 * (DEPTH - 8) ** 2", "return b + 0.05 * DEPTH"),   # a lower DEPTH "wins"
                     ('config = {"vocab": vocab,', 'config = {"depth": max(1, DEPTH - 6), "vocab": vocab,')):
        assert old in text
        text = text.replace(old, new)
    (root / "train.py").write_text(text)
    git(root, "commit", "-qam", "a stand-in whose DEPTH 7 and 6 build one model")
    with Loop(cfg(noise=0.002), root, "t", None) as lp:
        lp.enqueue_knobs({"DEPTH": 6})
        lp.run()
    base, six = read_results(root / "runs" / "t" / "results.tsv")
    assert six.val_bpb < base.val_bpb - 0.05                                   # a "win" by the numbers
    assert six.status is Status.DISCARD and "builds the same model as the best" in six.reason, six.reason
    assert (root / "runs" / "t" / f"0002-{six.commit}" / "model.json").is_file()   # what was built, recorded


def test_a_win_at_a_very_different_throughput_with_the_same_model_is_confirmed_first(tmp_path, prepared_cache):
    from autoresearch.ledger import read_results
    from autoresearch.session import Loop
    from test_loop import cfg, make_repo

    root = make_repo(tmp_path)
    with Loop(cfg(noise=0.002), root, "t", None) as lp:
        lp.enqueue_knobs({"TOTAL_BATCH_SIZE": 2**18, "TOKENS_PER_S": 300000})   # better, and 3x the speed
        lp.enqueue_knobs({"LR_MULT": 1.5})                                      # worse: no confirmation
        lp.run()
    base, fast, lr = read_results(root / "runs" / "t" / "results.tsv")
    assert fast.status is Status.KEEP, fast.reason
    assert "ran at 3.0x its tokens/s, so confirmed by a re-run with seed 43" in fast.reason, fast.reason
    assert (root / "runs" / "t" / f"0002-{fast.commit}" / "train-confirm.log").is_file()
    assert lr.status is Status.DISCARD and not list((root / "runs" / "t").glob("0003-*/train-confirm.log"))


# ------------------------------------------------------------------------------------------------ friction

def test_a_refused_run_or_sweep_says_nothing_before_the_lock_error(tmp_path, prepared_cache):
    from test_first_hour import holding_the_lock
    from test_loop import make_repo

    root = make_repo(tmp_path)
    (root / "s.yaml").write_text("name: lr\nprofile: cpu\naxes: {LR_MULT: [1.0, 2.0]}\n")
    with holding_the_lock(root):
        for args in (("run", "--tag", "other"), ("sweep", "s.yaml"), ("try",)):
            r = ar(*args, cwd=root)
            assert r.returncode == 3 and r.stdout == "", (args, r.stdout)
            assert r.stderr.startswith("error: ar is already running here") and r.stderr.count("\n") == 1, r.stderr
    assert not (root / "runs" / "other").exists()


def test_outside_a_repository_one_message_says_all_the_way(tmp_path):
    (tmp_path / "train.py").write_text("DEPTH = 1\n")
    r = ar("run", cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "`ar init DIR`" in r.stderr and "git init && git add train.py && git commit -m baseline" in r.stderr


def test_with_no_git_identity_the_dirty_tree_advice_works(tmp_path, prepared_cache):
    import os
    from test_loop import make_repo

    root = make_repo(tmp_path)                                  # committed with -c user.*: no identity stored
    (root / "train.py").write_text((root / "train.py").read_text() + "\n# my edit\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(HOME=str(tmp_path), GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    r = subprocess.run([sys.executable, "-m", "autoresearch", "run"], cwd=root, capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 1 and "uncommitted changes (train.py)" in r.stderr, r.stderr
    assert "git -c user.name=you -c user.email=you@example.com commit -am" in r.stderr and "ar try" in r.stderr


def test_a_mistyped_config_key_gets_a_suggestion_and_the_run_limits_are_keys(tmp_path, prepared_cache):
    from autoresearch.config import load_config
    from autoresearch.errors import ConfigError
    from autoresearch.ledger import read_results
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
    r = ar("run", "--tag", "t", "--config", tmp_path / "run.yaml", cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stopped: reached --max-experiments 1" in r.stdout
    assert len(read_results(root / "runs" / "t" / "results.tsv")) == 1
    lines = r.stdout.splitlines()
    assert sum("results in runs/t/" in ln for ln in lines) == 1, r.stdout     # the tag named once
    assert any(ln.startswith("branch autoresearch/t starts at ") for ln in lines), r.stdout
    st = json.loads(ar("status", "--tag", "t", "--json", cwd=root).stdout)
    assert st["tag"] == "t" and st["counts"] == {"keep": 1}
    missing = ar("status", "--tag", "nope", cwd=root)
    assert missing.returncode == 1 and "no tag 'nope'" in missing.stderr and "tags: t" in missing.stderr


def test_the_progress_plot_shows_the_noise_threshold():
    import matplotlib.pyplot as plt
    from autoresearch.views import plots

    fig = plots.progress_figure(quick_start_rows(), noise=0.198)
    try:
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert "noise threshold (0.198): a win clears it" in labels, labels
    finally:
        plt.close(fig)
