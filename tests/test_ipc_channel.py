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
touch another process's shared memory on this machine.

Below, the channels that reached the fresh re-scorer while it ran beside the main worker (a UNIX socket file in
the main worker's folder, a stat of a file there, UDP on localhost): the real evaluator starts the fresh worker
only once the main one, what it left and what it made are gone, and the fresh worker reaches none of them; the
control runs the same two workers side by side (the evaluator's own `_start`), and there they are reached."""

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


@pytest.mark.integration
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



# ---- the fresh re-scorer starts only once the main worker and all it made are gone --------------------------
# The hostile model of tests/fixtures/memo_channels.py opens three channels in whichever worker runs it first
# (a UNIX socket file in its folder served by a daemon it forks, a file whose size is a number, UDP on
# 127.0.0.1) and tries to reach them from a later one; each worker says in its eval.log what it opened and
# reached. Two sandbox policies: the runner's CPU one ("own namespaces": each worker its own IPC, mount and
# network namespaces) and the GPU's ("shared namespaces": the model worker of CUDA IPC, `ipc_policy`, in the
# evaluator's namespaces, where localhost is one for all), here with host buffers.
MEMO_MODEL = Path(__file__).parent / "fixtures" / "memo_channels.py"
POLICIES = ("own namespaces", "shared namespaces")
EVALUATOR = [sys.executable, "-I", "-B", "-m", "autoresearch.harness.evaluator"]     # one request, then "go"


def _memo_workspace(tmp_path: Path, policies: str) -> dict:
    """A workspace as the runner lays it out, the hostile model's checkpoint, the runner's worker policies."""
    import socket

    import numpy as np

    from autoresearch.experiment.evaluate import fresh_job, worker_policy
    from autoresearch.experiment.execute import Workspace
    from autoresearch.harness import checkpoint
    from autoresearch.harness.evaluator import ipc_policy
    os.chmod(tmp_path, 0o755)
    ws = Workspace.at(tmp_path / "ws")
    for d in (ws.src, ws.job):
        d.mkdir(parents=True)
    (ws.src / "models.py").write_text(MEMO_MODEL.read_text())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:   # a port free now: the model's fixed port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    size = 4096 + secrets.randbelow(1 << 20)                        # the number a file's size says
    checkpoint.save(ws.checkpoint, factory="channels", arrays={"bias": np.array([0.5, 1.0, -1.0, 2.0], np.float32)},
                    config={"vocab": 4, "port": port, "size": size, "linger": 0.05})   # 50 ms a forward, once open
    fresh = fresh_job(ws)
    policy, fresh_policy = worker_policy(ws), worker_policy(ws, fresh)
    if policies == "shared namespaces":
        policy, fresh_policy = ipc_policy(policy, []), ipc_policy(fresh_policy, [])
    sandbox.give_to_sandbox(ws.src, ws.checkpoint, ws.job)
    return {"ws": ws, "fresh": fresh, "policy": policy, "fresh_policy": fresh_policy, "size": size, "port": port}


def _shares_localhost(policies: str) -> bool:
    """Whether the two workers share a network namespace (else each its own, whose loopback is down)."""
    return policies == "shared namespaces" or sandbox.isolation()[0] != "namespaces"


def _logs(*paths: Path, evaluator: str = "") -> str:
    out = [f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in paths if p.exists()]
    return "\n".join(out + ([f"--- the evaluator's stderr\n{evaluator[-3000:]}"] if evaluator else []))


def _said(log: Path) -> dict[str, list[dict]]:
    """The model's `memo-channel` lines of an eval.log, by what they say (reached, opened, selfcheck)."""
    out: dict[str, list[dict]] = {}
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if line.startswith("memo-channel "):
            doc = json.loads(line[len("memo-channel "):])
            out.setdefault(doc["what"], []).append(doc)
    return out


def _assert_opened(main: dict, policies: str, log: str) -> None:
    """The main worker opened every channel it could and reached each through itself: the attack is live."""
    assert len(main.get("opened", [])) == 1 and len(main.get("selfcheck", [])) == 1, log
    opened, check = main["opened"][0], main["selfcheck"][0]
    assert opened == {**opened, "socket": "ok", "size": "ok", "udp": "ok"}, log      # bound, written, bound
    assert check["connections"] == 1 and check["sizes"] == 1, log
    if _shares_localhost(policies):
        assert check["datagrams"] == 1, log
    else:          # a network namespace of its own, whose loopback is down: 127.0.0.1 binds, but nothing gets
        assert check["datagrams"] == 0 and "unreachable" in check["why"]["udp"], log     # there, not even its own


@pytest.mark.integration
@pytest.mark.parametrize("policies", POLICIES)
def test_the_fresh_worker_reaches_no_socket_file_size_or_udp_port_the_main_worker_opened(tmp_path, policies):
    """The real evaluator (one request, the real sandbox, the fresh re-score): the main worker opens the three
    channels and checks them itself; the fresh worker, started once the main one, its daemon and its files are
    gone, reaches none of them: connections made 0, sizes read 0, datagrams 0."""
    from autoresearch.harness.evaluator import manifest
    from test_evaluate import T, handmade
    m = _memo_workspace(tmp_path, policies)
    ws, tok = m["ws"], handmade(tmp_path, [0, 1, 2, 3], seed=1)
    req = {"tok_dir": str(tok), "dataset": "hand", "seq_len": T, "eval_tokens": 16 * 4 * T, "holdout_tokens": 0,
           "rows": 4, "device": "cpu", "manifest": manifest(tok), "checkpoint": str(ws.checkpoint),
           "source": str(ws.src), "train_file": "models.py", "job_dir": str(ws.job),
           "record": str(ws.root / "record.json"), "private": str(ws.root / "private.json"), "timeout": 120,
           "sandbox": True, "policy": m["policy"], "tolerance": 1e-3, "fresh_job_dir": str(m["fresh"]),
           "fresh_policy": m["fresh_policy"], "fresh_rows": 4}
    (tmp_path / "request.json").write_text(json.dumps(req))
    r = subprocess.run(EVALUATOR + [str(tmp_path / "request.json")], input="go\n", capture_output=True, text=True,
                       cwd="/", timeout=180)
    logs = _logs(ws.job / "eval.log", m["fresh"] / "eval.log", evaluator=r.stderr)
    assert r.returncode == 0, logs
    rec = json.loads(Path(req["record"]).read_text())
    assert rec["rejected"] is None and rec.get("error") is None and rec["fresh_max_diff"] == 0, (rec, logs)
    assert rec["transfer"] == "host", rec

    main, fresh = _said(ws.job / "eval.log"), _said(m["fresh"] / "eval.log")
    _assert_opened(main, policies, logs)
    assert len(fresh.get("reached", [])) == 1, logs                 # the fresh worker ran the model and tried
    tried = fresh["reached"][0]
    assert tried["folders"] == [str(ws.job)], logs                   # at the main worker's folder
    reached = {k: tried[k] for k in ("connections", "sizes", "datagrams")}
    assert reached == {"connections": 0, "sizes": 0, "datagrams": 0}, logs
    assert set(tried["why"]) == {"socket", "size", "udp"}, logs      # each failed, and why: the files were gone
    assert "FileNotFoundError" in tried["why"]["socket"] and "FileNotFoundError" in tried["why"]["size"], logs
    assert sorted(p.name for p in ws.job.iterdir()) == ["eval.log"], logs   # nothing else of it was left


@pytest.mark.integration
@pytest.mark.parametrize("policies", POLICIES)
def test_control_workers_side_by_side_do_reach_the_main_workers_channels(tmp_path, policies):
    """The control (the test above can fail): the same model, workspace and policies, in the evaluator's own
    workers (its fork server, `_start`, `_call`), but both workers started at once, as before the fresh one
    waited for the main one to be gone. The main worker scores a batch first; the fresh one, beside it, then
    reaches its socket file and its file's size (and, in shared namespaces, its UDP port)."""
    import time

    import torch

    from autoresearch.harness.evaluator import Zygote, _call, _retire, _start
    from test_evaluate import T
    m = _memo_workspace(tmp_path, policies)
    ws = m["ws"]
    m["fresh"].mkdir()
    sandbox.give_to_sandbox(m["fresh"])
    req = {"seq_len": T, "checkpoint": str(ws.checkpoint), "source": str(ws.src), "train_file": "models.py",
           "sandbox": True, "device": "cpu"}
    lanes = [(ws.job, 4, m["policy"]), (m["fresh"], 4, m["fresh_policy"])]
    started: list = []
    with open(tmp_path / "zygote.log", "w") as zlog:
        zygote = Zygote(zlog)
        try:
            workers = _start(req, zygote, time.monotonic() + 120, lanes, 4, "host", started)
            for w in workers:
                w.expect("mapped")
                w.send("go")
                w.expect("ready")
            x = torch.randint(0, 4, (4, T))
            _call(workers[0], x)                 # the main worker's first batch: it opens the channels
            _call(workers[1], x)                 # the fresh worker's, the main one still running
        finally:
            _retire(zygote, started)
            zygote.close()
    logs = _logs(ws.job / "eval.log", m["fresh"] / "eval.log", tmp_path / "zygote.log")
    main, fresh = _said(ws.job / "eval.log"), _said(m["fresh"] / "eval.log")
    _assert_opened(main, policies, logs)
    assert len(fresh.get("reached", [])) == 1, logs
    tried = fresh["reached"][0]
    assert tried["folders"] == [str(ws.job)], logs
    assert tried["connections"] >= 1 and tried["sizes"] >= 1, logs  # the channels the evaluator now closes
    if _shares_localhost(policies):
        assert tried["datagrams"] >= 1, logs
    else:                                                            # cut by the network namespaces anyway
        assert tried["datagrams"] == 0, logs


if __name__ == "__main__":                       # one scenario, in a process of its own (see _run)
    print(json.dumps(scenario(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))))
