"""The suite's three tiers, and the guard that keeps a test in its tier (a pytest plugin, loaded by conftest.py).

- fast (no marker): pure rules and in-process code. It starts no process and never sleeps; `pytest -m fast`
  runs only these, in well under a minute.
- `integration`: real processes, but no ar session: git, a server, one subprocess, a real `train.py` run.
- `e2e`: a real ar session (the Loop in this process, or `ar run`/`ar sweep`/`ar try`/`ar eval` as a process):
  what only a whole session shows (kill -9, the sandbox, slots, the browser).

The guard: a fast test that starts a process or sleeps fails, saying which marker it needs; an `integration` test
that runs an ar session fails the same way. With AR_TIERS_RECORD=FILE nothing fails: each test's tier as seen is
appended to FILE (how the markers were first set). AR_TESTS_CPU=FILE appends the same lines with the guard on:
each test's CPU seconds (its own and its reaped children's) tell where the suite's time goes."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import threading
import time

import pytest

TIERS = ("fast", "integration", "e2e")
SESSION_WORDS = {"run", "sweep", "try", "eval"}      # `ar WORD`: a command that runs experiments

_seen: dict[str, int] = {}          # what the running test did: the highest tier it needed
_test_thread: list[threading.Thread | None] = [None]


def _need(tier: str, what: str) -> None:
    level = TIERS.index(tier)
    if level > _seen.get("level", 0):
        _seen.update(level=level, what=what)


def _argv_tier(args) -> tuple[str, str]:
    argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    text = " ".join(argv)
    if "autoresearch" in text and any(a in SESSION_WORDS for a in argv):
        return "e2e", f"`{text[:120]}`"
    return "integration", f"a process: `{text[:120]}`"


_real_execute_child = subprocess.Popen._execute_child
_real_fork = os.fork
_real_sleep = time.sleep


def _execute_child(self, args, *rest, **kw):
    _need(*_argv_tier(args))
    return _real_execute_child(self, args, *rest, **kw)


def _fork():
    _need("integration", "a fork")
    return _real_fork()


def _sleep(seconds):
    if threading.current_thread() is _test_thread[0]:
        _need("integration", f"time.sleep({seconds})")
    return _real_sleep(seconds)


def _session_started(*_a, **_k):
    _need("e2e", "an ar session (Scheduler.run)")


def pytest_configure(config):
    subprocess.Popen._execute_child = _execute_child
    os.fork = _fork
    time.sleep = _sleep
    from autoresearch.session import scheduler
    real_run = scheduler.Scheduler.run

    def run(self, *a, **k):
        _session_started()
        return real_run(self, *a, **k)

    scheduler.Scheduler.run = run


# fixtures wider than a test that start processes (once, in whichever test asks first): every test that asks
# for one is in that tier, whether or not it was the one that started it
PROCESS_FIXTURES = {"server": "integration", "cluster": "e2e", "after_baseline": "e2e", "after_honest": "e2e"}


def add_fixture_tiers(items) -> None:
    for item in items:
        tiers = [PROCESS_FIXTURES[f] for f in getattr(item, "fixturenames", ()) if f in PROCESS_FIXTURES]
        if tiers and TIERS.index(max(tiers, key=TIERS.index)) > TIERS.index(marked_tier(item)):
            item.add_marker(getattr(pytest.mark, max(tiers, key=TIERS.index)))


def marked_tier(item) -> str:
    for tier in ("e2e", "integration"):
        if item.get_closest_marker(tier) is not None:
            return tier
    return "fast"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _seen.clear()
    _test_thread[0] = threading.current_thread()
    cpu0 = _cpu()
    yield
    _test_thread[0] = None
    record = os.environ.get("AR_TIERS_RECORD") or os.environ.get("AR_TESTS_CPU")
    if record:         # also the CPU seconds the test and the processes it reaped used: where the suite's time goes
        with open(record, "a") as f:
            f.write(json.dumps({"id": item.nodeid, "tier": TIERS[_seen.get("level", 0)], "what": _seen.get("what"),
                                "cpu": round(_cpu() - cpu0, 2)}) + "\n")


def _cpu() -> float:
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    needed = TIERS[_seen.get("level", 0)]
    if not os.environ.get("AR_TIERS_RECORD") and TIERS.index(needed) > TIERS.index(marked_tier(item)):
        pytest.fail(f"this test is marked {marked_tier(item)} but started {_seen['what']}: mark it "
                    f"@pytest.mark.{needed} (tests/tiers.py)", pytrace=False)
    return result
