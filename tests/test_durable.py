"""records/durable.py's replace-a-file-whole and put-back-in-place (append_line's cases are in test_ledger.py): the
reader sees the old content or the new, nothing is left beside the file, `sync` is what asks the disk, and a
record put back stays the file an open handle reads."""

import json
import os
import threading

import pytest

from autoresearch.records.durable import put_back, write_atomic, write_json


def test_a_file_is_replaced_whole_and_nothing_is_left_beside_it(tmp_path):
    f = tmp_path / "record.json"
    f.write_text("old")
    inode = f.stat().st_ino
    write_atomic(f, "new ✓")
    assert f.read_text(encoding="utf-8") == "new ✓" and f.stat().st_ino != inode    # a new file, renamed over
    write_json(f, {"val_bpb": 0.99, "path": tmp_path})           # what json cannot say is written as text
    assert json.loads(f.read_text()) == {"val_bpb": 0.99, "path": str(tmp_path)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


@pytest.mark.parametrize("write,sync,fsyncs", [(write_atomic, False, 0), (write_atomic, True, 2),   # file, folder
                                               (put_back, False, 0), (put_back, True, 1)])
def test_sync_is_what_asks_the_disk(tmp_path, monkeypatch, write, sync, fsyncs):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    f = tmp_path / "clock.json"
    f.write_text("{}")
    write(f, "{}" if write is write_atomic else b"{}", sync=sync)
    assert len(calls) == fsyncs


def test_a_record_put_back_is_the_same_file_an_open_handle_reads(tmp_path):
    f = tmp_path / "results.tsv"
    f.write_bytes(b"header\nrow 1\n")
    before, inode = f.read_bytes(), f.stat().st_ino
    with open(f, "rb") as held:                                 # ar's handle, opened before the run
        f.write_bytes(b"forged by the run\n")
        put_back(f, before)
        assert held.read() == before and f.stat().st_ino == inode


def test_a_failed_replace_keeps_what_was_there_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "results.tsv"
    target.mkdir()                                              # os.replace cannot put a file over a folder
    (target / "inside").write_text("kept")
    with pytest.raises(OSError):
        write_atomic(target, "forged", sync=True)
    assert (target / "inside").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.tsv"]


def test_threads_writing_one_file_never_mix(tmp_path):
    """Slots write from their own threads: each its own temporary name, so the file is always one writer's."""
    f = tmp_path / "journal.md"
    texts = [str(i) * 50_000 for i in range(8)]
    threads = [threading.Thread(target=lambda t=t: [write_atomic(f, t) for _ in range(20)]) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert f.read_text() in texts
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.md"]
