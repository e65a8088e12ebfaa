import errno
import os

import pytest

from autoresearch.records import ledger as ledger_mod
from autoresearch.errors import ArError
from autoresearch.records.durable import append_line
from autoresearch.records.ledger import (COLUMNS, HEADER, UPSTREAM_COLUMNS, Ledger, LedgerError, Row, Status,
                                 read_results)


def full_row(**kw):
    args = dict(commit="a1b2c3d4e5f6", val_bpb=0.9979, memory_gb=44.0, status=Status.KEEP,
                description='wider "MLP"\twith a tab', exp_id=3, tag="nov30", parent="0f0f0f0", mfu=39.8,
                tokens_per_s=1600000.0, training_seconds=300.1, total_seconds=325.9, num_steps=953,
                total_tokens_M=499.6, time_budget=300.0, seed=42, knobs={"DEPTH": 8, "LR_MULT": 1.5},
                reason="beats the best", started_at="2026-11-30T04:50:00+00:00",
                finished_at="2026-11-30T04:55:00+00:00")
    args.update(kw)
    return Row(**args)


def crash_row(**kw):
    args = dict(commit="deadbeef", val_bpb=None, memory_gb=None, status=Status.CRASH, description="oom")
    args.update(kw)
    return Row(**args)


def test_columns_upstream_first():
    assert COLUMNS[:5] == UPSTREAM_COLUMNS and "exp_id" in COLUMNS and COLUMNS[-1] == "finished_at"
    assert issubclass(LedgerError, ArError)


def test_roundtrip(tmp_path):
    led = Ledger(tmp_path / "runs" / "nov30")
    row = full_row()
    led.append(row)
    led.append(crash_row(exp_id=4))
    assert led.path == tmp_path / "runs" / "nov30" / "results.tsv"
    rows = led.rows()
    assert rows[0] == row
    assert rows[1].val_bpb is None and rows[1].memory_gb is None and rows[1].status is Status.CRASH
    assert rows[1].finished_at  # filled in on append
    text = led.path.read_text()
    assert text.startswith(HEADER) and text.count(HEADER) == 1 and text.count("\n") == 3
    # a missing number is an empty field, never 0
    crash_fields = text.splitlines()[2].split("\t")
    assert crash_fields[1] == "" and crash_fields[2] == "" and crash_fields[3] == "crash"


def test_newlines_in_text_are_flattened(tmp_path):
    led = Ledger(tmp_path)
    led.append(full_row(description="line one\nline two\r\nthree", reason="a\nb"))
    assert led.rows()[0].description == "line one line two three"
    assert led.path.read_text().count("\n") == 2


def test_best_kept(tmp_path):
    led = Ledger(tmp_path)
    assert led.best_kept() is None
    led.append(full_row(val_bpb=1.0, exp_id=1))
    led.append(full_row(val_bpb=0.9, status=Status.DISCARD, exp_id=2))
    led.append(full_row(val_bpb=0.95, exp_id=3))
    led.append(crash_row(exp_id=4))
    assert led.best_kept().exp_id == 3


def test_exp_dir(tmp_path):
    led = Ledger(tmp_path)
    d = led.exp_dir(7, "a1b2c3d4e5f6")
    assert d == tmp_path / "0007-a1b2c3d" and d.is_dir()
    assert led.exp_dir(8, "").name == "0008-none"


def test_empty_and_header_only(tmp_path):
    p = tmp_path / "results.tsv"
    assert read_results(p) == []
    p.write_text("")
    assert read_results(p) == []
    p.write_text(HEADER)
    assert read_results(p) == []
    p.write_text(HEADER[:10])  # a header cut short
    assert read_results(p) == []


def test_upstream_five_column_file(tmp_path):
    p = tmp_path / "results.tsv"
    p.write_text("commit\tval_bpb\tmemory_gb\tstatus\tdescription\n"
                 "a1b2c3d\t0.997900\t44.0\tkeep\tbaseline\n"
                 "b2c3d4e\t0.993200\t44.2\tkeep\tincrease LR to 0.04 \"aggressive\"\n"
                 "c3d4e5f\t0.000000\t0.0\tcrash\tdouble model width (OOM)\n"
                 "d4e5f6a\t1.005000\t44.0\tdiscard\tswitch to GeLU\twith a stray tab\n")
    rows = read_results(p)
    assert [r.status for r in rows] == [Status.KEEP, Status.KEEP, Status.CRASH, Status.DISCARD]
    assert rows[1].description == 'increase LR to 0.04 "aggressive"'
    assert rows[2].val_bpb is None and rows[2].memory_gb is None
    assert rows[3].description == "switch to GeLU\twith a stray tab"
    assert rows[0].exp_id is None and rows[0].knobs == {}


def test_garbage_line_strict_and_tolerant(tmp_path):
    led = Ledger(tmp_path)
    led.append(full_row(exp_id=1))
    with open(led.path, "a") as f:
        f.write("this is\tnot a row\n")
    led.append(full_row(exp_id=3))
    with pytest.raises(LedgerError, match="results.tsv line 3"):
        read_results(led.path)
    warnings = []
    assert [r.exp_id for r in read_results(led.path, warn=warnings.append)] == [1, 3]
    assert len(warnings) == 1 and "line 3" in warnings[0]
    seen = []
    led2 = Ledger(tmp_path, warn=seen.append)
    assert [r.exp_id for r in led2.rows()] == [1, 3]
    led2.rows()
    assert len(seen) == 1  # reported once, not on every read


def test_bad_values_name_the_line(tmp_path):
    led = Ledger(tmp_path)
    led.append(full_row())
    p = led.path
    good = p.read_text().splitlines()[1]
    p.write_text(HEADER + good + "\n" + good.replace("keep", "kept", 1) + "\n")
    with pytest.raises(LedgerError, match="line 3: status 'kept'"):
        read_results(p)
    p.write_text(HEADER + good.replace("0.997900", "abc") + "\n")
    with pytest.raises(LedgerError, match="line 2: val_bpb 'abc' is not a number"):
        read_results(p)
    p.write_text("hello\tworld\n")
    with pytest.raises(LedgerError, match="line 1: not a results.tsv header"):
        read_results(p)


def test_truncated_last_line_is_dropped_before_appending(tmp_path):
    led = Ledger(tmp_path)
    led.append(full_row(exp_id=1))
    line = led.path.read_text().splitlines()[1]
    with open(led.path, "a") as f:
        f.write(line[: len(line) - 9])  # killed mid-write: finished_at cut short
    warnings = []
    led = Ledger(tmp_path, warn=warnings.append)
    assert [r.exp_id for r in led.rows()] == [1]
    assert warnings and "partial last line" in warnings[0]
    led.append(full_row(exp_id=2))
    assert [r.exp_id for r in read_results(led.path)] == [1, 2]  # strict read: the file is clean again
    assert any("dropped a partial last line" in w for w in warnings)


@pytest.mark.parametrize("cut", [1, 40, 100])
def test_cut_anywhere_never_glues(tmp_path, cut):
    led = Ledger(tmp_path)
    led.append(full_row(exp_id=1))
    line = led.path.read_text().splitlines()[1]
    with open(led.path, "a") as f:
        f.write(line[:cut])
    Ledger(tmp_path, warn=lambda m: None).append(full_row(exp_id=2))
    assert [r.exp_id for r in read_results(led.path)] == [1, 2]


def test_complete_last_line_without_newline_is_kept(tmp_path):
    led = Ledger(tmp_path)
    led.append(full_row(exp_id=1))
    led.path.write_bytes(led.path.read_bytes()[:-1])  # only the newline is missing
    led = Ledger(tmp_path, warn=lambda m: pytest.fail(m))
    led.append(full_row(exp_id=2))
    assert [r.exp_id for r in read_results(led.path)] == [1, 2]


def test_partial_header_is_rewritten(tmp_path):
    p = tmp_path / "results.tsv"
    p.write_text(HEADER[:12])
    led = Ledger(tmp_path, warn=lambda m: None)
    led.append(full_row(exp_id=1))
    assert p.read_text().count(HEADER) == 1 and [r.exp_id for r in read_results(p)] == [1]


def test_refuses_to_append_to_another_format(tmp_path):
    p = tmp_path / "results.tsv"
    p.write_text("commit\tval_bpb\tmemory_gb\tstatus\tdescription\na\t1.0\t1.0\tkeep\tx\n")
    with pytest.raises(LedgerError, match="other columns"):
        Ledger(tmp_path).append(full_row())
    assert p.read_text().count("\n") == 2


def test_append_fsyncs(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(ledger_mod.os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    led = Ledger(tmp_path)
    led.append(full_row(exp_id=1))
    n = len(calls)
    assert n >= 1
    led.append(full_row(exp_id=2))
    assert len(calls) == n + 1


def test_full_disk_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    led = Ledger(tmp_path)
    led.append(full_row(exp_id=1))
    before = led.path.read_bytes()
    real = os.write

    def half_then_enospc(fd, data):
        real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ledger_mod.os, "write", half_then_enospc)
    with pytest.raises(LedgerError, match="No space left on device"):
        led.append(full_row(exp_id=2))
    monkeypatch.undo()
    assert led.path.read_bytes() == before


def test_append_line_is_whole_callback(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"a": 1}\n{"b": 2}')
    append_line(p, '{"c": 3}\n', is_whole=lambda s: s.endswith("}"))
    assert p.read_text() == '{"a": 1}\n{"b": 2}\n{"c": 3}\n'
    p.write_text('{"a": 1}\n{"b": ')
    warnings = []
    append_line(p, '{"c": 3}\n', is_whole=lambda s: s.endswith("}"), warn=warnings.append)
    assert p.read_text() == '{"a": 1}\n{"c": 3}\n' and warnings
