"""The evaluator's model worker on a GPU shares the evaluator's namespaces and uid (CUDA IPC needs them): it may
write the reference-count files it is given in /dev/shm and nothing else there, and every System V / POSIX IPC
call and keyring is refused, so nothing it makes can outlive it. Checked here on the CPU with the real sandbox."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from autoresearch.harness import sandbox

from test_sandbox import sandboxed

pytestmark = pytest.mark.skipif(not sandbox.available()[0] or not os.path.isdir("/dev/shm"),
                                reason="needs Landlock and /dev/shm")

PROBE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
given = sys.argv[1]
with open(given, "r+b") as f:                       # the reference count it was given: read and written
    f.write(b"\x01")
print("given ok")
for name in ("/dev/shm/ar-planted-" + str(os.getpid()), "/dev/mqueue/ar-planted"):
    try:
        open(name, "wb").write(b"val tokens")
        print("created", name)
    except OSError as e:
        print("refused", name, e.errno)
print("shmget", libc.shmget(0, 4096, 0o1666), ctypes.get_errno())   # IPC_PRIVATE | IPC_CREAT
print("msgget", libc.msgget(0, 0o1666), ctypes.get_errno())
print("uid", os.getuid())
"""


@pytest.mark.integration
def test_the_shared_ipc_worker_writes_only_its_reference_counts(tmp_path):
    counter = Path(f"/dev/shm/ar-test-{uuid.uuid4().hex[:8]}")
    counter.write_bytes(b"\x00" * 8)
    try:
        p = sandbox.base_policy()
        p["read"].append(str(tmp_path))
        p.update(shared_ipc=True, ipc_files=[str(counter)])
        r = sandboxed(tmp_path, p, PROBE.replace("sys.argv[1]", repr(str(counter))))
        out = r.stdout
        assert "given ok" in out, (out, r.stderr)
        assert "created" not in out and out.count("refused") >= 1, out
        assert "shmget -1 1" in out and "msgget -1 1" in out, out        # EPERM from seccomp
        assert f"uid {os.getuid()}" in out                                # the evaluator's uid: CUDA IPC needs it
        assert counter.read_bytes()[:1] == b"\x01"
        assert not list(Path("/dev/shm").glob("ar-planted-*"))
    finally:
        counter.unlink(missing_ok=True)
