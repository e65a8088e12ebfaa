import json
import sys
import time

import pytest

from autoresearch.errors import ConfigError
from autoresearch.session.hooks import EVENTS, Hooks
from autoresearch.records.ledger import Status

PAYLOAD = {"tag": "nov30", "exp_id": 7, "commit": "a1b2c3d", "val_bpb": 0.9979, "status": Status.KEEP,
           "description": "wider MLP"}


@pytest.fixture
def journal(tmp_path):
    return tmp_path / "runs" / "nov30" / "hooks.jsonl"


def make(tmp_path, journal, commands, **kw):
    logs = []
    kw.setdefault("timeout", 5.0)
    return Hooks(commands, journal, cwd=tmp_path, log=logs.append, **kw), logs


def entries(journal):
    return [json.loads(line) for line in journal.read_text().splitlines()]


@pytest.mark.integration
def test_payload_on_stdin_and_env(tmp_path, journal):
    cmd = 'cat > stdin.json; echo "$AR_EVENT|$AR_TAG|$AR_EXP_ID|$AR_COMMIT|$AR_VAL_BPB|$AR_STATUS" > env.txt'
    hooks, logs = make(tmp_path, journal, {"kept": [cmd]})
    hooks.fire("kept", "7", PAYLOAD)
    got = json.loads((tmp_path / "stdin.json").read_text())
    assert got == {"event": "kept", "key": "7", **PAYLOAD, "status": "keep"}
    assert (tmp_path / "env.txt").read_text().strip() == "kept|nov30|7|a1b2c3d|0.997900|keep"
    assert logs == []
    start, end = entries(journal)
    assert (start["phase"], end["phase"], end["result"], end["rc"]) == ("start", "end", "ok", 0)


@pytest.mark.integration
def test_missing_payload_fields_are_empty(tmp_path, journal):
    hooks, _ = make(tmp_path, journal, {"loop_finished": ['echo "[$AR_EXP_ID][$AR_VAL_BPB][$AR_TAG]" > env.txt']})
    hooks.fire("loop_finished", "end", {"tag": "nov30", "val_bpb": None})
    assert (tmp_path / "env.txt").read_text().strip() == "[][][nov30]"


@pytest.mark.integration
def test_exactly_once_across_instances(tmp_path, journal):
    cmd = "echo $AR_EXP_ID >> count.txt"
    hooks, _ = make(tmp_path, journal, {"kept": [cmd], "run_started": [cmd, cmd]})
    hooks.fire("kept", "7", PAYLOAD)
    hooks.fire("kept", "7", PAYLOAD)
    again, _ = make(tmp_path, journal, {"kept": [cmd], "run_started": [cmd, cmd]})  # e.g. after a resume
    again.fire("kept", "7", PAYLOAD)
    again.fire("kept", "8", {**PAYLOAD, "exp_id": 8})
    again.fire("run_started", "8", {**PAYLOAD, "exp_id": 8})  # two commands: each once
    hooks.fire("run_started", "8", {**PAYLOAD, "exp_id": 8})
    assert (tmp_path / "count.txt").read_text().split() == ["7", "8", "8", "8"]
    assert again.fired("kept", "7") and not again.fired("kept", "9")


@pytest.mark.integration
def test_failing_hook_is_logged_and_does_not_raise(tmp_path, journal):
    hooks, logs = make(tmp_path, journal, {"crashed": ["echo 'webhook down' >&2; exit 3", "echo ok > second.txt"]})
    hooks.fire("crashed", "3", PAYLOAD)
    assert len(logs) == 1 and "failed with exit code 3" in logs[0] and "webhook down" in logs[0]
    assert (tmp_path / "second.txt").exists()  # the next command still runs
    end = [e for e in entries(journal) if e["phase"] == "end"][0]
    assert end["rc"] == 3 and "webhook down" in end["output"]


@pytest.mark.integration
def test_hanging_hook_times_out(tmp_path, journal):
    hooks, logs = make(tmp_path, journal, {"run_finished": ["sleep 30"]}, timeout=0.5)
    t = time.monotonic()
    hooks.fire("run_finished", "1", PAYLOAD)
    assert time.monotonic() - t < 5
    assert len(logs) == 1 and "timed out after 0.5s" in logs[0]
    assert hooks.fired("run_finished", "1")


@pytest.mark.integration
def test_hook_ignoring_sigterm_is_killed(tmp_path, journal):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)"
    hooks, logs = make(tmp_path, journal, {"run_finished": [f'{sys.executable} -c "{code}"']}, timeout=0.3)
    t = time.monotonic()
    hooks.fire("run_finished", "1", PAYLOAD)
    assert time.monotonic() - t < 6 and "timed out" in logs[0]


@pytest.mark.integration
def test_hook_killed_by_a_signal(tmp_path, journal):
    hooks, logs = make(tmp_path, journal, {"reverted": ["kill -9 $$"]})
    hooks.fire("reverted", "2", PAYLOAD)
    assert len(logs) == 1 and "killed by SIGKILL" in logs[0]


@pytest.mark.integration
def test_background_process_holding_output_does_not_block(tmp_path, journal):
    hooks, logs = make(tmp_path, journal, {"kept": ["sleep 5 & echo started"]})
    t = time.monotonic()
    hooks.fire("kept", "1", PAYLOAD)
    assert time.monotonic() - t < 3 and logs == []


@pytest.mark.integration
def test_hook_that_ignores_a_large_payload(tmp_path, journal):
    hooks, logs = make(tmp_path, journal, {"kept": ["true"]})
    hooks.fire("kept", "1", {**PAYLOAD, "big": "x" * 500_000})
    assert logs == [] and hooks.fired("kept", "1")


def test_interrupted_hook_is_not_run_again(tmp_path, journal):
    journal.parent.mkdir(parents=True)
    journal.write_text(json.dumps({"event": "kept", "key": "7", "i": 0, "cmd": "x", "phase": "start"}) + "\n")
    hooks, logs = make(tmp_path, journal, {"kept": ["echo ran > ran.txt"]})
    hooks.fire("kept", "7", PAYLOAD)
    assert not (tmp_path / "ran.txt").exists()
    assert len(logs) == 1 and "interrupted earlier" in logs[0]


@pytest.mark.integration
def test_damaged_journal(tmp_path, journal):
    journal.parent.mkdir(parents=True)
    done = {"event": "kept", "key": "1", "i": 0, "cmd": "x"}
    journal.write_text("garbage\n" + json.dumps({**done, "phase": "start"}) + "\n"
                       + json.dumps({**done, "phase": "end"}) + "\n" + '{"event": "kept", "key": "2", "i"')
    hooks, logs = make(tmp_path, journal, {"kept": ["echo $AR_EXP_ID >> count.txt"]})
    hooks.fire("kept", "1", {"exp_id": 1})
    hooks.fire("kept", "2", {"exp_id": 2})  # its start line was cut short: it never ran
    assert (tmp_path / "count.txt").read_text().split() == ["2"]
    lines = journal.read_text().splitlines()
    assert lines[0] == "garbage" and all(json.loads(x) for x in lines[1:])  # nothing glued


def test_no_commands_is_a_no_op(tmp_path, journal):
    hooks, logs = make(tmp_path, journal, {})
    for e in EVENTS:
        hooks.fire(e, "1", PAYLOAD)
    assert not journal.exists() and logs == []


def test_unknown_event(tmp_path, journal):
    with pytest.raises(ConfigError, match="unknown event 'on_keep'"):
        Hooks({"on_keep": ["true"]}, journal)
    hooks, _ = make(tmp_path, journal, {})
    with pytest.raises(ValueError):
        hooks.fire("on_keep", "1", {})


def test_unwritable_journal_skips_the_hook(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    hooks, logs = make(tmp_path, blocker / "hooks.jsonl", {"kept": ["echo ran > ran.txt"]})
    hooks.fire("kept", "1", PAYLOAD)
    assert not (tmp_path / "ran.txt").exists() and "not run" in logs[0]
