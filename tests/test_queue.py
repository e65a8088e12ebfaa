import errno
import json
import os

import pytest

from autoresearch.records import ledger as ledger_mod
from autoresearch.records.ledger import LedgerError
from autoresearch.records.queue import ExperimentQueue, Spec


def test_order_and_lifecycle(tmp_path):
    q = ExperimentQueue(tmp_path / "queue.jsonl")
    a = q.add("baseline", {})
    b = q.add("knobs", {"DEPTH": 9})
    c = q.add("propose", {"agent": "claude"})
    assert (a.id, b.id, c.id) == (1, 2, 3)
    assert q.next() == a
    q.start(a.id)
    assert q.is_started(a.id) and not q.is_done(a.id) and q.next() == a  # started, not done: still pending
    q.done(a.id, "keep")
    assert q.is_done(a.id) and q.status(a.id) == "keep"
    assert [s.id for s in q.pending()] == [2, 3] and q.next() == b
    assert [s.id for s in q.all()] == [1, 2, 3]


def test_survives_a_restart(tmp_path):
    p = tmp_path / "queue.jsonl"
    q = ExperimentQueue(p)
    for i in range(5):
        q.add("knobs", {"i": i})
    q.start(1)
    q.done(1, "keep")
    q.start(2)  # ar dies here
    q2 = ExperimentQueue(p, warn=lambda m: pytest.fail(m))
    assert [s.id for s in q2.pending()] == [2, 3, 4, 5]
    assert q2.is_started(2) and not q2.is_done(2) and q2.get(3).payload == {"i": 2}
    q2.start(2)
    assert q2.starts(2) == 2
    assert q2.add("rerun", {}).id == 6


def test_done_is_final(tmp_path):
    q = ExperimentQueue(tmp_path / "queue.jsonl")
    s = q.add("baseline", {})
    q.start(s.id)
    q.done(s.id, "crash")
    q.done(s.id, "keep")  # a repeat (resume) is a no-op
    assert q.status(s.id) == "crash"
    with pytest.raises(ValueError, match="already done"):
        q.start(s.id)
    assert ExperimentQueue(q.path).status(s.id) == "crash"


def test_bad_arguments(tmp_path):
    q = ExperimentQueue(tmp_path / "queue.jsonl")
    with pytest.raises(ValueError):
        q.add("nonsense", {})
    with pytest.raises(ValueError):
        q.start(99)
    with pytest.raises(ValueError):
        q.done(99, "keep")


def lines(p):
    return p.read_text().splitlines()


def test_truncated_last_line(tmp_path):
    p = tmp_path / "queue.jsonl"
    q = ExperimentQueue(p)
    q.add("knobs", {"a": 1})
    q.add("knobs", {"a": 2})
    q.start(1)
    with open(p, "a") as f:
        f.write('{"op":"done","id":1,"sta')  # killed mid-write
    warnings = []
    q2 = ExperimentQueue(p, warn=warnings.append)
    assert len(warnings) == 1 and "line 4" in warnings[0] and "partial last line" in warnings[0]
    assert [s.id for s in q2.pending()] == [1, 2] and q2.is_started(1)
    q2.done(1, "keep")
    assert all(json.loads(line) for line in lines(p))  # repaired: no glued line
    q3 = ExperimentQueue(p, warn=lambda m: pytest.fail(m))
    assert q3.is_done(1) and [s.id for s in q3.pending()] == [2]


def test_garbage_lines_keep_every_valid_event(tmp_path):
    p = tmp_path / "queue.jsonl"
    q = ExperimentQueue(p)
    q.add("knobs", {"a": 1})
    with open(p, "a") as f:
        f.write("\x00\x00garbage\n")
        f.write('{"op":"start","id":42}\n')
        f.write('[1, 2]\n')
    q.add("knobs", {"a": 2})  # ids continue from the valid events
    q.start(2)
    warnings = []
    q2 = ExperimentQueue(p, warn=warnings.append)
    assert [w.split(":")[0] for w in warnings] == ["queue.jsonl line 2", "queue.jsonl line 3", "queue.jsonl line 4"]
    assert [s.id for s in q2.all()] == [1, 2] and q2.is_started(2)


def test_complete_last_event_without_newline_is_kept(tmp_path):
    p = tmp_path / "queue.jsonl"
    q = ExperimentQueue(p)
    q.add("knobs", {})
    q.start(1)
    p.write_bytes(p.read_bytes()[:-1])
    q2 = ExperimentQueue(p, warn=lambda m: pytest.fail(m))
    assert q2.is_started(1)
    q2.done(1, "discard")
    assert ExperimentQueue(p).is_done(1) and len(lines(p)) == 3


def test_every_event_is_fsynced(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(ledger_mod.os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    q = ExperimentQueue(tmp_path / "queue.jsonl")
    q.add("baseline", {})
    n = len(calls)
    q.start(1)
    q.done(1, "keep")
    assert n >= 1 and len(calls) == n + 2


def test_full_disk_is_a_clear_error_and_nothing_changes(tmp_path, monkeypatch):
    p = tmp_path / "queue.jsonl"
    q = ExperimentQueue(p)
    q.add("baseline", {})
    before = p.read_bytes()

    def enospc(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ledger_mod.os, "write", enospc)
    with pytest.raises(LedgerError, match="queue.jsonl"):
        q.start(1)
    monkeypatch.undo()
    assert p.read_bytes() == before and not q.is_started(1)


def test_spec_is_plain_data():
    assert Spec(1, "knobs", {"a": 1}) == Spec(1, "knobs", {"a": 1})
