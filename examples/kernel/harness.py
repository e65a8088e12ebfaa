"""What the gate and the timing harness share: the candidate runs in a worker process of its own, in a
sandbox that can read kernel.py, worker.py and inputs.py (a fresh copy) and nothing else of this folder, so
it can neither read the reference nor reach this process. Fixed harness code: a proposal may not change it."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
CANDIDATE_FILES = ("kernel.py", "worker.py", "inputs.py")


class CandidateError(Exception):
    """The candidate failed or answered something malformed."""


class Worker:
    def __init__(self, device: str):
        self.device = device
        self.dir = Path(tempfile.mkdtemp(prefix="candidate-"))
        for name in CANDIDATE_FILES:
            shutil.copyfile(HERE / name, self.dir / name)
        scratch = self.dir / "scratch"
        scratch.mkdir()
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES",
                                                            "LD_LIBRARY_PATH", "CUDA_HOME")}
        env.update(HOME=str(scratch), TMPDIR=str(scratch), TRITON_CACHE_DIR=str(scratch / "triton"),
                   TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"), PYTHONDONTWRITEBYTECODE="1",
                   PYTHONUNBUFFERED="1",
                   TORCHINDUCTOR_COMPILE_THREADS="1")   # no compile workers: a sandboxed process may not start them
                                                        # where it runs as root (see ar's request.py)
        cmd = [sys.executable, "-E", "-s", "-B", str(self.dir / "worker.py")]
        wrap = _sandbox(self.dir, scratch)
        self.log = open(self.dir / "worker.log", "wb")
        self.proc = subprocess.Popen([*wrap, *cmd], cwd=self.dir, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log)

    def run(self, seeds: list[int], n: int, v: int, dtype: str) -> torch.Tensor:
        """Send one request and read its answer: float32 [len(seeds), n]."""
        req = {"op": "run", "seeds": seeds, "n": n, "v": v, "dtype": dtype, "device": self.device}
        try:
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
            head = self.proc.stdout.readline()
        except OSError as e:
            raise CandidateError(f"the worker is gone ({e}){self.tail()}") from None
        try:
            doc = json.loads(head)
        except ValueError:
            raise CandidateError(f"the worker answered {head[:200]!r}{self.tail()}") from None
        if not isinstance(doc, dict) or not doc.get("ok"):
            raise CandidateError(f"the kernel failed: {doc.get('error') if isinstance(doc, dict) else doc}")
        if doc.get("count") != len(seeds) or doc.get("n") != n:
            raise CandidateError(f"the worker answered for {doc.get('count')} x {doc.get('n')}, "
                                 f"asked {len(seeds)} x {n}")
        size = len(seeds) * n * 4
        data = self.proc.stdout.read(size)
        if len(data) != size:
            raise CandidateError(f"the worker sent {len(data)} of {size} bytes{self.tail()}")
        return torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy()).reshape(len(seeds), n)

    def tail(self) -> str:
        self.log.flush()
        lines = (self.dir / "worker.log").read_text(errors="replace").strip().splitlines()
        return f"; its last line: {lines[-1][:300]}" if lines else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _sandbox(folder: Path, scratch: Path) -> list[str]:
    """ar's sandbox around the worker (nested inside the one ar runs this harness in), when it is there."""
    try:
        from autoresearch.harness import sandbox
    except ImportError:
        print("warning: ar's sandbox is not importable; the candidate runs unsandboxed", file=sys.stderr)
        return []
    ok, why = sandbox.available()
    if not ok:
        print(f"warning: the candidate runs unsandboxed ({why})", file=sys.stderr)
        return []
    policy = sandbox.base_policy()
    policy["read"] += [str(folder)]          # the three files, its own log and scratch: nothing else of ours
    policy["write"] += [str(scratch)]
    (folder.parent / f"{folder.name}-policy.json").write_text(json.dumps(policy))
    return [sys.executable, "-I", "-B", sandbox.__file__,   # by path: -I ignores PYTHONPATH, where ar may be
            str(folder.parent / f"{folder.name}-policy.json"), "--"]


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def fresh_seeds(k: int) -> list[int]:
    """Seeds no candidate can know in advance: from the OS, new on every run."""
    return [int.from_bytes(os.urandom(6), "little") for _ in range(k)]
