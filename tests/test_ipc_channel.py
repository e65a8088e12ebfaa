"""No channel between model workers through what CUDA IPC lets them write (issue 27).

On a GPU each model worker (the main one, then the fresh re-scorer, then the next experiment's) shares the
evaluator's namespaces and uid, and may write the /dev/shm files of its own buffer owner: the CUDA driver's
`cuda.shm.<n>.<owner pid in hex>.<n>` and torch's reference counts. Here, on the CPU with the real sandbox, the
owner is simulated (a process that makes files of those names and exits) and the rest is the evaluator's own
code: the runner's worker policies (`worker_policy`), the evaluator's `owner_files`, `ipc_policy` and
`remove_owner_files`. Worker 1 tries to leave a marker in everything it may write (every folder of the
filesystem, every regular file, its own /proc entries, other processes' /proc entries, the devices whose write
would persist); after the trusted side's cleanup, worker 2 (its own owner, its own folder, as the fresh re-scorer
gets them) looks for it everywhere it can read, at every path worker 1 wrote. The control is the same attack with
/dev/shm writable (the fix that makes CUDA IPC work by opening /dev/shm): there the marker reaches worker 2.

Each scenario runs in a private /dev/shm (a mount namespace of its own), so that the control's worker cannot
touch another process's shared memory on this machine."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from autoresearch.harness import sandbox

pytestmark = pytest.mark.skipif(not sandbox.available()[0] or not os.path.isdir("/dev/shm"),
                                reason="needs Landlock and /dev/shm")

# Worker 1: a marker in every folder (a new file, a new folder) and at the end of every regular file it can open
# for writing. Outside the places where a write is harmless (its folders, /dev/shm, /tmp, its own /proc entries)
# it only opens for writing and closes: a success there fails the test by itself, the marker adds nothing.
ATTACK = r'''
import json, os, stat, sys
spec = json.loads(sys.argv[1])
marker = spec["marker"].encode()
me = os.getpid()
try:                                            # never run unsandboxed: the walk below would append to everything
    os.close(os.open(spec["canary"], os.O_WRONLY | os.O_APPEND))
    print(json.dumps({"unsandboxed": True}))
    sys.exit(0)
except OSError:
    pass
own_proc = os.path.realpath("/proc/self")
harmless = ("/dev/shm", "/tmp", "/var/tmp", os.environ["HOME"], own_proc)
flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK
found = {"pid": me, "created": [], "wrote": [], "opened": [], "dirs": 0, "files": 0}

def inside(p, tops):
    return any(p == t or p.startswith(t.rstrip("/") + "/") for t in tops)

def try_dir(d):
    found["dirs"] += 1
    for kind in ("file", "dir"):
        p = os.path.join(d, f".ar-marker-{kind}-{me}")
        try:
            if kind == "dir":
                os.mkdir(p)
            else:
                fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
                os.write(fd, marker)
                os.close(fd)
            found["created"].append(p)
        except OSError:
            pass

def try_file(p, write=True):
    found["files"] += 1
    try:
        fd = os.open(p, flags)
    except OSError:
        return
    try:
        if write and inside(p, harmless):
            os.write(fd, marker)
            found["wrote"].append(p)
            return
    except OSError:
        pass
    finally:
        os.close(fd)
    found["opened"].append(p)                  # opened for writing (not written: see above)

def walk(top):
    for d, dirs, files in os.walk(top):
        try_dir(d)
        for f in files:
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):
                try_file(p)

for line in sys.stdin:                         # what it cannot list, listed for it by the trusted side: every
    kind, p = line.rstrip("\n").split(" ", 1)  # folder and regular file but /proc and /sys, its owner's files,
    if kind == "d":                            # and the devices whose writes would outlive the writer (opened
        try_dir(p)                             # for writing, never written)
    else:
        try_file(p, write=kind == "f")
walk(os.environ["HOME"])                       # its folder (HOME and TMPDIR), as it is now
for d, dirs, files in os.walk(own_proc):       # its own /proc entries
    dirs[:] = [x for x in dirs if x not in ("fd", "fdinfo", "map_files", "ns", "net")]
    for f in files:
        if f not in ("mem", "pagemap", "clear_refs"):
            try_file(os.path.join(d, f))
for pid in os.listdir("/proc"):                # every other process's, of its uid (the trusted ones included)
    if pid.isdigit() and int(pid) != me:
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                continue
            names = os.listdir(f"/proc/{pid}")
        except OSError:
            continue
        for f in names:
            if os.path.isfile(f"/proc/{pid}/{f}"):
                try_file(f"/proc/{pid}/{f}", write=False)
for d, dirs, files in os.walk("/proc/sys"):
    for f in files:
        try_file(os.path.join(d, f), write=False)
for d, dirs, files in os.walk("/sys/fs/cgroup"):
    try_dir(d)
    for f in files:
        try_file(os.path.join(d, f), write=False)
print(json.dumps(found))
'''

# Worker 2: every readable file at every place a marker could be, and at every path worker 1 wrote.
SEARCH = r'''
import json, os, stat, sys
spec = json.loads(sys.argv[1])
marker = spec["marker"].encode()
hits, read = [], 0

def look(p):
    global read
    try:
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            return
        with open(p, "rb") as f:
            data = f.read(32 << 20)
    except OSError:
        return
    read += 1
    if marker in data or marker in os.path.basename(p).encode():
        hits.append(p)

for top in spec["roots"]:
    if os.path.isfile(top):
        look(top)
    for d, dirs, files in os.walk(top):
        for name in dirs + files:
            if marker in name.encode() or ".ar-marker-" in name:
                hits.append(os.path.join(d, name))
        for f in files:
            look(os.path.join(d, f))
for p in spec["paths"]:
    look(p)
print(json.dumps({"hits": sorted(set(hits)), "read": read}))
'''

OWNER = r'''
import os, sys
pid = os.getpid()
for name in (f"cuda.shm.0.{pid:x}.1", f"torch_{pid}_1234_0"):      # the driver's file and torch's ref counts
    fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.write(fd, bytes(64))
    os.close(fd)
print("ready", flush=True)
sys.stdin.read()
'''


def targets(out: Path) -> None:
    """Every folder and regular file of the filesystem but /proc and /sys (which the attack takes on by itself),
    and the devices whose writes outlive the writer, one "KIND PATH" a line: what a worker may not be able to
    list but can name (d: make a file and a folder in it; f: append to it; o: open it for writing only)."""
    import stat
    with open(out, "w") as f:
        for top in sorted(os.listdir("/")):
            if top in ("proc", "sys") or os.path.islink("/" + top) or not os.path.isdir("/" + top):
                continue
            for d, dirs, files in os.walk("/" + top):
                if "\n" in d:
                    continue
                f.write(f"d {d}\n")
                for name in files:
                    p = os.path.join(d, name)
                    try:
                        mode = os.lstat(p).st_mode
                    except OSError:
                        continue
                    if "\n" in p:
                        continue
                    if stat.S_ISREG(mode):
                        f.write(f"f {p}\n")
                    elif stat.S_ISBLK(mode) or p in ("/dev/kmsg", "/dev/mem", "/dev/port", "/dev/net/tun") or \
                            (p.startswith("/dev/cpu/") and p.endswith("/msr")):
                        f.write(f"o {p}\n")


def _sandboxed(policy: dict, env: dict, cwd: Path, code: str, spec: dict, where: Path, stdin: str = "") -> dict:
    where.write_text(json.dumps(policy))
    r = subprocess.run([sys.executable, "-I", "-B", "-m", "autoresearch.harness.sandbox", str(where), "--",
                        sys.executable, "-I", "-B", "-c", code, json.dumps(spec)], input=stdin,
                       capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
    if r.returncode != 0 or not r.stdout.strip():
        raise RuntimeError(f"sandboxed process failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _owner() -> tuple[subprocess.Popen, list[str]]:
    from autoresearch.harness.evaluator import owner_files
    proc = subprocess.Popen([sys.executable, "-I", "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc, owner_files(proc.pid)


def _stop(proc: subprocess.Popen, files: list[str]) -> list[str]:
    """The trusted side once a worker is gone: its owner exits and is reaped, then its files are removed."""
    from autoresearch.harness.evaluator import remove_owner_files
    proc.stdin.close()
    proc.wait(timeout=30)
    return remove_owner_files(proc.pid, files)


def scenario(root: Path, mode: str, listed: Path) -> dict:
    """Worker 1 attacks, the trusted side cleans up, worker 2 searches. mode "narrow": the evaluator's policy;
    "wide": the same with /dev/shm writable (the control)."""
    libc = sandbox._libc()         # a /dev/shm of this scenario's own (first: a user namespace needs one thread)
    if libc is None or not sandbox._namespaces(libc, network=True):
        return {"skip": "no mount namespace for a private /dev/shm"}
    from autoresearch.experiment.evaluate import fresh_job, worker_policy
    from autoresearch.experiment.execute import Workspace
    from autoresearch.harness.evaluator import ipc_policy, worker_env
    marker = f"ar-channel-{mode}-{secrets.token_hex(8)}"
    ws = Workspace.at(root / "ws")
    fresh = fresh_job(ws)
    for d in (ws.src, ws.checkpoint, ws.job, fresh):
        d.mkdir(parents=True)
    (ws.src / "train.py").write_text("# the proposal\n")
    canary = root / "canary.txt"                # outside every policy: a worker that can open it is not sandboxed
    canary.write_text("")
    sandbox.give_to_sandbox(ws.src, ws.checkpoint, ws.job, fresh)
    out: dict = {"marker": marker}

    owner1, f1 = _owner()
    policy1 = ipc_policy(worker_policy(ws), f1)
    if mode == "wide":
        policy1["write"].append("/dev/shm")
    out["f1"] = f1
    named = listed.read_text() + "".join(f"f {f}\n" for f in f1)
    out["worker1"] = _sandboxed(policy1, worker_env(ws.job), ws.src, ATTACK,
                                {"marker": marker, "canary": str(canary)}, root / "policy1.json", named)
    out["removed1"] = _stop(owner1, f1)
    out["f1_left"] = [f for f in f1 if os.path.lexists(f)]

    owner2, f2 = _owner()
    policy2 = ipc_policy(worker_policy(ws, fresh), f2)
    if mode == "wide":
        policy2["write"].append("/dev/shm")
    w1 = out["worker1"]
    paths = w1.get("created", []) + w1.get("wrote", []) + w1.get("opened", []) + f1
    roots = ["/dev/shm", "/tmp", "/var/tmp", "/dev", str(ws.root), str(ws.src), str(fresh), str(ws.job)] + f2
    out["worker2"] = _sandboxed(policy2, worker_env(fresh), ws.src, SEARCH, {"marker": marker, "paths": paths,
                                                                             "roots": roots}, root / "policy2.json")
    _stop(owner2, f2)
    for p in sorted(w1.get("created", []), reverse=True):     # what worker 1 made outside the private /dev/shm
        try:
            os.rmdir(p) if os.path.isdir(p) else os.unlink(p)
        except OSError:
            pass
    return out


def _run(tmp_path: Path, mode: str) -> subprocess.Popen:
    root = tmp_path / mode
    root.mkdir()
    os.chmod(tmp_path, 0o755)
    return subprocess.Popen([sys.executable, __file__, str(root), mode, str(tmp_path / "listed.txt")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _inside(p: str, tops) -> bool:
    return any(p == t or p.startswith(t.rstrip("/") + "/") for t in tops)


def test_no_byte_a_model_worker_writes_reaches_a_later_one_and_the_control_leaks(tmp_path):
    targets(tmp_path / "listed.txt")
    procs = {mode: _run(tmp_path, mode) for mode in ("narrow", "wide")}   # side by side: 2 cores
    res = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        res[mode] = json.loads(stdout.strip().splitlines()[-1])
    (tmp_path / "listed.txt").unlink()                                  # ~40 MB
    if "skip" in res["narrow"]:
        pytest.skip(res["narrow"]["skip"])

    safe = res["narrow"]
    w1, w2 = safe["worker1"], safe["worker2"]
    assert not w1.get("unsandboxed"), w1
    assert w1["dirs"] > 1000 and w1["files"] > 10000, w1                # it did walk the filesystem
    assert set(safe["f1"]) <= set(w1["wrote"]) and safe["f1"], w1      # live: it wrote its owner's files
    job = str(tmp_path / "narrow" / "ws" / "eval")
    allowed = [job, f"/proc/{w1['pid']}"] + safe["f1"]
    outside = [p for p in w1["created"] + w1["wrote"] + w1["opened"] if not _inside(p, allowed)]
    assert outside == [], f"worker 1 could write outside its folder, its owner's files and its /proc: {outside}"
    assert safe["f1_left"] == [] and set(safe["removed1"]) >= set(safe["f1"]), safe
    assert w2["hits"] == [], f"worker 2 found worker 1's marker in {w2['hits']}"
    assert w2["read"] > 0, w2                               # it could read something (the proposal, its own files)

    ctl = res["wide"]
    c1, c2 = ctl["worker1"], ctl["worker2"]
    assert [p for p in c1["created"] if p.startswith("/dev/shm/")], c1
    leaked = [p for p in c2["hits"] if p.startswith("/dev/shm/")]
    assert leaked, f"the control did not leak: the test cannot fail ({c2})"


if __name__ == "__main__":                       # one scenario, in a process of its own (see _run)
    print(json.dumps(scenario(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))))
