"""A fork server for model workers: torch imported once, a fresh sandboxed process for every evaluation.

    python -I -B -m autoresearch.harness.zygote          (started by the evaluator; one job per stdin line)

It runs only trusted code and holds no data (the evaluator, which holds the validation tokens, is its parent,
not it). For each job {"job_dir", "source", "policy", "sandbox", "env"} it forks a child that leaves the
session, restricts itself to the policy (Landlock; the child is single-threaded right after fork), resets its
environment, closes every inherited descriptor, connects to the evaluator through two FIFOs in the job folder
(`to_worker`, `from_worker`) and runs worker.main. It answers "pid N" for each job. No process that ran one
proposal's code serves another: each child exits after its job, and the zygote (a child subreaper) kills and
reaps whatever a child left behind when the evaluator says "clean" or "clean PID ..." (all but those pids and
what is below them: the main worker's, before the fresh one loads the proposal; then everything, after every
evaluation; it answers "clean").

A job {"owner": true, "job_dir", "rows", "seq_len", "vocab", "device"} is a model worker's buffer owner on a GPU
(`owner`): trusted, not sandboxed, in the zygote's environment, its stderr the evaluator's log, its FIFOs in a
private folder of the evaluator's. A child of the zygote because the zygote has torch imported and no CUDA
context, so that a forked child can start one.

The evaluator starts it with `fork_server()`: forked from itself right after importing torch, before it reads any
request (so it holds no data yet), rather than as a new interpreter that imports torch again (about 1.2 CPU-s a
session). Elsewhere (a test beside other threads) it is started as above.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback

from . import sandbox, worker
from .sandbox import remove_owner_files


def _child(job: dict) -> int:
    os.setsid()
    d, model = job["job_dir"], not job.get("owner")
    if model:
        log = os.open(os.path.join(d, "eval.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 2)
    fin = os.open(os.path.join(d, "to_worker"), os.O_RDONLY)      # before the sandbox: the FIFOs stay the
    fout = os.open(os.path.join(d, "from_worker"), os.O_WRONLY)   # evaluator's, the worker never opens them
    if model and job.get("sandbox", True):
        sandbox.restrict_policy(job["policy"])     # its own namespaces, not root, then Landlock
    os.dup2(fin, 0)
    os.dup2(fout, 1)
    os.closerange(3, 1 << 16)              # nothing of the zygote's pipes or the evaluator's reaches the model
    if model:
        os.environ.clear()
        os.environ.update(job.get("env", {}))
        os.chdir(job["source"])
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return worker.main(d) if model else owner(job)


def owner(job: dict) -> int:
    """A model worker's buffer owner: allocate its input and output buffers on the GPU, export them (CUDA IPC
    handles, pickled, as hex: "ready HEX"), keep them until "exit" or the end of input. The files in /dev/shm
    named for its pid are the only ones there its worker may write; the evaluator removes them once both are
    reaped (sandbox.remove_owner_files), and any left by a dead process of the same pid go first, here."""
    import pickle

    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    remove_owner_files(os.getpid())
    B, T, V = job["rows"], job["seq_len"], job["vocab"]
    try:
        inp = torch.zeros(B, T, dtype=torch.int64, device=job["device"])
        out = torch.zeros(B, T, V, dtype=torch.float32, device=job["device"])
        fn, a = reduce_tensor(inp)
        _, b = reduce_tensor(out)
        torch.cuda.synchronize()
        handles = pickle.dumps((fn, (a, b)))
    except Exception as e:
        traceback.print_exc()
        print(" ".join(f"err {type(e).__name__}: {e}".split())[:2000], flush=True)
        return 1
    print("ready " + handles.hex(), flush=True)
    for line in sys.stdin:
        if line.split()[:1] == ["exit"]:
            break
    return 0


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))     # the evaluator's stop: workers are reaped below
    try:
        return _serve()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # reaping every worker is not to be cut short
        sandbox._kill_below(os.getpid())


def _serve() -> int:
    import torch  # noqa: F401  (the point: imported once, before any fork)
    import safetensors.torch  # noqa: F401

    sandbox.sandbox_ids()                 # looked up once here, not in each forked worker
    libc = sandbox._libc()
    if libc is not None:
        libc.prctl(sandbox._PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        if line.split()[0] == "clean":     # an evaluation is over: its workers' leftovers (daemons included) go;
            spare = [int(pid) for pid in line.split()[1:]]    # "clean PID ...": all but those (the fresh worker's)
            sandbox._kill_below(os.getpid(), spare)
            print("clean", flush=True)
            continue
        job = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(job)
            except BaseException:
                traceback.print_exc()
            finally:
                try:
                    sys.stderr.flush()
                except Exception:
                    pass
                os._exit(code if isinstance(code, int) else 1)
        print(f"pid {pid}", flush=True)
    return 0


class Forked:
    """The fork server as a child of this process, with the parts of `subprocess.Popen` that the evaluator uses:
    `stdin`/`stdout` (text, line-buffered), `pid`, `returncode`, `poll`, `wait`, `terminate`, `kill`."""

    def __init__(self, pid: int, stdin, stdout):
        self.pid, self.stdin, self.stdout, self.returncode = pid, stdin, stdout, None
        try:
            self._fd = os.pidfd_open(pid)      # readable once the child has exited: waits without polling
        except (AttributeError, OSError):
            self._fd = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("the model fork server", timeout)
            if self._fd is not None:
                select.select([self._fd], [], [], left)
            else:
                time.sleep(0.01 if left is None else min(0.01, left))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_server() -> Forked:
    """Import torch here, then fork the fork server from this process (single-threaded, holding no data yet):
    stdin and stdout are pipes to this process, stderr stays this process's, every other descriptor is closed,
    cwd is /, and it stays in this process group (whoever stops the evaluator stops both)."""
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    down_r, down_w = os.pipe()
    up_r, up_w = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.dup2(down_r, 0)
            os.dup2(up_w, 1)
            os.closerange(3, 1 << 16)          # nothing of the evaluator's pipes or files reaches the fork server
            os.chdir("/")
            sys.stdin = open(0, "r", closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            code = main()
        except BaseException:
            traceback.print_exc()
        finally:
            sandbox.exit_now(code if isinstance(code, int) else 1)
    os.close(down_r)
    os.close(up_w)
    return Forked(pid, open(down_w, "w", buffering=1), open(up_r, "r", buffering=1))


if __name__ == "__main__":
    sandbox.exit_now(main())
