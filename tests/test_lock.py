import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from autoresearch.errors import LockHeld
from autoresearch.records.lock import RepoLock, gpu_lock_path, metadata_path, read_holder

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from autoresearch.records.lock import RepoLock
    lock = RepoLock(Path(sys.argv[1]), tag="nov30", command="ar run")
    lock.acquire()
    print("ready", flush=True)
    time.sleep(60)
""")

CONTENDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from autoresearch.errors import LockHeld
    from autoresearch.records.lock import RepoLock
    start = float(sys.argv[2])
    while time.time() < start:
        time.sleep(0.001)
    try:
        with RepoLock(Path(sys.argv[1]), tag="t", command="ar run"):
            print("got", flush=True)
            release = Path(sys.argv[1] + ".release")
            deadline = time.time() + 30
            while not release.exists() and time.time() < deadline:
                time.sleep(0.01)
    except LockHeld as e:
        print("held:", e, flush=True)
""")


@pytest.fixture
def holder(tmp_path):
    path = tmp_path / "runs" / ".ar.lock"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield path, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.mark.integration
def test_second_acquirer_gets_lockheld_naming_the_holder(holder):
    path, proc = holder
    with pytest.raises(LockHeld) as e:
        RepoLock(path, tag="other", command="ar sweep").acquire()
    msg = str(e.value)
    assert msg.startswith("ar is already running here: ")
    assert f"pid {proc.pid} on host " in msg and "(tag nov30, `ar run`)" in msg
    assert msg.endswith("wait for it or stop it") and e.value.exit_code == 3


@pytest.mark.integration
def test_read_holder_from_another_process(holder):
    path, proc = holder
    meta = read_holder(path)
    assert meta["pid"] == proc.pid and meta["tag"] == "nov30" and meta["command"] == "ar run"
    assert meta["since"]


@pytest.mark.integration
def test_kill_9_holder_never_blocks_the_next_run(holder):
    path, proc = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert metadata_path(path).exists()  # stale metadata is left behind...
    assert read_holder(path) is None     # ...and ignored
    with RepoLock(path, tag="next", command="ar run") as lock:
        assert lock.held
        assert read_holder(path)["pid"] == os.getpid() and read_holder(path)["tag"] == "next"
    assert read_holder(path) is None and not metadata_path(path).exists()


@pytest.mark.integration
def test_in_process_acquire_release(tmp_path):
    path = tmp_path / ".ar.lock"
    assert read_holder(path) is None
    a = RepoLock(path, tag="a", command="ar run", extra={"gpu": 0})
    a.acquire()
    a.acquire()  # already held by this object: no-op
    assert json.loads(metadata_path(path).read_text())["gpu"] == 0
    with pytest.raises(LockHeld, match="tag a"):
        RepoLock(path, tag="b", command="ar run").acquire()
    a.release()
    a.release()
    with RepoLock(path, tag="b", command="ar run"):
        pass


@pytest.mark.integration
def test_stale_metadata_is_not_named(tmp_path):
    path = tmp_path / ".ar.lock"
    a = RepoLock(path, tag="a", command="ar run")
    a.acquire()
    # metadata that names a dead process while the lock is held (e.g. left by an earlier kill -9)
    meta = json.loads(metadata_path(path).read_text())
    metadata_path(path).write_text(json.dumps({**meta, "pid": 2**22 + 12345}))
    t = time.monotonic()
    with pytest.raises(LockHeld, match="details are not readable"):
        RepoLock(path, tag="b", command="ar run").acquire()
    assert time.monotonic() - t < 3
    a.release()


@pytest.mark.integration
def test_label(tmp_path):
    path = gpu_lock_path(tmp_path / "cache", 1)
    with RepoLock(path, tag="a", command="ar run", label="on GPU 1"):
        with pytest.raises(LockHeld, match="^ar is already running on GPU 1: pid"):
            RepoLock(path, tag="b", command="ar run", label="on GPU 1").acquire()


def test_gpu_lock_path(tmp_path):
    p = gpu_lock_path(tmp_path / "cache", 3)
    assert p == tmp_path / "cache" / "locks" / "gpu3.lock" and p.parent.is_dir()


@pytest.mark.integration
def test_concurrent_starts_exactly_one_runs(tmp_path):
    path = tmp_path / ".ar.lock"
    start = time.time() + 1.0
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(path), str(start)], stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outs = [p.stdout.readline().strip() for p in procs]  # the winner holds on until all have answered
    (tmp_path / ".ar.lock.release").touch()
    for p in procs:
        p.communicate(timeout=30)
    assert sum(o == "got" for o in outs) == 1, outs
    winner = procs[[o == "got" for o in outs].index(True)].pid
    assert all(f"pid {winner} " in o for o in outs if o != "got"), outs


# ------------------------------------------------------------------------------- another `ar` holding the repo's lock

def ar(*args, cwd, timeout=180):
    return subprocess.run([sys.executable, "-m", "autoresearch", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@contextlib.contextmanager
def holding_the_lock(root):
    """Another process holds the repo's lock (as a running `ar run` would) while the block runs."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import time; from pathlib import Path; from autoresearch.records.lock import RepoLock\n"
        "l = RepoLock(Path('runs/.ar.lock'), tag='night', command='ar run'); l.acquire(); print('held', flush=True)\n"
        "time.sleep(60)")], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.e2e
def test_a_refused_run_or_sweep_says_nothing_before_the_lock_error(tmp_path, prepared_cache):
    from test_loop import make_repo

    root = make_repo(tmp_path)
    (root / "s.yaml").write_text("name: lr\nprofile: cpu\naxes: {LR_MULT: [1.0, 2.0]}\n")
    with holding_the_lock(root):
        for args in (("run", "--tag", "other"), ("sweep", "s.yaml"), ("try",)):
            r = ar(*args, cwd=root)
            assert r.returncode == 3 and r.stdout == "", (args, r.stdout)
            assert r.stderr.startswith("error: ar is already running here") and r.stderr.count("\n") == 1, r.stderr
    assert not (root / "runs" / "other").exists()
