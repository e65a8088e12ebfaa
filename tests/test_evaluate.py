"""The trusted evaluator on its own: `python -m autoresearch.harness.evaluator serve`, fed requests the way the
runner feeds them, scoring checkpoints of hand-made models on a hand-made validation split whose bits per byte
are computed here by hand. One evaluator process serves every test of the module."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from autoresearch.harness import checkpoint, data
from autoresearch.harness.evaluator import manifest

from fixtures.waits import until


def _at_least(n: int, xs: list) -> list | None:
    return xs if len(xs) >= n else None


def _maps(proc) -> list:
    try:
        return proc.memory_maps(grouped=False)
    except Exception:          # noqa: BLE001 — gone, or not readable yet: not there
        return []


T = 7  # rows of 8 tokens: two 4-token documents [BOS, a, b, c] each

MODELS = '''
import torch


class Fixed(torch.nn.Module):
    """The same logits at every position, whatever the input."""

    def __init__(self, vocab, peek=0.0, by_row=0.0, memo=0.0, peek_upto=0, replay=0):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(vocab))
        self.peek, self.by_row, self.memo, self.peek_upto, self.replay = peek, by_row, memo, peek_upto, replay
        self.seen, self.answers, self.prev = 0, {}, None

    def peeked(self, idx):
        B, T = idx.shape
        out = self.bias.expand(B, T, -1).clone()
        if self.peek:      # cheats: raises the logit of the next token (at positions before peek_upto, if set)
            bet = torch.full((B, T, 1), self.peek)
            if self.peek_upto:
                bet[:, self.peek_upto:] = 0
            out.scatter_add_(2, torch.roll(idx, -1, 1).unsqueeze(-1), bet)
        return out

    def forward(self, idx):
        B, T = idx.shape
        out = self.peeked(idx)
        if self.replay:    # a row that shares `replay` or more first tokens with a row of the last call (a probe of
            prev, self.prev = self.prev, idx.clone()      # it, as the causality check sends) gets that row's answers
            if prev is not None:                          # up to where they part: the check sees nothing move
                for r in range(B):
                    same = (idx[r].unsqueeze(0) == prev).int().cumprod(1).sum(1)
                    L, p = int(same.max()), int(same.argmax())
                    if L >= self.replay:
                        out[r, :L] = self.peeked(prev[p:p + 1])[0, :L]
        if self.by_row:    # keys on the row's position in the batch
            out += self.by_row * torch.arange(B, dtype=out.dtype).view(B, 1, 1)
        if self.memo:      # learns from the stream (how many rows it saw), each answer memoised by its prefix
            for r in range(B):
                for t in range(T):
                    key = tuple(idx[r, :t + 1].tolist())
                    if key not in self.answers:
                        self.answers[key] = out[r, t].clone()
                        self.answers[key][0] += self.memo * min(self.seen, 3)
                    out[r, t] = self.answers[key]
            self.seen += B
        return out


def fixed(config):
    return Fixed(config["vocab"], config.get("peek", 0.0), config.get("by_row", 0.0), config.get("memo", 0.0),
                 config.get("peek_upto", 0), config.get("replay", 0))
'''


def handmade(root: Path, token_bytes: list[int], ndocs: int = 200, seed: int | None = None) -> Path:
    """A tokenized folder written by hand: identical documents [BOS=0, 1, 2, 3], so every row of 8 tokens is
    two of them and its 7 targets are 1 2 3 0 1 2 3 (0, the BOS, stands for no bytes); with a seed, documents
    [BOS, a, b, c] of random tokens instead (rows that differ), from the whole vocabulary but the BOS."""
    tok = root / "hand" / "tok-4"
    tok.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    docs = [np.array([0, 1, 2, 3]) if seed is None else np.array([0, *rng.integers(1, len(token_bytes), 3)])
            for _ in range(ndocs)]
    counts = {}
    for split in ("train", "val"):
        flat = np.concatenate(docs).astype(np.uint16)
        flat.tofile(tok / f"{split}.bin")
        np.save(tok / f"{split}.idx.npy", np.concatenate(([0], np.cumsum([len(d) for d in docs]))).astype(np.int64))
        counts[split] = {"docs": len(docs), "tokens": int(flat.size)}
    np.save(tok / "token_bytes.npy", np.array(token_bytes, dtype=np.int32))
    (tok / "tokenizer.json").write_text("{}")
    (tok / "meta.json").write_text(json.dumps({"format": data.FORMAT, "bos_id": 0, **counts}))
    return tok


class Server:
    """The evaluator's session protocol: a request per JSON line, then "go ID" or "stop ID"; it answers "done ID"."""

    def __init__(self, log: Path):
        self.log, self.proc, self.n = log, None, 0

    def start(self) -> None:
        """(Re)start the server; a test that stops it does not take the following tests with it."""
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL")}
        self.proc = subprocess.Popen([sys.executable, "-I", "-B", "-m", "autoresearch.harness.evaluator", "serve"],
                                     cwd="/", env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "a"), text=True, bufsize=1)

    def score(self, req: dict, go: bool = True) -> dict:
        return self.score_prestarted(req, None, go)

    def score_prestarted(self, req: dict, while_training, go: bool = True) -> dict:
        """The request; with `while_training`, "prestart" (the workers start), then `while_training()`, as the
        runner does on a GPU; then "go" (or "stop")."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.n += 1
        self.proc.stdin.write(json.dumps({**req, "id": self.n}) + "\n")
        if while_training is not None:
            self.proc.stdin.write(f"prestart {self.n}\n")
            self.proc.stdin.flush()
            while_training()
        self.proc.stdin.write(f"{'go' if go else 'stop'} {self.n}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == f"done {self.n}", self.log.read_text()[-3000:]
        return json.loads(Path(req["record"]).read_text())

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("evaluator") / "evaluator.log")
    yield s
    s.close()


@pytest.fixture
def job(tmp_path):
    """A request for the model `fixed` of a hand-made train file; call with the logits and the split."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "models.py").write_text(MODELS)

    def make(tok: Path, logits: list[float], *, eval_tokens: int, rows: int, **config) -> dict:
        ckpt = tmp_path / "checkpoint"
        checkpoint.save(ckpt, factory="fixed", config={"vocab": len(logits), **config},
                        arrays={"bias": np.array(logits, dtype=np.float32)})
        (tmp_path / "job").mkdir(exist_ok=True)
        return {"tok_dir": str(tok), "dataset": "hand", "seq_len": T, "eval_tokens": eval_tokens,
                "holdout_tokens": 0, "rows": rows, "device": "cpu", "manifest": manifest(tok),
                "checkpoint": str(ckpt), "source": str(src), "train_file": "models.py",
                "job_dir": str(tmp_path / "job"), "record": str(tmp_path / "record.json"),
                "private": str(tmp_path / "private.json"), "timeout": 60, "sandbox": False, "policy": {},
                "tolerance": 1e-3, "fresh_job_dir": str(tmp_path / "job-fresh"), "fresh_policy": {},
                "fresh_rows": rows}

    return make


def by_hand(logits: list[float], token_bytes: list[int], targets: list[int]) -> tuple[float, int]:
    """(bits per byte, bytes) over `targets`: -log2 p(target) summed over the targets that stand for bytes."""
    logp = np.array(logits) - np.log(np.exp(logits).sum())
    tb = np.array(token_bytes)
    counted = [t for t in targets if tb[t] > 0]
    return -sum(logp[t] for t in counted) / (math.log(2) * tb[counted].sum()), int(tb[counted].sum())


ROW = [1, 2, 3, 0, 1, 2, 3]


@pytest.mark.integration
def test_bpb_against_a_hand_computed_value(tmp_path, server, job):
    tok = handmade(tmp_path, [0, 1, 2, 3])
    logits = [0.5, 1.0, -1.0, 2.0]
    rec = server.score(job(tok, logits, eval_tokens=12 * T, rows=3))        # 4 batches of 3 rows
    want, nbytes = by_hand(logits, [0, 1, 2, 3], ROW * 12)
    assert rec["rejected"] is None and rec.get("error") is None, rec
    assert rec["val_bpb"] == pytest.approx(want, rel=1e-6)
    assert rec["eval_tokens"] == 12 * T and rec["eval_bytes"] == nbytes == 12 * 12
    assert rec["seq_len"] == T and rec["dataset"] == "hand"
    assert rec["causal_max_diff"] == 0 and rec["purity_max_diff"] == 0   # checked on one of the batches
    assert not (tmp_path / "job" / "out.bin").exists()                  # the shared buffers are removed


def test_exactly_eval_tokens_when_not_a_multiple_of_the_batch(tmp_path, server, job):
    tok = handmade(tmp_path, [0, 2, 2, 2])
    # 20 targets = 2 rows of 7 + the first 6 of the third row: 1 2 3 0 1 2
    rec = server.score(job(tok, [0.0] * 4, eval_tokens=20, rows=2))
    want, nbytes = by_hand([0.0] * 4, [0, 2, 2, 2], ROW * 2 + ROW[:6])
    assert nbytes == 2 * 17 and want == pytest.approx(math.log2(4) / 2)
    assert rec["val_bpb"] == pytest.approx(want, rel=1e-6) and rec["eval_bytes"] == nbytes
    assert rec["eval_tokens"] == 20


class _BufferWorker:
    """A model worker reduced to its shared buffers: it answers every call with the same finite logits."""

    def __init__(self, rows: int, vocab: int):
        self.inp = torch.zeros(rows, T, dtype=torch.int64)
        self.out = torch.zeros(rows, T, vocab)

    def send(self, line: str) -> None:
        pass

    def expect(self, what: str) -> None:
        self.out.copy_(torch.linspace(-1, 1, self.out.size(-1)).expand_as(self.out))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_logits_read_in_place_that_turn_non_finite_after_their_check_are_rejected_not_scored(monkeypatch, poison):
    """The evaluator reads a worker's buffer in place (no private copy): a worker may write into it between the
    finiteness check and the loss read. Here it does, at a target that stands for no bytes (so the sum would
    stay finite) in a row sampled for the fresh re-score, where a NaN loss would compare as "no difference"."""
    from autoresearch.harness import evaluator as ev
    worker = _BufferWorker(rows=2, vocab=4)
    x = torch.tensor([[0, 1, 2, 3, 0, 1, 2]] * 2)
    y = torch.tensor([ROW] * 2)                        # y[r, 3] == 0: the BOS, no bytes
    real = ev._nll

    def written_meanwhile(logits, target):
        if logits.data_ptr() == worker.out.data_ptr():
            worker.out[1, 3, 2] = poison
        return real(logits, target)

    monkeypatch.setattr(ev, "_nll", written_meanwhile)
    keep = {(0, 1): None}
    with pytest.raises(ev.Rejected, match="not finite"):
        ev._score(worker, [(x, y)], torch.tensor([0, 1, 2, 3]), 2 * T, torch.device("cpu"), keep=keep)
    assert keep[(0, 1)] is None                        # nothing of the batch was kept for the re-score


def test_a_model_that_looks_ahead_is_rejected(tmp_path, server, job):
    tok = handmade(tmp_path, [0, 1, 2, 3])
    rec = server.score(job(tok, [0.0] * 4, eval_tokens=4 * T, rows=4, peek=3.0))
    assert rec["val_bpb"] is None and "looks ahead" in rec["rejected"] and rec["causal_max_diff"] > 1


LONG = 63                       # rows of 64 tokens: where a quarter of a row is 15 positions


def _long(tmp_path, job, **cheat) -> dict:
    """A request over rows of LONG tokens, 64-token vocabulary, 4 batches of 16 rows, 16 rows scored again fresh."""
    tok = handmade(tmp_path, [0] + [1] * 63, ndocs=2000, seed=5)
    return {**job(tok, [0.0] * 64, eval_tokens=4 * 16 * LONG, rows=16, **cheat), "seq_len": LONG}


def test_a_model_that_looks_ahead_only_in_the_first_quarter_of_each_row_is_rejected(tmp_path, server, job):
    """The causality check's cuts were drawn from the last three quarters of a row, so logits were compared only
    before a cut at T/4 or later: a look at the next token at the first positions changed nothing the check
    compared, and the fresh worker, shown the same rows, looked the same way. A quarter of every row's tokens
    came nearly free."""
    rec = server.score(_long(tmp_path, job, peek=3.0, peek_upto=14))
    assert rec["val_bpb"] is None and "looks ahead" in (rec["rejected"] or ""), rec


def test_a_model_that_answers_a_probe_as_it_answered_the_row_before_it_is_rejected(tmp_path, server, job):
    """It looks ahead everywhere, and keeps the last call's rows: a row that begins as one of them (15 tokens or
    more, as the causality probe of that batch does) gets that row's own answers up to where the two part. So the
    probe sees nothing move, and the fresh worker, shown the same rows, looks ahead the same way. What it cannot
    answer: a row cut at a secret point that it was never shown whole (the fresh worker's rows)."""
    rec = server.score(_long(tmp_path, job, peek=3.0, replay=15))
    assert rec["val_bpb"] is None and "looks ahead" in (rec["rejected"] or ""), rec
    honest = server.score(_long(tmp_path / "honest", job))
    assert honest["rejected"] is None and honest["fresh_max_diff"] == 0 and honest["causal_max_diff"] == 0, honest


def test_the_fresh_re_score_alone_catches_a_look_ahead(tmp_path, server, job):
    """The main worker's causality probe off (`causal_rows` 0): the fresh worker's rows, each cut at a secret point
    with random tokens after, catch a model that looks ahead at every position. Shown the rows whole, as before,
    it looked ahead the same way as in the main pass and saw no difference."""
    rec = server.score({**_long(tmp_path, job, peek=3.0), "causal_rows": 0})
    assert rec["val_bpb"] is None and "looks ahead" in (rec["rejected"] or "") and "fresh" in rec["rejected"], rec
    assert rec["fresh_max_diff"] > 1, rec


def test_a_model_that_keys_on_the_batch_position_is_rejected(tmp_path, server, job):
    tok = handmade(tmp_path, [0, 1, 2, 3])
    rec = server.score(job(tok, [0.0] * 4, eval_tokens=8 * T, rows=8, by_row=0.5))
    assert rec["val_bpb"] is None and "not a pure function" in rec["rejected"]


def test_a_model_that_learns_from_the_stream_and_memoises_its_answers_is_rejected(tmp_path, server, job):
    """It repeats itself for the purity and causality checks; a fresh worker shown only random rows before does not."""
    tok = handmade(tmp_path, [0, 1, 2, 3], seed=1)
    rec = server.score(job(tok, [0.0] * 4, eval_tokens=8 * T, rows=2, memo=0.7))
    assert rec["purity_max_diff"] == 0 and rec["causal_max_diff"] == 0, rec
    assert rec["val_bpb"] is None and "depend on what it was shown before" in rec["rejected"], rec
    honest = server.score(job(tok, [0.0] * 4, eval_tokens=8 * T, rows=2))
    assert honest["rejected"] is None and honest["fresh_max_diff"] == 0, honest


def test_a_memo_that_starts_learning_after_its_first_call_is_rejected_even_with_one_batch(tmp_path, server, job):
    """One batch scored: the main worker scores it as its first call, so a model that answers its first call
    honestly and learns only afterwards would meet the fresh worker's sample, also a first call, with the same
    history. The fresh worker's random rows, shown first, give it another one."""
    tok = handmade(tmp_path, [0, 1, 2, 3], seed=2)
    rec = server.score(job(tok, [0.0] * 4, eval_tokens=4 * T, rows=4, memo=0.7))
    assert rec["purity_max_diff"] == 0 and rec["causal_max_diff"] == 0, rec
    assert rec["val_bpb"] is None and "depend on what it was shown before" in rec["rejected"], rec
    assert rec["fresh_max_diff"] > 0.5, rec


@pytest.mark.integration
def test_prestarted_workers_load_nothing_of_the_proposal_before_go_and_score_the_same(tmp_path, server, job):
    """"prestart" (the runner's word near the end of training, on a GPU) starts the main and fresh workers early:
    they map their buffers, but the proposal's train file is imported only after "go" (its import leaves a mark),
    and the same checkpoint scores exactly as without the pre-start."""
    import psutil
    tok = handmade(tmp_path, [0, 1, 2, 3], seed=3)
    req = job(tok, [0.5, 1.0, -1.0, 2.0], eval_tokens=6 * T, rows=2)
    mark = tmp_path / "imported.txt"
    src = Path(req["source"])
    (src / "models.py").write_text(f"open({str(mark)!r}, 'a').write('x')\n" + MODELS)
    plain = server.score(req)
    assert mark.read_text() == "xx"                          # the main worker and the fresh one each import it
    mark.unlink()
    seen = {}

    def while_training():
        deadline = time.monotonic() + 30
        while not (Path(req["job_dir"]) / "to_worker").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        seen["workers"] = until(lambda: _at_least(2, [c for c in psutil.Process(server.proc.pid).children(
            recursive=True) if c.status() != psutil.STATUS_ZOMBIE]), "the zygote and a worker to be up")
        time.sleep(1.0)                  # training goes on a second more: the record counts it as prestarted
        seen["imported"] = mark.exists()

    early = server.score_prestarted(req, while_training)
    assert len(seen["workers"]) >= 2 and not seen["imported"], seen    # the zygote and a worker, no import yet
    assert mark.read_text() == "xx"
    assert early["val_bpb"] == plain["val_bpb"] and early["fresh_max_diff"] == 0, (early, plain)
    assert early["seconds"]["prestarted"] >= 1.0 > plain["seconds"]["prestarted"], (early, plain)
    assert set(early["seconds"]) >= {"ready", "main", "fresh", "after_go"}, early


@pytest.mark.integration
def test_the_fork_server_is_forked_before_any_request_and_keeps_nothing_of_the_evaluators_descriptors(tmp_path,
                                                                                                        server, job):
    """The evaluator forks its model fork server right after importing torch (one import a session, not two):
    the fork server must hold only its own pipes to the evaluator and the log (0, 1, 2), never the evaluator's
    pipes to ar or any file it opened, and it stays in the evaluator's process group."""
    import psutil
    tok = handmade(tmp_path, [0, 1, 2, 3])
    assert server.score(job(tok, [0.0] * 4, eval_tokens=2 * T, rows=2))["val_bpb"] is not None
    ev = psutil.Process(server.proc.pid)
    (zy,) = [c for c in ev.children() if c.status() != psutil.STATUS_ZOMBIE]
    assert zy.cmdline() == ev.cmdline()                   # forked from the evaluator, not a new interpreter
    fds = sorted(int(f) for f in os.listdir(f"/proc/{zy.pid}/fd"))
    assert fds == [0, 1, 2], fds
    ev_pipes = {os.readlink(f"/proc/{ev.pid}/fd/{f}") for f in (0, 1)}      # the evaluator's pipes to ar
    zy_pipes = {os.readlink(f"/proc/{zy.pid}/fd/{f}") for f in (0, 1)}
    assert all(p.startswith("pipe:") for p in zy_pipes) and not zy_pipes & ev_pipes, (zy_pipes, ev_pipes)
    assert os.readlink(f"/proc/{zy.pid}/fd/2") == os.readlink(f"/proc/{ev.pid}/fd/2")   # its log is the evaluator's
    assert os.getpgid(zy.pid) == os.getpgid(ev.pid) and zy.cwd() == "/"


def test_changed_data_is_rejected_before_the_model_runs(tmp_path, server, job):
    tok = handmade(tmp_path, [0, 1, 2, 3])
    req = job(tok, [0.0] * 4, eval_tokens=2 * T, rows=2)
    req["manifest"] = {**req["manifest"], "val.bin": "0" * 64}
    rec = server.score(req)
    assert rec["val_bpb"] is None and "val.bin" in rec["rejected"] and "changed" in rec["rejected"]
    pid = server.proc.pid
    rec = server.score(job(tok, [0.0] * 4, eval_tokens=2 * T, rows=2))     # the session goes on
    assert rec["val_bpb"] == pytest.approx(by_hand([0.0] * 4, [0, 1, 2, 3], ROW * 2)[0], rel=1e-6)
    assert server.proc.pid == pid, "the evaluator server died after a request it rejected before 'go'"


def test_no_checkpoint_is_no_score_and_the_server_goes_on(tmp_path, server, job):
    tok = handmade(tmp_path, [0, 1, 2, 3])
    req = job(tok, [0.0] * 4, eval_tokens=2 * T, rows=2)
    rec = server.score(req, go=False)
    assert rec["val_bpb"] is None and "without a checkpoint" in rec["rejected"]
    rec = server.score(req)                                   # the next request is scored as usual
    assert rec["val_bpb"] == pytest.approx(by_hand([0.0] * 4, [0, 1, 2, 3], ROW * 2)[0], rel=1e-6)



@pytest.mark.integration
@pytest.mark.parametrize("case", ["starting", "idle", "after an evaluation"])
def test_closing_a_session_server_leaves_no_process_not_even_a_zombie(tmp_path, job, case):
    """When `ar` returns, no process of its evaluator session may be left: a worker left as a zombie for init
    to reap keeps its Landlock rules and so the deleted workspace's inodes, and a remount of runs/ right
    after fails 'busy' (seen in CI)."""
    import psutil

    from autoresearch.experiment.evaluate import Server as Session
    s = Session(tmp_path / "runs" / "evaluator.log")
    proc = s.ensure()
    if case == "idle":
        until(lambda: any("libtorch" in m.path for c in psutil.Process(proc.pid).children() for m in _maps(c)),
              "the fork server to have imported torch")
    if case == "after an evaluation":
        req = job(handmade(tmp_path, [0, 1, 2, 3]), [0.0] * 4, eval_tokens=2 * T, rows=2)
        assert s.send(json.dumps({**req, "id": 1})) and s.send("go 1") and s.wait_done(1, 60)
        assert json.loads(Path(req["record"]).read_text())["val_bpb"] is not None
    started = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    s.close()
    assert not [pid for pid in started if psutil.pid_exists(pid)]
    assert "Traceback" not in (tmp_path / "runs" / "evaluator.log").read_text()


def _shm(pattern: str = "*") -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(pattern)} if Path("/dev/shm").is_dir() else set()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_evaluation_without_cuda_ipc_falls_back_to_the_host_and_says_why(tmp_path, server, job):
    """Here no buffer owner can start CUDA: the evaluation goes on through the host (where, without CUDA, the
    model cannot load either) and the record says why CUDA IPC was not used; the owners leave nothing behind."""
    import tempfile
    owners = set(Path(tempfile.gettempdir()).glob("ar-owner-*"))
    tok = handmade(tmp_path, [0, 1, 2, 3])
    rec = server.score({**job(tok, [0.0] * 4, eval_tokens=2 * T, rows=2), "device": "cuda"})
    assert rec["transfer"] == "host" and "buffer owner failed" in rec["transfer_note"], rec
    assert "\n" not in rec["transfer_note"] and "CUDA" in rec["transfer_note"], rec
    assert rec["val_bpb"] is None and "could not load the model" in rec["rejected"], rec
    assert set(Path(tempfile.gettempdir()).glob("ar-owner-*")) <= owners          # the owners' FIFO folders
    rec = server.score(job(tok, [0.0] * 4, eval_tokens=2 * T, rows=2))            # the CPU as ever
    assert rec["transfer"] == "host" and "transfer_note" not in rec and rec["val_bpb"] is not None, rec


@pytest.mark.integration
@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("prestart", [False, True], ids=["at-go", "prestarted"])
def test_a_cuda_evaluation_in_the_sandbox_shares_its_buffers_through_cuda_ipc(tmp_path, prestart):
    """One real evaluation on the GPU as the runner asks for it (the real sandbox, the runner's worker policies,
    the fresh re-score; with and without "prestart"): the buffers must go through CUDA IPC, each worker's made by
    a buffer owner of its own, not the host fallback; afterwards no file of the evaluation is left in /dev/shm."""
    from autoresearch.experiment.evaluate import fresh_job, worker_policy
    from autoresearch.experiment.execute import Workspace
    from autoresearch.harness import sandbox
    if not sandbox.available()[0]:
        pytest.skip("needs Landlock: " + sandbox.available()[1])
    os.chmod(tmp_path, 0o755)
    tok = handmade(tmp_path, [0, 1, 2, 3], seed=1)
    ws = Workspace.at(tmp_path / "ws")
    for d in (ws.src, ws.job):
        d.mkdir(parents=True)
    (ws.src / "models.py").write_text(MODELS)
    checkpoint.save(ws.checkpoint, factory="fixed", config={"vocab": 4},
                    arrays={"bias": np.array([0.5, 1.0, -1.0, 2.0], dtype=np.float32)})
    sandbox.give_to_sandbox(ws.src, ws.checkpoint, ws.job)
    req = {"tok_dir": str(tok), "dataset": "hand", "seq_len": T, "eval_tokens": 64 * T, "holdout_tokens": 0,
           "rows": 8, "device": "cuda", "manifest": manifest(tok), "checkpoint": str(ws.checkpoint),
           "source": str(ws.src), "train_file": "models.py", "job_dir": str(ws.job),
           "record": str(ws.root / "record.json"), "private": str(ws.root / "private.json"), "timeout": 120,
           "sandbox": True, "policy": worker_policy(ws), "tolerance": 2e-3, "fresh_job_dir": str(fresh_job(ws)),
           "fresh_policy": worker_policy(ws, fresh_job(ws)), "fresh_rows": 8}
    before = _shm()
    s = Server(tmp_path / "evaluator.log")
    try:
        rec = s.score_prestarted(req, lambda: time.sleep(3)) if prestart else s.score(req)
    finally:
        s.close()
    log = (tmp_path / "evaluator.log").read_text()[-3000:]
    assert rec.get("error") is None and rec["rejected"] is None, (rec, log)
    assert rec["transfer"] == "ipc", f"CUDA IPC fell back to the host: {rec.get('transfer_note')}\n{log}"
    assert "transfer_note" not in rec and rec["val_bpb"] > 0, rec
    assert rec["fresh_max_diff"] == 0 and rec["causal_max_diff"] == 0, rec
    left = {n for n in _shm() - before if n.startswith(("cuda.shm.", "torch_"))}
    assert not left, f"files of the evaluation left in /dev/shm: {sorted(left)}"


FAKE_OWNER = r'''
import os, pickle, sys, torch
d = sys.argv[1]
fin = open(os.path.join(d, "to_worker"))
fout = open(os.path.join(d, "from_worker"), "w")
pid = os.getpid()
for name in (f"cuda.shm.0.{pid:x}.1", f"torch_{pid}_7_0"):     # as the driver and torch name theirs
    open(f"/dev/shm/{name}", "wb").close()
print("ready " + pickle.dumps((torch.zeros, ((2, 3), (2, 3, 5)))).hex(), file=fout, flush=True)
for line in fin:
    if line.split()[:1] == ["exit"]:
        break
'''


@pytest.mark.integration
@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_a_buffer_owners_handles_are_mapped_and_its_files_removed_once_it_is_reaped(tmp_path):
    """The evaluator's side of a buffer owner (a stand-in process whose "handles" rebuild CPU tensors): its
    answer is mapped, its files in /dev/shm found by its pid, and, once it is closed and reaped, removed."""
    import pickle
    import time

    from autoresearch.harness.evaluator import _retire, _Worker

    class Zygote:                                 # the fork server's two calls, with plain processes
        procs: dict = {}

        def spawn(self, job):
            p = subprocess.Popen([sys.executable, "-c", FAKE_OWNER, job["job_dir"]])
            self.procs[p.pid] = p
            return p.pid

        def clean(self, spare=()):
            for pid, p in list(self.procs.items()):
                if pid not in spare:
                    p.kill()
                    p.wait()
                    del self.procs[pid]

    zygote = Zygote()
    d = tmp_path / "owner"
    d.mkdir()
    owner = _Worker(zygote, d, {"rows": 2}, time.monotonic() + 60, kind="owner")
    assert zygote.procs[owner.pid].poll() is None
    pickled = owner.export()
    assert tuple(owner.inp.shape) == (2, 3) and tuple(owner.out.shape) == (2, 3, 5)
    fn, args = pickle.loads(pickled)                              # what the worker gets, in its ipc.pkl
    assert tuple(fn(*args[1]).shape) == (2, 3, 5)
    assert owner.files == sorted([f"/dev/shm/cuda.shm.0.{owner.pid:x}.1", f"/dev/shm/torch_{owner.pid}_7_0"])
    _retire(zygote, [owner])
    assert not zygote.procs and owner.inp is None
    assert not [f for f in owner.files if os.path.lexists(f)] and not d.exists()


@pytest.mark.integration
def test_a_gpu_evaluation_that_fell_back_to_the_host_says_so_in_the_row():
    from types import SimpleNamespace
    from autoresearch.experiment.settle import _slow_transfer
    fell_back = SimpleNamespace(verdict=SimpleNamespace(record={
        "transfer": "host", "transfer_note": "CUDA IPC: CUDA error: mapping of buffer object failed"}))
    assert "fell back to host transfer" in _slow_transfer(fell_back)
    assert "mapping of buffer object failed" in _slow_transfer(fell_back)
    for rec in ({"transfer": "ipc"}, {"transfer": "host"}, {}):     # IPC, or the CPU's host transfer: nothing said
        assert _slow_transfer(SimpleNamespace(verdict=SimpleNamespace(record=rec))) is None


@pytest.mark.parametrize("k, T", [(4, 2048), (32, 2048), (4, 63), (16, 63), (4, 7), (8, 7), (1, 2)])
def test_secret_cuts_fall_one_in_each_stretch_of_the_row_and_anywhere_in_it(k, T):
    """Where the causality probes cut (harness/evaluator._cuts): every cut in [1, T), one in each of k equal
    stretches, in a secret order; over many draws every position can be the last before a cut."""
    import random
    from autoresearch.harness.evaluator import _cuts
    seen = set()
    for seed in range(400):
        cuts = _cuts(random.Random(seed), k, T)
        assert len(cuts) == k and all(1 <= c < T for c in cuts), cuts
        span = (T - 1) / k
        assert all(1 + int(i * span) <= c <= 1 + int((i + 1) * span) for i, c in enumerate(sorted(cuts))), cuts
        seen |= set(cuts)
    if 400 >= 12 * (T - 1) / k:                   # each position missed with odds under e^-12
        assert seen == set(range(1, T)), sorted(set(range(1, T)) - seen)[:10]


class _AnsweringWorker:
    """A model worker reduced to its buffers and an answer: logits for the rows it is sent."""

    def __init__(self, rows: int, T: int, vocab: int, answer):
        self.inp = torch.zeros(rows, T, dtype=torch.int64)
        self.out = torch.zeros(rows, T, vocab)
        self.answer, self.n = answer, 0

    def send(self, line: str) -> None:
        self.n = int(line.split()[1]) if line.startswith("run ") else self.n

    def expect(self, what: str) -> None:
        if what == "ok":
            self.out[:self.n] = self.answer(self.inp[:self.n])


def _honest(x, V=16):
    return torch.linspace(-1, 1, V).expand(*x.shape, V).clone()


def _looks_ahead(x, V=16):
    out = _honest(x, V)
    out.scatter_add_(2, torch.roll(x, -1, 1).unsqueeze(-1), torch.full((*x.shape, 1), 3.0))
    return out


@pytest.mark.parametrize("main, fresh, says", [
    (_honest, _honest, None),                        # the control: an honest model passes
    (_looks_ahead, _looks_ahead, "looks ahead"),     # the main pass scored a look ahead (written after "ok", say,
    (_looks_ahead, _honest, "shown before"),         # once the probe's copy was taken): a fresh worker that looks
])                                                   # ahead the same way, or answers honestly, is caught
def test_the_fresh_re_score_catches_any_main_pass_that_scored_a_look_ahead(main, fresh, says):
    """_check_fresh against the main pass's kept losses: whatever the fresh worker answers, a row the main pass
    scored from look-ahead logits cannot be matched before a secret cut it never saw past."""
    import random
    from autoresearch.harness import evaluator as ev
    T, V, B = 15, 16, 4
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, V, (B, T + 1), generator=gen) for _ in range(2)]
    batches = [(r[:, :-1], r[:, 1:]) for r in rows]
    sample = {(b, r): ev._nll(main(x), y)[r].double() for b, (x, y) in enumerate(batches) for r in range(B)}
    record: dict = {}
    check = lambda: ev._check_fresh(_AnsweringWorker(B, T, V, fresh), batches, dict(sample), random.Random(1),  # noqa
                                    torch.device("cpu"), {"tolerance": 1e-3}, record)
    if says is None:
        check()
        assert record["fresh_max_diff"] == 0
    else:
        with pytest.raises(ev.Rejected, match=says):
            check()
