"""CUDA IPC through a buffer owner per model worker (issue 27), on a GPU host (not a test; about 30 s).

    python bench/diag_ipc_owner.py [--out ipc_owner.json]

Prints one JSON line per check:
  env        torch, CUDA, the GPU and driver, uid, Landlock and isolation.
  narrow     the evaluator's design: a buffer owner forked by the real zygote exports two buffers; this process
             (as the evaluator) maps them and writes the input; a worker sandboxed with the evaluator's policy
             (`ipc_policy`: of /dev/shm only the owner's files writable) maps them, reads the input and fills the
             output, which this process then reads. ok/fail, the error, and /dev/shm before / during / after
             (each file with the pid it is named for: owner, worker or this process).
  none       the same with nothing of /dev/shm writable: expected to fail.
  refcounts_only  the same with only torch's reference counts writable, not the driver's file: expected to fail
             with "mapping of buffer object failed" if the driver's file is what the mapping needs (issue 27).
  wide       the same with all of /dev/shm writable (the unsafe fix): expected ok; shows what the worker itself
             makes there, i.e. whether an importer needs a file of its own.
  uid_split  (as root) owner and worker as `nobody`, this process root: would let the shared-namespace worker
             drop root (see docs/reliability.md); ok/fail.
  owner_start  the time from the owner's fork to its "ready" (and the mapping here), 5 times, and the median.
  residue    GPU memory residue: process A fills 1 GiB with a known pattern and exits; process B allocates 1 GiB
             with torch.empty and counts the pattern's words. A channel software cannot close where the driver
             does not scrub; measured, not closed, by ar.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r'''
import json, os, pickle, sys, time
t0 = time.time()
import torch
try:
    torch.zeros(1, device="cuda")             # CUDA first, as a model worker starts it loading the model
    fn, args = pickle.loads(open(os.path.join(sys.argv[1], "ipc.pkl"), "rb").read())
    inp, out = fn(*args[0]), fn(*args[1])
    s = int(inp.sum())
    out.fill_(7.0)
    torch.cuda.synchronize()
    print(json.dumps({"ok": True, "pid": os.getpid(), "inp_sum": s, "seconds": round(time.time() - t0, 2)}))
except Exception as e:
    print(json.dumps({"ok": False, "pid": os.getpid(), "error": " ".join(f"{type(e).__name__}: {e}".split())[:600]}))
'''

OWNER = r'''
import os, pickle, sys, torch
from torch.multiprocessing.reductions import reduce_tensor
B, T, V = map(int, sys.argv[1:4])
inp = torch.zeros(B, T, dtype=torch.int64, device="cuda")
out = torch.zeros(B, T, V, dtype=torch.float32, device="cuda")
fn, a = reduce_tensor(inp)
_, b = reduce_tensor(out)
torch.cuda.synchronize()
print("ready " + pickle.dumps((fn, (a, b))).hex(), flush=True)
sys.stdin.read()
'''

RESIDUE_A = r'''
import sys, torch
n = int(sys.argv[1]) // 8
t = torch.full((n,), int(sys.argv[2]), dtype=torch.int64, device="cuda")
torch.cuda.synchronize()
print(int((t == int(sys.argv[2])).sum()), flush=True)
'''

RESIDUE_B = r'''
import sys, torch
n = int(sys.argv[1]) // 8
t = torch.empty((n,), dtype=torch.int64, device="cuda")
torch.cuda.synchronize()
print(int((t == int(sys.argv[2])).sum()), int((t == 0).sum()), flush=True)
'''

B, T, V = 4, 64, 512          # small buffers: the mechanism, not the size


def say(doc: dict, out: list) -> None:
    out.append(doc)
    print(json.dumps(doc), flush=True)


def shm(pids: dict[str, int]) -> list[str]:
    """/dev/shm's entries, each "NAME (WHOSE, mode, uid)" where the name holds a known pid (in hex or decimal)."""
    rows = []
    for name in sorted(os.listdir("/dev/shm")):
        try:
            st = os.stat(f"/dev/shm/{name}")
        except OSError:
            continue
        whose = [k for k, pid in pids.items() if pid and (f".{pid:x}." in name or f".{pid}." in name or
                                                          f"_{pid}_" in name)]
        rows.append(f"{name} ({'/'.join(whose) or 'other'}, {oct(st.st_mode & 0o777)}, uid {st.st_uid})")
    return rows


def policy_for(job: Path, files: list[str], shm_mode: str) -> dict:
    from autoresearch.harness import sandbox
    from autoresearch.harness.evaluator import ipc_policy
    p = sandbox.base_policy()
    p["write"] += [str(job)]
    keep = {"narrow": files, "refcounts_only": [f for f in files if "/cuda.shm." not in f]}.get(shm_mode, [])
    p = ipc_policy(p, keep)
    if shm_mode == "wide":
        p["write"].append("/dev/shm")
    return p


def run_worker(work: Path, job: Path, policy: dict, user: str | None = None) -> dict:
    from autoresearch.harness.evaluator import worker_env
    (work / "policy.json").write_text(json.dumps(policy))
    env = worker_env(job)
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-I", "-B", "-m", "autoresearch.harness.sandbox", str(work / "policy.json"),
                        "--", sys.executable, "-I", "-B", "-c", WORKER, str(job)], cwd=str(job), env=env,
                       capture_output=True, text=True, timeout=180, user=user)
    try:
        doc = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"ok": False, "error": f"rc {r.returncode}: {r.stderr[-600:]}"}
    if not doc.get("ok"):
        doc["stderr_tail"] = r.stderr[-600:]
    return doc


def ipc_check(name: str, zygote, work: Path, shm_mode: str) -> dict:
    """An owner from the real zygote, the evaluator's mapping here, a sandboxed worker's mapping."""
    import torch

    from autoresearch.harness.evaluator import _retire, _Worker
    job = work / f"job-{name}"
    job.mkdir()
    t0 = time.monotonic()
    owner = _Worker(zygote, Path(tempfile.mkdtemp(prefix="ar-owner-")),
                    {"rows": B, "seq_len": T, "vocab": V, "device": "cuda"}, time.monotonic() + 120, kind="owner")
    doc: dict = {"check": name, "owner_pid": owner.pid}
    try:
        (job / "ipc.pkl").write_bytes(owner.export())
    except Exception as e:
        _retire(zygote, [owner])
        return {**doc, "ok": False, "error": f"owner/mapping here: {e}"}
    doc.update(owner_ready_s=round(time.monotonic() - t0, 3), owner_files=owner.files)
    owner.inp.copy_(torch.arange(B * T, device=owner.inp.device).view(B, T))
    torch.cuda.synchronize()
    doc["shm_during"] = shm({"owner": owner.pid, "evaluator": os.getpid()})
    w = run_worker(work, job, policy_for(job, owner.files, shm_mode))
    doc["worker"] = w
    doc["shm_after_worker"] = shm({"owner": owner.pid, "evaluator": os.getpid(), "worker": w.get("pid", 0)})
    doc["ok"] = bool(w.get("ok")) and w.get("inp_sum") == B * T * (B * T - 1) // 2 and \
        bool((owner.out == 7.0).all())
    pid = owner.pid
    _retire(zygote, [owner])                  # as the evaluator: close, reap, remove the owner's files
    doc["owner_files_left"] = [n for n in os.listdir("/dev/shm") if f".{pid:x}." in n or f"_{pid}_" in n]
    if w.get("pid"):                          # what the worker itself made (only "wide" lets it)
        from autoresearch.harness.evaluator import remove_owner_files
        doc["worker_files_removed"] = remove_owner_files(w["pid"])
    return doc


def uid_split(work: Path) -> dict:
    """Owner and worker as nobody, this process (root) maps the buffers."""
    import torch

    from autoresearch.harness import sandbox
    from autoresearch.harness.evaluator import _ref_counters, owner_files
    if os.geteuid() != 0:
        return {"check": "uid_split", "skipped": "not root"}
    if sandbox._gpu_nodes_closed():
        return {"check": "uid_split", "skipped": "a GPU device node is not open to every user"}
    job = work / "job-uid"
    job.mkdir()
    os.chown(job, 65534, 65534)
    try:
        owner = subprocess.Popen([sys.executable, "-I", "-c", OWNER, str(B), str(T), str(V)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, user=65534, group=65534,
                                 extra_groups=[], cwd="/")
    except OSError as e:
        return {"check": "uid_split", "skipped": f"nobody cannot run {sys.executable}: {e}"}
    doc: dict = {"check": "uid_split", "owner_pid": owner.pid}
    try:
        line = owner.stdout.readline().strip()
        if not line.startswith("ready "):
            return {**doc, "ok": False, "error": "owner: " + owner.stderr.read()[-600:]}
        pickled = bytes.fromhex(line[6:])
        fn, args = pickle.loads(pickled)
        try:
            inp, out = fn(*args[0]), fn(*args[1])
        except Exception as e:
            return {**doc, "ok": False, "error": f"mapping here (root): {type(e).__name__}: {e}"}
        inp.copy_(torch.arange(B * T, device=inp.device).view(B, T))
        torch.cuda.synchronize()
        files = sorted(set(owner_files(owner.pid)) | set(_ref_counters(*args)))
        (job / "ipc.pkl").write_bytes(pickled)
        os.chown(job / "ipc.pkl", 65534, 65534)
        doc["shm_during"] = shm({"owner": owner.pid})
        w = run_worker(work, job, policy_for(job, files, "narrow"), user="nobody")
        doc["worker"] = w
        doc["ok"] = bool(w.get("ok")) and bool((out == 7.0).all())
        del inp, out
        return doc
    finally:
        owner.stdin.close()
        owner.wait(timeout=30)
        from autoresearch.harness.evaluator import remove_owner_files
        remove_owner_files(owner.pid)


def owner_start(zygote) -> dict:
    """The owner as the evaluator starts it: fork (the zygote's), CUDA, two buffers, exported ("ready"); then
    the mapping here."""
    from autoresearch.harness.evaluator import _retire, _Worker
    ready, mapped = [], []
    for _ in range(5):
        t0 = time.monotonic()
        owner = _Worker(zygote, Path(tempfile.mkdtemp(prefix="ar-owner-")),
                        {"rows": B, "seq_len": T, "vocab": V, "device": "cuda"}, time.monotonic() + 120,
                        kind="owner")
        try:
            line = owner._readline()
            if not line.startswith("ready "):
                return {"check": "owner_start", "ok": False, "error": line[:600] or "see the zygote's log"}
            ready.append(round(time.monotonic() - t0, 3))
            fn, args = pickle.loads(bytes.fromhex(line.split()[1]))
            owner.inp, owner.out = fn(*args[0]), fn(*args[1])
            mapped.append(round(time.monotonic() - t0, 3))
        finally:
            _retire(zygote, [owner])
    return {"check": "owner_start", "fork_to_ready_s": ready, "median_s": statistics.median(ready),
            "with_mapping_here_s": mapped, "median_with_mapping_s": statistics.median(mapped)}


def residue(gib: float) -> dict:
    n = int(gib * 2**30)
    pattern = 0x41525245534944  # "ARRESID"
    a = subprocess.run([sys.executable, "-I", "-c", RESIDUE_A, str(n), str(pattern)], capture_output=True, text=True,
                       timeout=120)
    b = subprocess.run([sys.executable, "-I", "-c", RESIDUE_B, str(n), str(pattern)], capture_output=True, text=True,
                       timeout=120)
    try:
        found, zeros = map(int, b.stdout.split())
    except ValueError:
        return {"check": "residue", "error": (a.stderr + b.stderr)[-800:]}
    words = n // 8
    return {"check": "residue", "bytes": n, "a_wrote_words": int(a.stdout.strip() or 0), "b_found_words": found,
            "b_found_fraction": round(found / words, 6), "b_zero_fraction": round(zeros / words, 6),
            "scrubbed": found == 0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="ipc_owner.json")
    ap.add_argument("--residue-gib", type=float, default=1.0)
    args = ap.parse_args()
    import torch

    from autoresearch.harness import sandbox
    from autoresearch.harness.evaluator import Zygote
    results: list = []
    t_all = time.monotonic()
    say({"check": "env", "torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available(),
         "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
         "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                  capture_output=True, text=True).stdout.strip() if shutil.which("nvidia-smi") else None,
         "uid": os.geteuid(), "landlock": sandbox.available(), "isolation": sandbox.isolation()[0],
         "shm_before": shm({"this": os.getpid()})}, results)
    if not torch.cuda.is_available():
        return 1
    work = Path(tempfile.mkdtemp(prefix="ar-diag-ipc-"))
    os.chmod(work, 0o755)
    log = open(work / "zygote.log", "w")
    zygote = Zygote(log)
    try:
        for mode in ("narrow", "none", "refcounts_only", "wide"):
            say(ipc_check(mode, zygote, work, mode), results)
        say(uid_split(work), results)
        say(owner_start(zygote), results)
        say(residue(args.residue_gib), results)
    finally:
        zygote.close()
        log.close()
    say({"check": "done", "seconds": round(time.monotonic() - t_all, 1),
         "shm_after": shm({"this": os.getpid()}), "zygote_log_tail": (work / "zygote.log").read_text()[-1500:]},
        results)
    Path(args.out).write_text(json.dumps(results, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
