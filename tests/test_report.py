"""ar report: upstream's five-column results.tsv, our own rows, the per-knob summary, the plot, JSON, and the
one-line answers for missing, empty and corrupt results; one best (the best kept result) in report, status and
journal, `ar status`'s noise and budgets, small token counts, `--all`'s numbering and order, the noise threshold
on the plot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoresearch.proposers import memory
from autoresearch.cli import app
from autoresearch.session.loop import Loop
from autoresearch.views import plots
from autoresearch.views import report as rep
from autoresearch.records.ledger import COLUMNS, Ledger, Row, Status

from test_loop import cfg, make_repo, no_ar_settings  # noqa: F401  (no_ar_settings: a fixture, asked for by name)
from fixtures.cli import committed_repo, run_ar

UPSTREAM = Path(__file__).parent / "data" / "upstream_results.tsv"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
AR = str(Path(sysconfig.get_path("scripts")) / "ar")  # the installed console script


def ar(args, monkeypatch, capsys) -> tuple[int, str, str]:
    """Run `ar ARGS` in-process through the real entry point (its error handling included)."""
    from autoresearch.cli import console, err_console, main

    monkeypatch.setattr(sys, "argv", ["ar", *map(str, args)])
    monkeypatch.setattr(console, "width", 250)
    monkeypatch.setattr(err_console, "width", 250)
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def upstream_repo(tmp_path):
    d = tmp_path / "runs" / "mar5"
    d.mkdir(parents=True)
    shutil.copy(UPSTREAM, d / "results.tsv")
    return tmp_path


def sweep_rows() -> list[Row]:
    def row(i, tbs, lr, budget, val, status, seed=42, commit=None):
        return Row(commit=commit or f"{i:07x}aaaa", val_bpb=val, memory_gb=40.0, status=Status(status),
                   description=f"point {i}", exp_id=i, tag="sweep-t", mfu=40.0 + i, tokens_per_s=1e6,
                   training_seconds=budget, total_seconds=budget + 25, num_steps=100 * i, total_tokens_M=50.0 * i,
                   time_budget=budget, seed=seed, knobs={"TOTAL_BATCH_SIZE": tbs, "LR_MULT": lr})
    return [row(1, 2**17, 1.0, 300.0, 1.10, "keep"), row(2, 2**18, 1.0, 300.0, 1.12, "discard"),
            row(3, 2**17, 2.0, 300.0, None, "pruned"), row(4, 2**17, 1.0, 600.0, 1.05, "keep"),
            row(5, 2**18, 2.0, 600.0, None, "crash"),
            row(6, 2**17, 1.0, 600.0, 1.052, "validation", seed=1, commit="0000004aaaa"),
            row(7, 2**17, 1.0, 600.0, 1.047, "validation", seed=2, commit="0000004aaaa")]


# ------------------------------------------------------------------------------------------------ pure

def test_build_on_sweep_rows_best_top_per_knob_and_validation():
    data = rep.build(sweep_rows(), ["sweep-t"], top=2)
    best = data["best"]
    assert best["commit"] == "0000004aaaa" and best["val_bpb"] == 1.05 and best["mfu"] == 44.0
    assert best["knobs"] == {"TOTAL_BATCH_SIZE": 2**17, "LR_MULT": 1.0} and best["time_budget"] == 600.0
    assert best["command"] == "git checkout 0000004aaaa && AR_TIME_BUDGET=600 AR_SEED=42 python train.py"
    assert [e["index"] for e in data["top"]] == [4, 1]
    assert len(data["experiments"]) == 7 and data["experiments"][2]["status"] == "pruned"
    assert data["experiments"][2]["val_bpb"] is None
    per = data["per_knob"]
    assert [(e["value"], e["best_val_bpb"], e["runs"]) for e in per["TOTAL_BATCH_SIZE"]] == [
        (2**17, 1.05, 5), (2**18, 1.12, 2)]
    assert [(e["value"], e["best_val_bpb"]) for e in per["LR_MULT"]] == [(1.0, 1.05), (2.0, None)]
    assert [(e["value"], e["best_val_bpb"]) for e in per["TIME_BUDGET"]] == [(600, 1.05), (300, 1.10)]
    (v,) = data["validation"]
    assert v["commit"] == "0000004aaaa" and v["n"] == 3 and v["verdict"] == "best"
    assert v["mean"] == pytest.approx((1.05 + 1.052 + 1.047) / 3)
    json.dumps(data)  # JSON-ready as it is


def test_sections_are_tables_of_strings():
    data = rep.build(sweep_rows(), ["sweep-t"], top=3)
    secs = rep.sections(data)
    titles = [s.title for s in secs]
    assert titles[0].startswith("top 3 of 7 experiments") and titles[1].startswith("best: 0000004")
    assert "per-knob: TOTAL_BATCH_SIZE" in titles and titles[-1].startswith("validation re-runs")
    assert all(isinstance(c, str) for s in secs for r in s.rows for c in r)
    best = dict(secs[1].rows)
    assert best["TOTAL_BATCH_SIZE"] == "2**17" and best["LR_MULT"] == "1.0" and best["TIME_BUDGET"] == "600s"


def test_no_candidates_means_no_best():
    data = rep.build([Row("abc", None, None, Status.CRASH, "boom")], ["t"])
    assert data["best"] is None and data["top"] == [] and len(data["experiments"]) == 1


# ------------------------------------------------------------------------------------------------ CLI

def test_report_reads_upstream_five_columns(upstream_repo, monkeypatch, capsys):
    code, out, err = ar(["report", "--repo", upstream_repo], monkeypatch, capsys)
    assert code == 0, err
    assert "top 6 of 7 experiments (4 keep, 2 discard, 1 crash) — mar5" in out
    assert "git checkout a7b8c9d && python train.py" in out
    assert "0.988400" in out and "error" not in err


def test_report_json_parses(upstream_repo, monkeypatch, capsys):
    code, out, _ = ar(["report", "--repo", upstream_repo, "--json"], monkeypatch, capsys)
    assert code == 0
    data = json.loads(out)
    assert {"commit", "val_bpb", "mfu", "knobs", "time_budget"} <= set(data["best"])
    assert data["best"]["commit"] == "a7b8c9d" and data["best"]["val_bpb"] == pytest.approx(0.9884)
    assert len(data["experiments"]) == 7
    crash = data["experiments"][3]
    assert crash["status"] == "crash" and crash["val_bpb"] is None and crash["memory_gb"] is None


def test_report_plot_is_a_valid_png(upstream_repo, tmp_path, monkeypatch, capsys):
    png = tmp_path / "out" / "progress.png"
    code, out, _ = ar(["report", "--repo", upstream_repo, "--plot", png], monkeypatch, capsys)
    assert code == 0 and f"plot: {png}" in out.replace("\n", "")
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    import matplotlib.image
    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 100 and img.shape[1] > 100


def test_report_plot_of_sweep_rows(tmp_path):
    png = plots.plot(sweep_rows(), tmp_path / "s.png")
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def progress_rows(n: int = 40) -> list[Row]:
    """A run of n experiments: every third kept (the last one too, at the right edge), long descriptions."""
    rows = []
    for i in range(1, n + 1):
        keep = i % 3 == 1 or i == n
        rows.append(Row(commit=f"{i:07x}", val_bpb=(1.5 - 0.01 * i) if keep else 1.6 + 0.001 * i, memory_gb=None,
                        status=Status.KEEP if keep else Status.DISCARD,
                        description=f"experiment {i}: " + "a long explanation of the change " * 4))
    rows.append(Row("crashed", None, None, Status.CRASH, "boom"))
    return rows


def test_progress_plot_has_integer_ticks_and_labels_inside_the_figure():
    import matplotlib.pyplot as plt
    rows = progress_rows()
    fig = plots.progress_figure(rows)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (ax,) = fig.axes
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert len(ticks) >= 3 and all(float(t).is_integer() for t in ticks)
        kept = [r for r in rows if r.status is Status.KEEP]
        assert len(ax.texts) == len(kept)                                          # every kept change named
        assert all(len(t.get_text()) <= 44 and "\n" not in t.get_text() for t in ax.texts)
        assert ax.texts[0].get_text().startswith("experiment 1: a long") and ax.texts[0].get_text().endswith("…")
        box = ax.get_window_extent(renderer)
        for t in ax.texts:                                       # inside the plot, the right-edge label included
            bb = t.get_window_extent(renderer)
            assert box.x0 <= bb.x0 and bb.x1 <= box.x1 and box.y0 <= bb.y0 and bb.y1 <= box.y1, t.get_text()
        legend = ax.get_legend()
        assert [t.get_text() for t in legend.get_texts()] == ["discarded", "running best", "kept"]
        lb, fb = legend.get_window_extent(renderer), fig.bbox
        assert fb.x0 <= lb.x0 and lb.x1 <= fb.x1 and fb.y0 <= lb.y0 and lb.y1 <= fb.y1
        assert lb.y1 <= box.y0                                                     # under the plot, not over points
    finally:
        plt.close(fig)
    few = plots.progress_figure(progress_rows(3))            # 4 experiments: where fractional ticks showed up
    try:
        (ax,) = few.axes
        lo, hi = ax.get_xlim()
        assert all(float(t).is_integer() for t in ax.get_xticks() if lo <= t <= hi)
    finally:
        plt.close(few)


def test_progress_plot_draws_seed_reruns_apart_from_discards_and_tokens_read_small():
    import matplotlib.pyplot as plt
    rows = progress_rows(6)
    rows.insert(1, Row(rows[0].commit, rows[0].val_bpb + 0.003, None, Status.VALIDATION, "noise calibration"))
    fig = plots.progress_figure(rows)
    try:
        (ax,) = fig.axes
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "re-run of a commit (another seed, noise calibration)" in labels and "discarded" in labels
        hollow = [c for c in ax.collections if len(c.get_offsets()) == 1 and c.get_facecolors().size == 0]
        assert [tuple(c.get_offsets()[0]) for c in hollow] == [(2.0, rows[1].val_bpb)]
    finally:
        plt.close(fig)
    assert rep._tokens({"total_tokens_M": 0.0327}) == "32.7K" and rep._tokens({"total_tokens_M": 52.4}) == "52.4M"


def test_progress_plot_puts_far_worse_runs_on_the_top_edge():
    import matplotlib.pyplot as plt
    rows = progress_rows(10)
    fig = plots.progress_figure(rows + [Row("ffffff0", 9.0, None, Status.DISCARD, "exploded")])
    plain = plots.progress_figure(rows)
    try:
        (ax,), (ax2,) = fig.axes, plain.axes
        assert 1.61 < ax.get_ylim()[1] < 2.0                # every ordinary discard shows, the 9.0 does not
        assert "discarded, above the scale (1)" in [t.get_text() for t in ax.get_legend().get_texts()]
        assert "discarded" in [t.get_text() for t in ax2.get_legend().get_texts()]
        assert not any("above" in t.get_text() for t in ax2.get_legend().get_texts())
    finally:
        plt.close(fig)
        plt.close(plain)


def grid_rows() -> list[Row]:
    """A 2-GPU style sweep of TOTAL_BATCH_SIZE × TIME_BUDGET; the best point has two validation seeds."""
    def row(i, tbs, budget, val, status="discard", seed=42, commit=None):
        ident = {"name": "bb", "point": i, "axes": {"TOTAL_BATCH_SIZE": tbs, "TIME_BUDGET": budget},
                 "base": "abcdef123456"}
        return Row(commit=commit or f"{i:07x}", val_bpb=val, memory_gb=None, status=Status(status),
                   description=f"sweep bb: point {i}", exp_id=i + 1, tag="sweep-bb", time_budget=budget, seed=seed,
                   knobs={"TOTAL_BATCH_SIZE": tbs, "DEPTH": 8}, sweep=ident)
    rows = [row(0, 2**16, 60.0, 1.30, "keep"), row(1, 2**16, 120.0, 1.20, "keep"),
            row(2, 2**17, 60.0, 1.25, "discard"), row(3, 2**17, 120.0, 1.22, "discard"),
            row(4, 2**18, 60.0, None, "pruned")]
    rows += [row(1, 2**16, 120.0, 1.21, "validation", seed=1, commit=rows[1].commit),
             row(1, 2**16, 120.0, 1.19, "validation", seed=2, commit=rows[1].commit)]
    return rows


def test_a_sweep_report_tabulates_points_not_keeps():
    data = rep.build(grid_rows(), ["sweep-bb"])
    pts = data["points"]
    assert [p["label"] for p in pts] == ["TOTAL_BATCH_SIZE=2**16 budget=120s", "TOTAL_BATCH_SIZE=2**17 budget=120s",
                                         "TOTAL_BATCH_SIZE=2**17 budget=60s", "TOTAL_BATCH_SIZE=2**16 budget=60s",
                                         "TOTAL_BATCH_SIZE=2**18 budget=60s"]
    assert (pts[0]["n"], pts[0]["seeds"], pts[0]["mean"]) == (3, [42, 1, 2], pytest.approx(1.20))
    assert pts[0]["spread"] == pytest.approx(0.01) and pts[1]["spread"] is None
    assert pts[-1]["state"] == "pruned" and pts[-1]["mean"] is None and pts[-1]["n"] == 0
    assert data["top"] == [] and data["validation"] == [] and data["per_knob"] == {}
    assert data["best"]["commit"] == "0000001" and data["best"]["point"]["n"] == 3
    secs = rep.sections(data)
    assert [s.title.split(":")[0] for s in secs] == ["sweep bb", "best point"]
    assert secs[0].title == "sweep bb: 5 points (4 done, 1 pruned) — sweep-bb"
    assert secs[0].columns[:4] == ("#", "TOTAL_BATCH_SIZE", "budget", "val_bpb (mean)")
    assert secs[0].rows[0] == ("1", "2**16", "120s", "1.200000", "0.010000", "3", "done", "0000001")
    cells = {c for s in secs for r in s.rows for c in r}
    assert not cells & {"keep", "discard"}
    best = dict(secs[1].rows)
    assert best["TOTAL_BATCH_SIZE"] == "2**16" and "DEPTH" not in best and best["TIME_BUDGET"] == "120s"
    json.dumps(data)


def test_grid_plot_draws_val_bpb_against_each_axis_with_seed_error_bars(tmp_path):
    import matplotlib.pyplot as plt
    points = rep.build(grid_rows(), ["sweep-bb"])["points"]
    fig = plots.grid_figure(points)
    try:
        by_x = {ax.get_xlabel(): ax for ax in fig.axes if ax.get_visible()}
        assert set(by_x) == {"TOTAL_BATCH_SIZE", "budget (seconds)"}
        def legend(ax):
            return [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend(by_x["TOTAL_BATCH_SIZE"]) == ["60s", "120s", "best point"]             # a line per budget
        assert by_x["TOTAL_BATCH_SIZE"].get_legend().get_title().get_text() == "budget"
        assert legend(by_x["budget (seconds)"]) == ["2**16", "2**17", "best point"]
        assert [t.get_text() for t in by_x["TOTAL_BATCH_SIZE"].get_xticklabels()] == ["2**16", "2**17"]
        bars = [c for c in by_x["TOTAL_BATCH_SIZE"].containers if c.has_yerr]
        assert len(bars) == 2
        (_, caps, (segments,)) = bars[1]                                        # budget=120s: the 3-seed point
        (y0, y1) = sorted(segments.get_segments()[0][:, 1])
        assert (y0, y1) == (pytest.approx(1.19), pytest.approx(1.21))
    finally:
        plt.close(fig)
    assert plots.grid_plot(points, tmp_path / "g.png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.integration
def test_piped_sweep_report_is_a_points_table_and_writes_the_grid_plot(tmp_path):
    led = Ledger(tmp_path / "runs" / "sweep-bb")
    for r in grid_rows():
        led.append(r)
    env = {**os.environ, "COLUMNS": "80", "FORCE_COLOR": ""}
    r = subprocess.run([AR, "report", "--repo", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    title = out.index("sweep bb: 5 points (4 done, 1 pruned) — sweep-bb")
    assert out[title + 1].split("\t") == ["#", "TOTAL_BATCH_SIZE", "budget", "val_bpb (mean)", "± (sd)", "seeds",
                                          "state", "commit"]
    table = out[title + 2:out.index("", title)]
    assert [ln.split("\t")[1:3] for ln in table] == [["2**16", "120s"], ["2**17", "120s"], ["2**17", "60s"],
                                                      ["2**16", "60s"], ["2**18", "60s"]]
    grid = tmp_path / "runs" / "sweep-bb" / "grid.png"
    assert f"grid plot: {grid}" in out and grid.read_bytes()[:8] == PNG_SIGNATURE


def test_all_tags_with_a_run_and_a_sweep_get_both_plots(upstream_repo, tmp_path, monkeypatch, capsys):
    led = Ledger(upstream_repo / "runs" / "sweep-bb")
    for r in grid_rows():
        led.append(r)
    png = tmp_path / "p.png"
    code, out, err = ar(["report", "--repo", upstream_repo, "--all", "--json", "--plot", png], monkeypatch, capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["plot"] == str(png) and data["grid_plot"] == str(tmp_path / "p-grid.png")
    assert (tmp_path / "p-grid.png").read_bytes()[:8] == PNG_SIGNATURE
    assert len(data["top"]) == 6 and {e["commit"] for e in data["top"]}.isdisjoint(
        c for p in data["points"] for c in p["commits"])              # the run's table holds the run's rows only
    assert data["best"]["commit"] == "a7b8c9d" and len(data["points"]) == 5


def test_missing_and_empty_results_are_one_line_exit_1(tmp_path, monkeypatch, capsys):
    code, out, err = ar(["report", "--repo", tmp_path], monkeypatch, capsys)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("error: no results yet") and "run `ar run`" in err
    (tmp_path / "runs" / "t").mkdir(parents=True)
    (tmp_path / "runs" / "t" / "results.tsv").write_text("\t".join(COLUMNS) + "\n")
    code, out, err = ar(["report", "--repo", tmp_path], monkeypatch, capsys)
    assert code == 1 and err.startswith("error: no results yet in") and err.count("\n") == 1
    code, out, err = ar(["report", "--repo", tmp_path, "--tag", "nope", "--json"], monkeypatch, capsys)
    assert code == 1 and err == ""
    assert json.loads(out) == {"error": f"no results for tag 'nope': {tmp_path}/runs/nope/results.tsv does not "
                                        "exist; tags with results: t", "exit_code": 1}


@pytest.mark.integration
def test_piped_report_is_one_line_per_row_and_plain(upstream_repo):
    """Through a pipe (the real console script): no escape codes, no wrapping, however long a description."""
    f = upstream_repo / "runs" / "mar5" / "results.tsv"
    lines = f.read_text().splitlines(keepends=True)
    long = "a very long description of what this experiment changed " * 6
    f.write_text(lines[0] + "".join(ln.replace("\tkeep\t", f"\tkeep\t{long} ", 1) for ln in lines[1:]))
    env = {**os.environ, "COLUMNS": "80", "FORCE_COLOR": ""}
    r = subprocess.run([AR, "report", "--repo", str(upstream_repo), "--top", "20"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout + r.stderr
    out = r.stdout.splitlines()
    title = next(i for i, ln in enumerate(out) if ln.startswith("top 6 of 7 experiments"))
    assert out[title + 1].split("\t")[:3] == ["#", "commit", "val_bpb"]
    table = out[title + 2:out.index("", title)]
    assert len(table) == 6 and all(len(ln.split("\t")) == 10 for ln in table)  # one line per row, 10 columns
    assert sum(long.strip() in ln for ln in table) == 4                          # the 4 kept rows, unwrapped
    assert any(ln.startswith("reproduce\tgit checkout a7b8c9d") for ln in out)


def test_a_corrupt_results_line_is_named_and_the_rest_reported(upstream_repo, monkeypatch, capsys):
    f = upstream_repo / "runs" / "mar5" / "results.tsv"
    lines = f.read_text().splitlines(keepends=True)
    lines[3] = "c3d4e5f\tnot-a-number\t44.0\tdiscard\tbroken\n"
    f.write_text("".join(lines))
    code, out, err = ar(["report", "--repo", upstream_repo], monkeypatch, capsys)
    assert code == 0 and "line 4" in out + err and "Traceback" not in err      # as `ar run` and `ar status` do
    assert "c3d4e5f" not in out and lines[1].split("\t")[0] in out


@pytest.mark.e2e
def test_report_names_a_garbage_line_and_goes_on(tmp_path, prepared_cache):
    root = make_repo(tmp_path)
    s = Loop(cfg(noise=0.002), root, "t", None).run()
    with open(s.results, "a") as f:
        f.write("this is not a results row\n")
    r = CliRunner().invoke(app, ["report", "--repo", str(root), "--tag", "t"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "line 3" in r.output and "baseline" in r.output, r.output


def test_default_tag_is_the_newest_and_all_reads_every_tag(upstream_repo, monkeypatch, capsys):
    led = Ledger(upstream_repo / "runs" / "newer")
    for r in sweep_rows()[:2]:
        led.append(r)
    old = time.time() - 100
    os.utime(upstream_repo / "runs" / "mar5" / "results.tsv", (old, old))
    assert rep.find_tags(upstream_repo) == ["newer", "mar5"]
    code, out, _ = ar(["report", "--repo", upstream_repo, "--json"], monkeypatch, capsys)
    data = json.loads(out)
    assert data["tags"] == ["newer"] and len(data["experiments"]) == 2
    code, out, _ = ar(["report", "--repo", upstream_repo, "--json", "--all"], monkeypatch, capsys)
    data = json.loads(out)
    assert data["tags"] == ["mar5", "newer"] and len(data["experiments"]) == 9
    assert data["best"]["commit"] == "a7b8c9d" and data["experiments"][0]["tag"] == "mar5"
    code, out, _ = ar(["report", "--repo", upstream_repo, "--tag", "newer", "--top", "1"], monkeypatch, capsys)
    assert code == 0 and "top 1 of 2 experiments" in out and "per-knob: TOTAL_BATCH_SIZE" in out


def test_the_report_lists_windows_shorter_than_the_budget_and_why():
    from autoresearch.records.ledger import Row, Status
    from autoresearch.views.report import build, sections

    def row(i, reason):
        return Row(commit=f"{i:07x}", val_bpb=2.0 + i / 10, memory_gb=None, status=Status.DISCARD,
                   description=f"exp {i}", exp_id=i, tag="t", reason=reason, time_budget=10.0)
    rows = [row(1, "first result: val_bpb 2.100000 is the baseline"),
            row(2, "val_bpb 2.200000 is worse than the best 2.100000 by 0.100000; its start-up used 10.2 CPU-s "
                   "before its first batch, more than the 3.1 the baseline's 2.4 allows: its training window was "
                   "cut by 7.0s")]
    table = {s.title: s for s in sections(build(rows, ["t"]))}["training windows shorter than the budget"]
    assert [r[0] for r in table.rows] == ["2"] and "window was cut by 7.0s" in table.rows[0][2]


# -------------------------------------------------------------------------- one best, the numbers of status and --all


def quick_start_rows() -> list[Row]:
    """The quick start's ledger: a kept baseline, its calibration re-runs, then a discard that scored lower than
    the best but inside the noise."""
    def row(i, commit, val, status, desc, reason=""):
        return Row(commit=commit, val_bpb=val, memory_gb=None, status=status, description=desc, exp_id=i, tag="dec1",
                   time_budget=20.0, seed=42, num_steps=9, total_tokens_M=0.036864, reason=reason)
    return [row(1, "75a7ff5", 2.727349, Status.KEEP, "baseline"),
            row(2, "75a7ff5", 2.911, Status.VALIDATION, "noise calibration: baseline again"),
            row(3, "75a7ff5", 2.774, Status.VALIDATION, "noise calibration: baseline again"),
            row(4, "f509726", 2.699725, Status.DISCARD, "strategy: LR_MULT 1.0 -> 0.666667",
                "val_bpb 2.699725 is better than the best 2.727349 by 0.027624, within the noise threshold 0.198")]


@pytest.mark.integration
def test_the_best_of_a_run_is_its_best_kept_result_in_report_status_and_journal(tmp_path):
    root = committed_repo(tmp_path / "repo", {"train.py": "X = 1\n"})
    ledger = Ledger(root / "runs" / "dec1")
    for r in quick_start_rows():
        ledger.append(r)
    data = rep.build(ledger.rows(), ["dec1"])
    assert data["best"]["commit"] == "75a7ff5" and data["best"]["val_bpb"] == 2.727349
    assert data["best"]["command"].startswith("git checkout 75a7ff5 ")
    assert data["top"][0]["commit"] == "f509726" and data["top"][0]["status"] == "discard"  # ranked, not the best
    out = run_ar("report", "--repo", root, "--json", cwd=root)
    assert json.loads(out.stdout)["best"]["commit"] == "75a7ff5", out.stdout + out.stderr
    table = run_ar("report", "--repo", root, cwd=root).stdout
    assert "best: 75a7ff5  val_bpb 2.727349" in table and "git checkout 75a7ff5" in table, table
    status = json.loads(run_ar("status", "--repo", root, "--json", cwd=root).stdout)
    assert status["best"]["commit"] == "75a7ff5"
    j = memory.build(ledger.rows(), tag="dec1", source="t", noise=0.198, noise_source="t")
    assert j.best.commit == "75a7ff5"


def test_small_token_counts_survive_results_tsv(tmp_path):
    ledger = Ledger(tmp_path / "t")
    ledger.append(quick_start_rows()[3])                     # 9 steps of 4,096 tokens
    (row,) = ledger.rows()
    assert row.total_tokens_M == pytest.approx(0.036864)
    assert rep._tokens(rep.experiment(row, 1)) == "36.9K"


@pytest.mark.e2e
def test_status_reports_the_calibrated_noise_and_a_sweeps_own_budgets(tmp_path, prepared_cache):
    from autoresearch.session.loop import Loop
    from autoresearch.views.status import read_status
    from test_loop import cfg, make_repo

    root = make_repo(tmp_path, SEED_NOISE=0.01)
    Loop(cfg(), root, "t", None, calibrate_noise=2).run(max_experiments=2)
    calibrated = json.loads((root / "runs" / "t" / "noise.json").read_text())["noise"]
    assert calibrated != 0.002
    st = read_status(root)["status"]
    assert st["noise"] == pytest.approx(calibrated), st
    with Loop(cfg(), root, "s", None, baseline=False, command="ar sweep s.yaml") as lp:
        lp.enqueue_knobs({"LR_MULT": 2.0}, time_budget=0.3, description="sweep s: LR_MULT=2.0")
        lp.run()
    got = read_status(root)
    assert got["tag"] == "s" and got["status"]["budget"] is None and got["budgets"] == [0.3], got


@pytest.mark.integration
@pytest.mark.usefixtures("no_ar_settings")
def test_report_all_shows_exp_ids_and_tags_oldest_first(tmp_path):
    from autoresearch.records.ledger import Ledger, Row

    def rows(tag, n):
        return [Row(commit=f"{tag}{i:06d}", val_bpb=3.0 - i / 10, memory_gb=None, status=Status.KEEP,
                    description=f"{tag} {i}", exp_id=i, tag=tag, time_budget=20.0, training_seconds=20.1,
                    total_seconds=31.0, tokens_per_s=4000.0, num_steps=9) for i in range(1, n + 1)]
    for tag, n, created in (("b", 2, "2026-11-30T10:00:00+00:00"), ("a", 3, "2026-12-01T10:00:00+00:00")):
        d = tmp_path / "runs" / tag
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"tag": tag, "created_at": created}))
        for r in rows(tag, n):
            Ledger(d).append(r)
    os.utime(tmp_path / "runs" / "a" / "results.tsv", (1e9, 1e9))             # a's file older: b resumed later
    data = json.loads(run_ar("report", "--repo", tmp_path, "--all", "--json", cwd=tmp_path).stdout)
    assert data["tags"] == ["b", "a"], data["tags"]
    assert [(e["tag"], e["exp_id"]) for e in data["experiments"]] == [("b", 1), ("b", 2), ("a", 1), ("a", 2),
                                                                       ("a", 3)]
    table = run_ar("report", "--repo", tmp_path, "--all", cwd=tmp_path).stdout.splitlines()
    header = next(ln for ln in table if ln.startswith("#\t"))
    assert header.split("\t")[:3] == ["#", "tag", "commit"], header
    assert any(ln.startswith("3\ta\ta000003") for ln in table), table            # a's experiment 3, not #5
    # the friction list: the training time in the table (CPU runs have no MFU: no peak FLOPs), times in `best`
    assert "trained" in header.split("\t") and any("\t20.1s\t" in ln for ln in table), header
    assert data["best"]["training_seconds"] == 20.1 and data["best"]["total_seconds"] == 31.0, data["best"]
    assert data["best"]["exp_id"] == 3 and data["best"]["num_steps"] == 9


def test_the_progress_plot_shows_the_noise_threshold():
    import matplotlib.pyplot as plt
    from autoresearch.views import plots

    fig = plots.progress_figure(quick_start_rows(), noise=0.198)
    try:
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert "noise threshold (0.198): a win clears it" in labels, labels
    finally:
        plt.close(fig)
