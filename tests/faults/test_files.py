"""Broken files under runs/: cut or garbage lines in results.tsv and queue.jsonl, a full disk, a read-only
runs/. `ar` names the bad line and keeps every valid row; a disk it cannot write is a clear stop (one line,
no traceback) that corrupts nothing, and the next run after the fix goes on."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

import autoresearch.records.ledger as ledger_mod
from autoresearch.config import load_config
from autoresearch.errors import ArError
from autoresearch.records.ledger import read_results
from autoresearch.session.loop import Loop
from autoresearch.records.queue import ExperimentQueue

from .helpers import History, agent_cmd, audit, fork_ar, make_repo, write_cfg

pytestmark = pytest.mark.e2e

TAG = "t"


def setup(tmp_path: Path, name: str = "repo"):
    root = make_repo(tmp_path, name, DEPTH=40, STEP_SECONDS=0.02)
    conf = write_cfg(tmp_path / f"{name}.yaml", agent=agent_cmd("cycle_agent.py"))
    return root, conf, ("run", "--repo", str(root), "--tag", TAG, "--config", str(conf), "--max-experiments")


def cut_last_line(f: Path) -> int:
    lines = f.read_bytes().split(b"\n")[:-1]
    f.write_bytes(b"\n".join(lines[:-1]) + b"\n" + lines[-1][: len(lines[-1]) // 2])
    return len(lines)


def insert_garbage(f: Path, after: int, garbage: bytes) -> int:
    lines = f.read_bytes().split(b"\n")
    lines.insert(after, garbage)
    f.write_bytes(b"\n".join(lines))
    return after + 1


CASES = {
    "results.tsv cut mid-line": ("results.tsv", lambda f: cut_last_line(f)),
    "results.tsv with a garbage line": ("results.tsv", lambda f: insert_garbage(f, 2, b"garbage\tline\x00\xff")),
    "queue.jsonl cut mid-line": ("queue.jsonl", lambda f: cut_last_line(f)),
    "queue.jsonl with a garbage line": ("queue.jsonl", lambda f: insert_garbage(f, 3, b'{"op": "add", "id": ')),
}


@pytest.mark.slow
def test_cut_and_garbage_lines_are_reported_and_the_rest_recovered(tmp_path, table):
    root, conf, args = setup(tmp_path)
    noise = load_config(conf).noise_threshold(root / "runs" / TAG)[0]
    assert fork_ar(*args, "4", log=tmp_path / "ar.log") == 0
    problems = []
    for fault, (name, corrupt) in CASES.items():
        f = root / "runs" / TAG / name
        line = corrupt(f)
        hist = History()
        hist.observe(root, TAG)                         # the valid rows and entries that must survive
        log = tmp_path / f"{fault}.log"
        rc = fork_ar(*args, "1", log=log, timeout=120)
        out = log.read_text()
        c = audit(root, TAG, hist, noise)
        reported = f"{name} line {line}" in out or f"{name}: dropped a partial last line" in out
        table.add(f"file: {fault}", 1, c.lost, c.duplicated, c.wrongly_kept,
                  c.inconsistent + int(rc != 0) + int(not reported))
        problems += [f"{fault}: {n}" for n in c.notes]
        if rc != 0 or not reported or "Traceback" in out:
            problems.append(f"{fault}: rc {rc}, reported {reported}:\n{out[-1500:]}")
    assert not problems, "\n".join(problems)


def _stop_is_clear(rc: int, out: str) -> bool:
    return rc not in (0, -9) and "error:" in out and "Traceback" not in out


def _no_torn_lines(root: Path) -> int:
    """1 when results.tsv or queue.jsonl holds a line that does not parse (what a bad write would leave)."""
    bad = []
    try:
        read_results(root / "runs" / TAG / "results.tsv")
    except ArError as e:
        bad.append(str(e))
    ExperimentQueue(root / "runs" / TAG / "queue.jsonl", warn=bad.append)
    return int(bool(bad))


@pytest.fixture
def small_fs(tmp_path):
    """A small tmpfs mounted where the repo's runs/ goes (root only); skipped where mounting is not allowed.
    48 MB: an experiment's workspace under runs/.work holds the evaluator's logits buffer (16 rows x 256 x 2048
    float32 = 32 MiB on the cpu profile) while it runs."""
    mounts = []

    def mount(path: Path, size: str = "48m") -> Path:
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounts.append(path)
        return path

    yield mount
    for m in reversed(mounts):
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


def _three_on_a_small_fs(tmp_path, small_fs):
    """A tag with three results whose runs/ is a small tmpfs: (root, args, noise, runs, history)."""
    root, conf, args = setup(tmp_path)
    noise = load_config(conf).noise_threshold(root / "runs" / TAG)[0]
    runs = small_fs(root / "runs")
    assert fork_ar(*args, "3", log=tmp_path / "ok.log") == 0
    hist = History()
    hist.observe(root, TAG)
    return root, args, noise, runs, hist


def test_full_disk_is_a_clear_stop(tmp_path, small_fs, table):
    root, args, noise, runs, hist = _three_on_a_small_fs(tmp_path, small_fs)
    filler = runs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)     # fill the disk to the last block
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    log = tmp_path / "full.log"
    rc = fork_ar(*args, "3", log=log)
    out = log.read_text()
    torn = _no_torn_lines(root)
    filler.unlink()
    assert fork_ar(*args, "3", log=tmp_path / "after.log") == 0
    c = audit(root, TAG, hist, noise)
    clear = _stop_is_clear(rc, out)
    table.add("disk full (tmpfs)", 1, c.lost, c.duplicated, c.wrongly_kept, c.inconsistent + torn + int(not clear))
    assert clear, out[-2000:]
    assert not torn and not c.notes, c.notes


def _remount_read_only(path: Path, tries: int = 50) -> None:
    """`mount -o remount,ro`, again while the kernel says busy. Every process of ar is reaped when it exits, but a
    sandboxed process's Landlock ruleset is freed after it, from a kernel work queue, and its rules hold the
    deleted workspace's folders (under runs/.work) until then: a deleted inode still held makes a read-only
    remount busy. A user never sees it; a remount straight after `ar` exits did, 2 times in 15."""
    for _ in range(tries):
        r = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True)
        if r.returncode == 0:
            return
        assert "busy" in r.stderr, r.stderr
        time.sleep(0.1)
    raise AssertionError(f"{path} stayed busy: {r.stderr}")


def test_read_only_runs_is_a_clear_stop(tmp_path, small_fs, table):
    root, args, noise, runs, hist = _three_on_a_small_fs(tmp_path, small_fs)
    _remount_read_only(runs)
    log = tmp_path / "ro.log"
    try:
        rc = fork_ar(*args, "3", log=log)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(runs)], check=True)
    out = log.read_text()
    torn = _no_torn_lines(root)
    assert fork_ar(*args, "3", log=tmp_path / "after.log") == 0
    c = audit(root, TAG, hist, noise)
    clear = _stop_is_clear(rc, out)
    table.add("read-only runs/ (tmpfs)", 1, c.lost, c.duplicated, c.wrongly_kept,
              c.inconsistent + torn + int(not clear))
    assert clear, out[-2000:]
    assert not torn and not c.notes, c.notes


@pytest.mark.slow
def test_enospc_on_the_ledger_append_simulated(tmp_path, monkeypatch, table):
    """Without a mount: the write of a results.tsv row fails with ENOSPC half-way."""
    root, conf, args = setup(tmp_path)
    cfg = load_config(conf)
    noise = cfg.noise_threshold(root / "runs" / TAG)[0]
    assert fork_ar(*args, "3", log=tmp_path / "ok.log") == 0
    hist = History()
    hist.observe(root, TAG)
    real_write = os.write

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("results.tsv"):
            real_write(fd, bytes(data)[:10])         # part of the row reaches the disk, then it is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(ledger_mod.os, "write", write)
    with pytest.raises(ArError) as e:
        with Loop(cfg, root, TAG, None) as loop:
            loop.enqueue_knobs({"LR_MULT": 3.0})
            loop.run()
    monkeypatch.setattr(ledger_mod.os, "write", real_write)
    torn = _no_torn_lines(root)
    Loop(cfg, root, TAG, None).run()                  # the space is back: the experiment runs again
    c = audit(root, TAG, hist, noise)
    clear = "No space left" in str(e.value) and "nothing recorded was lost" in str(e.value)
    table.add("disk full (ENOSPC on the ledger append, simulated)", 1, c.lost, c.duplicated, c.wrongly_kept,
              c.inconsistent + torn + int(not clear))
    assert clear and not torn and not c.notes, (str(e.value), c.notes)
    assert read_results(root / "runs" / TAG / "results.tsv")[-1].knobs["LR_MULT"] == 3.0
