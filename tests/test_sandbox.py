"""The sandbox itself: real Landlock on real processes (skipped where the kernel has none), and what the loop
does with and without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from autoresearch.errors import ConfigError
from autoresearch.harness import sandbox
from autoresearch.records.ledger import read_results
from autoresearch.session.loop import Loop

from fixtures.waits import until

from test_loop import cfg, make_repo

needs_landlock = pytest.mark.skipif(not sandbox.available()[0], reason="needs Landlock: " + sandbox.available()[1])


def sandboxed(tmp_path: Path, policy: dict, code: str) -> subprocess.CompletedProcess:
    sandbox.give_to_sandbox(*(w for w in policy.get("write", []) if w not in ("/dev", "/proc")))  # as ar does
    f = tmp_path / "policy.json"
    f.write_text(json.dumps(policy))
    return subprocess.run([sys.executable, "-I", "-B", "-m", "autoresearch.harness.sandbox", str(f), "--",
                           sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)


def probe(paths: dict[str, str]) -> str:
    """Code that tries each (label -> python statement) and prints `label ok|denied`."""
    lines = ["import os"]
    for label, stmt in paths.items():
        lines.append(f"try:\n    {stmt}\n    print({label!r}, 'ok')\nexcept OSError:\n    print({label!r}, 'denied')")
    return "\n".join(lines)


@pytest.mark.integration
@needs_landlock
def test_allow_list_policy_reads_and_writes_only_what_it_names(tmp_path):
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "val.bin").write_bytes(b"validation")
    (tmp_path / "work").mkdir()
    policy = sandbox.base_policy()
    policy["write"] += [str(tmp_path / "work")]
    r = sandboxed(tmp_path, policy, probe({
        "read secret": f"open({str(tmp_path / 'secret' / 'val.bin')!r}).read()",
        "write work": f"open({str(tmp_path / 'work' / 'x')!r}, 'w').write('x')",
        "write beside": f"open({str(tmp_path / 'y')!r}, 'w').write('x')",
        "read stdlib": "open(os.__file__).read()",
        "signal init": "os.kill(1, 0)",
    }))
    out = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines())
    assert out == {"read secret": "denied", "write work": "ok", "write beside": "denied", "read stdlib": "ok",
                   "signal init": "denied" if sandbox.abi_version() >= 6 else "ok"}, r.stdout + r.stderr


@pytest.mark.integration
@needs_landlock
def test_complement_policy_hides_a_folder_and_a_rename_cannot_leak_it(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "val.bin").write_bytes(b"validation")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    (tmp_path / "repo").mkdir()
    policy = {"deny": [str(tmp_path / "data")], "read_only": [str(tmp_path / "pkg")], "network": True}
    r = sandboxed(tmp_path, policy, probe({
        "read data": f"open({str(tmp_path / 'data' / 'val.bin')!r}).read()",
        "read pkg": f"open({str(tmp_path / 'pkg' / 'mod.py')!r}).read()",
        "write pkg": f"open({str(tmp_path / 'pkg' / 'mod.py')!r}, 'a').write('y')",
        "write repo": f"open({str(tmp_path / 'repo' / 'train.py')!r}, 'w').write('x')",
        "move to repo": f"os.rename({str(tmp_path / 'data' / 'val.bin')!r}, {str(tmp_path / 'repo' / 'v')!r})",
    }))
    out = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines())
    assert out == {"read data": "denied", "read pkg": "ok", "write pkg": "denied", "write repo": "ok",
                   "move to repo": "denied"}, r.stdout + r.stderr


@pytest.mark.integration
@needs_landlock
def test_a_hidden_folder_inside_a_readable_one_stays_unreadable(tmp_path):
    lib = tmp_path / "lib"
    (lib / "test" / "deep").mkdir(parents=True)
    (lib / "pkg").mkdir()
    for f in (lib / "a.py", lib / "pkg" / "b.py", lib / "test" / "val.py", lib / "test" / "deep" / "v.py"):
        f.write_text("x = 1\n")
    policy = sandbox.base_policy()
    policy["read"] += [str(lib), str(lib / "pkg")]
    policy["hide"] = [str(lib / "test")]
    r = sandboxed(tmp_path, policy, probe({
        "read a": f"open({str(lib / 'a.py')!r}).read()",
        "read pkg": f"open({str(lib / 'pkg' / 'b.py')!r}).read()",
        "list lib": f"os.listdir({str(lib)!r})",
        "read test": f"open({str(lib / 'test' / 'val.py')!r}).read()",
        "read deep": f"open({str(lib / 'test' / 'deep' / 'v.py')!r}).read()",
        "list test": f"os.listdir({str(lib / 'test')!r})",
    }))
    out = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines())
    assert out == {"read a": "ok", "read pkg": "ok", "list lib": "ok", "read test": "denied", "read deep": "denied",
                   "list test": "ok"}, r.stdout + r.stderr      # names, never contents


@pytest.mark.integration
@needs_landlock
def test_the_supervisor_leaves_no_daemon_behind(tmp_path):
    marker = f"ar-sandbox-test-{os.getpid()}-{time.time()}"
    code = ("import os, time\n"
            "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execvp('sleep', ['sleep', '1000', {marker!r}])\n    os._exit(0)\n"
            "time.sleep(0.3)\n")
    r = sandboxed(tmp_path, sandbox.base_policy(), code)
    assert r.returncode == 0, r.stderr
    until(lambda: not [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])],
          "the daemon the sandboxed code left to be gone")


@pytest.mark.e2e
def test_no_sandbox_refuses_in_one_line_and_unsandboxed_marks_every_result(tmp_path, monkeypatch, prepared_cache):
    import autoresearch.session.loop as loop_mod
    monkeypatch.setattr(loop_mod.sandbox, "available", lambda: (False, "this kernel has no Landlock"))
    root = make_repo(tmp_path)
    with pytest.raises(ConfigError, match="no Landlock.*--unsandboxed"):
        Loop(cfg(), root, "t", None).run()
    Loop(cfg(sandbox=False), root, "t", None).run()
    rows = read_results(root / "runs" / "t" / "results.tsv")
    assert rows and all(r.reason.startswith("unsandboxed") for r in rows), [r.reason for r in rows]


# ---- nothing outlives a run (issue 22, class 1) ---------------------------------------------------------------
KEY = 0x41520000 + os.getpid() % 0xFFFF
LIBC = "import ctypes, os, socket, sys, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
LEAVE = {   # kind -> (what the first run leaves, the statement the second run tries; it prints 'found' if it works)
    "sysv shm": (f"print(libc.shmget({KEY}, 4096, 0o1666))", f"assert libc.shmget({KEY}, 0, 0o666) >= 0"),
    "sysv msg": (f"print(libc.msgget({KEY + 1}, 0o1666))", f"assert libc.msgget({KEY + 1}, 0o666) >= 0"),
    "sysv sem": (f"print(libc.semget({KEY + 2}, 1, 0o1666))", f"assert libc.semget({KEY + 2}, 0, 0o666) >= 0"),
    "posix mq": (f"print(libc.mq_open(b'/ar-{KEY}', os.O_CREAT | os.O_RDWR, 0o666, None))",
                 f"assert libc.mq_open(b'/ar-{KEY}', os.O_RDWR) >= 0"),
    "dev shm": (f"open('/dev/shm/ar-{KEY}', 'w').write('weights')", f"open('/dev/shm/ar-{KEY}').read()"),
    "keyring": (f"libc.syscall.restype = ctypes.c_long\n"
                f"print(libc.syscall(248 if os.uname().machine == 'x86_64' else 217, b'user', b'ar-{KEY}', b'w', 1, -4))",
                f"libc.syscall.restype = ctypes.c_long\n"
                f"assert libc.syscall(250 if os.uname().machine == 'x86_64' else 219, 10, -4, b'user', b'ar-{KEY}', 0) >= 0"),
    "abstract socket": (f"if os.fork() == 0:\n    os.setsid()\n    s = socket.socket(socket.AF_UNIX)\n"
                        f"    s.bind(b'\\0ar-{KEY}')\n    s.listen()\n    time.sleep(30)\nos._exit(0) if False else time.sleep(0.5)",
                        f"socket.socket(socket.AF_UNIX).connect(b'\\0ar-{KEY}')"),
}


def _remove_leftovers() -> None:
    """What a run of the code before this defence leaves on the host (ipcrm, unlink)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for get, ctl, k in ((lambda k: libc.shmget(k, 0, 0o666), libc.shmctl, KEY),
                        (lambda k: libc.msgget(k, 0o666), libc.msgctl, KEY + 1),
                        (lambda k: libc.semget(k, 0, 0o666), None, KEY + 2)):
        i = get(k)
        if i >= 0:
            (ctl(i, 0, None) if ctl else libc.semctl(i, 0, 0))   # IPC_RMID
    libc.mq_unlink(f"/ar-{KEY}".encode())
    Path(f"/dev/shm/ar-{KEY}").unlink(missing_ok=True)


@pytest.mark.integration
@needs_landlock
@pytest.mark.parametrize("kind", list(LEAVE))
def test_nothing_a_sandboxed_run_creates_reaches_the_next(tmp_path, kind):
    leave, find = LEAVE[kind]
    try:
        first = sandboxed(tmp_path, sandbox.base_policy(), LIBC + leave)
        second = sandboxed(tmp_path, sandbox.base_policy(),
                           LIBC + f"try:\n    " + find.replace("\n", "\n    ") + "\n    print('found')\n"
                           "except (OSError, AssertionError):\n    print('gone')")
        assert second.stdout.strip() == "gone", (kind, first.stdout, first.stderr, second.stdout, second.stderr)
    finally:
        _remove_leftovers()


@needs_landlock
def test_isolation_is_said(tmp_path):
    mode, why = sandbox.isolation()
    assert mode in ("namespaces", "seccomp") and why, (mode, why)
    assert why in sandbox.available()[1]


@pytest.mark.integration
@needs_landlock
@pytest.mark.skipif(os.geteuid() != 0, reason="the supervisor drops root only when it is root")
def test_a_sandboxed_process_started_as_root_runs_as_nobody_and_writes_its_workspace(tmp_path):
    work = tmp_path / "work"                     # under pytest's 0700 folder: readable inputs stay readable
    work.mkdir()
    (tmp_path / "input.txt").write_text("data")
    policy = sandbox.base_policy()
    policy["read"] += [str(tmp_path / "input.txt")]
    policy["write"] += [str(work)]
    r = sandboxed(tmp_path, policy, "import os\n"
                  f"open({str(work / 'out')!r}, 'w').write(open({str(tmp_path / 'input.txt')!r}).read())\n"
                  "open(f'/proc/{os.getpid()}/comm', 'w').write('x')\n"
                  "import subprocess, sys\n"
                  "subprocess.run([sys.executable, '-c', \"import os; open(f'/proc/{os.getpid()}/comm', 'w').write('y')\"],"
                  " check=True)\n"
                  "print(os.getuid(), os.geteuid(), os.getgroups())")
    assert r.returncode == 0, r.stderr
    uid, euid, groups = r.stdout.split(maxsplit=2)
    assert int(uid) != 0 and int(euid) != 0 and groups.strip() == "[]", r.stdout
    assert (work / "out").read_text() == "data"


@pytest.mark.integration
@needs_landlock
@pytest.mark.skipif(os.geteuid() != 0 or sandbox.sandbox_ids() is None, reason="root hands the run to `nobody` only")
@pytest.mark.skipif(not __import__("shutil").which("gcc"), reason="needs gcc (what Triton compiles its launcher with)")
def test_a_run_under_a_root_only_folder_can_compile_with_gcc(tmp_path):
    """As root, a run is `nobody`, which reaches a workspace under a root-only folder (/root; pytest's
    /tmp/pytest-of-root) through CAP_DAC_READ_SEARCH, but gcc checks TMPDIR with access(2), which asks with no
    capabilities; it fell back to /tmp and aborted (a cold compile of a new shape on the H100 as root: "Cannot
    create temporary file in /tmp/"). The run's TMPDIR is then a folder of its own under /tmp."""
    from autoresearch.experiment import execute
    from autoresearch.gitops import GitRepo
    from fixtures.cli import committed_repo
    os.chmod(tmp_path, 0o700)                    # a root-only folder above the workspace
    repo = committed_repo(tmp_path / "repo", {"a.c": "int f(void) { return 1; }\n"})
    ws, _ = execute.make_workspace(GitRepo(repo), "HEAD", tmp_path / "work", None)
    try:
        assert not sandbox.reachable_by_others(ws.scratch) and ws.tmp is not None and sandbox.reachable_by_others(ws.tmp)
        policy = tmp_path / "policy.json"
        policy.write_text(json.dumps(execute.train_policy(_req_stub(), ws, [])))
        gcc = f"gcc -O2 -shared -fPIC -o {ws.scratch}/a.so {ws.src}/a.c"
        for tmpdir, ok in ((ws.tmp, True), (ws.scratch, False)):      # the control: TMPDIR in the workspace
            p = subprocess.run([sys.executable, "-m", "autoresearch.harness.sandbox", str(policy), "--", "sh", "-c", gcc],
                               env={**os.environ, "TMPDIR": str(tmpdir)}, capture_output=True, text=True)
            assert (p.returncode == 0) == ok, (tmpdir, p.returncode, p.stderr[-500:])
            if not ok:
                assert "Cannot create temporary file" in p.stderr, p.stderr[-500:]
    finally:
        execute.remove_workspace(ws)
    assert not ws.tmp.exists()


def _req_stub():
    """What train_policy reads of a request: the cache (its probe folder) and the data (none: hidden nothing)."""
    import types
    return types.SimpleNamespace(cache=Path("/nonexistent-cache"), tok_dir=None)
