"""The trusted evaluator: bits per byte of a checkpoint, computed here from the model's logits.

    python -I -B -m autoresearch.harness.evaluator serve            (a session's: one request per line)
    python -I -B -m autoresearch.harness.evaluator REQUEST.json     (one request; waits for "go" on stdin)

It runs in a fresh interpreter with no checkout on sys.path and never imports the proposal. It holds the
validation tokens and the token-bytes table; the proposal's model runs in a sandboxed worker (worker.py) that
cannot open either, gets token ids only (never the targets) through a shared buffer, and returns logits.

The buffers (token ids [rows, T] int64 in, logits [rows, T, vocab] float32 out): on the CPU, files in the worker's
folder that both map. On a GPU, CUDA IPC: each model worker (the main one, the fresh one) gets a buffer owner of
its own, a short-lived trusted process forked by the zygote (zygote.owner) that allocates that worker's two
buffers and exports them; the evaluator maps the same handles. The worker then shares the evaluator's namespaces
and uid (sandbox.py, "shared_ipc"), and the only files of /dev/shm it may write are its owner's (`owner_files`:
the CUDA driver's file of the exporting process, which an importer must open for writing, and torch's reference
counts). The owner lives until its worker is closed, then exits; once both are reaped, those files are removed
(`remove_owner_files`), so nothing a worker wrote there reaches a later worker (the fresh one, the next
experiment's). Where CUDA IPC fails (the owner, the mapping here or the worker's), the evaluation falls back to
host transfer, in workers of their own namespaces, and says why in the record.
Here: cross-entropy = logsumexp(logits) − logit[target], summed in float64 over exactly `eval_tokens` targets,
divided by ln 2 × the UTF-8 bytes those targets stand for (special tokens have no bytes and count in neither).

Checks, each a rejection with a reason a user can read:
- the validation files, token-bytes table and tokenizer hash to the session's manifest (sha256);
- logits are finite and of shape [rows, T, vocab];
- causality: at a batch chosen in secret, a few rows are sent again with the tokens after a secret cut replaced
  by random ones, in a shuffled batch; logits before the cut must not change (a model that looks ahead fails).
  Cuts fall anywhere in a row, one in each of as many equal stretches as there are rows (`_cuts`);
- purity: the other rows of that batch, sent again in other positions, must give the same logits (a model
  that learns from what it is shown, or keys on batch position, fails);
- freshness: a secret sample of rows from every batch scored (hold-out included) is scored again by a second
  worker process, started only once the main worker, its buffer owner, every process it left and every file it
  made in its folder are gone (no socket to connect to, no file to read or stat: the two never run side by
  side), shown one call of random rows first (not scored), then the sample with batch-mates from other
  batches, each row only up to a secret cut (random tokens after it); its losses before the cut must match the
  main pass's (a model that learns from the evaluation stream, a cache or a memo of what it was shown, fails even
  when it repeats itself for the purity and causality checks; and so does one that looks ahead and answers the
  causality probe of a row as it answered the row, since here no row is ever shown whole).
A hold-out slice (validation rows after the evaluated ones) is scored the same way and written only to the
private file the runner names, never to the record or any log.

The record: val_bpb, eval_tokens, eval_bytes, dataset, seq_len, rejected (a reason, or None), causal_max_diff,
purity_max_diff, fresh_max_diff, seconds {total, after_go, prestarted (how long before "go" the workers were
started; 0 without "prestart"), ready, main, holdout, fresh (each after "go": the main worker's model loaded, its
pass, the hold-out's, the fresh re-score)}; transfer ("ipc" or "host": how the buffers were
shared) and, only where a CUDA evaluation fell back to the host, transfer_note (one line: why CUDA IPC failed).

The runner's word on a request (serve: one line each, after the request): "prestart ID", optional, when training
is near its end (the workers and their buffer owners start then and do trusted work only: buffers, CUDA context,
mapping; no proposal code is loaded before "go"), then "go ID" (the checkpoint is complete and every process of
the run is gone) or "stop ID" (nothing to score).

REQUEST (JSON): tok_dir, dataset, seq_len, eval_tokens, holdout_tokens, rows, device, manifest {file: sha256},
checkpoint, source, train_file, job_dir, record, private, timeout, sandbox (bool), policy (the worker's
sandbox policy), tolerance; fresh_job_dir, fresh_policy, fresh_rows, fresh_calls (the fresh worker's folder, policy,
rows a call and calls, FRESH_CALLS's for the device by default; without fresh_job_dir there is no fresh re-score).
"""

from __future__ import annotations

import hashlib
import json
import signal
import math
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .env import KEPT_ENV  # noqa: E402
from .sandbox import owner_files, process_alive as _alive, remove_owner_files

FILES = ("meta.json", "tokenizer.json", "token_bytes.npy", "val.bin", "val.idx.npy")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest(tok_dir: Path) -> dict[str, str]:
    """sha256 of every file the evaluator reads; taken at session start, checked before every evaluation."""
    return {name: sha256_file(Path(tok_dir) / name) for name in FILES}


class Rejected(Exception):
    """The checkpoint or the model's behaviour disqualifies the run (the message says why)."""


class _NoIPC(Exception):
    """CUDA IPC failed on the trusted side (the buffer owner, or the mapping here): host transfer instead."""


class Release:
    """The runner's word on one request, a line at a time from `readline`: an optional "prestart ID", then "go ID"
    or "stop ID" (without an id when `rid` is None: a single request's). Anything else counts as "stop"."""

    def __init__(self, rid, readline):
        self.rid, self.readline = rid, readline
        self.word: str | None = None             # the last word read: prestart, go, stop
        self.at: dict[str, float] = {}           # when each word arrived (monotonic)

    def _next(self) -> None:
        parts = self.readline().split()
        word = parts[0] if parts else "stop"
        if parts[1:] != ([] if self.rid is None else [str(self.rid)]) or word not in ("prestart", "go", "stop"):
            word = "stop"
        self.word = word
        self.at.setdefault(word, time.monotonic())

    @property
    def settled(self) -> bool:
        """Whether "go" or "stop" has been read (serve reads on until it has, whatever the evaluation did)."""
        return self.word in ("go", "stop")

    def prestart(self) -> None:
        """Return at "prestart" or "go"; raise Rejected at "stop"."""
        if self.word is None:
            self._next()
        if self.word == "stop":
            raise Rejected("the run ended without a checkpoint")

    def go(self) -> None:
        """Return at "go" (the checkpoint is complete); raise Rejected at "stop"."""
        while not self.settled:
            self._next()
        if self.word != "go":
            raise Rejected("the run ended without a checkpoint")


class Zygote:
    """The fork server (zygote.py) that makes one fresh sandboxed model process per evaluation."""

    def __init__(self, log, fork: bool = False):
        """`fork`: forked from this process (the evaluator: single-threaded, no data read yet), saving the fork
        server's own torch import; else a new interpreter (`log` its stderr)."""
        if fork:
            from .zygote import fork_server
            self.proc = fork_server()
        else:
            self.proc = subprocess.Popen([sys.executable, "-I", "-B", "-m", "autoresearch.harness.zygote"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                         bufsize=1, cwd="/")   # in the evaluator's process group: stopped with it
        self.ready = False

    def _start(self) -> None:
        if not self.ready:
            if self.proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the model fork server did not start; see evaluator.log")
            self.ready = True

    def clean(self, spare: tuple[int, ...] = ()) -> None:
        """Kill and reap whatever the last workers (and their buffer owners) left behind, now (not when the next
        job comes); all but the `spare` pids and what is below them."""
        self._start()
        self.proc.stdin.write(" ".join(["clean", *map(str, spare)]) + "\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "clean":
            raise RuntimeError("the model fork server stopped; see evaluator.log")

    def spawn(self, job: dict) -> int:
        self._start()
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split()
        if len(line) != 2 or line[0] != "pid":
            raise RuntimeError("the model fork server stopped; see evaluator.log")
        return int(line[1])

    def close(self) -> None:
        """Stop the fork server; it kills and reaps every worker first. A worker left as a zombie for init to
        reap would keep its Landlock rules, and with them the deleted workspace's inodes, alive."""
        from .sandbox import stop_on_end_of_input
        stop_on_end_of_input(self.proc, grace=5)     # end of input: it reaps its workers and leaves by itself


def worker_env(d: Path) -> dict[str, str]:
    """A model worker's environment: what every process of a run keeps, and its folder as HOME and TMPDIR."""
    env = {k: v for k, v in os.environ.items() if k in KEPT_ENV}
    env.update(HOME=str(d), TMPDIR=str(d), PYTHONUNBUFFERED="1")
    return env


class _Worker:
    """A child of the zygote and its line protocol over two FIFOs in its folder `d`: a sandboxed model process
    (kind "model", the folder its job folder), or the buffer owner of one (kind "owner", the folder a private one
    of the evaluator's that no worker can reach: the owner's answer is unpickled here)."""

    def __init__(self, zygote: Zygote, d: Path, job: dict, deadline: float, kind: str = "model"):
        for name in ("to_worker", "from_worker"):
            (d / name).unlink(missing_ok=True)
            os.mkfifo(d / name, 0o600)
        self.dir, self.kind, self.deadline = d, kind, deadline
        self.what = "the model process" if kind == "model" else "the buffer owner"
        self.inp = self.out = None       # the buffers, as mapped here
        self.owner: _Worker | None = None    # (a model worker on CUDA IPC) its buffer owner
        self.files: list[str] = []       # (an owner) its files in /dev/shm: its worker's to write
        self.rfd = os.open(d / "from_worker", os.O_RDONLY | os.O_NONBLOCK)
        self.pid = zygote.spawn({**job, "job_dir": str(d), "owner": kind == "owner"})
        while True:                                  # the writer end opens once the worker opens its reader end
            try:
                self.wfd = os.open(d / "to_worker", os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                if time.monotonic() > self.deadline or not _alive(self.pid):
                    raise Rejected(f"{self.what} did not start; see eval.log") from None
                time.sleep(0.005)
        os.set_blocking(self.wfd, True)
        self._buf = b""

    def send(self, line: str) -> None:
        try:
            os.write(self.wfd, (line + "\n").encode())
        except OSError:
            raise Rejected(f"{self.what} exited early; see eval.log") from None

    def _readline(self) -> str:
        import select
        while b"\n" not in self._buf:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.rfd], [], [], left)[0]:
                raise Rejected(f"{'the model' if self.kind == 'model' else self.what} took longer than the "
                               "evaluation allowance")
            try:
                chunk = os.read(self.rfd, 4096)
            except BlockingIOError:
                continue
            if not chunk:
                if not _alive(self.pid) or len(self._buf) == 0:
                    return ""
                continue
            self._buf += chunk
            if len(self._buf) > 1 << 16:
                raise Rejected(f"{self.what} flooded the evaluator's channel")
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace").strip()

    def expect(self, what: str) -> None:
        line = self._readline()
        if line == what:
            return
        if line.startswith("err "):
            raise Rejected(f"the model failed: {line[4:]}")
        raise Rejected(f"{self.what} exited early; see eval.log" if not line else
                       f"{self.what} said {line[:80]!r} instead of {what!r}")

    def export(self) -> bytes:
        """(an owner) Wait until it has made and exported its worker's buffers; map them here too; note its files
        in /dev/shm. Returns the pickled handles, for the worker."""
        line = self._readline()
        if not line.startswith("ready "):
            raise _NoIPC(f"the buffer owner failed: {line[4:] if line.startswith('err ') else 'see evaluator.log'}")
        pickled = bytes.fromhex(line[len("ready "):])
        fn, args = pickle.loads(pickled)         # from the owner, trusted, over a FIFO no worker can open
        try:
            self.inp, self.out = fn(*args[0]), fn(*args[1])
        except Exception as e:
            raise _NoIPC(f"the evaluator could not map the buffers: {type(e).__name__}: {e}") from None
        self.files = sorted(set(owner_files(self.pid)) | set(_ref_counters(*args)))
        return pickled

    def close(self) -> None:
        self.inp = self.out = None               # the evaluator's mapping goes before the owner does
        try:
            self.send("exit")
        except Rejected:
            pass
        deadline = time.monotonic() + 5
        while _alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            os.killpg(self.pid, 9)
        except OSError:
            pass
        for fd in (self.rfd, self.wfd):
            try:
                os.close(fd)
            except OSError:
                pass


def _batches(tok_dir: Path, rows: int, seq_len: int, n_tokens: int, skip_tokens: int = 0):
    """(x, y) CPU batches covering n_tokens targets after the first skip_tokens, in the split's fixed order."""
    from .loader import PackedLoader
    per = rows * seq_len
    skip, n = -(-skip_tokens // per) if skip_tokens else 0, -(-n_tokens // per)
    out = []
    with PackedLoader(tok_dir, "val", rows, seq_len, shuffle=False, prefetch=2) as loader:
        for i in range(skip + n):
            x, y = next(loader)
            if i >= skip:
                out.append((x.clone(), y.clone()))
    return out


class Evaluation:
    """One evaluation of one checkpoint; its phases are methods, in order: `check_data` (the session's data is
    the data it started with; the rows, from the server's cache), `open` (the workers start at
    `release.prestart()`, buffers mapped, no proposal loaded), `go` (after `release.go()`: the checkpoint is
    complete and the run's processes are gone; the model loads), `score` (the main and hold-out slices, the
    causality check on a secret batch), `check_fresh` (a fresh worker scores a secret sample again once the main
    one and everything it left are gone), then `close` (nothing a worker started outlives it). `run` strings
    them together and returns the record (the runner's) and the hold-out (private)."""

    def __init__(self, req: dict, zygote: Zygote, release: Release, cache: dict | None = None):
        import torch
        self.req, self.zygote, self.release = req, zygote, release
        self.t0 = time.monotonic()
        self.tok_dir, self.job = Path(req["tok_dir"]), Path(req["job_dir"])
        self.B, self.T = int(req["rows"]), int(req["seq_len"])
        self.record = {"val_bpb": None, "eval_tokens": int(req["eval_tokens"]), "eval_bytes": None,
                       "dataset": req["dataset"], "seq_len": self.T, "rejected": None, "causal_max_diff": None,
                       "purity_max_diff": None, "fresh_max_diff": None}
        self.private = {"holdout_bpb": None, "holdout_tokens": 0}
        self.cache = {} if cache is None else cache
        self.started: list[_Worker] = []         # every child of the zygote this evaluation has running
        self.device = torch.device(req["device"])
        self.phases: dict[str, float] = {}
        self.worker = self.fresh = self.fresh_lane = None
        self.sample: dict = {}

    def run(self) -> dict:
        try:
            self.check_data()
            self.open()
            self.go()
            self.score()
            if self.fresh_lane is not None:
                self.check_fresh()
            self.record["seconds"] = {"total": round(time.monotonic() - self.t0, 3),
                                      "after_go": round(time.monotonic() - self.t_go, 3), **self.phases}
        except Rejected as e:
            self.record.update(val_bpb=None, rejected=str(e))
            self.private = {"holdout_bpb": None, "holdout_tokens": 0}
        finally:
            self.close()
        return {"record": self.record, "private": self.private}

    def check_data(self) -> None:
        import numpy as np
        import torch
        req, tok_dir, B, T = self.req, self.tok_dir, self.B, self.T
        for name, digest in req["manifest"].items():
            if sha256_file(tok_dir / name) != digest:
                raise Rejected(f"the data changed during the session ({name} no longer has the hash taken at "
                               "its start); restore it (`ar prepare`) and start again")
        self.token_bytes = torch.from_numpy(np.load(tok_dir / "token_bytes.npy").astype(np.int64))
        self.V = int(self.token_bytes.numel())
        meta = json.loads((tok_dir / "meta.json").read_text())
        holdout = int(req.get("holdout_tokens") or 0)
        if holdout and self.record["eval_tokens"] + holdout + 2 * B * T > meta["val"]["tokens"]:
            holdout = 0                          # too small a split: no hold-out rather than a re-used one
        key = (str(tok_dir), B, T, self.record["eval_tokens"], holdout, json.dumps(req["manifest"], sort_keys=True))
        if key not in self.cache:                # a server keeps the rows of the session's data in memory
            self.cache.clear()
            self.cache[key] = (_batches(tok_dir, B, T, self.record["eval_tokens"]),
                               _batches(tok_dir, B, T, holdout, skip_tokens=self.record["eval_tokens"])
                               if holdout else [])
        self.batches, self.held = self.cache[key]
        self.holdout = holdout

    def open(self) -> None:
        req = self.req
        self.release.prestart()                  # near the end of training, or at "go"
        self.t_pre = time.monotonic()
        deadline = self.t_pre + float(req["timeout"])
        self.lanes = [(self.job, self.B, req["policy"])]   # (folder, rows, policy) of the main model worker
        if req.get("fresh_job_dir"):             # the fresh one's: it loads the proposal once the main one is gone
            fresh_dir = Path(req["fresh_job_dir"])
            fresh_dir.mkdir(exist_ok=True)
            from .sandbox import give_to_sandbox
            give_to_sandbox(fresh_dir)
            self.fresh_lane = (fresh_dir, min(self.B, int(req.get("fresh_rows") or self.B)), req["fresh_policy"])
        transfers = ["ipc", "host"] if self.device.type == "cuda" else ["host"]
        self.worker, self.fresh = _open(req, self.zygote, deadline, self.lanes, self.fresh_lane, self.V, transfers,
                                        self.started, self.record)

    def go(self) -> None:
        self.release.go()                        # the checkpoint is complete; the run's processes are gone
        self.t_go = self.release.at["go"]
        self.phases["prestarted"] = round(max(0.0, self.t_go - self.t_pre), 3)
        self.deadline = self.t_go + float(self.req["timeout"])
        for w in self.started:
            w.deadline = self.deadline
        self.worker.send("go")
        try:
            self.worker.expect("ready")
        except Rejected as e:
            if self.record["transfer"] != "ipc":
                raise
            # the model could not load in the shared-namespace worker (something the GPU stack needs was refused):
            # the host path, in workers of their own namespaces, where a broken model fails the same way
            _fall_back(self.zygote, self.started, self.record, e)
            self.worker, self.fresh = _open(self.req, self.zygote, self.deadline, self.lanes, self.fresh_lane,
                                            self.V, ["host"], self.started, self.record)
            self.worker.send("go")
            self.worker.expect("ready")
        self.phases["ready"] = round(time.monotonic() - self.t_go, 3)

    def score(self) -> None:
        record, batches, held = self.record, self.batches, self.held
        self.token_bytes = self.token_bytes.to(self.device)
        self.secret = secrets.SystemRandom()
        check_at = self.secret.randrange(len(batches))
        if self.fresh_lane:
            calls = max(1, int(self.req.get("fresh_calls") or FRESH_CALLS.get(self.req["device"], 4)))
            self.sample = _fresh_sample(self.secret, len(batches) + len(held), self.B, self.fresh_lane[1] * calls)
        nats, nbytes = _score(self.worker, batches, self.token_bytes, record["eval_tokens"], self.device,
                              check=(check_at, self.secret, self.req, record), keep=self.sample)
        if nbytes == 0:
            raise Rejected(f"the {record['eval_tokens']} evaluated targets stand for no bytes")
        bpb = nats / (math.log(2) * nbytes)
        if not math.isfinite(bpb):
            raise Rejected("val_bpb is not finite")
        record.update(val_bpb=bpb, eval_bytes=nbytes)
        self.phases["main"] = round(time.monotonic() - self.t_go, 3)
        if held:
            hn, hb = _score(self.worker, held, self.token_bytes, self.holdout, self.device, keep=self.sample,
                            first=len(batches))
            self.private = {"holdout_bpb": hn / (math.log(2) * hb) if hb else None, "holdout_tokens": self.holdout}
            self.phases["holdout"] = round(time.monotonic() - self.t_go, 3)

    def check_fresh(self) -> None:
        """The main worker, its owner, every process it left and every file it made in its folder are gone before
        the fresh one loads anything of the proposal: nothing of it is left to connect to, stat or read (eval.log
        stays, for the runner)."""
        fresh = self.fresh
        spare = [p for p in (fresh, fresh and fresh.owner) if p is not None]
        mine = [p for p in self.started if p not in spare]
        _retire(self.zygote, mine, spare=spare)
        self.started[:] = spare
        _clear_folder(self.job, keep=("eval.log",))
        t_fresh = time.monotonic()
        if fresh is None:
            fresh = _start(self.req, self.zygote, self.deadline, [self.fresh_lane], self.V, self.record["transfer"],
                           self.started)[0]
            fresh.expect("mapped")
        fresh.send("go")
        _check_fresh(fresh, self.batches + self.held, self.sample, self.secret, self.device, self.req, self.record)
        self.record["fresh_seconds"] = round(time.monotonic() - t_fresh, 3)
        self.phases["fresh"] = round(time.monotonic() - self.t_go, 3)

    def close(self) -> None:
        try:
            _retire(self.zygote, self.started)   # nothing a worker started outlives its evaluation, nor its files
        except (OSError, RuntimeError):
            pass
        fresh_dir = Path(self.req["fresh_job_dir"]) if self.req.get("fresh_job_dir") else None
        for d in (self.job, fresh_dir):
            for name in ("in.bin", "out.bin", "ipc.pkl", "to_worker", "from_worker"):
                if d is not None:
                    (d / name).unlink(missing_ok=True)


def evaluate(req: dict, zygote: Zygote, release: Release, cache: dict | None = None) -> dict:
    """Score the checkpoint named by `req` (Evaluation); returns the record (the runner's) and the hold-out
    (private). The workers start at `release.prestart()`, the model loads after `release.go()`."""
    return Evaluation(req, zygote, release, cache).run()


def _open(req: dict, zygote: Zygote, deadline: float, lanes: list, fresh_lane, V: int, transfers: list[str],
          started: list, record: dict):
    """(main worker, fresh worker or None): started and their buffers mapped, no proposal loaded yet. The first
    transfer that works: with "ipc" the fresh worker starts now too (its CUDA context and mapping take a while;
    it may write nothing but its own /proc entries, its folder and its owner's files, so the main worker has
    nothing of it to reach); with "host" it starts once the main one is gone."""
    for transfer in transfers:
        record["transfer"] = transfer
        both = fresh_lane is not None and transfer == "ipc"
        try:
            workers = _start(req, zygote, deadline, lanes + ([fresh_lane] if both else []), V, transfer, started)
            for w in workers:
                w.expect("mapped")
            return workers[0], (workers[1] if both else None)
        except (Rejected, _NoIPC) as e:
            if transfer == transfers[-1]:
                raise
            _fall_back(zygote, started, record, e)
    raise AssertionError("no transfer")


def _fall_back(zygote: Zygote, started: list, record: dict, why: Exception) -> None:
    """CUDA IPC failed (some sandboxed GPU runtimes): retire its workers and note why; the host path follows."""
    print(f"evaluator: {why}; falling back to host transfer", file=sys.stderr, flush=True)
    record["transfer_note"] = " ".join(str(why).split())[:300]
    _retire(zygote, started)
    started.clear()


def _start(req: dict, zygote: Zygote, deadline: float, lanes: list, V: int, transfer: str,
           started: list) -> list[_Worker]:
    """A model worker per lane (folder, rows, policy), each once its buffers exist: with "ipc", made by a buffer
    owner of its own (every owner starts at once; a worker starts once its owner has exported them, since its
    policy names the owner's files), with "host", files in its folder. None is told "go" (the model loads then).
    Every child started is added to `started`."""
    T = int(req["seq_len"])
    owners = []
    for _, rows, _ in lanes if transfer == "ipc" else []:
        d = Path(tempfile.mkdtemp(prefix="ar-owner-"))      # its FIFOs: in no worker's reach
        try:
            owners.append(_Worker(zygote, d, {"rows": rows, "seq_len": T, "vocab": V, "device": req["device"]},
                                  deadline, kind="owner"))
        except Rejected:
            shutil.rmtree(d, ignore_errors=True)
            raise
        started.append(owners[-1])
    workers = []
    for i, (d, rows, policy) in enumerate(lanes):
        (d / "job.json").write_text(json.dumps({
            "rows": rows, "seq_len": T, "vocab": V, "device": req["device"], "checkpoint": req["checkpoint"],
            "source": req["source"], "train_file": req["train_file"], "transfer": transfer}))
        env = worker_env(d)
        owner = owners[i] if owners else None
        if owner is not None:
            (d / "ipc.pkl").write_bytes(owner.export())
            policy = ipc_policy(policy, owner.files)
            env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"    # its /proc entries only: a compile worker has none
            inp, out = owner.inp, owner.out
        else:
            inp, out = _host_buffers(d, rows, T, V)
        w = _Worker(zygote, d, {"source": req["source"], "policy": policy, "sandbox": req.get("sandbox", True),
                                "env": env}, deadline)
        started.append(w)
        w.inp, w.out, w.owner = inp, out, owner
        workers.append(w)
    return workers


def _clear_folder(d: Path, keep: tuple[str, ...] = ()) -> None:
    """Remove everything in a retired worker's folder but `keep`."""
    for p in d.iterdir():
        if p.name in keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _retire(zygote: Zygote, procs: list[_Worker], spare: list[_Worker] = ()) -> None:
    """Close `procs` (the model workers, then the buffer owners), have the zygote reap them and whatever they
    left (all but `spare`), then remove every owner's files in /dev/shm (a killed owner's driver may leave its
    own) and its folder: no byte a worker wrote may reach a later worker."""
    for p in sorted(procs, key=lambda p: p.kind == "owner"):
        p.close()
    try:
        zygote.clean(spare=tuple(p.pid for p in spare))
    finally:
        for p in procs:
            if p.kind == "owner":
                remove_owner_files(p.pid, p.files)
                shutil.rmtree(p.dir, ignore_errors=True)


def ipc_policy(policy: dict, files: list[str]) -> dict:
    """A model worker's policy with CUDA IPC: the shared-namespace sandbox (sandbox.py), in which the only files
    of /dev/shm it may write are `files`, its buffer owner's."""
    return {**policy, "shared_ipc": True, "ipc_files": list(files)}


def _fresh_sample(secret, n_batches: int, B: int, k: int) -> dict:
    """k secret (batch, row) pairs to score again in a fresh worker, from as many batches as there are."""
    pairs = [(b, r) for b in range(n_batches) for r in range(B)]
    secret.shuffle(pairs)
    out, used = [], set()
    for b, r in pairs:                  # one row per batch first, then the rest
        if b not in used:
            out.append((b, r))
            used.add(b)
        if len(out) == k:
            break
    out += [p for p in pairs if p not in out][:k - len(out)]
    return {p: None for p in out}


# calls of sampled rows the fresh worker scores, by device: each row there is one look-ahead probe (_cuts). On a GPU
# a call of 32 rows costs about 45 ms (H100, eager), so 16 calls (512 probes) add about 0.7 s to an evaluation.
FRESH_CALLS = {"cuda": 16, "cpu": 4}


def _cuts(secret, k: int, T: int) -> list[int]:
    """k secret cut points in [1, T), one in each of k equal strata of the row, in a secret order: a row's
    tokens from its cut on are replaced by random ones, and its logits before the cut must not move. Every
    position of a row can be the last before a cut (a look ahead anywhere can be caught there), and a look ahead
    over any stretch of two strata's length is caught for certain."""
    if k <= 0:
        return []
    span = (T - 1) / k
    cuts = [min(T - 1, 1 + int((i + secret.random()) * span)) for i in range(k)]
    secret.shuffle(cuts)
    return cuts


def _check_fresh(fresh, batches, sample: dict, secret, device, req: dict, record: dict) -> None:
    """Score the sampled rows again in the fresh worker, shuffled together, after rows of random tokens (a model
    with a history is then sure to have another one than when the main worker scored them, whatever the sample's
    order); their losses before a secret cut must not move. Each row is shown only up to its cut, random tokens
    after (_cuts), and never whole: a model that looks ahead and answers a probe of a row it was shown as it
    answered that row (so the main worker's causality check saw nothing move) has no such row here, and its loss
    at the last position before the cut, where the main pass saw the real next token, moves."""
    import torch
    fresh.expect("ready")
    pairs = list(sample)
    secret.shuffle(pairs)
    x = torch.stack([batches[b][0][r] for b, r in pairs]).to(device)
    y = torch.stack([batches[b][1][r] for b, r in pairs]).to(device)
    T, V = x.size(1), fresh.out.size(-1)
    gen = torch.Generator().manual_seed(secret.getrandbits(63))
    n = fresh.out.size(0)                                # rows a call
    _call(fresh, torch.randint(0, V, (min(n, len(pairs)), T), generator=gen).to(device))   # not scored
    cuts = _cuts(secret, len(pairs), T)
    for i, c in enumerate(cuts):
        x[i, c:] = torch.randint(0, V, (T - c,), generator=gen).to(device)
    again = torch.cat([_nll(_call(fresh, x[i:i + n]), y[i:i + n]).double().cpu()    # against the real targets:
                       for i in range(0, len(pairs), n)])                          # the main pass's losses
    before = max(float((again[i, :c - 1] - sample[p][:c - 1]).abs().max()) if c > 1 else 0.0
                 for i, (p, c) in enumerate(zip(pairs, cuts)))
    at_cut = max(float((again[i, c - 1] - sample[p][c - 1]).abs()) for i, (p, c) in enumerate(zip(pairs, cuts)))
    record["fresh_max_diff"] = max(before, at_cut)
    tol = float(req.get("tolerance", 1e-3))
    if before > tol:
        raise Rejected(f"the model's logits depend on what it was shown before: {len(pairs)} secret rows scored "
                       f"again by a fresh model process (shown only random rows before) gave losses {before:.3g} "
                       f"apart (tolerance {tol:g}); a row's logits must depend on that row alone")
    if at_cut > tol:
        raise Rejected(f"the model looks ahead: {len(pairs)} secret rows scored again by a fresh model process, each "
                       f"with random tokens after a secret cut, gave a loss {at_cut:.3g} apart at the position before "
                       f"the cut (tolerance {tol:g}); attention must be causal")


def _host_buffers(job: Path, B: int, T: int, V: int):
    """The input (token ids) and output (logits) buffers as files in the worker's folder that both processes map
    (the CPU's, and a GPU's fallback); the worker's to write when it runs as another uid."""
    import torch
    from .sandbox import give_to_sandbox
    for name, n, dtype in (("in.bin", B * T, torch.int64), ("out.bin", B * T * V, torch.float32)):
        with open(job / name, "wb") as f:
            f.truncate(n * torch.tensor([], dtype=dtype).element_size())
    give_to_sandbox(job / "in.bin", job / "out.bin")
    inp = torch.from_file(str(job / "in.bin"), shared=True, size=B * T, dtype=torch.int64).view(B, T)
    out = torch.from_file(str(job / "out.bin"), shared=True, size=B * T * V, dtype=torch.float32).view(B, T, V)
    return inp, out


def _ref_counters(*rebuild_args) -> list[str]:
    """The /dev/shm files that hold the reference counts of CUDA buffers shared with torch's reduce_tensor
    (its 12th rebuild argument): besides the driver's, the files in /dev/shm the worker must open for writing."""
    out = []
    for args in rebuild_args:
        name = args[11] if len(args) > 11 else None
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if isinstance(name, str) and name.startswith("/") and "/" not in name[1:]:
            out.append("/dev/shm" + name)
    return out



def _call(worker: _Worker, x, private: bool = True):
    """The model's logits for the rows of x. private: a copy taken the moment the worker says ok, for logits kept
    past the next call; otherwise, where the buffer is already on x's device, the buffer itself, which the caller
    reads once, at once (one pass over 2 GiB fewer a call on a GPU; what the worker may write into it meanwhile
    is still only its own logits, and the losses taken from them are checked finite again)."""
    import torch
    inp, out = worker.inp, worker.out
    n = x.size(0)
    inp[:n].copy_(x, non_blocking=False)
    if inp.is_cuda:
        torch.cuda.synchronize()
    worker.send(f"run {n}")
    worker.expect("ok")
    logits = out[:n] if not private and out.device == x.device else out[:n].to(x.device, copy=True)
    if not torch.isfinite(logits).all():
        raise Rejected("the model's logits are not finite")
    return logits


def _nll(logits, y):
    """Each target's loss in nats, float32: log-softmax and gather in one kernel (F.cross_entropy), where
    logsumexp, gather and a subtraction made several passes over the logits."""
    import torch.nn.functional as F
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="none").view_as(y)


def _score(worker, batches, token_bytes, n_tokens: int, device, check=None, keep=None, first: int = 0):
    """Summed nats and bytes over exactly n_tokens targets (rows in order; the last batch counted in part)."""
    import torch
    nats = torch.zeros((), dtype=torch.float64, device=device)
    nbytes = torch.zeros((), dtype=torch.int64, device=device)
    left = n_tokens
    for i, (x, y) in enumerate(batches):
        x, y = x.to(device), y.to(device)
        checked = check is not None and i == check[0]
        logits = _call(worker, x, private=checked)      # the checked batch's logits outlive the probe's call
        loss = _nll(logits, y)
        if not torch.isfinite(loss).all():              # the buffer changed under the read: not a model's output
            raise Rejected("the model's logits are not finite")
        w = token_bytes[y]
        per = y.numel()
        if left < per:
            w = w * (torch.arange(per, device=device).view_as(y) < left)
        nats += torch.where(w > 0, loss.double(), 0.0).sum()
        nbytes += w.sum()
        left -= min(left, per)
        for (b, r) in (keep or {}):
            if b == first + i:              # a sampled row: its losses as scored, for the fresh worker's re-score
                keep[(b, r)] = loss[r].double().cpu()
        if checked:
            _check_causal(worker, x, logits, *check[1:])
        del logits
    return float(nats.item()), int(nbytes.item())


def _check_causal(worker, x, logits, secret, req: dict, record: dict) -> None:
    """Resend x shuffled, with a few rows' futures randomised; earlier logits must not move."""
    import torch
    B, T = x.shape
    V = logits.size(-1)
    k = min(int(req.get("causal_rows", 4)), B)
    tol = float(req.get("tolerance", 1e-3))
    rows = secret.sample(range(B), k)
    cuts = dict(zip(rows, _cuts(secret, k, T)))
    probe = x.clone()
    gen = torch.Generator().manual_seed(secret.getrandbits(63))
    for r, c in cuts.items():
        probe[r, c:] = torch.randint(0, V, (T - c,), generator=gen).to(x.device)
    perm = secret.sample(range(B), B)
    again = _call(worker, probe[perm])
    back = torch.empty_like(again)
    back[perm] = again
    causal, pure = 0.0, 0.0
    for r in range(B):
        if r in cuts:
            c = cuts[r]
            causal = max(causal, float((back[r, :c] - logits[r, :c]).abs().max()))
        else:
            pure = max(pure, float((back[r] - logits[r]).abs().max()))
    record.update(causal_max_diff=causal, purity_max_diff=pure)
    if pure > tol:
        raise Rejected(f"the model is not a pure function of its input: the same rows gave logits {pure:.3g} apart "
                       f"when sent again in another order (tolerance {tol:g})")
    if causal > tol:
        raise Rejected(f"the model looks ahead: its logits at earlier positions changed by {causal:.3g} when only "
                       f"later tokens changed (tolerance {tol:g}); attention must be causal")


def _write(path: str | None, doc: dict) -> None:
    if path:
        tmp = Path(path).with_name(f".{Path(path).name}.tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)


def _run(req: dict, zygote: Zygote, release: Release, cache: dict) -> None:
    try:
        result = evaluate(req, zygote, release, cache)
    except Exception as e:                           # a harness failure, not the model's: the runner says so
        traceback.print_exc()
        result = {"record": {"val_bpb": None, "rejected": None, "error": f"{type(e).__name__}: {e}"}, "private": {}}
    _write(req["record"], result["record"])
    _write(req.get("private"), result["private"])


def _free_gpu_cache() -> None:
    """Between evaluations the server holds no GPU memory it does not need: its scoring's cached blocks (gigabytes
    at the GPU's shape) would otherwise stay taken, and the next run's head start on a shared GPU needs the room
    (experiment/headstart.py)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()


def serve() -> int:
    """A session's evaluator: one request (a JSON line) at a time; "prestart ID", "go ID" / "stop ID"; "done ID"."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))     # ar's stop: the finally below still runs
    zygote = Zygote(sys.stderr, fork=True)
    cache: dict = {}
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            release = Release(req["id"], sys.stdin.readline)
            _run(req, zygote, release, cache)
            _free_gpu_cache()
            while not release.settled:   # rejected before the run ended (changed data): its go/stop still comes
                release._next()
            print(f"done {req['id']}", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a stop now must not cut the fork server's cleanup short
        zygote.close()
        remove_owner_files(os.getpid())  # the driver's file of this process, if it made one: exit_now leaves it
    return 0


def main(argv: list[str]) -> int:
    if argv == ["serve"]:
        return serve()
    zygote = Zygote(sys.stderr, fork=True)        # forked before the request is read: it holds nothing of it
    try:
        _run(json.loads(Path(argv[0]).read_text()), zygote, Release(None, sys.stdin.readline), {})
    finally:
        zygote.close()
        remove_owner_files(os.getpid())
    return 0


if __name__ == "__main__":
    from .sandbox import exit_now
    exit_now(main(sys.argv[1:]))
