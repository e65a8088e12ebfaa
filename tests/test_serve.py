"""`ar serve` over real HTTP: a real `ar serve` process, a real ledger appended to while it runs, SSE read off
the socket. The browser test (Playwright driving the system's Chromium) is in test_dashboard_browser.py."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from autoresearch.records.events import EventLog
from autoresearch.records.ledger import Ledger, Row, Status
from autoresearch.records.lock import RepoLock

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def make_tag(tmp_path: Path, rows: int = 3) -> tuple[Path, Ledger]:
    """A repo with runs/t/: a few rows and a diff, as the loop leaves them (no training needed to serve them)."""
    repo = tmp_path / "repo"
    (repo / "runs" / "t").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    ledger = Ledger(repo / "runs" / "t")
    for i in range(1, rows + 1):
        add(ledger, i, 2.0 - 0.01 * i if i != 3 else 2.5, "keep" if i != 3 else "discard", f"change {i}")
    return repo, ledger


def add(ledger: Ledger, i: int, bpb: float | None, status: str, desc: str) -> None:
    commit = f"{i:07x}"
    d = ledger.exp_dir(i, commit)
    (d / "diff.patch").write_text(f"--- a/train.py\n+++ b/train.py\n@@ -1 +1 @@\n-LR_MULT = 1.0\n+LR_MULT = {i}.5\n")
    ledger.append(Row(commit=commit, val_bpb=bpb, memory_gb=1.0, status=Status(status), description=desc, exp_id=i,
                      tag="t"))


class Served:
    def __init__(self, *args: str, cwd: Path):
        env = {**os.environ, "NO_COLOR": "1"}
        self.p = subprocess.Popen([sys.executable, "-m", "autoresearch", "serve", "--port", "0", *args], cwd=cwd,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.p.stdout.readline()
        assert "serving" in line, line + self.p.stderr.read()
        self.url = line.split(" at ")[1].split()[0]
        u = urlparse(self.url)
        self.host, self.port, self.query = u.hostname, u.port, u.query

    def get(self, path: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict, str]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        c.request(method, path, headers=headers or {})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read().decode()

    def events(self, path: str = "/api/events"):
        """(kind, data) pairs as the server pushes them."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        c.request("GET", path)
        r = c.getresponse()
        assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
        kind = None
        while True:
            line = r.readline().decode()
            if not line:
                return
            if line.startswith("event: "):
                kind = line[7:].strip()
            elif line.startswith("data: "):
                yield kind, json.loads(line[6:])

    def stop(self) -> int:
        self.p.send_signal(signal.SIGINT)
        try:
            return self.p.wait(timeout=10)
        finally:
            if self.p.poll() is None:
                self.p.kill()


@pytest.fixture
def served(tmp_path):
    started = []

    def start(*args, cwd=tmp_path):
        s = Served(*args, cwd=cwd)
        started.append(s)
        return s
    yield start
    for s in started:
        if s.p.poll() is None:
            s.stop()


def test_serve_state_diff_and_live_push(tmp_path, served):
    repo, ledger = make_tag(tmp_path)
    s = served("--repo", str(repo))
    assert s.url.startswith("http://127.0.0.1:") and "token" not in s.url
    code, headers, page = s.get("/")
    assert code == 200 and '<script src="/dashboard.js">' in page
    assert "script-src 'self'" in headers["content-security-policy"] and "unsafe-inline" not in \
        headers["content-security-policy"].split("script-src")[1].split(";")[0]
    code, _, body = s.get("/api/state")
    state = json.loads(body)
    assert code == 200 and state["name"] == "t" and [r["exp_id"] for r in state["rows"]] == [1, 2, 3]
    assert state["journal"]["best"]["exp_id"] == 2 and [p["best"] for p in state["curve"]] == [1.99, 1.98, 1.98]
    code, _, diff = s.get("/api/diff/3")
    assert code == 200 and "+LR_MULT = 3.5" in diff
    assert s.get("/api/diff/99")[0] == 404
    # read-only: no method but GET; loopback only answers to a loopback Host
    assert s.get("/api/state", method="POST")[0] == 405 and s.get("/", method="DELETE")[0] == 405
    assert s.get("/", headers={"Host": "evil.example:80"})[0] == 403
    # SSE: the current state first, then a row appended by "the loop" arrives without asking, and its events
    stream = s.events()
    first = dict([next(stream), next(stream)])
    assert len(first["results"]["rows"]) == 3 and "rows" not in first["status"]
    t0 = time.monotonic()
    add(ledger, 4, 1.9, "keep", "a new best <b>bold</b>")
    kind, doc = next(stream)
    assert kind == "results" and doc["rows"][-1]["exp_id"] == 4 and doc["rows"][-1]["description"].endswith("</b>")
    assert time.monotonic() - t0 < 3
    with RepoLock(repo / "runs" / ".ar.lock", tag="t", command="ar run"):    # held, as by a running loop
        log = EventLog(repo / "runs" / "t" / "events.jsonl")
        log.session_started(tag="t", branch="autoresearch/t", by_slot=False, slots=[])
        log.write("experiment_started", exp_id=5, kind="propose", slot=0, description="wider")
        log.write("phase", exp_id=5, phase="training")
        kind, doc = next(stream)
        while doc["experiment"] is None or doc["experiment"]["phase"] != "training":   # pushed as they come
            kind, doc = next(stream)
        assert kind == "status" and doc["state"] == "running" and doc["experiment"]["id"] == 5
    kind, doc = next(stream)       # the lock is given back without a stop: a kill -9, as the page must see it
    assert kind == "status" and doc["state"] == "stopped" and doc["experiment"] is None
    assert s.stop() == 130 and "Traceback" not in s.p.stderr.read()       # Ctrl-C: 130, the exit code in docs/usage.md


def test_serve_beyond_loopback_needs_the_token(tmp_path, served):
    repo, _ = make_tag(tmp_path)
    s = served("--repo", str(repo), "--host", "0.0.0.0")
    token = s.query.removeprefix("token=")
    assert len(token) >= 16
    assert s.get("/api/state")[0] == 401 and s.get("/?token=wrong")[0] == 401
    code, headers, _ = s.get(f"/?token={token}")
    assert code == 200 and f"ar_token={token}" in headers["set-cookie"]
    assert s.get("/api/state", headers={"Cookie": f"ar_token={token}"})[0] == 200
    assert s.get("/api/state", headers={"Authorization": f"Bearer {token}"})[0] == 200
    assert s.get("/api/events", headers={"Host": "anything.example"})[0] == 401


def test_serve_an_upstream_results_file(tmp_path, served):
    tsv = tmp_path / "results.tsv"
    tsv.write_text("commit\tval_bpb\tmemory_gb\tstatus\tdescription\n"
                   "a1b2c3d\t0.997900\t44.0\tkeep\tbaseline\n"
                   "b2c3d4e\t0.000000\t0.0\tcrash\tdouble the width\n")
    s = served("--results", str(tsv))
    state = json.loads(s.get("/api/state")[2])
    assert [(r["exp_id"], r["status"], r["val_bpb"]) for r in state["rows"]] == [(1, "keep", 0.9979),
                                                                                 (2, "crash", None)]
    assert state["status"] == {} and s.get("/api/diff/2") == (200, s.get("/api/diff/2")[1], "")


def test_serve_errors_are_one_line(tmp_path):
    def run(*args):
        p = subprocess.run([sys.executable, "-m", "autoresearch", "serve", *args], capture_output=True, text=True,
                           timeout=60)
        assert p.stderr.startswith("error:") and len(p.stderr.strip().splitlines()) == 1, p.stderr
        return p.returncode, p.stderr
    assert run("--repo", str(tmp_path))[0] == 1                              # no results yet
    repo, _ = make_tag(tmp_path)
    assert run("--repo", str(repo), "--host", "0.0.0.0", "--token", "short") == (
        2, "error: --token must be at least 12 characters; leave it out to get a random one\n")
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        code, err = run("--repo", str(repo), "--port", str(busy.getsockname()[1]))
        assert code == 2 and "pick another --port" in err


def test_the_dashboard_state_names_the_objective_and_follows_its_direction(tmp_path):
    # A tag measured by a score to maximise: the best is the highest kept, deltas say higher is better.
    from autoresearch.views.serve import read_results_state, source_for
    repo = tmp_path / "repo"
    (repo / "runs" / "t").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "runs" / "t" / "meta.json").write_text(json.dumps(
        {"tag": "t", "objective": {"name": "score", "unit": "pts", "direction": "max", "noise": 0.5}}))
    ledger = Ledger(repo / "runs" / "t", sign=-1)
    for i, (v, st) in enumerate([(10.0, "keep"), (30.0, "keep"), (29.8, "discard"), (5.0, "discard")], 1):
        add(ledger, i, v, st, f"change {i}")
    doc = read_results_state(source_for(repo, "t", None))
    assert doc["objective"] == {"name": "score", "unit": "pts", "direction": "max", "noise_share": None, "noise": 0.5}
    assert [p["best"] for p in doc["curve"]] == [10.0, 30.0, 30.0, 30.0]
    entries = {e["exp_id"]: e for e in doc["journal"]["entries"]}
    assert doc["journal"]["best"]["exp_id"] == 2
    assert entries[3]["near_miss"] and entries[4]["dead_end"]      # 0.2 below the best: within the noise 0.5
