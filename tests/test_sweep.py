"""ar sweep: parsing and validation, expansion and order, resume keys, early stopping, halving, seeds;
then end to end through the real Loop on temp git repos with a scripted train stand-in, and a sweep refused
before it makes anything (beside a running loop, on a dirty tree)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from autoresearch.sweep import run as sw
from autoresearch.sweep import file as sf
from autoresearch.errors import ConfigError
from autoresearch.records.ledger import COLUMNS, Row, Status, read_results

KNOBS = {"DEPTH": 8, "TOTAL_BATCH_SIZE": 2**19, "DEVICE_BATCH_SIZE": "auto", "LR_MULT": 1.0,
         "WINDOW_PATTERN": "L", "VALUE_EMBEDS": True, "COMPILE_MODEL": "auto", "CPU_BATCH_DIVISOR": 64}


def parse(data, seq_len=2048, profile="gpu"):
    return sf.parse_sweep(data, knobs=KNOBS, seq_len=seq_len, profile=profile, default_name="t")


# ------------------------------------------------------------------------------------- parsing

def test_values_written_as_powers_and_expressions():
    s = parse({"axes": {"TOTAL_BATCH_SIZE": ["2**17", 2**18, "3*2**16"], "LR_MULT": [1, "1e-1"]}})
    assert s.axes["TOTAL_BATCH_SIZE"] == [2**17, 2**18, 3 * 2**16]
    assert s.axes["LR_MULT"] == [1.0, 0.1] and isinstance(s.axes["LR_MULT"][0], float)


@pytest.mark.parametrize("data, message", [
    ({"axes": {"LR": [1.0]}}, "unknown knob 'LR': train.py has DEPTH, TOTAL_BATCH_SIZE"),
    ({"axes": {"LR_MULT": []}}, "axis LR_MULT is empty"),
    ({"axes": {"DEPTH": [8, "deep"]}}, "DEPTH='deep' is not an integer"),
    ({"axes": {"DEPTH": [8.5]}}, "is not an integer"),
    ({"axes": {"LR_MULT": ["fast"]}}, "is not a number"),
    ({"axes": {"VALUE_EMBEDS": [1]}}, "is not a boolean"),
    ({"axes": {"WINDOW_PATTERN": [3]}}, "is not a string"),
    ({"axes": {"TIME_BUDGET": [0]}}, "not a positive number of seconds"),
    ({"axes": {"DEPTH": [8]}, "grid": 1}, "unknown key(s) in sweep file: grid"),
    ({"axes": {}}, "needs `axes`"),
    ({"axes": {"DEPTH": [8]}, "order": "random"}, "order 'random' is not one of: listed, cheap-first"),
    ({"axes": {"DEPTH": [8]}, "fixed": {"DEPTH": 4}}, "both an axis and fixed"),
    ({"axes": {"DEPTH": [8]}, "name": "Big Sweep"}, "sweep name 'Big Sweep'"),
    ({"axes": {"DEPTH": [8]}, "seeds": ["a"]}, "`seeds` must be a list of integers"),
    ({"axes": {"DEPTH": [8]}, "early_stop": {"bogus": 1}}, "early_stop takes margin"),
    ({"axes": {"TOTAL_BATCH_SIZE": [2**16, 2**17], "DEVICE_BATCH_SIZE": [64]}},
     "TOTAL_BATCH_SIZE=65536 is not divisible by DEVICE_BATCH_SIZE × sequence length = 64 × 2048 = 131072"),
    ({"axes": {"TOTAL_BATCH_SIZE": [1000]}}, "not a multiple of the sequence length 2048"),
])
def test_bad_sweep_files_are_one_config_error_line(data, message):
    with pytest.raises(ConfigError) as e:
        parse(data)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_batch_check_skips_auto_and_follows_the_cpu_profile():
    parse({"axes": {"TOTAL_BATCH_SIZE": [2**16, 2**17]}})  # DEVICE_BATCH_SIZE "auto": only seq must divide
    parse({"axes": {"TOTAL_BATCH_SIZE": [2**17]}, "fixed": {"DEVICE_BATCH_SIZE": 64}})  # 64 × 2048 = 2**17
    # CPU: 2**17 // 64 = 2048 tokens; device batch 64 // 8 = 8 rows × 256 = 2048: fine
    parse({"axes": {"TOTAL_BATCH_SIZE": [2**17]}, "fixed": {"DEVICE_BATCH_SIZE": 64}}, seq_len=256, profile="cpu")
    with pytest.raises(ConfigError, match="CPU profile"):
        parse({"axes": {"TOTAL_BATCH_SIZE": [2**16]}, "fixed": {"DEVICE_BATCH_SIZE": 64}}, seq_len=256,
              profile="cpu")


def test_auto_knobs_take_concrete_values():
    s = parse({"axes": {"COMPILE_MODEL": [True, False, "auto"], "DEVICE_BATCH_SIZE": ["auto", 16]},
               "fixed": {"TOTAL_BATCH_SIZE": 2**15}})
    assert len(sf.expand(s)) == 6


def test_shipped_sweep_files_validate():
    from pathlib import Path
    from autoresearch.knobs import read_knobs
    root = Path(__file__).resolve().parents[1]
    knobs = read_knobs(root / "train.py")
    big = sf.load_sweep(root / "configs/sweep-batch-budget.yaml", knobs=knobs, seq_len=2048, profile="gpu")
    assert len(sf.expand(big)) == 36 and big.tag == "sweep-batch-budget"
    small = sf.load_sweep(root / "configs/sweep-cpu-small.yaml", knobs=knobs, seq_len=256, profile="cpu")
    assert all(p.time_budget <= 15 for p in sf.expand(small))


# ------------------------------------------------------------------------------------- expansion, order

def test_expansion_is_product_order_then_seeds():
    s = parse({"axes": {"TOTAL_BATCH_SIZE": [2**17, 2**18], "TIME_BUDGET": [600, 300]},
               "fixed": {"DEPTH": 4}, "seeds": [1, 2]})
    pts = sf.expand(s)
    assert [(p.knobs["TOTAL_BATCH_SIZE"], p.time_budget, p.seed) for p in pts] == [
        (2**17, 600, 1), (2**17, 600, 2), (2**17, 300, 1), (2**17, 300, 2),
        (2**18, 600, 1), (2**18, 600, 2), (2**18, 300, 1), (2**18, 300, 2)]
    assert all(p.knobs["DEPTH"] == 4 and "TIME_BUDGET" not in p.knobs for p in pts)
    assert pts[0].label == "TOTAL_BATCH_SIZE=2**17 budget=600s seed=1"


def test_labels_show_every_axis_that_varies_the_budget_too():
    grid = sf.expand(parse({"axes": {"TOTAL_BATCH_SIZE": [2**16, 2**17], "TIME_BUDGET": [60, 120],
                                     "DEPTH": [8]}}))
    assert [p.label for p in grid] == ["TOTAL_BATCH_SIZE=2**16 budget=60s", "TOTAL_BATCH_SIZE=2**16 budget=120s",
                                       "TOTAL_BATCH_SIZE=2**17 budget=60s", "TOTAL_BATCH_SIZE=2**17 budget=120s"]
    assert [p.grid for p in grid] == [0, 1, 2, 3]
    fixed = sf.expand(parse({"axes": {"TOTAL_BATCH_SIZE": [2**16, 2**17]}, "fixed": {"TIME_BUDGET": 60}}))
    assert [p.label for p in fixed] == ["TOTAL_BATCH_SIZE=2**16", "TOTAL_BATCH_SIZE=2**17"]
    one = sf.expand(parse({"axes": {"LR_MULT": [0.5]}, "seeds": [1, 2]}))
    assert [p.label for p in one] == ["LR_MULT=0.5 seed=1", "LR_MULT=0.5 seed=2"] and [p.grid for p in one] == [0, 0]


def test_order_listed_and_cheap_first_is_stable():
    s = parse({"axes": {"LR_MULT": [0.5, 1.0], "TIME_BUDGET": [1200, 300, 600]}})
    pts = sf.expand(s)
    assert sf.order_points(pts, "listed") == pts
    cheap = sf.order_points(pts, "cheap-first")
    assert [(p.time_budget, p.knobs["LR_MULT"]) for p in cheap] == [
        (300, 0.5), (300, 1.0), (600, 0.5), (600, 1.0), (1200, 0.5), (1200, 1.0)]
    with pytest.raises(ConfigError):
        sf.order_points(pts, "fastest")


# ------------------------------------------------------------------------------------- resume keys

def _row(axes, budget, status, base="abcdef1234", seed=42, val=1.0, commit="c0ffee0", extra=None):
    """A ledger row of the point `axes` (+ budget) of sweep t on `base`; `extra`: other knobs it ran with."""
    return Row(commit=commit, val_bpb=val, memory_gb=1.0, status=Status(status), description="sweep t: x",
               knobs={**axes, **(extra or {})}, time_budget=budget, seed=seed,
               sweep={"name": "t", "point": 0, "axes": {**axes, "TIME_BUDGET": budget}, "base": base[:12]})


def test_point_states_done_crashed_and_retry():
    s = parse({"axes": {"LR_MULT": [0.5, 1.0, 2.0], "TIME_BUDGET": [300]}})
    pts = sf.expand(s)
    base = "abcdef1234567890"
    rows = [_row({"LR_MULT": 0.5}, 300, "discard", base, extra={"DEPTH": 8}),  # done (other knobs ignored)
            _row({"LR_MULT": 1.0}, 300, "crash", base),                     # crashed
            _row({"LR_MULT": 2.0}, 300, "keep", "0123456789ab"),            # another base: not this point
            _row({"LR_MULT": 2.0}, 600, "keep", base),                      # another budget
            _row({"LR_MULT": 2.0}, 300, "validation", base)]                # re-runs never count
    assert sf.point_states(pts, rows, base) == {0: "done", 1: "crashed", 2: "todo"}
    assert sf.point_states(pts, rows, base, retry_crashed=True) == {0: "done", 1: "todo", 2: "todo"}
    # a later finished row of a crashed point makes it done; an interrupted one leaves it to run
    assert sf.point_states(pts, rows + [_row({"LR_MULT": 1.0}, 300, "pruned", base)], base)[1] == "done"
    assert sf.point_states(pts, [_row({"LR_MULT": 0.5}, 300, "interrupted", base)], base)[0] == "todo"


def test_point_key_matches_int_and_float_and_explicit_seed():
    s = parse({"axes": {"LR_MULT": [1]}, "fixed": {"TIME_BUDGET": 300}, "seeds": [7]})
    base = "abcdef1234567890"
    assert sf.point_states(sf.expand(s), [_row({"LR_MULT": 1}, 300.0, "keep", base, seed=7)], base) == {0: "done"}
    assert sf.point_states(sf.expand(s), [_row({"LR_MULT": 1}, 300.0, "keep", base, seed=8)], base) == {0: "todo"}


def test_the_identity_round_trips_through_results_tsv(tmp_path):
    from autoresearch.records.ledger import Ledger
    s = parse({"name": "bb", "axes": {"TOTAL_BATCH_SIZE": [2**17, 2**16], "TIME_BUDGET": [60, 120]}})
    base = "abcdef1234567890abcdef1234567890abcdef12"
    pts = sf.expand(s)
    led = Ledger(tmp_path / "sweep-bb")
    for p in pts:
        led.append(Row(commit="c0ffee0", val_bpb=1.0, memory_gb=None, status=Status.DISCARD,
                       description=sf.describe(s, p), knobs=dict(p.knobs), time_budget=p.time_budget, seed=42,
                       sweep=sf.identity(s, p, base)))
    rows = read_results(tmp_path / "sweep-bb" / "results.tsv")
    assert rows[3].sweep == {"name": "bb", "point": 3, "axes": {"TOTAL_BATCH_SIZE": 2**16, "TIME_BUDGET": 120},
                             "base": base[:12]}
    assert list(rows[3].sweep["axes"]) == ["TOTAL_BATCH_SIZE", "TIME_BUDGET"]   # the file's order, for labels
    assert "base=" not in rows[0].description
    assert sf.point_states([replace(p, seed=42) for p in pts], rows, base) == {i: "done" for i in range(4)}
    assert sf.point_states(pts, rows, "0123456789ab") == {i: "todo" for i in range(4)}   # another base


OLD_COLUMNS = tuple(c for c in COLUMNS if c != "sweep")   # what ar wrote before the sweep column


def old_line(**fields) -> str:
    row = dict.fromkeys(OLD_COLUMNS, "")
    row.update(fields)
    return "\t".join(row[c] for c in OLD_COLUMNS) + "\n"


def test_an_old_header_reads_and_migrates_on_the_next_append(tmp_path):
    from autoresearch.records.ledger import Ledger
    d = tmp_path / "sweep-bb"
    d.mkdir()
    done = "2026-11-30T10:00:00+00:00"
    point = old_line(commit="abc1234", val_bpb="1.100000", status="discard", exp_id="1", time_budget="120",
                     seed="42", knobs='"{""DEPTH"":8,""TOTAL_BATCH_SIZE"":65536}"', finished_at=done,
                     description="sweep bb: TOTAL_BATCH_SIZE=2**16 budget=120s seed=42 base=abcdef123456")
    other = old_line(commit="def5678", val_bpb="1.200000", status="keep", exp_id="2", description="a\tb",
                     finished_at=done).replace("a\tb", '"a\tb"')
    corrupt = "bad\tline\n"
    (d / "results.tsv").write_text("\t".join(OLD_COLUMNS) + "\n" + point + other + corrupt + point[:40])
    warned = []
    rows = read_results(d / "results.tsv", warn=warned.append)
    assert [r.commit for r in rows] == ["abc1234", "def5678"] and len(warned) == 2
    assert rows[0].sweep == {"name": "bb", "point": None, "axes": {"TOTAL_BATCH_SIZE": 65536, "TIME_BUDGET": 120.0},
                             "base": "abcdef123456"}
    assert rows[1].sweep == {} and rows[1].description == "a\tb"
    # the next append brings the header up to date; what was recorded reads the same
    led = Ledger(d, warn=warned.append)
    led.append(Row(commit="0a1b2c3", val_bpb=1.0, memory_gb=None, status=Status.DISCARD, description="new",
                   sweep={"name": "bb", "point": 0, "axes": {"TIME_BUDGET": 60}, "base": "abcdef123456"}))
    text = (d / "results.tsv").read_text()
    assert text.startswith("\t".join(COLUMNS) + "\n") and text.count("\n") == 5   # the cut line is gone
    assert "bad\tline\n" in text                                                   # a corrupt line is left as it was
    after = read_results(d / "results.tsv", warn=lambda m: None)
    assert after[:2] == rows and after[2].sweep["point"] == 0 and after[2].description == "new"
    assert any("added the column(s) sweep" in w for w in warned)
    assert not list(d.glob("*.migrating"))


def test_an_upstream_results_tsv_is_still_refused_for_appends(tmp_path):
    from autoresearch.records.ledger import Ledger, LedgerError
    (tmp_path / "results.tsv").write_text("commit\tval_bpb\tmemory_gb\tstatus\tdescription\n")
    with pytest.raises(LedgerError, match="other columns than ar writes"):
        Ledger(tmp_path).append(Row("abc", 1.0, None, Status.KEEP, "x"))
    assert (tmp_path / "results.tsv").read_text().count("\n") == 1


def test_overhead_estimate():
    r = _row({}, 300, "keep")
    r.training_seconds, r.total_seconds = 300.0, 330.0
    assert sf.estimate_overhead([r, r], 30.0) == (30.0, "median of 2 past run(s)")   # from total_seconds
    r.started_at, r.finished_at = "2025-01-01T10:00:00+00:00", "2025-01-01T10:05:40+00:00"
    assert sf.estimate_overhead([r], 30.0) == (40.0, "median of 1 past run(s)")      # from the wall clock
    assert sf.estimate_overhead([], 12.0) == (12.0, "default estimate")


# ------------------------------------------------------------------------------------- early stopping

def test_loss_at_interpolates_and_is_none_outside():
    c = [(10.0, 4.0), (20.0, 3.0), (40.0, 2.0)]
    assert sw.loss_at(c, 15.0) == pytest.approx(3.5)
    assert sw.loss_at(c, 40.0) == 2.0
    assert sw.loss_at(c, 5.0) is None and sw.loss_at(c, 50.0) is None and sw.loss_at([], 1.0) is None


def test_prune_decision_needs_margin_patience_and_min_pct():
    ref = [(0.0, 5.0), (100.0, 3.0)]  # best loss at 50% is 4.0
    es = sf.EarlyStop(margin=0.05, min_pct=20, patience=2)
    assert sw.prune_decision([ref], 10.0, 9.0, 0, es) == (0, None)          # before min_pct: no decision
    assert sw.prune_decision([ref], 50.0, 4.1, 0, es) == (0, None)          # inside the margin
    assert sw.prune_decision([], 50.0, 9.0, 0, es) == (0, None)             # no reference yet
    strikes, reason = sw.prune_decision([ref], 50.0, 4.5, 0, es)
    assert (strikes, reason) == (1, None)
    strikes, reason = sw.prune_decision([ref], 51.0, 4.5, strikes, es)
    assert strikes == 2 and reason.startswith("early stop at 51.0%: loss 4.5000 vs best 3.9800")
    assert sw.prune_decision([ref], 52.0, 3.9, 1, es) == (0, None)          # a good line resets the count
    # the best of several references counts
    worse = [(0.0, 9.0), (100.0, 9.0)]
    assert sw.prune_decision([worse, ref], 50.0, 4.5, 1, es)[1] is not None
    assert sw.prune_decision([ref], 50.0, math.nan, 1, es) == (0, None)


def test_halving_promotes_the_top_fraction_only():
    a, b, c, d = [((("X", float(i)),), None) for i in range(4)]
    finished = [(a, 300.0, 1.0), (b, 300.0, 1.2), (c, 300.0, None), (d, 300.0, 1.1), (a, 150.0, 9.0)]
    assert sw.halving_verdict(a, 600.0, finished, 0.5) is None
    assert sw.halving_verdict(d, 600.0, finished, 0.5) is None
    assert sw.halving_verdict(b, 600.0, finished, 0.5) == "halving: ranked 3 of 4 at budget 300s (top 2 go on)"
    assert sw.halving_verdict(c, 600.0, finished, 0.5).startswith("halving: ranked 4 of 4")
    assert sw.halving_verdict(b, 600.0, finished, 1.0) is None               # halving off
    assert sw.halving_verdict(b, 300.0, finished, 0.5) is None               # nothing smaller than 300 for b
    assert sw.halving_verdict((("X", 9.0),), 600.0, finished, 0.5) is None  # never ran smaller: no verdict


# ------------------------------------------------------------------------------------- seeds

def test_seed_stats_and_ties():
    rows = [Row("aaa", 1.000, None, Status.KEEP, "a"), Row("aaa", 1.004, None, Status.VALIDATION, "a"),
            Row("aaa", 0.996, None, Status.VALIDATION, "a"),
            Row("bbb", 1.002, None, Status.DISCARD, "b"), Row("bbb", 1.006, None, Status.VALIDATION, "b"),
            Row("ccc", 1.050, None, Status.DISCARD, "c"), Row("ccc", 1.052, None, Status.VALIDATION, "c"),
            Row("ddd", None, None, Status.CRASH, "d")]
    stats = sw.seed_stats(rows, ["aaa", "bbb", "ccc", "ddd"])
    assert [s.commit for s in stats] == ["aaa", "bbb", "ccc"]
    assert stats[0].mean == pytest.approx(1.0) and stats[0].spread == pytest.approx(0.004)
    v = sw.verdicts(stats)
    assert [(s.commit, verdict) for s, verdict in v] == [("aaa", "best"), ("bbb", "tie"), ("ccc", "worse")]
    assert sw.verdicts([]) == []


S = sw.SeedStats
# σ pooled over the points' seeds; 'worse' past 1.645 standard errors of the difference of the two means
@pytest.mark.parametrize("points, expect", [
    # σ 0.01 (pooled); 3 runs each: SE of the difference 0.0082, bar 0.0134
    ([S("a", "a", (1.00, 1.01, 0.99)), S("b", "b", (1.013, 1.023, 1.003))], ["best", "tie"]),
    ([S("a", "a", (1.00, 1.01, 0.99)), S("b", "b", (1.015, 1.025, 1.005))], ["best", "worse"]),
    # the same gap of means, 6 runs of the later point: its mean is known better, the SE smaller
    ([S("a", "a", (1.00, 1.01, 0.99)), S("b", "b", (1.003, 1.023) * 3)], ["best", "worse"]),
    # one run each: no spread to pool; any difference is 'worse', equal is a tie
    ([S("a", "a", (1.00,)), S("b", "b", (1.0001,)), S("c", "c", (1.00,))], ["best", "tie", "worse"]),
    # a wide point (σ from its own seeds) next to a tight best: both pooled, not the larger spread alone
    ([S("a", "a", (1.000, 1.000, 1.000)), S("b", "b", (0.98, 1.04, 1.01))], ["best", "tie"]),
])
def test_validation_calls_worse_only_past_the_standard_error(points, expect):
    got = sw.verdicts(points)
    assert sorted(v for _, v in got) == sorted(expect)
    assert got[0][1] == "best" and got[0][0].mean == min(p.mean for p in points)


# ------------------------------------------------------------------------------------- real repos

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import git  # noqa: E402
import yaml  # noqa: E402

from test_lock import holding_the_lock  # noqa: E402
from test_loop import make_repo, no_ar_settings  # noqa: E402,F401  (no_ar_settings: a fixture, asked for by name)
from test_report import ar  # noqa: E402  (the in-process `ar` runner)

FAKE_TRAIN = Path(__file__).parent / "fixtures" / "fake_train.py"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


@pytest.fixture
def repo(tmp_path, monkeypatch, prepared_cache):
    """A git repo whose train.py is the scripted stand-in, plus a run config for fast CPU runs."""
    for k, v in GIT_ENV.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "repo"
    root.mkdir()
    text = FAKE_TRAIN.read_text().replace("STEP_SECONDS = 0.05", "STEP_SECONDS = 0.04")
    (root / "train.py").write_text(text)
    (root / ".gitignore").write_text("runs/\n__pycache__/\n")
    r = git.Repo.init(root)
    r.index.add(["train.py", ".gitignore"])
    r.index.commit("stand-in train.py")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(
        {"profile": "cpu", "prepare_data": False, "startup_allowance": 30.0, "eval_allowance": 30.0,
         "noise": 0.0, "eval_tokens": 2048}))
    return root


def write_sweep(path: Path, **data) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path




@pytest.mark.integration
def test_dry_run_prints_the_plan_in_order_and_runs_nothing(repo, tmp_path, monkeypatch, capsys):
    f = write_sweep(tmp_path / "sweep-dry.yaml", axes={"LR_MULT": [1.0, 2.0], "TIME_BUDGET": [20, 10]},
                    fixed={"TOTAL_BATCH_SIZE": "2**17"}, overhead_s=5)
    args = ["sweep", f, "--repo", repo, "--config", tmp_path / "run.yaml", "--dry-run"]
    code, out, err = ar(args, monkeypatch, capsys)
    assert code == 0, err
    listed = [ln for ln in out.splitlines() if "LR_MULT=" in ln]
    assert [("LR_MULT=1.0" in ln, "budget=20s" in ln) for ln in listed] == [
        (True, True), (True, False), (False, True), (False, False)]
    assert "4 of 4 points to run" in out and "CPU time ≈ 1 min = 1 min of training + 4 × 5 s per-run overhead" in out
    code, out, err = ar(args + ["--order", "cheap-first"], monkeypatch, capsys)
    listed = [ln for ln in out.splitlines() if "LR_MULT=" in ln]
    assert [("LR_MULT=1.0" in ln, "budget=20s" in ln) for ln in listed] == [
        (True, False), (False, False), (True, True), (False, True)]
    assert not (repo / "runs").exists()
    assert [h.name for h in git.Repo(repo).heads] == [git.Repo(repo).active_branch.name]


@pytest.mark.integration
def test_bad_sweep_file_is_one_line_before_anything_runs(repo, tmp_path, monkeypatch, capsys):
    f = write_sweep(tmp_path / "bad.yaml", axes={"LR": [1.0]})
    code, out, err = ar(["sweep", f, "--repo", repo, "--config", tmp_path / "run.yaml"], monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1
    assert "unknown knob 'LR': train.py has DEPTH, TOTAL_BATCH_SIZE, DEVICE_BATCH_SIZE, LR_MULT" in err
    assert not (repo / "runs").exists() and len(git.Repo(repo).heads) == 1
    f = write_sweep(tmp_path / "bad2.yaml", axes={"TOTAL_BATCH_SIZE": [1000]})
    code, out, err = ar(["sweep", f, "--repo", repo, "--config", tmp_path / "run.yaml"], monkeypatch, capsys)
    assert code == 2 and "not a multiple of the sequence length 256 (cpu profile)" in err
    f = write_sweep(tmp_path / "bad3.yaml", axes={"LR_MULT": [1.0]}, base="no-such-branch")
    code, out, err = ar(["sweep", f, "--repo", repo, "--config", tmp_path / "run.yaml"], monkeypatch, capsys)
    assert code == 2 and "base 'no-such-branch' is not a commit or branch" in err


def sweep_rows(repo: Path, tag: str):
    return read_results(repo / "runs" / tag / "results.tsv")


@pytest.mark.e2e
def test_sweep_end_to_end_then_resume_skips_everything(repo, tmp_path, monkeypatch, capsys):
    f = write_sweep(tmp_path / "sweep-e2e.yaml", axes={"LR_MULT": [1.0, 2.0], "TOTAL_BATCH_SIZE": ["2**17", "2**19"]},
                    fixed={"TIME_BUDGET": 1}, order="listed")
    args = ["sweep", f, "--repo", repo, "--config", tmp_path / "run.yaml"]
    code, out, err = ar(args, monkeypatch, capsys)
    assert code == 0, out + err
    rows = sweep_rows(repo, "sweep-e2e")
    assert [r.status.value for r in rows] == ["keep", "discard", "discard", "discard"]
    assert [(r.knobs["LR_MULT"], r.knobs["TOTAL_BATCH_SIZE"], r.time_budget, r.seed) for r in rows] == [
        (1.0, 2**17, 1.0, 42), (1.0, 2**19, 1.0, 42), (2.0, 2**17, 1.0, 42), (2.0, 2**19, 1.0, 42)]
    assert all(r.val_bpb > rows[0].val_bpb + 0.02 for r in rows[1:])         # the bowl's minimum wins
    g = git.Repo(repo)
    assert g.active_branch.name == "autoresearch/sweep-e2e"
    assert "LR_MULT = 1.0" in (repo / "train.py").read_text()          # the tree is at the best point
    assert "best: " in out and "ran 4 experiment(s)" in out
    # the same sweep again: everything is done, nothing runs
    code, out, err = ar(args, monkeypatch, capsys)
    assert code == 0 and "0 of 4 points to run, 4 already done" in out and "ran 0 experiment(s)" in out
    assert len(sweep_rows(repo, "sweep-e2e")) == 4
    assert [r.sweep["axes"] for r in rows] == [{"LR_MULT": lr, "TOTAL_BATCH_SIZE": tbs, "TIME_BUDGET": 1}
                                               for lr in (1.0, 2.0) for tbs in (2**17, 2**19)]
    assert [r.sweep["point"] for r in rows] == [0, 1, 2, 3] and [r.sweep["name"] for r in rows] == ["e2e"] * 4
    # and the report reads it as grid points, not keeps: the best point, its knobs, the command, the grid plot
    code, out, err = ar(["report", "--repo", repo, "--json"], monkeypatch, capsys)
    data = json.loads(out)
    assert data["tags"] == ["sweep-e2e"] and len(data["experiments"]) == 4 and data["top"] == []
    first = data["points"][0]
    assert (first["label"], first["n"], first["state"]) == ("LR_MULT=1.0 TOTAL_BATCH_SIZE=2**17", 1, "done")
    assert [p["mean"] for p in data["points"]] == sorted(r.val_bpb for r in rows)
    best = data["best"]
    assert best["commit"] == rows[0].commit and best["knobs"]["LR_MULT"] == 1.0 and best["time_budget"] == 1.0
    assert best["command"] == f"git checkout {rows[0].commit} && AR_PROFILE=cpu AR_TIME_BUDGET=1 AR_SEED=42 python train.py"
    assert data["grid_plot"] == str(repo / "runs" / "sweep-e2e" / "grid.png")
    png = tmp_path / "sweep.png"
    code, out, err = ar(["report", "--repo", repo, "--plot", png], monkeypatch, capsys)
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"grid plot: {png}" in out
    assert "sweep e2e: 4 points (4 done)" in out and "best point: LR_MULT=1.0 TOTAL_BATCH_SIZE=2**17" in out
    assert "discard" not in out and "top " not in out


def to_old_format(results: Path) -> None:
    """Rewrite results.tsv as the ar before the sweep column wrote it: no such column, and the identity in the
    description ("sweep NAME: <every axis> budget=Ns seed=S base=SHA")."""
    import csv
    with open(results, newline="") as f:
        table = list(csv.DictReader(f, dialect="excel-tab"))
    with open(results, "w", newline="") as f:
        w = csv.writer(f, dialect="excel-tab", lineterminator="\n")
        w.writerow(OLD_COLUMNS)
        for r in table:
            ident = json.loads(r["sweep"])
            axes = " ".join(f"{k}={sf.show_value(v)}" for k, v in ident["axes"].items() if k != "TIME_BUDGET")
            r["description"] = (f"sweep {ident['name']}: {axes} budget={sf.show_number(float(r['time_budget']))}s "
                                f"seed={r['seed']} base={ident['base']}")
            w.writerow([r[c] for c in OLD_COLUMNS])


@pytest.mark.e2e
def test_an_old_format_sweep_resumes_reports_and_migrates(repo, tmp_path, monkeypatch, capsys):
    f = write_sweep(tmp_path / "sweep-old.yaml", axes={"LR_MULT": [1.0], "TOTAL_BATCH_SIZE": ["2**17"]},
                    fixed={"TIME_BUDGET": 0.5})
    args = ["sweep", f, "--repo", repo, "--config", tmp_path / "run.yaml"]
    assert ar(args, monkeypatch, capsys)[0] == 0
    results = repo / "runs" / "sweep-old" / "results.tsv"
    to_old_format(results)
    (old,) = read_results(results)
    assert old.sweep["axes"] == {"LR_MULT": 1.0, "TOTAL_BATCH_SIZE": 2**17, "TIME_BUDGET": 0.5}  # from the text
    # the grid grows by a point: the old row still counts as done, the new one runs and the file migrates
    write_sweep(f, axes={"LR_MULT": [1.0, 2.0], "TOTAL_BATCH_SIZE": ["2**17"]}, fixed={"TIME_BUDGET": 0.5})
    code, out, err = ar(args, monkeypatch, capsys)
    assert code == 0, out + err
    assert "1 of 2 points to run, 1 already done" in out and "ran 1 experiment(s)" in out
    assert results.read_text().split("\n", 1)[0] == "\t".join(COLUMNS)
    first, new = read_results(results)
    assert first == old and new.sweep["axes"] == {"LR_MULT": 2.0, "TOTAL_BATCH_SIZE": 2**17, "TIME_BUDGET": 0.5}
    code, out, err = ar(args, monkeypatch, capsys)
    assert "0 of 2 points to run, 2 already done" in out
    code, out, err = ar(["report", "--repo", repo, "--json"], monkeypatch, capsys)
    assert [p["label"] for p in json.loads(out)["points"]] == ["LR_MULT=1.0", "LR_MULT=2.0"]
    code, out, err = ar(["report", "--repo", repo], monkeypatch, capsys)
    assert code == 0 and "sweep old: 2 points (2 done)" in out and "0.5s" in out and "AR_TIME_BUDGET=0.5" in out


@pytest.mark.e2e
def test_early_stop_prunes_the_losers_and_keeps_the_winner(repo, tmp_path, monkeypatch, capsys):
    # the stand-in's loss at progress p is val_bpb + 2(1-p)^2, val_bpb a bowl with its minimum at
    # LR_MULT 1.0 and TOTAL_BATCH_SIZE 2**17: listed first, the winner sets the reference curve
    f = write_sweep(tmp_path / "sweep-es.yaml", axes={"LR_MULT": [1.0, 2.0, 0.5], "TIME_BUDGET": [1.5]},
                    fixed={"TOTAL_BATCH_SIZE": "2**17"},
                    early_stop={"margin": 0.01, "min_pct": 20, "patience": 3, "keep_fraction": 1.0})
    code, out, err = ar(["sweep", f, "--repo", repo, "--config", tmp_path / "run.yaml", "--early-stop"],
                        monkeypatch, capsys)
    assert code == 0, out + err
    rows = sweep_rows(repo, "sweep-es")
    assert [(r.knobs["LR_MULT"], r.status.value) for r in rows] == [(1.0, "keep"), (2.0, "pruned"), (0.5, "pruned")]
    for r in rows[1:]:
        assert r.val_bpb is None and r.reason.startswith("early stop at ") and "% margin" in r.reason
        pct = float(r.reason.split("early stop at ")[1].split("%")[0])
        assert 20 <= pct < 80                       # stopped early, and the reason says where
        assert r.num_steps is None or r.num_steps < rows[0].num_steps
    assert rows[0].val_bpb is not None and rows[0].reason.startswith("first result")


@pytest.mark.e2e
def test_halving_leaves_out_the_losers_of_the_smaller_budget(repo, tmp_path, monkeypatch, capsys):
    f = write_sweep(tmp_path / "sweep-sh.yaml", axes={"LR_MULT": [2.0, 1.0], "TIME_BUDGET": [1.2, 0.6]},
                    fixed={"TOTAL_BATCH_SIZE": "2**17"}, order="cheap-first",
                    early_stop={"margin": 0.5, "keep_fraction": 0.5})   # a huge margin: nothing pruned mid-run
    code, out, err = ar(["sweep", f, "--repo", repo, "--config", tmp_path / "run.yaml", "--early-stop"],
                        monkeypatch, capsys)
    assert code == 0, out + err
    rows = sweep_rows(repo, "sweep-sh")
    assert [(r.knobs["LR_MULT"], r.time_budget, r.status.value) for r in rows] == [
        (2.0, 0.6, "keep"), (1.0, 0.6, "keep"), (1.0, 1.2, "discard")]
    assert "left out LR_MULT=2.0 budget=1.2s: halving: ranked 2 of 2 at budget 0.6s" in out


@pytest.mark.e2e
def test_validate_top_reruns_with_other_seeds_and_calls_ties(repo, tmp_path, monkeypatch, capsys):
    text = (repo / "train.py").read_text().replace("SEED_NOISE = 0.0 ", "SEED_NOISE = 0.01")
    (repo / "train.py").write_text(text)
    git.Repo(repo).index.add(["train.py"])
    git.Repo(repo).index.commit("seed noise")
    f = write_sweep(tmp_path / "sweep-val.yaml", axes={"LR_MULT": [1.0, 1.1, 3.0]},
                    fixed={"TIME_BUDGET": 0.5, "TOTAL_BATCH_SIZE": "2**17"}, validate_seeds=[1, 2])
    args = ["sweep", f, "--repo", repo, "--config", tmp_path / "run.yaml", "--validate-top", "2"]
    code, out, err = ar(args, monkeypatch, capsys)
    assert code == 0, out + err
    rows = sweep_rows(repo, "sweep-val")
    val = [r for r in rows if r.status is Status.VALIDATION]
    assert len(rows) == 7 and len(val) == 4
    assert {(r.seed, r.time_budget) for r in val} == {(1, 0.5), (2, 0.5)}
    top2 = {r.commit for r in sorted(rows[:3], key=lambda r: r.val_bpb)[:2]}
    assert {r.commit for r in val} == top2
    lines = [ln for ln in out.splitlines() if "over 3 seed(s)" in ln]
    assert len(lines) == 2 and lines[0].endswith("— best") and lines[1].endswith(("— tie", "— worse"))
    # again: the re-runs are recorded, none is queued twice
    code, out, err = ar(args, monkeypatch, capsys)
    assert code == 0 and len(sweep_rows(repo, "sweep-val")) == 7


@pytest.mark.e2e
def test_no_other_ar_takes_the_repo_between_a_sweeps_loops(repo, tmp_path):
    """ar sweep holds one lock from its branch to its last run. It used to let go between its branch and its first
    Loop, and between Loops (the validation re-runs): eight `ar run`/`ar sweep` started at once after a kill -9 were
    told to wait for a sweep that then lost the repo to an `ar run`. Each Loop says its first line before it
    opens: another holder tries the lock then."""
    from autoresearch.config import load_config
    from autoresearch.errors import LockHeld
    from autoresearch.records.layout import RunsLayout
    from autoresearch.records.lock import RepoLock
    f = write_sweep(tmp_path / "sweep-lk.yaml", axes={"LR_MULT": [1.0, 3.0]},
                    fixed={"TIME_BUDGET": 0.3, "TOTAL_BATCH_SIZE": "2**17"}, validate_seeds=[1])
    cfg = load_config(tmp_path / "run.yaml")
    tried, taken = [], []

    def other_ar(event):
        if event.message.startswith(("new tag", "resuming tag")):
            tried.append(event.message)
            try:
                with RepoLock(RunsLayout(repo).lock, tag="x", command="ar run"):
                    taken.append(event.message)
            except LockHeld:
                pass
    result = sw.run_sweep(sf.plan(f, repo, cfg), cfg, validate_top=1, on_event=other_ar)
    assert len(tried) >= 2 and not taken, taken                   # the rounds' Loop, the re-runs' Loop
    assert result.ran == 3 and len(sweep_rows(repo, "sweep-lk")) == 3


@pytest.mark.e2e
def test_resume_after_kill_9_skips_what_finished_and_runs_nothing_twice(repo, tmp_path, monkeypatch, capsys):
    f = write_sweep(tmp_path / "sweep-kill.yaml", axes={"LR_MULT": [1.0, 2.0, 0.5, 1.5]},
                    fixed={"TIME_BUDGET": 1.5, "TOTAL_BATCH_SIZE": "2**17"})
    args = ["sweep", f, "--repo", repo, "--config", tmp_path / "run.yaml"]
    results = repo / "runs" / "sweep-kill" / "results.tsv"
    proc = subprocess.Popen([sys.executable, "-m", "autoresearch", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "200"})
    try:
        deadline = time.time() + 60
        while time.time() < deadline and len(read_results(results)) < 1:
            time.sleep(0.1)
        assert len(read_results(results)) >= 1, "the first point never finished"
        time.sleep(0.7)                                     # the second point is training now
        proc.kill()                                         # kill -9 of `ar sweep`
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = read_results(results)
    assert 1 <= len(before) < 4
    code, out, err = ar(args, monkeypatch, capsys)
    assert code == 0, out + err
    assert f"{4 - len(before)} of 4 points to run, {len(before)} already done" in out
    rows = read_results(results)
    assert rows[:len(before)] == before                     # nothing recorded was lost or rewritten
    assert sorted(r.knobs["LR_MULT"] for r in rows) == [0.5, 1.0, 1.5, 2.0]   # each point once
    assert all(r.status in (Status.KEEP, Status.DISCARD) for r in rows)
    from autoresearch.records.queue import ExperimentQueue
    q = ExperimentQueue(repo / "runs" / "sweep-kill" / "queue.jsonl")
    assert len(q) == 4 and not q.pending()                  # no spec queued twice
    assert [q.starts(s.id) for s in q.all()].count(2) == 1  # the one cut short ran again, only it


@pytest.mark.e2e
def test_a_moved_base_is_refused_and_a_missing_base_comes_from_the_branch(repo, tmp_path, monkeypatch, capsys):
    from autoresearch.config import load_config
    g = git.Repo(repo)
    main = g.active_branch.name
    f = write_sweep(tmp_path / "sweep-b.yaml", axes={"LR_MULT": [1.0]}, fixed={"TIME_BUDGET": 0.3}, base=main)
    cfg = load_config(tmp_path / "run.yaml")
    p = sf.plan(f, repo, cfg)
    sw.run_sweep(p, cfg)
    assert sf.plan(f, repo, cfg).states == {0: "done"}
    g.git.checkout(main)
    (repo / "README").write_text("moved on\n")
    g.index.add(["README"])
    g.index.commit("new base")
    with pytest.raises(ConfigError, match="started from .* but base '.*' is now"):
        sf.plan(f, repo, cfg)
    nobase = write_sweep(tmp_path / "sweep-b.yaml", axes={"LR_MULT": [1.0]}, fixed={"TIME_BUDGET": 0.3})
    assert sf.plan(nobase, repo, cfg).base == p.base      # the branch's start, not today's HEAD


# ------------------------------------------------------------------------------------ refused before anything is made

# `python -m autoresearch ARGS` in a subprocess
def run_ar(*args, cwd, timeout=180, env=None):
    return subprocess.run([sys.executable, "-m", "autoresearch", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


def git_cmd(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.mark.e2e
def test_sweep_beside_a_running_loop_writes_nothing_before_it_has_the_lock(tmp_path, prepared_cache):
    root = make_repo(tmp_path)
    (root / "sweep.yaml").write_text(yaml.safe_dump({"name": "lr", "axes": {"LR_MULT": [1.0, 2.0]},
                                                      "profile": "cpu"}))
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "x", "--allow-empty"],
                   cwd=root, check=True)
    subprocess.run(["git", "add", "sweep.yaml"], cwd=root, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "sweep"], cwd=root,
                   check=True)
    with holding_the_lock(root):
        refs_before = subprocess.run(["git", "for-each-ref"], cwd=root, capture_output=True, text=True).stdout
        r = run_ar("sweep", "sweep.yaml", cwd=root)
        assert r.returncode == 3, r.stdout + r.stderr
        assert "already running" in r.stdout + r.stderr and "Traceback" not in r.stderr
        refs_after = subprocess.run(["git", "for-each-ref"], cwd=root, capture_output=True, text=True).stdout
        assert refs_after == refs_before                     # no branch was made under the running loop


@pytest.mark.e2e
@pytest.mark.usefixtures("no_ar_settings")
def test_a_sweep_on_a_dirty_tree_is_refused_before_its_plan_naming_ar_sweep(tmp_path, prepared_cache):
    from test_loop import make_repo

    root = make_repo(tmp_path)
    (root / "s.yaml").write_text("name: lr\nprofile: cpu\naxes: {LR_MULT: [1.0, 2.0]}\n")
    git_cmd(root, "add", "s.yaml")
    git_cmd(root, "commit", "-qm", "a sweep file")
    (root / "train.py").write_text((root / "train.py").read_text() + "\n# my edit\n")
    r = run_ar("sweep", "s.yaml", cwd=root)
    assert r.returncode == 1 and r.stdout == "", r.stdout                     # no plan first
    assert r.stderr.count("\n") == 1 and "uncommitted changes (train.py)" in r.stderr, r.stderr
    assert "`ar sweep`" in r.stderr and "ar run" not in r.stderr, r.stderr
    assert not (root / "runs" / "sweep-lr").exists()
    assert run_ar("sweep", "s.yaml", "--dry-run", cwd=root).returncode == 0       # a plan only: the tree may be dirty
