"""Which tag a run takes and what it says first: today's tag resumes only when its results compare; another
budget or dataset starts today-2 instead of mixing; an `ar run` beside a running loop is refused before it
prepares any data."""

from __future__ import annotations

import subprocess
import sys
import time

from autoresearch.gitops import default_tag
from autoresearch.session import Loop

from test_first_hour import holding_the_lock
from test_loop import cfg, make_repo


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
