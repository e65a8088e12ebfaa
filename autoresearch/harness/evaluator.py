"""The trusted evaluator: bits per byte of a checkpoint, computed here from the model's logits.

    python -I -B -m autoresearch.harness.evaluator serve            (a session's: one request per line)
    python -I -B -m autoresearch.harness.evaluator REQUEST.json     (one request; waits for "go" on stdin)

It runs in a fresh interpreter with no checkout on sys.path and never imports the proposal. It holds the
validation tokens and the token-bytes table; the proposal's model runs in a sandboxed worker (worker.py) that
cannot open either, gets token ids only (never the targets) through a shared buffer, and returns logits.
Here: cross-entropy = logsumexp(logits) − logit[target], summed in float64 over exactly `eval_tokens` targets,
divided by ln 2 × the UTF-8 bytes those targets stand for (special tokens have no bytes and count in neither).

Checks, each a rejection with a reason a user can read:
- the validation files, token-bytes table and tokenizer hash to the session's manifest (sha256);
- logits are finite and of shape [rows, T, vocab];
- causality: at a batch chosen in secret, a few rows are sent again with the tokens after a secret cut replaced
  by random ones, in a shuffled batch; logits before the cut must not change (a model that looks ahead fails);
- purity: the other rows of that batch, sent again in other positions, must give the same logits (a model
  that learns from what it is shown, or keys on batch position, fails);
- freshness: a secret sample of rows from every batch scored (hold-out included) is scored again, after the
  main worker is gone, by a second worker process that was shown nothing else, with batch-mates from other
  batches; its logits must give the same losses (a model that learns from the evaluation stream, a cache or a
  memo of what it was shown, fails even when it repeats itself for the purity and causality checks).
A hold-out slice (validation rows after the evaluated ones) is scored the same way and written only to the
private file the runner names, never to the record or any log.

REQUEST (JSON): tok_dir, dataset, seq_len, eval_tokens, holdout_tokens, rows, device, manifest {file: sha256},
checkpoint, source, train_file, job_dir, record, private, timeout, sandbox (bool), policy (the worker's
sandbox policy), tolerance; fresh_job_dir, fresh_policy, fresh_rows (the fresh worker's folder, policy and rows;
without fresh_job_dir there is no fresh re-score).
"""

from __future__ import annotations

import hashlib
import json
import signal
import math
import os
import pickle
import secrets
import subprocess
import sys
import time
import traceback
from pathlib import Path

from .env import KEPT_ENV  # noqa: E402

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


class Zygote:
    """The fork server (zygote.py) that makes one fresh sandboxed model process per evaluation."""

    def __init__(self, log):
        self.proc = subprocess.Popen([sys.executable, "-I", "-B", "-m", "autoresearch.harness.zygote"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
                                     cwd="/")   # in the evaluator's process group: whoever stops that stops both
        self.ready = False

    def _start(self) -> None:
        if not self.ready:
            if self.proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the model fork server did not start; see evaluator.log")
            self.ready = True

    def clean(self, spare: int | None = None) -> None:
        """Kill whatever the last workers left behind, now (not when the next job comes); all but `spare`."""
        self._start()
        self.proc.stdin.write("clean\n" if spare is None else f"clean {spare}\n")
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


class _Worker:
    """One sandboxed model process (a child of the zygote) and its line protocol over two FIFOs."""

    def __init__(self, req: dict, zygote: Zygote, deadline: float, job_dir: str | None = None,
                 policy: dict | None = None):
        d = Path(job_dir or req["job_dir"])
        for name in ("to_worker", "from_worker"):
            (d / name).unlink(missing_ok=True)
            os.mkfifo(d / name, 0o600)
        env = {k: v for k, v in os.environ.items() if k in KEPT_ENV}
        env.update(HOME=str(d), TMPDIR=str(d), PYTHONUNBUFFERED="1")
        self.deadline = deadline
        self.rfd = os.open(d / "from_worker", os.O_RDONLY | os.O_NONBLOCK)
        self.pid = zygote.spawn({"job_dir": str(d), "source": req["source"], "policy": policy or req["policy"],
                                 "sandbox": req.get("sandbox", True), "env": env})
        while True:                                  # the writer end opens once the worker opens its reader end
            try:
                self.wfd = os.open(d / "to_worker", os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                if time.monotonic() > self.deadline or not _alive(self.pid):
                    raise Rejected("the model process did not start; see eval.log") from None
                time.sleep(0.005)
        os.set_blocking(self.wfd, True)
        self._buf = b""

    def send(self, line: str) -> None:
        try:
            os.write(self.wfd, (line + "\n").encode())
        except OSError:
            raise Rejected("the model process exited early; see eval.log") from None

    def _readline(self) -> str:
        import select
        while b"\n" not in self._buf:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.rfd], [], [], left)[0]:
                raise Rejected("the model took longer than the evaluation allowance")
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
                raise Rejected("the model process flooded the evaluator's channel")
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace").strip()

    def expect(self, what: str) -> None:
        line = self._readline()
        if line == what:
            return
        if line.startswith("err "):
            raise Rejected(f"the model failed: {line[4:]}")
        raise Rejected("the model process exited early; see eval.log" if not line else
                       f"the model process said {line[:80]!r} instead of {what!r}")

    def close(self) -> None:
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


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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


def evaluate(req: dict, zygote: Zygote, go=lambda: None, cache: dict | None = None) -> dict:
    """Score the checkpoint named by `req`; returns the record (the runner's) and the hold-out (private).
    `go()` returns when the checkpoint is complete (raises Rejected when there is none)."""
    import numpy as np
    import torch

    t0 = time.monotonic()
    tok_dir, job = Path(req["tok_dir"]), Path(req["job_dir"])
    B, T = int(req["rows"]), int(req["seq_len"])
    record = {"val_bpb": None, "eval_tokens": int(req["eval_tokens"]), "eval_bytes": None, "dataset": req["dataset"],
              "seq_len": T, "rejected": None, "causal_max_diff": None, "purity_max_diff": None,
              "fresh_max_diff": None}
    cache = {} if cache is None else cache
    worker = fresh = None
    try:
        for name, digest in req["manifest"].items():
            if sha256_file(tok_dir / name) != digest:
                raise Rejected(f"the data changed during the session ({name} no longer has the hash taken at "
                               "its start); restore it (`ar prepare`) and start again")
        token_bytes = torch.from_numpy(np.load(tok_dir / "token_bytes.npy").astype(np.int64))
        V = int(token_bytes.numel())
        meta = json.loads((tok_dir / "meta.json").read_text())
        holdout = int(req.get("holdout_tokens") or 0)
        if holdout and record["eval_tokens"] + holdout + 2 * B * T > meta["val"]["tokens"]:
            holdout = 0                          # too small a split: no hold-out rather than a re-used one
        key = (str(tok_dir), B, T, record["eval_tokens"], holdout, json.dumps(req["manifest"], sort_keys=True))
        if key not in cache:                     # a server keeps the rows of the session's data in memory
            cache.clear()
            cache[key] = (_batches(tok_dir, B, T, record["eval_tokens"]),
                          _batches(tok_dir, B, T, holdout, skip_tokens=record["eval_tokens"]) if holdout else [])
        batches, held = cache[key]
        device = torch.device(req["device"])
        go()                                     # the runner: the checkpoint is complete
        t_go = time.monotonic()
        deadline = time.monotonic() + float(req["timeout"])
        fresh_dir = Path(req["fresh_job_dir"]) if req.get("fresh_job_dir") else None
        for transfer in (["ipc", "host"] if device.type == "cuda" else ["host"]):
            inp, out, counters = _job(job, B, T, V, device, transfer, req)
            worker = _Worker(req, zygote, deadline, policy=_policy(req["policy"], counters))
            worker.send("go")
            if fresh_dir is not None:        # shown nothing until the end: it loads while the main pass runs
                nf = min(B, int(req.get("fresh_rows") or B))
                fresh_dir.mkdir(exist_ok=True)
                from .sandbox import give_to_sandbox
                give_to_sandbox(fresh_dir)
                *fresh_bufs, counters = _job(fresh_dir, nf, T, V, device, transfer, req)
                fresh = _Worker(req, zygote, deadline, str(fresh_dir), _policy(req["fresh_policy"], counters))
                fresh.send("go")
            try:
                worker.expect("ready")
                break
            except Rejected as e:   # CUDA IPC unavailable (some sandboxed GPU runtimes), or the shared-namespace
                if transfer != "ipc":   # worker refused something the GPU stack needs: logits through the host, in
                    raise               # the worker's own namespaces (a broken model fails there the same way)
                print(f"evaluator: {e}; falling back to host transfer", file=sys.stderr, flush=True)
                worker.close()
                if fresh is not None:
                    fresh.close()
                    fresh = None
        record["transfer"] = transfer
        token_bytes = token_bytes.to(device)
        secret = secrets.SystemRandom()
        check_at = secret.randrange(len(batches))
        sample = _fresh_sample(secret, len(batches) + len(held), B, fresh_bufs[0].size(0)) if fresh else {}
        nats, nbytes = _score(worker, inp, out, batches, token_bytes, record["eval_tokens"], device,
                              check=(check_at, secret, req, record), keep=sample)
        if nbytes == 0:
            raise Rejected(f"the {record['eval_tokens']} evaluated targets stand for no bytes")
        bpb = nats / (math.log(2) * nbytes)
        if not math.isfinite(bpb):
            raise Rejected("val_bpb is not finite")
        record.update(val_bpb=bpb, eval_bytes=nbytes)
        private = {"holdout_bpb": None, "holdout_tokens": 0}
        if held:
            hn, hb = _score(worker, inp, out, held, token_bytes, holdout, device, keep=sample, first=len(batches))
            private = {"holdout_bpb": hn / (math.log(2) * hb) if hb else None, "holdout_tokens": holdout}
        if fresh is not None:
            worker.close()                       # gone before the fresh worker is shown anything, with every
            worker = None                        # process it left (only the fresh worker's own tree is spared)
            zygote.clean(spare=fresh.pid)
            _check_fresh(fresh, *fresh_bufs, batches + held, sample, secret, device, req, record)
        record["seconds"] = {"total": round(time.monotonic() - t0, 3), "after_go": round(time.monotonic() - t_go, 3)}
    except Rejected as e:
        record.update(val_bpb=None, rejected=str(e))
        private = {"holdout_bpb": None, "holdout_tokens": 0}
    finally:
        for w in (worker, fresh):
            if w is not None:
                w.close()
        try:
            zygote.clean()                       # nothing a worker started outlives its evaluation
        except (OSError, RuntimeError):
            pass
        for d in (job, Path(req["fresh_job_dir"]) if req.get("fresh_job_dir") else None):
            for name in ("in.bin", "out.bin", "ipc.pkl", "to_worker", "from_worker"):
                if d is not None:
                    (d / name).unlink(missing_ok=True)
    return {"record": record, "private": private}


def _job(job: Path, B: int, T: int, V: int, device, transfer: str, req: dict):
    """Write a worker's job.json and make its buffers (the worker's to write when it runs as another uid)."""
    (job / "job.json").write_text(json.dumps({
        "rows": B, "seq_len": T, "vocab": V, "device": req["device"], "checkpoint": req["checkpoint"],
        "source": req["source"], "train_file": req["train_file"], "transfer": transfer}))
    *bufs, ref_counters = _buffers(job, B, T, V, device, transfer)
    from .sandbox import give_to_sandbox
    give_to_sandbox(*(job / n for n in ("in.bin", "out.bin")))
    return (*bufs, ref_counters)


def _policy(policy: dict, ref_counters: list[str]) -> dict:
    """The worker's policy for this transfer: with CUDA IPC, the shared-namespace sandbox (sandbox.py)."""
    return {**policy, "shared_ipc": True, "ipc_files": ref_counters} if ref_counters else policy


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


def _check_fresh(fresh, inp, out, batches, sample: dict, secret, device, req: dict, record: dict) -> None:
    """Score the sampled rows again in the fresh worker, shuffled together; their losses must not move."""
    import torch
    fresh.expect("ready")
    pairs = list(sample)
    secret.shuffle(pairs)
    x = torch.stack([batches[b][0][r] for b, r in pairs]).to(device)
    y = torch.stack([batches[b][1][r] for b, r in pairs]).to(device)
    again = _nll(_call(fresh, inp, out, x), y).double().cpu()
    diff = max(float((again[i] - sample[p]).abs().max()) for i, p in enumerate(pairs))
    record["fresh_max_diff"] = diff
    tol = float(req.get("tolerance", 1e-3))
    if diff > tol:
        raise Rejected(f"the model's logits depend on what it was shown before: {len(pairs)} secret rows scored "
                       f"again by a fresh model process (shown nothing else) gave losses {diff:.3g} apart "
                       f"(tolerance {tol:g}); a row's logits must depend on that row alone")


def _buffers(job: Path, B: int, T: int, V: int, device, transfer: str = "host"):
    """The shared input (token ids) and output (logits) buffers, allocated here, mapped by the worker: on the
    GPU through CUDA IPC handles, else files both processes map (on a GPU, the slow fallback)."""
    import torch
    if transfer == "ipc":
        from torch.multiprocessing.reductions import reduce_tensor
        inp = torch.zeros(B, T, dtype=torch.int64, device=device)
        out = torch.zeros(B, T, V, dtype=torch.float32, device=device)
        fn, a = reduce_tensor(inp)
        _, b = reduce_tensor(out)
        (job / "ipc.pkl").write_bytes(pickle.dumps((fn, (a, b))))
        return inp, out, _ref_counters(a, b)
    for name, n, dtype in (("in.bin", B * T, torch.int64), ("out.bin", B * T * V, torch.float32)):
        with open(job / name, "wb") as f:
            f.truncate(n * torch.tensor([], dtype=dtype).element_size())
    inp = torch.from_file(str(job / "in.bin"), shared=True, size=B * T, dtype=torch.int64).view(B, T)
    out = torch.from_file(str(job / "out.bin"), shared=True, size=B * T * V, dtype=torch.float32).view(B, T, V)
    return inp, out, []


def _ref_counters(*rebuild_args) -> list[str]:
    """The /dev/shm files that hold the reference counts of CUDA buffers shared with torch's reduce_tensor
    (its 12th rebuild argument): the only files in /dev/shm the worker may open for writing."""
    out = []
    for args in rebuild_args:
        name = args[11] if len(args) > 11 else None
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if isinstance(name, str) and name.startswith("/") and "/" not in name[1:]:
            out.append("/dev/shm" + name)
    return out


def _call(worker: _Worker, inp, out, x):
    """The model's logits for the rows of x (a private copy, taken the moment the worker says ok)."""
    import torch
    n = x.size(0)
    inp[:n].copy_(x, non_blocking=False)
    if inp.is_cuda:
        torch.cuda.synchronize()
    worker.send(f"run {n}")
    worker.expect("ok")
    logits = out[:n].to(x.device, copy=True)
    if not torch.isfinite(logits).all():
        raise Rejected("the model's logits are not finite")
    return logits


def _nll(logits, y):
    return logits.logsumexp(-1) - logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)


def _score(worker, inp, out, batches, token_bytes, n_tokens: int, device, check=None, keep=None, first: int = 0):
    """Summed nats and bytes over exactly n_tokens targets (rows in order; the last batch counted in part)."""
    import torch
    nats = torch.zeros((), dtype=torch.float64, device=device)
    nbytes = torch.zeros((), dtype=torch.int64, device=device)
    left = n_tokens
    for i, (x, y) in enumerate(batches):
        x, y = x.to(device), y.to(device)
        logits = _call(worker, inp, out, x)
        w = token_bytes[y]
        per = y.numel()
        if left < per:
            w = w * (torch.arange(per, device=device).view_as(y) < left)
        nats += torch.where(w > 0, _nll(logits, y).double(), 0.0).sum()
        nbytes += w.sum()
        left -= min(left, per)
        for (b, r) in (keep or {}):
            if b == first + i:              # a sampled row: its losses, for the fresh worker's re-score
                keep[(b, r)] = _nll(logits[r], y[r]).double().cpu()
        if check is not None and i == check[0]:
            _check_causal(worker, inp, out, x, logits, *check[1:])
        del logits
    return float(nats.item()), int(nbytes.item())


def _check_causal(worker, inp, out, x, logits, secret, req: dict, record: dict) -> None:
    """Resend x shuffled, with a few rows' futures randomised; earlier logits must not move."""
    import torch
    B, T = x.shape
    V = logits.size(-1)
    k = min(int(req.get("causal_rows", 4)), B)
    tol = float(req.get("tolerance", 1e-3))
    rows = secret.sample(range(B), k)
    cuts = {r: secret.randrange(max(1, T // 4), T) for r in rows}
    probe = x.clone()
    gen = torch.Generator().manual_seed(secret.getrandbits(63))
    for r, c in cuts.items():
        probe[r, c:] = torch.randint(0, V, (T - c,), generator=gen).to(x.device)
    perm = secret.sample(range(B), B)
    again = _call(worker, inp, out, probe[perm])
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


def _run(req: dict, zygote: Zygote, go, cache: dict) -> None:
    try:
        result = evaluate(req, zygote, go, cache)
    except Exception as e:                           # a harness failure, not the model's: the runner says so
        traceback.print_exc()
        result = {"record": {"val_bpb": None, "rejected": None, "error": f"{type(e).__name__}: {e}"}, "private": {}}
    _write(req["record"], result["record"])
    _write(req.get("private"), result["private"])


def serve() -> int:
    """A session's evaluator: one request (a JSON line) at a time; "go ID" / "stop ID" release it; "done ID"."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))     # ar's stop: the finally below still runs
    zygote = Zygote(sys.stderr)
    cache: dict = {}
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            released: list[str] = []

            def go(rid=req["id"]):
                released.append(sys.stdin.readline())
                if released[0].split() != ["go", str(rid)]:
                    raise Rejected("the run ended without a checkpoint")

            _run(req, zygote, go, cache)
            if not released:             # rejected before the run ended (changed data): its go/stop still comes
                sys.stdin.readline()
            print(f"done {req['id']}", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a stop now must not cut the fork server's cleanup short
        zygote.close()
    return 0


def main(argv: list[str]) -> int:
    if argv == ["serve"]:
        return serve()
    req = json.loads(Path(argv[0]).read_text())

    def go():
        if sys.stdin.readline().strip() != "go":
            raise Rejected("the run ended without a checkpoint")

    zygote = Zygote(sys.stderr)
    try:
        _run(req, zygote, go, {})
    finally:
        zygote.close()
    return 0


if __name__ == "__main__":
    from .sandbox import exit_now
    exit_now(main(sys.argv[1:]))
