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
from autoresearch.ledger import read_results
from autoresearch.session import Loop

from test_loop import cfg, make_repo

needs_landlock = pytest.mark.skipif(not sandbox.available()[0], reason="needs Landlock: " + sandbox.available()[1])


def sandboxed(tmp_path: Path, policy: dict, code: str) -> subprocess.CompletedProcess:
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


@needs_landlock
def test_the_supervisor_leaves_no_daemon_behind(tmp_path):
    marker = f"ar-sandbox-test-{os.getpid()}-{time.time()}"
    code = ("import os, time\n"
            "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execvp('sleep', ['sleep', '1000', {marker!r}])\n    os._exit(0)\n"
            "time.sleep(0.3)\n")
    r = sandboxed(tmp_path, sandbox.base_policy(), code)
    assert r.returncode == 0, r.stderr
    time.sleep(0.3)
    alive = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert not alive


def test_no_sandbox_refuses_in_one_line_and_unsandboxed_marks_every_result(tmp_path, monkeypatch, prepared_cache):
    import autoresearch.session as loop_mod
    monkeypatch.setattr(loop_mod.sandbox, "available", lambda: (False, "this kernel has no Landlock"))
    root = make_repo(tmp_path)
    with pytest.raises(ConfigError, match="no Landlock.*--unsandboxed"):
        Loop(cfg(), root, "t", None).run()
    Loop(cfg(sandbox=False), root, "t", None).run()
    rows = read_results(root / "runs" / "t" / "results.tsv")
    assert rows and all(r.reason.startswith("unsandboxed") for r in rows), [r.reason for r in rows]
