"""Regression tests for the first hour, third round (issue 30): a tag pinned to the data it was scored on and a
split key that outlives the cache; experiments cut off by a stop (or failed outside the proposal) run again; one
tag rule for every command; a sweep refused before its plan; `ar eval`'s hint; bare `ar` into a pipe; `ar
report --all`'s numbers and order; a baseline never given up; the friction list."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from autoresearch.harness import data
from autoresearch.ledger import Status, read_results

ROOT = Path(__file__).resolve().parent.parent


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def ar(*args, cwd, timeout=180, env=None):
    return subprocess.run([sys.executable, "-m", "autoresearch", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    for var in ("AR_PROFILE", "AR_TIME_BUDGET", "AR_SEED", "AR_DATASET", "AR_TOK_DIR", "AR_CHECKPOINT_DIR"):
        monkeypatch.delenv(var, raising=False)


def small_text(folder: Path, n: int = 60, start: int = 0) -> Path:
    """n short documents of real text (a few hundred characters each): a dataset that prepares in a second."""
    import sysconfig
    folder.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pieces = [p for f in sorted(stdlib.glob("*.py"))[:40] for p in data.split_long(f.read_text(errors="replace"), 600)]
    for i, piece in enumerate(pieces[start:start + n]):
        (folder / f"doc_{i:04d}.txt").write_text(piece)
    return folder


# ------------------------------------------------------------------ 1. the split key and the tag's data

def test_the_split_key_lives_outside_the_cache_so_a_rebuilt_cache_splits_the_same(tmp_path, monkeypatch):
    secret = tmp_path / "state" / "secret"
    monkeypatch.setenv("AR_SECRET_DIR", str(secret))
    text = small_text(tmp_path / "text")
    cache = tmp_path / "cache"
    first = data.load_meta(data.prepare("files", cache=cache, vocab_size=300, path=text))
    key = secret / "split.key"
    assert key.is_file() and key.stat().st_mode & 0o077 == 0 and len(key.read_text().strip()) == 64
    assert not (cache / ".secret").exists()                              # not in the cache any more
    tok = data.tokenized_dir(data.dataset_dir(cache, "files"), 300)
    assert str(secret) in data.hidden_sources(tok)                       # the sandboxes hide it
    shutil.rmtree(cache)                                                 # rm -rf ~/.cache/autoresearch
    again = data.load_meta(data.prepare("files", cache=cache, vocab_size=300, path=text))
    assert again["val"] == first["val"] and again["raw_sha256"] == first["raw_sha256"]
    # a cache that holds a key of its own (an older ar's, or the tests' empty one) keeps splitting by it
    (tmp_path / "old" / ".secret").mkdir(parents=True)
    (tmp_path / "old" / ".secret" / "split.key").write_text("")
    assert data.split_key(tmp_path / "old") == b"" and data.split_key(cache) == bytes.fromhex(key.read_text())


def test_a_tag_refuses_to_go_on_with_data_other_than_it_was_scored_on(tmp_path, prepared_cache):
    from autoresearch.session import Loop
    from test_loop import cfg, make_repo, write_cfg

    root = make_repo(tmp_path)
    Loop(cfg(noise=0.002), root, "t", None).run(max_experiments=1)
    pinned = json.loads((root / "runs" / "t" / "data.json").read_text())   # recorded with the first result
    tiny = data.load_meta(data.check_prepared(prepared_cache, "builtin", 2048))
    assert pinned["dataset"] == tiny["dataset"] and pinned["val"] == tiny["val"], pinned
    # the cache deleted and prepared again with another key: another validation split
    (prepared_cache / "builtin").unlink()
    (prepared_cache / ".secret").mkdir()
    (prepared_cache / ".secret" / "split.key").write_text("ab" * 32)
    data.prepare("files", cache=prepared_cache, vocab_size=2048, name="builtin", path=small_text(tmp_path / "t"))
    results = (root / "runs" / "t" / "results.tsv").read_bytes()
    conf = write_cfg(tmp_path, time_budget=0.5)
    for args in (("run", "--tag", "t", "--max-experiments", "1"), ("try", "--tag", "t")):
        r = ar(*args, "--config", conf, cwd=root)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, (args, r.stderr)
        assert "tag t was scored on" in r.stderr and "--tag" in r.stderr and "split key" in r.stderr, r.stderr
        assert f"{pinned['val']['docs']} validation documents" in r.stderr, r.stderr
    assert (root / "runs" / "t" / "results.tsv").read_bytes() == results        # nothing ran, nothing recorded
    r = ar("run", "--tag", "fresh", "--config", conf, "--max-experiments", "1", cwd=root)   # the way forward
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------ 2. what runs again; 9. the baseline

def _on_step_of(exp_id: int, act):
    """An on_event that calls act() once, at the first training step of experiment exp_id."""
    done: list[bool] = []

    def on_event(e):
        if e.kind == "step" and e.spec is not None and e.spec.id == exp_id and not done:
            done.append(True)
            act()
    return on_event


def test_a_run_whose_data_changed_under_it_runs_again_at_the_next_session(tmp_path, tiny_dataset, monkeypatch):
    """Item 2, the data's case: the training data changes while experiment 2 trains (a file touched: the fingerprint
    holds size, times and inode), so the run is a crash and the session halts; it is not the proposal's doing, so
    the next `ar run` runs that proposal again, once."""
    from autoresearch.session import Loop
    from test_loop import assert_consistent, cfg, make_repo
    cache = tmp_path / "cache"              # a copy of the shared dataset: this test changes it
    cache.mkdir()
    shutil.copytree(tiny_dataset.cache / tiny_dataset.name, cache / "builtin")
    monkeypatch.setenv("AR_CACHE", str(cache))
    train_bin = cache / "builtin" / tiny_dataset.tok_dir.relative_to(tiny_dataset.cache / tiny_dataset.name) / "train.bin"
    root = make_repo(tmp_path)
    said: list[str] = []
    hook = _on_step_of(2, lambda: os.utime(train_bin))
    with Loop(cfg(noise=0.002), root, "t", None, on_event=lambda e: (said.append(e.message), hook(e))) as lp:
        lp.enqueue_knobs({"LR_MULT": 1.5})
        first = lp.run()
    rows = assert_consistent(root)
    assert [r.status for r in rows] == [Status.KEEP, Status.CRASH] and first.failed, [r.reason for r in rows]
    assert "training data" in rows[1].reason and "changed" in rows[1].reason, rows[1].reason
    assert any("0002" in m and "outside the proposal" in m and "runs again as experiment 0003" in m
               for m in said), said
    with Loop(cfg(noise=0.002), root, "t", None) as lp:     # the next session: its own fingerprint of the data
        lp.run()
    rows = assert_consistent(root)
    assert len(rows) == 3 and rows[2].knobs["LR_MULT"] == 1.5 and rows[2].status is not Status.CRASH, rows
    assert "again: 0002" in rows[2].description, rows[2].description


def test_an_experiment_cut_off_by_a_stop_runs_again_once_at_the_next_session(tmp_path, prepared_cache):
    from autoresearch.proposers.search import StrategyProposer
    from autoresearch.session import Loop
    from test_loop import assert_consistent, cfg, make_repo

    root = make_repo(tmp_path)
    c = cfg(noise=0.002)
    said: list[str] = []
    stop = lambda sig: _on_step_of(2, lambda: os.kill(os.getpid(), sig))   # noqa: E731  Ctrl-C, then SIGTERM
    s = Loop(c, root, "t", StrategyProposer(), on_event=lambda e: (said.append(e.message),
                                                                    stop(signal.SIGINT)(e))).run(max_experiments=4)
    assert s.interrupted
    rows = read_results(s.results)
    assert [r.status for r in rows] == [Status.KEEP, Status.INTERRUPTED], rows
    cut = rows[1]
    assert any("experiment 0002" in m and "runs again" in m for m in said), said
    said.clear()
    hook = _on_step_of(3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    s = Loop(c, root, "t", StrategyProposer(), on_event=lambda e: (said.append(e.message), hook(e))).run(
        max_experiments=1)                                                            # the same commit again ...
    again = read_results(s.results)[2]
    assert again.commit == cut.commit and again.status is Status.INTERRUPTED, again   # ... cut off once more
    assert any("experiment 0003 (the re-run of 0002)" in m and "not run again" in m for m in said), said
    s = Loop(c, root, "t", StrategyProposer()).run(max_experiments=1)
    rows = assert_consistent(root)
    assert len(rows) == 4 and rows[3].commit != cut.commit and rows[3].status in (Status.KEEP, Status.DISCARD), rows


def test_a_crash_outside_the_proposal_runs_again_once(tmp_path, prepared_cache):
    import psutil
    from autoresearch.session import Loop
    from test_loop import assert_consistent, cfg, make_repo

    def kill_the_evaluator():
        for p in psutil.Process().children(recursive=True):
            try:
                if "autoresearch.harness.evaluator" in " ".join(p.cmdline()):
                    os.killpg(p.pid, signal.SIGKILL)
            except (psutil.Error, OSError):
                pass

    root = make_repo(tmp_path)
    said: list[str] = []
    hook = _on_step_of(2, kill_the_evaluator)
    with Loop(cfg(noise=0.002), root, "t", None, on_event=lambda e: (said.append(e.message), hook(e))) as lp:
        lp.enqueue_knobs({"LR_MULT": 1.5})
        lp.run()
    rows = assert_consistent(root)
    assert [r.status for r in rows[:2]] == [Status.KEEP, Status.CRASH], rows
    assert "evaluation failed" in rows[1].reason, rows[1].reason
    assert len(rows) == 3 and rows[2].knobs["LR_MULT"] == 1.5 and rows[2].status is Status.DISCARD, rows
    assert any("0002" in m and "outside the proposal" in m and "runs again as experiment 0003" in m
               for m in said), said
    # a proposal's own crash is not run again
    with Loop(cfg(noise=0.002), root, "t", None) as lp:
        lp.enqueue_knobs({"FAIL_MODE": "crash"})
        lp.run()
    rows = assert_consistent(root)
    assert len(rows) == 4 and rows[3].status is Status.CRASH, rows


def test_the_baseline_is_never_given_up(tmp_path, prepared_cache):
    """kill -9 during the baseline, again and again: the next session runs it again, never a proposal in its
    place (which would be `first result: … is the baseline`)."""
    from autoresearch.proposers.search import StrategyProposer
    from autoresearch.queue import ExperimentQueue
    from autoresearch.session import MAX_STARTS, Loop
    from test_loop import assert_consistent, cfg, make_repo

    root = make_repo(tmp_path)
    q = ExperimentQueue(root / "runs" / "t" / "queue.jsonl")
    spec = q.add("baseline", {})
    for _ in range(MAX_STARTS):                         # started, and ar killed with it, MAX_STARTS times
        q.start(spec.id)
    said: list[str] = []
    s = Loop(cfg(noise=0.002), root, "t", StrategyProposer(), on_event=lambda e: said.append(e.message)).run(
        max_experiments=2)
    rows = assert_consistent(root)
    assert len(rows) == 2 and rows[0].status is Status.KEEP, rows
    assert rows[0].description == "baseline" and rows[0].exp_id == spec.id, rows
    assert "first result" not in rows[1].reason and not s.failed, rows[1].reason
    assert any("the baseline" in m and "runs again" in m for m in said), said


# ------------------------------------------------------------------ 3. one tag rule for every command

def test_every_command_reads_the_tag_of_the_branch_you_are_on_else_todays_and_says_so(tmp_path, prepared_cache):
    from typer.testing import CliRunner
    from autoresearch.cli import app
    from autoresearch.gitops import default_tag
    from autoresearch.session import Loop
    from test_loop import cfg, make_repo, write_cfg

    root = make_repo(tmp_path)
    today = default_tag()
    Loop(cfg(noise=0.002), root, None, None).run(max_experiments=1)         # today's tag ...
    Loop(cfg(noise=0.002), root, "other", None).run(max_experiments=1)      # ... then a newer one, on its branch

    def read(*args):                                        # in this process: a dozen of them stay quick
        r = CliRunner().invoke(app, [*args, "--repo", str(root)])
        assert r.exit_code == 0, r.output
        return r

    for branch, tag, why in (("master", today, "today's"), (f"autoresearch/{today}", today, "the branch you are on"),
                             ("autoresearch/other", "other", "the branch you are on")):
        git(root, "checkout", "-q", branch)
        docs = [json.loads(read(cmd, "--json").stdout) for cmd in ("report", "status", "journal")]
        assert (docs[0]["tags"], docs[1]["tag"], docs[2]["tag"]) == ([tag], tag, tag), (branch, docs[1]["tag"])
        assert all(d["tag_from"].startswith(why) for d in docs), [d["tag_from"] for d in docs]
        for cmd in ("report", "status", "journal"):         # and says so, on stderr (stdout stays the product)
            r = read(cmd)
            assert r.stderr.startswith(f"tag {tag} ({why}") and f"tag {tag} (" not in r.stdout, (cmd, r.stderr)
    r = ar("try", "--config", write_cfg(tmp_path, time_budget=0.5), cwd=root)    # on autoresearch/other
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tag other (the branch you are on, autoresearch/other)" in r.stdout and "tag other: best" in r.stdout
    said: list[str] = []
    Loop(cfg(noise=0.002), root, None, None, on_event=lambda e: said.append(e.message)).run(max_experiments=1)
    assert said[0].startswith("resuming tag other (1 result"), said               # `ar run` too


# ------------------------------------------------------------------ 5-8: sweep, eval, bare ar, report --all

def test_a_sweep_on_a_dirty_tree_is_refused_before_its_plan_naming_ar_sweep(tmp_path, prepared_cache):
    from test_loop import make_repo

    root = make_repo(tmp_path)
    (root / "s.yaml").write_text("name: lr\nprofile: cpu\naxes: {LR_MULT: [1.0, 2.0]}\n")
    git(root, "add", "s.yaml")
    git(root, "commit", "-qm", "a sweep file")
    (root / "train.py").write_text((root / "train.py").read_text() + "\n# my edit\n")
    r = ar("sweep", "s.yaml", cwd=root)
    assert r.returncode == 1 and r.stdout == "", r.stdout                     # no plan first
    assert r.stderr.count("\n") == 1 and "uncommitted changes (train.py)" in r.stderr, r.stderr
    assert "`ar sweep`" in r.stderr and "ar run" not in r.stderr, r.stderr
    assert not (root / "runs" / "sweep-lr").exists()
    assert ar("sweep", "s.yaml", "--dry-run", cwd=root).returncode == 0       # a plan only: the tree may be dirty


def test_ar_eval_refuses_a_folder_without_weights_before_numbering_and_its_hint_is_true(tmp_path, prepared_cache):
    from autoresearch.session import Loop
    from test_loop import cfg, make_repo

    root = make_repo(tmp_path)
    Loop(cfg(noise=0.002), root, "t", None).run(max_experiments=1)
    (exp,) = [d for d in (root / "runs" / "t").iterdir() if d.name.startswith("0001-")]
    assert (exp / "model.json").is_file()                                     # the built config, no weights
    r = ar("eval", exp, cwd=root)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert "weights.safetensors" in r.stderr and "python train.py" in r.stderr, r.stderr
    assert "pass the folder a run saved" not in r.stderr
    assert not (root / "runs" / "t" / "trials.tsv").exists() and not list((root / "runs" / "t").glob("eval-*"))


def test_bare_ar_prints_the_usage_into_a_pipe_too():
    r = ar(cwd=ROOT)
    assert "Usage:" in r.stdout + r.stderr and " run " in r.stdout + r.stderr, (r.returncode, r.stdout, r.stderr)
    assert r.returncode == 2


def test_report_all_shows_exp_ids_and_tags_oldest_first(tmp_path):
    from autoresearch.ledger import Ledger, Row

    def rows(tag, n):
        return [Row(commit=f"{tag}{i:06d}", val_bpb=3.0 - i / 10, memory_gb=None, status=Status.KEEP,
                    description=f"{tag} {i}", exp_id=i, tag=tag, time_budget=20.0, training_seconds=20.1,
                    total_seconds=31.0, tokens_per_s=4000.0, num_steps=9) for i in range(1, n + 1)]
    for tag, n, created in (("b", 2, "2026-11-30T10:00:00+00:00"), ("a", 3, "2026-12-01T10:00:00+00:00")):
        d = tmp_path / "runs" / tag
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"tag": tag, "created_at": created}))
        for r in rows(tag, n):
            Ledger(d).append(r)
    os.utime(tmp_path / "runs" / "a" / "results.tsv", (1e9, 1e9))             # a's file older: b resumed later
    data = json.loads(ar("report", "--repo", tmp_path, "--all", "--json", cwd=tmp_path).stdout)
    assert data["tags"] == ["b", "a"], data["tags"]
    assert [(e["tag"], e["exp_id"]) for e in data["experiments"]] == [("b", 1), ("b", 2), ("a", 1), ("a", 2),
                                                                       ("a", 3)]
    table = ar("report", "--repo", tmp_path, "--all", cwd=tmp_path).stdout.splitlines()
    header = next(ln for ln in table if ln.startswith("#\t"))
    assert header.split("\t")[:3] == ["#", "tag", "commit"], header
    assert any(ln.startswith("3\ta\ta000003") for ln in table), table            # a's experiment 3, not #5
    # the friction list: the training time in the table (CPU runs have no MFU: no peak FLOPs), times in `best`
    assert "trained" in header.split("\t") and any("\t20.1s\t" in ln for ln in table), header
    assert data["best"]["training_seconds"] == 20.1 and data["best"]["total_seconds"] == 31.0, data["best"]
    assert data["best"]["exp_id"] == 3 and data["best"]["num_steps"] == 9


# ------------------------------------------------------------------ the friction list

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


def test_ar_run_says_when_it_leaves_a_sweeps_branch(tmp_path, prepared_cache):
    from autoresearch.gitops import default_tag
    from autoresearch.session import Loop
    from test_loop import cfg, make_repo

    root = make_repo(tmp_path)
    Loop(cfg(noise=0.002), root, None, None).run(max_experiments=1)            # today's tag
    git(root, "checkout", "-q", "-b", "autoresearch/sweep-lr", "master")      # as `ar sweep` leaves the repo
    said: list[str] = []
    lp = Loop(cfg(noise=0.002), root, None, None, on_event=lambda e: said.append(e.message))
    lp.run(max_experiments=1)
    assert lp.tag == default_tag(), lp.tag                                    # not the sweep's tag
    assert any(f"switched from branch autoresearch/sweep-lr to autoresearch/{default_tag()}" in m for m in said), said
    assert git(root, "branch", "--show-current") == f"autoresearch/{default_tag()}"
