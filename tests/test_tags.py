"""Which tag a command works on and what it says first: today's tag resumes only when its results compare;
another budget or dataset starts today-2 instead of mixing, and a named tag resumed with other settings is
refused; every command reads the tag of the branch you are on (else today's) and says so, and `ar run` says
when it leaves a sweep's branch; a tag is pinned to the data it was scored on; an `ar run` beside a running
loop is refused before it prepares any data."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from autoresearch.errors import ConfigError
from autoresearch.gitops import default_tag
from autoresearch.harness import data
from autoresearch.session.loop import Loop

from test_data import small_text
from test_lock import holding_the_lock
from test_loop import cfg, make_repo, no_ar_settings  # noqa: F401  (no_ar_settings: a fixture, asked for by name)
from fixtures.cli import git, run_ar as ar

pytestmark = pytest.mark.e2e


def _first_line(root, **kw) -> tuple[str, Loop]:
    said = []
    lp = Loop(cfg(noise=0.002, **kw), root, None, None, on_event=lambda e: said.append(e.message))
    lp.run(max_experiments=1)
    return said[0], lp


def test_the_default_tag_resumes_only_runs_that_compare_and_says_so_first(tmp_path, prepared_cache):
    root = make_repo(tmp_path)
    today = default_tag()
    first, lp = _first_line(root)
    assert lp.tag == today and first.startswith(f"new tag {today}: branch autoresearch/{today}"), first
    first, lp = _first_line(root, time_budget=0.7)            # another budget: not comparable, a fresh tag
    assert lp.tag == f"{today}-2", first
    assert first.startswith(f"new tag {today}-2 (tag {today} was run with time_budget 0.5, this run asks for "
                            "0.7: a fresh tag)"), first
    first, lp = _first_line(root)                             # the first settings again: today's tag resumes
    assert lp.tag == today and first == f"resuming tag {today} (1 result; branch autoresearch/{today})", first
    first, lp = _first_line(root, time_budget=0.7)
    assert lp.tag == f"{today}-2" and first.startswith(f"resuming tag {today}-2 (1 result;"), first


def test_resuming_a_tag_with_other_settings_is_refused(tmp_path, prepared_cache):
    root = make_repo(tmp_path)
    Loop(cfg(noise=0.002), root, "t", None).run()
    with pytest.raises(ConfigError, match="time_budget.*not comparable"):
        Loop(cfg(noise=0.002, time_budget=2.0), root, "t", None).run()
    (prepared_cache / "other").symlink_to((prepared_cache / "builtin").resolve(), target_is_directory=True)
    with pytest.raises(ConfigError, match="dataset.*not comparable"):
        Loop(cfg(noise=0.002, dataset="other"), root, "t", None).run()


def test_run_beside_a_running_loop_is_refused_before_preparing_data(tmp_path, isolated_cache):
    root = make_repo(tmp_path)
    with holding_the_lock(root):
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "autoresearch", "run"], cwd=root,
                           capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 3 and "already running" in out and "Traceback" not in out, out
    assert "preparing" not in out and not any(isolated_cache.glob("**/*.bin")), out   # no data was made
    assert took < 30, took


@pytest.mark.usefixtures("no_ar_settings")
def test_every_command_reads_the_tag_of_the_branch_you_are_on_else_todays_and_says_so(tmp_path, prepared_cache):
    from typer.testing import CliRunner
    from autoresearch.cli import app
    from autoresearch.gitops import default_tag
    from autoresearch.session.loop import Loop
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


@pytest.mark.usefixtures("no_ar_settings")
def test_ar_run_says_when_it_leaves_a_sweeps_branch(tmp_path, prepared_cache):
    from autoresearch.gitops import default_tag
    from autoresearch.session.loop import Loop
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


@pytest.mark.usefixtures("no_ar_settings")
def test_a_tag_refuses_to_go_on_with_data_other_than_it_was_scored_on(tmp_path, prepared_cache):
    from autoresearch.session.loop import Loop
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
