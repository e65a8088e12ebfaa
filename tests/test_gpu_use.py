"""How busy the GPU was between training windows (views/gpu_use.py): the rules as tables, the loader on files
as trial.py writes them, and `ar report` showing it."""

from __future__ import annotations

import json

import pytest

from autoresearch.views import gpu_use
from autoresearch.views.gpu_use import Gap, Window

from test_report import ar, upstream_repo  # noqa: F401  (a fixture, asked for by name)


def W(exp, ready, first, last, gpu="0", session="s1", startup=0.0, prep=0.0):
    return Window(exp, gpu, session, ready, first, last, startup, prep)


@pytest.mark.parametrize("windows, expect", [
    # ready long before the window ended (waiting for its turn): the gap is all hand-over
    ([W(1, 0, 10, 70), W(2, 20, 72, 132)], [Gap(2, 2.0, 0.0)]),
    # ready 5 s after the window ended, first batch 9 s after: 5 s of it waited for the proposal
    ([W(1, 0, 10, 70), W(2, 75, 79, 139)], [Gap(2, 9.0, 5.0)]),
    # ready 0.5 s before the window ended, but its own start-up takes 4 s: all of a 4.5-s gap is its lateness
    ([W(1, 0, 10, 70), W(2, 69.5, 74.5, 134, startup=4.0)], [Gap(2, 4.5, 3.5)]),
    # ready 2.5 s before, but a 1-s workspace and a 2-s start-up: 0.5 s late, in a 3-s gap
    ([W(1, 0, 10, 70), W(2, 67.5, 73, 133, startup=2.0, prep=1.0)], [Gap(2, 3.0, 0.5)]),
    # ready 10 s early with the same start-up, but no head start (memory): the gap is the hand-over, not lateness
    ([W(1, 0, 10, 70), W(2, 60, 74.5, 134, startup=4.0)], [Gap(2, 4.5, 0.0)]),
    # listed out of order: sorted by first batch
    ([W(2, 75, 79, 139), W(1, 0, 10, 70)], [Gap(2, 9.0, 5.0)]),
    # a head start: first batch before the other's last step line (its last step ran on) is no negative gap
    ([W(1, 0, 10, 70), W(2, 40, 69.5, 130)], [Gap(2, 0.0, 0.0)]),
    # two GPUs: each its own sequence, never a gap across them
    ([W(1, 0, 10, 70, "0"), W(2, 0, 11, 71, "1"), W(3, 80, 82, 140, "0")], [Gap(3, 12.0, 10.0)]),
    # the tag resumed by another `ar run` an hour later: no gap across the two sessions
    ([W(1, 0, 10, 70), W(2, 75, 79, 139), W(3, 3600, 3610, 3670, session="s2"), W(4, 3600, 3672, 3732, session="s2")],
     [Gap(2, 9.0, 5.0), Gap(4, 2.0, 0.0)]),
])
def test_the_gaps_between_windows_and_what_they_waited_for(windows, expect):
    got = gpu_use.gaps(windows)
    assert [g for gs in got.values() for g in gs] == expect


@pytest.mark.parametrize("waited, says", [
    ([], False),                              # nothing yet
    ([30.0, 30.0], False),                    # two gaps are too few to advise on
    ([0.0, 0.2, 0.5, 0.0], False),            # ready in time: the gaps are hand-overs
    ([12.0, 0.0, 0.0, 0.0], False),           # once late: not the rule
    ([12.0, 14.0, 0.0, 0.0], True),           # half the gaps waited for a proposal
    ([18.4, 14.2, 9.0], True),
])
def test_more_slots_are_advised_only_where_the_gpu_mostly_waited_for_proposals(waited, says):
    advice = gpu_use.advice([Gap(i, w + 1.0, w) for i, w in enumerate(waited)])
    assert (advice is not None) == says
    if says:
        assert "0,0,0" in advice and f"in {sum(w >= 1 for w in waited)} of {len(waited)} gaps" in advice


def _timing(d, name="timing.json", **t):
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(t))


def _session(tag_dir, late: bool):
    """Five GPU windows of 60 s as trial.py records them; each next one ready 10 s after the last step (late) or
    30 s before it; one CPU run and one that never trained, which count for nothing."""
    t = 1000.0
    for i in range(1, 6):
        ready = t - 30 if i > 1 and not late else (t + 10 if i > 1 else t - 20)
        first = (t + 12 if late else t + 2) if i > 1 else t
        _timing(tag_dir / f"{i:04d}-abc{i}", prepare=ready, spawned=ready + 0.5, process_start=first - 1.5,
                window_start=first,
                last_step=first + 60, device="cuda", gpu="0", session="s1")
        t = first + 60
    _timing(tag_dir / "0006-cpu", prepare=0, window_start=5, last_step=10, device="cpu", gpu="")
    _timing(tag_dir / "0007-crash", prepare=t, window_start=None, last_step=None, device="cuda", gpu="0")
    (tag_dir / "0008-bad").mkdir()
    (tag_dir / "0008-bad" / "timing.json").write_text("{not json")


def test_the_loader_reads_every_gpu_window_a_decisions_further_runs_included(tmp_path):
    _session(tmp_path, late=True)
    _timing(tmp_path / "0005-abc5", name="timing-run2.json", prepare=1400, window_start=1400, last_step=1460,
            device="cuda", gpu="0", session="s1")
    windows = gpu_use.load(tmp_path)
    assert [w.exp for w in windows] == [1, 2, 3, 4, 5, 5]
    (used,) = gpu_use.summarize(windows)
    assert used["windows"] == 6 and used["gaps"][:4] == [12.0] * 4
    assert used["median_late"] == 12.0 and "0,0,0" in used["advice"]   # 10 s late, 0.5 + 1.5 to start


def test_the_busy_share_counts_each_session_from_its_first_batch_to_its_last_step():
    (used,) = gpu_use.summarize([W(1, 0, 0, 60), W(2, 50, 70, 130), W(3, 0, 5000, 5060, session="s2")])
    assert used["windows"] == 3 and used["gaps"] == [10.0]
    assert used["busy"] == pytest.approx(180 / (130 + 60))


@pytest.mark.parametrize("late", [True, False])
def test_ar_report_shows_how_busy_the_gpu_was(upstream_repo, monkeypatch, capsys, late):  # noqa: F811
    _session(upstream_repo / "runs" / "mar5", late)
    code, out, err = ar(["report", "--repo", upstream_repo], monkeypatch, capsys)
    assert code == 0, err
    assert "GPU use between training windows — mar5" in out
    busy = 100 * 300 / (300 + 4 * (12 if late else 2))
    assert f"{busy:.1f}%" in out
    assert ("waited for the next proposal in 4 of 4 gaps" in out) == late
    code, out, _ = ar(["report", "--repo", upstream_repo, "--json"], monkeypatch, capsys)
    (used,) = json.loads(out)["gpu_use"]["mar5"]
    assert used["median_gap"] == (12.0 if late else 2.0) and used["median_late"] == (12.0 if late else 0.0)


def test_a_report_without_gpu_runs_has_no_such_section(upstream_repo, monkeypatch, capsys):  # noqa: F811
    code, out, _ = ar(["report", "--repo", upstream_repo], monkeypatch, capsys)
    assert code == 0 and "GPU use" not in out
