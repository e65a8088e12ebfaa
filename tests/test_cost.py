"""Agent cost accounting: each preset's output format read from samples of what the tool prints, the presets
end to end through stand-ins of their CLIs on PATH, AR_USAGE from a scripted agent in a real loop with
--max-usd (and resume), the results.tsv columns, the report's cost per keep, and bad --max-usd values."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from autoresearch.views import report as rep
from autoresearch.config import load_config
from autoresearch.proposers.cost import Usage, UsageReader, spent, summary
from autoresearch.errors import ConfigError
from autoresearch.records.ledger import COLUMNS, HEADER, Ledger, Row, Status, read_results
from autoresearch.session.loop import Loop
from autoresearch.proposers.agent import AgentProposer, command_for

from test_loop import AGENTS, assert_consistent, cfg, make_repo
from test_proposers import ctx, repo_dir
from test_report import ar

SAMPLES = Path(__file__).parent / "data" / "agent_output"


def read(name: str) -> UsageReader:
    reader = UsageReader()
    for line in (SAMPLES / name).read_text().splitlines():
        reader.feed(line)
    return reader


# ------------------------------------------------------------------------------------ each preset's format

def test_claude_json_result():
    r = read("claude.json")
    u = r.usage()
    assert u.usd == pytest.approx(0.18734595)
    assert u.input_tokens == 23 + 12683 + 98120 and u.output_tokens == 1421   # the cache counts are tokens sent
    assert u.tokens == 23 + 12683 + 98120 + 1421
    assert r.final_line() == "halve TOTAL_BATCH_SIZE to 2**18"                  # the description, from `result`


def test_claude_result_longer_than_a_line_reads_its_tail():
    whole = (SAMPLES / "claude.json").read_text().strip()
    reader = UsageReader()
    assert reader.feed(whole[whole.index('"session_id"'):])   # the runner keeps a long line's last 64 KB only
    u = reader.usage()
    assert u.usd == pytest.approx(0.18734595) and u.output_tokens == 1421 and u.input_tokens == 110826


def test_codex_jsonl_events_have_tokens_and_a_cost_only_from_a_price_table():
    r = read("codex.jsonl")
    u = r.usage()
    assert (u.input_tokens, u.output_tokens, u.cached_input_tokens, u.usd) == (24763, 1122, 24448, None)
    assert r.final_line() == "halve TOTAL_BATCH_SIZE to 2**18"
    prices = {"gpt-5-codex": {"input": 1.25, "output": 10.0, "cached_input": 0.125}}
    priced = r.usage(prices)                 # the events name no model: the only entry applies
    assert priced.usd == pytest.approx(((24763 - 24448) * 1.25 + 24448 * 0.125 + 1122 * 10.0) / 1e6)
    assert r.usage({"some-model": {"input": 1, "output": 1}, "other": {"input": 2, "output": 2}}).usd is None
    assert r.usage({"default": {"input": 1.0, "output": 2.0}}).usd == pytest.approx((24763 + 2 * 1122) / 1e6)


def test_codex_legacy_token_count_events_add_up_and_name_the_model():
    r = read("codex-legacy.jsonl")
    u = r.usage({"codex-mini-latest": {"input": 1.5, "output": 6.0}, "default": {"input": 99, "output": 99}})
    assert (u.input_tokens, u.output_tokens, u.model) == (9120 + 10240, 310 + 95, "codex-mini-latest")
    assert u.usd == pytest.approx(((9120 + 10240) * 1.5 + 405 * 6.0) / 1e6)
    assert r.final_line() == "halve TOTAL_BATCH_SIZE to 2**18"
    later = UsageReader()   # releases with cumulative totals: the last total is the run's
    for total in (100, 250):
        later.feed(json.dumps({"id": "0", "msg": {"type": "token_count", "info": {
            "total_token_usage": {"input_tokens": total, "cached_input_tokens": 0, "output_tokens": 10},
            "last_token_usage": {"input_tokens": 50, "output_tokens": 5}}}}))
    assert later.usage().tokens == 260


def test_aider_reports_wrapped_or_not():
    r = read("aider.txt")
    u = r.usage()
    assert u.input_tokens == 4400 + 12000 and u.output_tokens == 95 + 1200
    assert u.usd == pytest.approx(0.08)                  # the session total of the last report
    plain = read("aider-no-price.txt").usage()
    assert (plain.tokens, plain.usd) == (2245, None)


def test_ar_usage_lines_add_up_and_win_over_a_presets_own_report():
    r = UsageReader()
    assert r.feed('AR_USAGE {"input_tokens": 1000, "output_tokens": 200, "usd": 0.04}')
    assert r.feed('AR_USAGE {"input_tokens": 10, "output_tokens": 5, "usd": 0.01, "model": "m"}')
    assert r.feed("Tokens: 4.4k sent, 95 received. Cost: $0.0146 message, $0.0146 session.")
    assert not r.feed("halve the batch")
    assert r.usage() == Usage(1010, 205, pytest.approx(0.05), model="m")
    bad = UsageReader()
    for line in ("AR_USAGE not json", 'AR_USAGE {"usd": -3}', 'AR_USAGE {"usd": "lots"}', "AR_USAGE [1, 2]",
                 "{" * 100000):
        bad.feed(line)                                   # nothing to read, and no exception into the pump
    assert bad.usage() is None
    assert UsageReader().usage() is None                 # nothing reported: unknown, never 0


# --------------------------------------------------------------------------- the presets, end to end

@pytest.mark.integration
@pytest.mark.parametrize("name, sample, tokens, usd, description", [
    ("claude", "claude.json", 112247, 0.1873, "halve TOTAL_BATCH_SIZE to 2**18"),
    ("codex", "codex.jsonl", 25885, None, "halve TOTAL_BATCH_SIZE to 2**18"),
    ("aider", "aider.txt", 17695, 0.08, "The edit is in place; nothing else needs to change.")])
def test_a_preset_runs_as_before_and_reports_its_cost(tmp_path, monkeypatch, name, sample, tokens, usd,
                                                       description):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / name
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {AGENTS / "preset.py"} {name} {SAMPLES / sample} "$@"\n')
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_AGENT_ARGV", str(tmp_path / "argv.json"))
    root = repo_dir(tmp_path)
    p = AgentProposer(name, timeout=20).propose(ctx(tmp=root))
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv == [x if x != "{prompt}" else (root / "exp" / "prompt.md").read_text() for x in command_for(name)]
    assert "TOTAL_BATCH_SIZE = 2**18" in (root / "train.py").read_text()             # the agent's work is done
    assert p.description == description       # the final message's last line, not a JSON or usage line
    assert p.usage.tokens == tokens and (p.usage.usd is None if usd is None else round(p.usage.usd, 4) == usd)


def test_preset_flags_only_add_machine_readable_output(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda exe: f"/usr/bin/{exe}")
    assert command_for("claude") == ["claude", "-p", "{prompt}", "--permission-mode", "acceptEdits",
                                     "--output-format", "json"]
    assert command_for("codex") == ["codex", "exec", "--full-auto", "--json", "{prompt}"]
    assert command_for("aider")[-1] == "train.py" and "--message" in command_for("aider")


# ---------------------------------------------------------------------------------------- results.tsv

def test_columns_are_written_read_and_migrated(tmp_path):
    assert COLUMNS.index("agent_usd") < COLUMNS.index("sweep") and COLUMNS[-1] == "finished_at"
    tag = tmp_path / "t"
    tag.mkdir()
    older = [c for c in COLUMNS if c not in ("agent_tokens", "agent_usd")]
    old_row = Row(commit="a" * 7, val_bpb=1.5, memory_gb=None, status=Status.KEEP, description="baseline",
                  exp_id=1, finished_at="2026-12-01T10:00:00+00:00").to_fields()
    (tag / "results.tsv").write_text("\t".join(older) + "\n" + "\t".join(
        v for c, v in zip(COLUMNS, old_row) if c in older) + "\n")
    led = Ledger(tag, warn=lambda m: None)
    led.append(Row(commit="b" * 7, val_bpb=1.4, memory_gb=None, status=Status.KEEP, description="x", exp_id=2,
                   agent_tokens=1200, agent_usd=0.04))
    led.append(Row(commit="", val_bpb=None, memory_gb=None, status=Status.REJECTED, description="y", exp_id=3,
                   agent_tokens=50, agent_usd=None))
    text = (tag / "results.tsv").read_text()
    assert text.startswith(HEADER)
    lines = [dict(zip(COLUMNS, ln.split("\t"))) for ln in text.splitlines()[1:]]
    assert [(d["agent_tokens"], d["agent_usd"]) for d in lines] == [("", ""), ("1200", "0.0400"), ("50", "")]
    rows = read_results(tag / "results.tsv")
    assert [(r.agent_tokens, r.agent_usd) for r in rows] == [(None, None), (1200, 0.04), (50, None)]
    assert spent(rows) == pytest.approx(0.04)


# -------------------------------------------------------------------------------- the loop, --max-usd

@pytest.fixture
def loop_env(prepared_cache, monkeypatch):
    for var in ("AR_PROFILE", "AR_TIME_BUDGET", "AR_SEED", "AR_DATASET", "AR_TOK_DIR", "AR_CHECKPOINT_DIR"):
        monkeypatch.delenv(var, raising=False)


def costly(edits: dict) -> AgentProposer:
    usage = json.dumps({"input_tokens": 1000, "output_tokens": 200, "usd": 0.04})
    cmd = " ".join([sys.executable, str(AGENTS / "costly.py"), f"'{json.dumps(edits)}'", f"'{usage}'",
                    "{prompt_file}"])
    return AgentProposer(cmd, timeout=30)


@pytest.mark.e2e
def test_max_usd_stops_before_the_next_proposal_and_resume_counts_the_spend(tmp_path, loop_env):
    root = make_repo(tmp_path)
    edits = {"2": {"TOTAL_BATCH_SIZE": "2**18"}, "3": {}, "4": "fail", "5": {}}
    said = []
    s = Loop(cfg(noise=0.002, max_usd=0.1), root, "t", costly(edits),
             on_event=lambda e: said.append(e.message)).run(max_experiments=10)
    rows = assert_consistent(root)
    assert [r.status.value for r in rows] == ["keep", "keep", "rejected", "rejected"]
    assert "changed nothing" in rows[2].reason and "exit code 1" in rows[3].reason
    # the baseline has no agent: unknown, not 0; a refused proposal's money was spent all the same
    assert [(r.agent_tokens, r.agent_usd) for r in rows] == [(None, None)] + [(1200, 0.04)] * 3
    assert s.stop_reason == "reached --max-usd 0.1: the agents of tag t spent $0.1200"
    assert said.count(f"stopped: {s.stop_reason}") == 1
    assert not (root / "runs" / "t" / "0005-none").exists()                 # no fifth proposal was started

    said.clear()
    s = Loop(cfg(noise=0.002, max_usd=0.15), root, "t", costly(edits),
             on_event=lambda e: said.append(e.message)).run(max_experiments=10)
    rows = assert_consistent(root)
    assert "agent cost so far on tag t: $0.1200 of --max-usd 0.15" in said
    assert len(rows) == 5 and (rows[4].agent_tokens, rows[4].agent_usd) == (1200, 0.04)
    assert s.stop_reason.startswith("reached --max-usd 0.15") and "$0.1600" in s.stop_reason


# ----------------------------------------------------------------------------------------------- report

def cost_rows() -> list[Row]:
    def row(i, status, val, usd, tokens, commit=None, parent="0000001"):
        return Row(commit=commit or f"{i:07d}", val_bpb=val, memory_gb=None, status=Status(status),
                   description=f"exp {i}", exp_id=i, tag="t", parent=parent, agent_usd=usd, agent_tokens=tokens)
    return [row(1, "keep", 1.5, None, None, parent="0000001"), row(2, "keep", 1.4, 0.25, 9000),
            row(3, "rejected", None, 0.10, 3000), row(4, "discard", 1.45, None, 500), row(5, "keep", 1.3, 0.15, 4000,
                                                                                         parent="0000002")]


def test_report_shows_total_cost_and_cost_per_keep():
    data = rep.build(cost_rows(), ["t"])
    assert data["agent_cost"] == {"usd": pytest.approx(0.5), "tokens": 16500, "experiments": 4, "keeps": 2,
                                  "usd_per_keep": pytest.approx(0.25)}
    assert data["experiments"][2]["agent_usd"] == 0.10 and data["experiments"][0]["agent_tokens"] is None
    section = next(s for s in rep.sections(data) if s.title.startswith("agent cost"))
    assert section.rows == [("$0.5000", "16,500", "4", "2", "$0.2500")]
    assert summary(cost_rows()[:1]) is None


def test_report_without_costs_is_unchanged():
    plain = [Row(commit=r.commit, val_bpb=r.val_bpb, memory_gb=None, status=r.status, description=r.description,
                 exp_id=r.exp_id, tag="t", parent=r.parent) for r in cost_rows()]
    data = rep.build(plain, ["t"])
    assert "agent_cost" not in data and not any("agent" in k for e in data["experiments"] for k in e)
    assert not any(s.title.startswith("agent cost") for s in rep.sections(data))


def test_report_json_and_table_through_the_cli(tmp_path, monkeypatch, capsys):
    led = Ledger(tmp_path / "runs" / "t")
    for r in cost_rows():
        led.append(r)
    code, out, err = ar(["report", "--repo", tmp_path, "--json"], monkeypatch, capsys)
    assert code == 0 and json.loads(out)["agent_cost"]["usd_per_keep"] == pytest.approx(0.25)
    code, out, _ = ar(["report", "--repo", tmp_path], monkeypatch, capsys)
    assert code == 0 and "agent cost" in out and "$0.2500" in out


# --------------------------------------------------------------------------------------- bad --max-usd

@pytest.mark.parametrize("value, says", [("-1", "must be positive"), ("0", "must be positive"),
                                         ("abc", "--max-usd"), ("nan", "must be a finite number")])
def test_a_bad_max_usd_is_one_line_exit_2(tmp_path, monkeypatch, capsys, value, says):
    code, out, err = ar(["run", "--repo", tmp_path, "--max-usd", value], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in out + err and len(err.strip().splitlines()) == 1, err
    assert "max" in err and says in err, err


def test_max_usd_and_prices_in_the_config_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("max_usd: 2.5\nagent_prices:\n  gpt-5-codex: {input: 1.25, output: 10, cached_input: 0.125}\n")
    c = load_config(f)
    assert c.max_usd == 2.5 and c.agent_prices["gpt-5-codex"]["output"] == 10.0
    for bad, says in (("max_usd: -1", "must be positive"), ("max_usd: lots", "must be a finite number"),
                      ("agent_prices: {m: {input: 1}}", "per million tokens"),
                      ("agent_prices: {m: {input: 1, output: -2}}", "must be a finite number >= 0")):
        f.write_text(bad + "\n")
        with pytest.raises(ConfigError, match=says):
            load_config(f)
