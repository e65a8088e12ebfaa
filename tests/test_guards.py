"""guards.py: the scope of a proposal and the content of train.py."""

import subprocess
from pathlib import Path

import pytest

from autoresearch.trust import guards
from autoresearch.gitops import GitRepo

ROOT = Path(__file__).resolve().parents[1]


def sh(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "train.py").write_text("DEPTH = 8\nprint(DEPTH)\n")
    (root / "prepare.py").write_text("EVAL_TOKENS = 100\n")
    (root / "program.md").write_text("# program\n")
    sh(root, "init", "-q")
    sh(root, "add", "-A")
    sh(root, "commit", "-qm", "start")
    g = GitRepo(root)
    g.ensure_ignored()
    tag_dir = root / "runs" / "t"
    tag_dir.mkdir(parents=True)
    (tag_dir / "results.tsv").write_text("header\nrow1\n")
    (tag_dir / "0001-abcdef0").mkdir()
    (tag_dir / "0001-abcdef0" / "train.log").write_text("log\n")
    (root / "notes.txt").write_text("the user's untracked file\n")
    return g, tag_dir


def check(g, tag_dir, snap):
    return guards.check_scope(g, snap, ["train.py"], tag_dir, exclude_prefix="0002-none/")


@pytest.mark.integration
def test_only_train_py_changed_passes(repo):
    g, tag_dir = repo
    snap = guards.snapshot(g, g.head_sha(), tag_dir)
    (g.root / "train.py").write_text("DEPTH = 9\nprint(DEPTH)\n")
    (tag_dir / "0002-none").mkdir()
    (tag_dir / "0002-none" / "agent.log").write_text("the proposer's own log is fine\n")
    assert check(g, tag_dir, snap) == (["train.py"], None)


@pytest.mark.integration
@pytest.mark.parametrize("edit, expect", [
    (lambda r: (r / "prepare.py").write_text("EVAL_TOKENS = 1\n"), "prepare.py"),
    (lambda r: (r / "program.md").unlink(), "program.md"),
    (lambda r: (r / "helper.py").write_text("x = 1\n"), "helper.py"),
    (lambda r: (r / "notes.txt").write_text("changed\n"), "notes.txt"),
    (lambda r: (r / ".git/hooks/post-commit").write_text("#!/bin/sh\n"), ".git/hooks/post-commit"),
    (lambda r: (r / ".git/config").write_text("[core]\n"), ".git/config"),
    (lambda r: (r / "runs/t/results.tsv").unlink(), "results.tsv under runs/"),
    (lambda r: (r / "runs/t/0001-abcdef0/train.log").write_text(""), "0001-abcdef0/train.log"),
])
def test_anything_else_is_rejected_and_restored(repo, edit, expect):
    g, tag_dir = repo
    snap = guards.snapshot(g, g.head_sha(), tag_dir)
    (g.root / "train.py").write_text("DEPTH = 9\nprint(DEPTH)\n")
    edit(g.root)
    _, reason = check(g, tag_dir, snap)
    assert reason and expect in reason
    guards.restore(g, snap, tag_dir)
    assert (g.root / "train.py").read_text() == "DEPTH = 8\nprint(DEPTH)\n"
    assert (g.root / "prepare.py").read_text() == "EVAL_TOKENS = 100\n"
    assert (g.root / "program.md").exists() and not (g.root / "helper.py").exists()
    assert (tag_dir / "results.tsv").read_text() == "header\nrow1\n"
    assert not (g.root / ".git/hooks/post-commit").exists()
    assert (g.root / "notes.txt").exists()                       # the user's untracked file stays
    assert g.dirty_paths() == []


@pytest.mark.integration
def test_a_commit_made_by_the_agent_is_rejected_and_undone(repo):
    g, tag_dir = repo
    start = g.head_sha()
    snap = guards.snapshot(g, start, tag_dir)
    (g.root / "train.py").write_text("DEPTH = 9\nprint(DEPTH)\n")
    sh(g.root, "commit", "-qam", "agent commits itself")
    _, reason = check(g, tag_dir, snap)
    assert reason and ".git/" in reason
    guards.restore(g, snap, tag_dir)
    assert g.head_sha() == start


@pytest.mark.parametrize("src, expect", [
    ("def broken(:\n", "does not parse"),
    ("import os\nB = os.environ['AR_TIME_BUDGET']\n", "AR_TIME_BUDGET"),
    ("import os\nos.environ['AR_SEED'] = '1'\n", "AR_SEED"),
    ("import os\nk = 'X'\nos.environ[k] = '1'\n", "computed key"),
    ("import os\nos.environ.update(A='1')\n", "update"),
    ("import os\nos.putenv('A', '1')\n", "putenv"),
    ("env = 1\nenv.time_budget = 600\n", ".time_budget"),
    ("import dataclasses\nenv = dataclasses.replace(env, time_budget=600)\n", "time_budget"),
    ("p = env.result_file\n", "result_file"),
    ("object.__setattr__(env, 'seed', 1)\n", "__setattr__"),
])
def test_content_checks(src, expect):
    reason = guards.check_source(src)
    assert reason and expect in reason


def test_legitimate_sources_pass():
    assert guards.check_source("import os\nos.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'\n") is None
    assert guards.check_source("torch.manual_seed(env.seed)\nbudget = env.time_budget\n") is None


def test_checks_are_relative_to_the_parent():
    parent = "v = evaluate(model, record_path=env.result_file)\n"
    assert guards.check_source(parent + "x = 1\n", parent_text=parent) is None
    reason = guards.check_source(parent + "open(env.result_file, 'w')\n", parent_text=parent)
    assert reason and "line 2" in reason


def test_the_shipped_train_py_passes_against_itself():
    text = (ROOT / "train.py").read_text()
    assert guards.check_source(text, parent_text=text) is None


def test_a_derived_views_temporary_file_is_not_the_proposals_change(tmp_path):
    # ar rewrites its views (journal.md through .journal.md.<pid>.<thread>.tmp) and appends to events.jsonl while
    # a slot's proposal runs; seeing them must not reject the proposal. A proposal's own file still counts.
    tag = tmp_path / "t"
    tag.mkdir()
    (tag / "results.tsv").write_text("x\n")
    before = guards._runs_files(tag)
    (tag / ".journal.md.123.456.tmp").write_text("#")
    (tag / "journal.md").write_text("#")
    (tag / "events.jsonl").write_text("{}\n")
    (tag / ".events.jsonl.123.456.tmp").write_text("{}\n")       # the event stream compacted, mid-rename
    assert guards._runs_files(tag) == before
    (tag / ".results.tsv.1.2.tmp").write_text("forged")
    assert ".results.tsv.1.2.tmp" in guards._runs_files(tag)
