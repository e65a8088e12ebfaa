"""Proposers: grid, random, strategy (pure), and the agent (prompt, presets, real scripted agents)."""

import sys
import time
from pathlib import Path

import psutil
import pytest

from autoresearch.config import RunConfig
from autoresearch.errors import ConfigError
from autoresearch.harness.env import PROFILES
from autoresearch.records.ledger import Row, Status
from autoresearch.proposers import Context, ProposalFailed, make_proposer
from autoresearch.proposers.agent import AgentProposer, command_for, fill, render_prompt
from autoresearch.proposers.search import GridProposer, RandomProposer, StrategyProposer

from fixtures.waits import until

AGENTS = Path(__file__).parent / "fixtures" / "agents"
BASE = {"DEPTH": 8, "TOTAL_BATCH_SIZE": 2**19, "DEVICE_BATCH_SIZE": "auto", "LR_MULT": 1.0, "WARMDOWN_RATIO": 0.5}


def sleepers_left(tmp_path: Path) -> list[psutil.Process]:
    """The fixtures' `time.sleep(10000)` children still alive that ran in this test's folder (xdist runs other
    tests beside this one)."""
    return [p for p in psutil.process_iter(["cmdline", "cwd"]) if "time.sleep(10000)" in " ".join(
        p.info["cmdline"] or []) and str(tmp_path) in (p.info["cwd"] or "")]


def row(knobs, status=Status.DISCARD, bpb=1.0, commit="c0", parent="", exp_id=1, description="d"):
    return Row(commit=commit, val_bpb=bpb, memory_gb=None, status=status, description=description, exp_id=exp_id,
               parent=parent, knobs=dict(knobs))


def ctx(knobs=BASE, rows=(), best=None, tmp=Path("/tmp"), profile="cpu"):
    return Context(root=tmp, train_file="train.py", knobs=dict(knobs), best=best, rows=list(rows), exp_id=len(rows) + 1,
                   exp_dir=tmp / "exp", tag="t", profile=PROFILES[profile], time_budget=20.0, eval_tokens=2**15,
                   noise=0.002)


# ---------------------------------------------------------------------------------------------- strategy

def test_strategy_starts_with_the_batch_and_skips_tried_points():
    s = StrategyProposer()
    base = row(BASE, Status.KEEP)
    p = s.propose(ctx(rows=[base], best=base))
    assert p.knobs == {"TOTAL_BATCH_SIZE": 2**18} and "2**19 -> 2**18" in p.description
    tried = row({**BASE, "TOTAL_BATCH_SIZE": 2**18}, exp_id=2)
    assert s.propose(ctx(rows=[base, tried], best=base)).knobs == {"TOTAL_BATCH_SIZE": 2**20}


def test_strategy_follows_a_winning_direction():
    s = StrategyProposer()
    base = row(BASE, Status.KEEP, bpb=1.1, commit="a")
    win = row({**BASE, "LR_MULT": 1.5}, Status.KEEP, bpb=1.0, commit="b", parent="a", exp_id=2)
    p = s.propose(ctx(knobs=win.knobs, rows=[base, win], best=win))
    assert p.knobs == {"LR_MULT": 2.25}


def test_strategy_respects_batch_divisibility():
    knobs = {"TOTAL_BATCH_SIZE": 2**12, "DEVICE_BATCH_SIZE": 16, "DEPTH": 8}
    names = [(k, v) for k, v in StrategyProposer().candidates(ctx(knobs=knobs))]
    # 2**12 tokens = 16 rows of 256: ÷2 would need 16 × 256 to divide 2**11, so it is skipped
    assert ("TOTAL_BATCH_SIZE", 2**11) not in names and ("TOTAL_BATCH_SIZE", 2**13) in names
    assert ("DEVICE_BATCH_SIZE", 8) in names and ("DEVICE_BATCH_SIZE", 32) not in names
    assert ("DEPTH", 7) in names and ("DEPTH", 9) in names


def test_strategy_runs_out():
    knobs = {"DEPTH": 8}
    rows = [row(knobs), row({"DEPTH": 7}, exp_id=2), row({"DEPTH": 9}, exp_id=3)]
    assert StrategyProposer().propose(ctx(knobs=knobs, rows=rows)) is None


def test_rejected_points_do_not_count_as_tried():
    knobs = {"DEPTH": 8}
    rows = [row(knobs), row({"DEPTH": 7}, Status.REJECTED, exp_id=2)]
    assert StrategyProposer().propose(ctx(knobs=knobs, rows=rows)).knobs == {"DEPTH": 7}


def test_the_strategy_proposer_does_not_shrink_a_size_the_profile_built_at_one():
    from autoresearch.harness.env import PROFILES
    from autoresearch.proposers import Context
    from autoresearch.proposers.search import StrategyProposer

    knobs = {"DEPTH": 7, "LR_MULT": 1.0, "TOTAL_BATCH_SIZE": 2**19}

    def ctx(built):
        return Context(root=Path("/tmp"), train_file="train.py", knobs=knobs, best=None, rows=[], exp_id=1,
                       exp_dir=Path("/tmp/exp"), tag="t", profile=PROFILES["cpu"], time_budget=20.0,
                       eval_tokens=2**15, noise=0.002, built=built)

    moves = StrategyProposer().candidates(ctx({"depth": 1, "width": 64}))   # CPU: DEPTH 7 builds depth 1
    assert ("DEPTH", 6) not in moves and ("DEPTH", 8) in moves
    assert ("DEPTH", 6) in StrategyProposer().candidates(ctx({"depth": 2}))
    assert ("DEPTH", 6) in StrategyProposer().candidates(ctx(None))         # nothing known of the build


# ----------------------------------------------------------------------------------------- grid, random

def test_grid_in_order_skipping_done_then_exhausted():
    g = GridProposer({"TOTAL_BATCH_SIZE": [2**17, 2**18], "LR_MULT": [0.5, 1.0]})
    rows = [row({**BASE, "TOTAL_BATCH_SIZE": 2**17, "LR_MULT": 0.5})]
    assert g.propose(ctx(rows=rows)).knobs == {"TOTAL_BATCH_SIZE": 2**17, "LR_MULT": 1.0}
    rows += [row({**BASE, "TOTAL_BATCH_SIZE": t, "LR_MULT": lr}) for t in (2**17, 2**18) for lr in (0.5, 1.0)]
    assert g.propose(ctx(rows=rows)) is None


def test_random_is_seeded_and_never_repeats():
    space = {"DEPTH": [6, 7, 8, 9], "LR_MULT": [0.5, 1.0, 2.0]}
    a, b = RandomProposer(space, seed=1), RandomProposer(space, seed=1)
    rows, seen = [], []
    for _ in range(12):
        p, q = a.propose(ctx(rows=rows)), b.propose(ctx(rows=rows))
        assert p.knobs == q.knobs
        seen.append(tuple(sorted(p.knobs.items())))
        rows.append(row({**BASE, **p.knobs}, exp_id=len(rows) + 1))
    assert len(set(seen)) == 12 and a.propose(ctx(rows=rows)) is None


def test_make_proposer_defaults():
    assert make_proposer(RunConfig()).name == "strategy"
    with pytest.raises(ConfigError, match="search_space"):
        make_proposer(RunConfig(proposer="grid"))
    with pytest.raises(ConfigError, match="not found on PATH"):
        make_proposer(RunConfig(agent="no-such-agent-xyz --go"))


# ------------------------------------------------------------------------------------------------ agent

def test_presets_and_free_form_commands(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda exe: f"/usr/bin/{exe}")
    assert command_for("claude")[:2] == ["claude", "-p"] and "acceptEdits" in command_for("claude")
    assert command_for("codex")[:3] == ["codex", "exec", "--full-auto"]
    assert "--yes-always" in command_for("aider") and "--no-auto-commits" in command_for("aider")
    assert command_for("my-agent --file {prompt_file}") == ["my-agent", "--file", "{prompt_file}"]
    assert command_for("my-agent --fast") == ["my-agent", "--fast", "{prompt}"]
    assert fill(["a", "{prompt}", "x={prompt_file}"], "hello world", Path("/p")) == ["a", "hello world", "x=/p"]


def test_prompt_has_program_context_and_rules(tmp_path):
    best = row(BASE, Status.KEEP, bpb=0.99, commit="abc1234", description="halve batch")
    rows = [row(BASE, Status.DISCARD, bpb=1.01, exp_id=i, description=f"idea {i}") for i in range(1, 15)] + [best]
    text = render_prompt(ctx(rows=rows, best=best, tmp=tmp_path), program="# my program\nlower val_bpb",
                         last_n=5, description_file=tmp_path / "d.txt")
    assert text.startswith("# my program")
    assert "TOTAL_BATCH_SIZE = 524288" in text and "0.990000 val_bpb at commit abc1234" in text
    assert "idea 14" in text and "idea 9" not in text            # only the last 5
    assert "CPU only" in text and "20 s of training" in text
    assert "Change only train.py" in text and str(tmp_path / "d.txt") in text


def agent(name, tmp_path, timeout=20.0, extra=""):
    cmd = f"{sys.executable} {AGENTS / name} {extra}".strip() + " {prompt_file}"
    return AgentProposer(cmd, timeout=timeout)


def repo_dir(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "train.py").write_text((Path(__file__).parent / "fixtures" / "fake_train.py").read_text())
    return root


@pytest.mark.integration
def test_agent_edits_and_describes(tmp_path):
    root = repo_dir(tmp_path)
    p = agent("improve.py", tmp_path).propose(ctx(tmp=root))
    assert p.description == "halve TOTAL_BATCH_SIZE to 2**18" and p.knobs is None
    assert "TOTAL_BATCH_SIZE = 2**18" in (root / "train.py").read_text()
    assert "thinking about the batch size" in (root / "exp" / "agent.log").read_text()
    assert (root / "exp" / "prompt.md").read_text().startswith("# autoresearch")


@pytest.mark.integration
def test_agent_description_falls_back_to_last_output_line(tmp_path):
    root = repo_dir(tmp_path)
    assert agent("syntax.py", tmp_path).propose(ctx(tmp=root)).description == "added a helper"


@pytest.mark.integration
def test_agent_timeout_kills_the_group(tmp_path):
    root = repo_dir(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(ProposalFailed, match="timed out after 1s"):
        agent("hang.py", tmp_path, timeout=1).propose(ctx(tmp=root))
    assert time.monotonic() - t0 < 8
    until(lambda: sleepers_left(tmp_path) == [], "the agent's sleeping children to be gone")


@pytest.mark.integration
def test_agent_failure_and_flood(tmp_path):
    root = repo_dir(tmp_path)
    (root / "fail.py").write_text("import sys\nprint('no API key')\nsys.exit(3)\n")
    with pytest.raises(ProposalFailed, match="exit code 3.*no API key"):
        AgentProposer(f"{sys.executable} fail.py").propose(ctx(tmp=root))
    p = agent("flood.py", tmp_path).propose(ctx(tmp=root))
    assert p.description == "halve the batch after a lot of talking"
    assert (root / "exp" / "agent.log").stat().st_size <= 5 * 2**20 + 4096
