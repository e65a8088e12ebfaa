import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from autoresearch.process import RUN_ID_VAR, find_marked, run_training, stop_marked

from fixtures.clocks import ManualClock

pytestmark = pytest.mark.integration

PY = sys.executable


def run(tmp_path, code, **kw):
    kw.setdefault("timeout", 20)
    kw.setdefault("grace", 0.5)
    return run_training([PY, "-c", textwrap.dedent(code)], cwd=tmp_path, env=dict(os.environ),
                        log_path=tmp_path / "exp" / "train.log", **kw)


def gone(pid, within=5.0):
    """The process no longer runs (a zombie waiting for an init that does not reap counts as gone)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def wait_for_pid(path, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.02)
    raise AssertionError(f"{path} never written")


SPAWN = """
    import os, subprocess, sys, time
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    open({pidfile!r}, "w").write(str(g.pid))
"""


def test_normal_exit_log_and_lines(tmp_path):
    seen = []
    r = run(tmp_path, """
        import sys
        print("hello")
        print("to stderr", file=sys.stderr)
        sys.stdout.write("no newline at the end")
        sys.exit(3)
    """, on_line=lambda line: seen.append(line))
    assert r.returncode == 3 and not r.timed_out and r.stop_reason is None and not r.log_truncated
    text = r.log_path.read_text()
    assert "hello\n" in text and "to stderr\n" in text and text.endswith("no newline at the end")
    assert seen[-1] == "no newline at the end" and "hello" in seen
    assert len(r.run_id) == 32


def test_env_gets_a_run_id(tmp_path):
    r = run(tmp_path, f"import os; print(os.environ[{RUN_ID_VAR!r}])")
    assert r.log_path.read_text().strip() == r.run_id


def test_timeout_kills_a_silent_child(tmp_path):
    """The timeout is on the clock the runner is given: the test moves it an hour on, and nothing waits for it."""
    clock = ManualClock()
    r = run(tmp_path, "import time; print('up', flush=True); time.sleep(60)", timeout=3600, clock=clock,
            on_line=lambda line: clock.advance(3600.5) if line == "up" else None)
    assert r.timed_out and r.stop_reason == "timeout" and r.returncode == -signal.SIGTERM
    assert r.wall_seconds >= 3600
    assert "[ar] run stopped (timeout)" in r.log_path.read_text()


def test_a_child_inside_its_timeout_is_not_stopped(tmp_path):
    clock = ManualClock()
    r = run(tmp_path, "print('up', flush=True)", timeout=3600, clock=clock,
            on_line=lambda line: clock.advance(3599.0) if line == "up" else None)
    assert r.returncode == 0 and not r.timed_out and r.stop_reason is None


def test_sigterm_ignored_means_sigkill_after_grace(tmp_path):
    r = run(tmp_path, """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """, timeout=0.5, grace=0.3)
    assert r.timed_out and r.returncode == -signal.SIGKILL and r.wall_seconds < 5


def test_setsid_grandchild_is_killed_on_timeout(tmp_path):
    pidfile = tmp_path / "g.pid"
    r = run(tmp_path, SPAWN.format(pidfile=str(pidfile)) + "    time.sleep(60)\n", timeout=1.0)
    g = wait_for_pid(pidfile)
    assert r.timed_out and gone(g)


def test_background_process_left_after_a_normal_exit_is_killed(tmp_path):
    pidfile = tmp_path / "g.pid"
    r = run(tmp_path, SPAWN.format(pidfile=str(pidfile)))  # exits at once, grandchild in its own session
    g = wait_for_pid(pidfile)
    assert r.returncode == 0 and r.stop_reason is None and not r.timed_out
    assert gone(g) and any(f"pid {g}" in x for x in r.leftovers_killed)
    assert "stopped processes left running" in r.log_path.read_text()


def test_output_flood_is_capped(tmp_path):
    t = time.monotonic()
    r = run(tmp_path, """
        import sys
        block = (b"x" * 1023 + b"\\n") * 1024
        for _ in range(200):
            sys.stdout.buffer.write(block)
        sys.stdout.flush()
        print("done")
    """, max_log_bytes=2**20, timeout=60)
    assert r.returncode == 0 and r.log_truncated
    size = r.log_path.stat().st_size
    assert 2**20 <= size < 2**20 + 500
    assert r.dropped_bytes == 200 * 2**20 + len("done\n") - 2**20
    assert "log capped" in r.log_path.read_text()[-300:]
    assert time.monotonic() - t < 20


def test_long_lines_without_newlines_do_not_grow_memory(tmp_path):
    seen = []
    r = run(tmp_path, """
        import sys
        sys.stdout.write("y" * (5 * 2**20))
        sys.stdout.write("\\nstep end\\n")
    """, on_line=lambda line: seen.append(len(line)), max_log_bytes=1024)
    assert r.returncode == 0 and max(seen) <= 2**16 and seen[-1] == len("step end")


def test_on_line_stop_reason_stops_the_run(tmp_path):
    def watch(line):
        return "degraded: too slow" if line == "step 5" else None

    r = run(tmp_path, """
        import itertools, time
        for i in itertools.count():
            print(f"step {i}", flush=True)
            time.sleep(0.01)
    """, on_line=watch)
    assert r.stop_reason == "degraded: too slow" and not r.timed_out
    assert r.returncode is not None and r.returncode < 0 and r.wall_seconds < 5


def test_on_line_exception_stops_and_is_reraised(tmp_path):
    def boom(line):
        raise RuntimeError("bug in the callback")

    t = time.monotonic()
    with pytest.raises(RuntimeError, match="bug in the callback"):
        run(tmp_path, "import time\nprint('x', flush=True)\ntime.sleep(60)", on_line=boom)
    assert time.monotonic() - t < 5


def test_ctrl_c_stops_the_run_and_returns_interrupted(tmp_path):
    pidfile = tmp_path / "g.pid"
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.8, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        r = run(tmp_path, SPAWN.format(pidfile=str(pidfile)) + "    time.sleep(60)\n", timeout=30)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
    assert r.stop_reason == "interrupted" and not r.timed_out and r.wall_seconds < 10
    assert gone(wait_for_pid(pidfile))


def test_could_not_start(tmp_path):
    r = run_training([str(tmp_path / "missing-binary")], cwd=tmp_path, env={}, log_path=tmp_path / "l.log",
                     timeout=5)
    assert r.returncode is None and "could not start" in r.stop_reason


DRIVER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from autoresearch.process import run_training
    code = "import os, time; open(%r, 'w').write(str(os.getpid())); time.sleep(60)" % sys.argv[1]
    run_training([sys.executable, "-c", code], cwd=Path.cwd(), env=dict(os.environ),
                 log_path=Path(sys.argv[1] + ".log"), timeout=60)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_training_dies_with_a_kill_9_of_ar(tmp_path):
    pidfile = tmp_path / "child.pid"
    driver = subprocess.Popen([PY, "-c", DRIVER, str(pidfile)])
    try:
        child = wait_for_pid(pidfile)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        assert gone(child)
    finally:
        if driver.poll() is None:
            driver.kill()


def test_stop_marked_sweeps_what_a_dead_run_left(tmp_path):
    env = dict(os.environ, **{RUN_ID_VAR: "leftover-test-123"})
    p = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while not find_marked("leftover-test-123") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [x.pid for x in find_marked("leftover-test-123")] == [p.pid]
        stopped = stop_marked("leftover-test-123", grace=0.5)
        assert len(stopped) == 1 and stopped[0].startswith(f"pid {p.pid} (python")
        assert p.wait(timeout=5) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
