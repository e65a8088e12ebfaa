"""ar's clock as rules: each row a made-up run (what ar saw of it) and what the clock must say. No process runs;
the end-to-end tests (test_loop.py, faults/test_hostile.py) show only that the wiring reaches these rules."""

from __future__ import annotations

import pytest

from autoresearch.experiment import clock
from autoresearch.experiment.clock import Credit, Timeline

NONE = Credit()                                          # before the baseline has run
CPU_BASE = Credit(wall=4.0, cpu=2.0, finish=0.5, finish_cpu=0.5)   # a CPU baseline: 2 CPU-s start-up, 0.5 finish
GPU_BASE = Credit(wall=40.0, cpu=9.0, finish=0.4, finish_cpu=None, gpu=3.0)  # a GPU baseline: 40 s, 3 GPU-s
COLD_BASE = Credit(wall=40.0, cpu=9.0, finish=0.4, gpu=3.0, gpu_cold=True)    # ... every run of it compiled cold


# -- start-up: free up to what the baseline's allows; the rest comes off the window -----------------------------
@pytest.mark.parametrize("credit, device, wall, cpu, gpu, cut", [
    # before the baseline: free (a kill at the start-up allowance is the bound, not a charge)
    (NONE, "cpu", 500.0, 400.0, None, 0.0),
    # CPU: CPU-seconds against 1.3 × the baseline's + 1 s = 3.6 CPU-s; wall time (load) costs nothing
    (CPU_BASE, "cpu", 60.0, 3.6, None, 0.0),
    (CPU_BASE, "cpu", 3.0, 5.6, None, 2.0),          # pre-window compute is paid from the window, second for second
    (CPU_BASE, "cpu", 30.0, 1.0, None, 0.0),         # a slow host: long wall, little CPU
    # CPU without a CPU reading (the run's tree could not be read): the wall rule
    (CPU_BASE, "cpu", 4.0 + 30.0, None, None, 0.0),
    (CPU_BASE, "cpu", 4.0 + 30.0 + 3.0, None, None, 3.0),
    # GPU, GPU time read: GPU-s against 1.3 × the baseline's 3 + 2.5 = 6.4 GPU-s; CPU seconds do not count
    (GPU_BASE, "cuda", 45.0, 500.0, 6.4, 0.0),       # a long compile (CPU work) and its autotuning are free
    (GPU_BASE, "cuda", 45.0, 9.0, 14.4, 8.0),        # steps before the window (GPU work) are paid, second for second
    # ... and the wall clock still allows the baseline's + max(60 s, the baseline's) = 100 s
    (GPU_BASE, "cuda", 100.0, 500.0, 3.0, 0.0),
    (GPU_BASE, "cuda", 105.0, 1.0, 3.0, 5.0),
    (GPU_BASE, "cuda", 105.0, 1.0, 16.4, 10.0),      # both over: the larger charge (not the sum)
    (Credit(wall=10.0, cpu=3.0, gpu=2.0), "cuda", 10.0 + 60.0 + 1.0, None, 0.0, 1.0),   # 60-s room: a cold compile
    # GPU time unread (this run's or the baseline's): the wall rule, tight: baseline's + max(10 s, a quarter)
    (GPU_BASE, "cuda", 50.0, 1.0, None, 0.0),
    (GPU_BASE, "cuda", 53.0, 1.0, None, 3.0),
    (Credit(wall=10.0, cpu=3.0), "cuda", 21.0, None, 7.0, 1.0),   # the baseline's GPU time was not read
    # a baseline that only ever compiled cold: its 3 GPU-s hold the autotuning: 1.3 × 3 + 0.5 = 4.4 GPU-s
    (COLD_BASE, "cuda", 45.0, 9.0, 4.4, 0.0),
    (COLD_BASE, "cuda", 45.0, 9.0, 7.4, 3.0),        # where a warm baseline's 6.4 would have let 2 GPU-s through
])
def test_start_up_cost(credit, device, wall, cpu, gpu, cut):
    cost, why = clock.start_up_cost(credit, device, wall, cpu, gpu)
    assert cost == pytest.approx(cut)
    assert (why is None) == (cut == 0.0)
    if why:
        assert f"cut by {cut:.1f}s" in why
        slack = 0.5 if credit.gpu_cold else 2.5
        by_gpu = gpu is not None and credit.gpu is not None and gpu - (1.3 * credit.gpu + slack) == pytest.approx(cut)
        assert ("GPU-s" in why) == by_gpu, why      # the reason names the rule that charged


# -- the GPU credit is cold until one run of the baseline started warm (its kernels in the compile store) --------
@pytest.mark.parametrize("runs, gpu, cold", [
    ([(3.0, True)], 3.0, True),                      # the first session on a machine: one cold run
    ([(3.0, True), (0.4, False)], 0.4, False),       # a calibration rerun found the store warm
    ([(0.4, False), (3.0, True)], 0.4, False),       # warm for good
    ([(3.0, True), (2.8, True)], 2.8, True),         # compile_cache: false: every run cold
    ([(None, True), (3.0, True)], 3.0, True),        # a run whose GPU time was not read changes nothing
    ([(None, False)], None, False),                  # never read: no GPU credit (the wall rule)
])
def test_the_gpu_credit_and_whether_it_was_cold(tmp_path, runs, gpu, cold):
    for g, c in runs:
        credit = clock.note_baseline(tmp_path, 40.0, 9.0, gpu=g, cold=c)
    assert (credit.gpu, credit.gpu is not None and credit.gpu_cold) == (gpu, cold)
    again = clock.load(tmp_path)                     # a resumed session reads the same
    assert (again.gpu, again.gpu_cold) == (gpu, cold)


# -- the finish allowance: 1.5 × the baseline's step and save + 1 s, in the start-up's currency ------------------
@pytest.mark.parametrize("credit, device, expect", [
    (NONE, "cpu", None),                                   # before the baseline: the run's own last-step slack
    (CPU_BASE, "cpu", (1.5 * 0.5 + 1.0, "cpu")),
    (CPU_BASE, "wall", (1.5 * 0.5 + 1.0, "wall")),         # no CPU samples of the run: the wall finish
    (GPU_BASE, "cuda", (1.5 * 0.4 + 1.0, "wall")),
    (Credit(wall=3.0, cpu=1.0, finish=None, finish_cpu=2.0), "cuda", None),   # a GPU has no CPU finish rule
])
def test_finish_allowance(credit, device, expect):
    got = clock.finish_allowance(credit, device)
    assert got == (pytest.approx(expect[0]), expect[1]) if expect else got is None


# -- the short window: under half the budget is never kept on its val_bpb ---------------------------------------
@pytest.mark.parametrize("window, budget, kept", [
    (10.0, 10.0, True), (5.0, 10.0, True), (4.99, 10.0, False), (None, 10.0, False), (0.0, 0.0, True),
])
def test_short_window(window, budget, kept):
    note = clock.short_window_note(window, budget)
    assert (note is None) == kept
    if window is None:
        assert "never asked" in note


# -- the verdict on a whole run ---------------------------------------------------------------------------------
def run(*, opened=1.0, budget=10.0, steps=None, written=None, cpu_rate=1.0, tail_rate=None, wall=None,
        stopped=False, deadline=None, samples=True) -> Timeline:
    """A run whose window opens at `opened`, steps every second inside it, writes its checkpoint at `written`
    (default: 0.2 s after the window), using `cpu_rate` CPU-s a second in its window and `tail_rate` after."""
    end = deadline if deadline is not None else (opened + budget if opened is not None else None)
    steps = steps if steps is not None else ([opened + i for i in range(1, int(budget) + 1)] if opened else [])
    written = written if written is not None else (end + 0.2 if end is not None else 5.0)
    tail_rate = cpu_rate if tail_rate is None else tail_rate
    series = []
    if samples and opened is not None:
        t, cpu = opened, 0.0
        while t <= max(written, end) + 0.05:
            series.append((t, cpu))
            cpu += 0.05 * (cpu_rate if t < end else tail_rate)
            t += 0.05
    return Timeline(budget=budget, slack_cap=5.0 + 0.1 * budget, startup_allowance=30.0,
                    wall=wall if wall is not None else written + 0.5, opened=opened, deadline=end,
                    steps=tuple(steps), written=written, samples=tuple(series), stopped=stopped)


CASES = [
    # (name, timeline, credit, device, timed out?, phrase in the reason)
    ("an honest run, before the baseline", run(), NONE, "cpu", False, None),
    ("an honest run against a CPU baseline", run(), CPU_BASE, "cpu", False, None),
    ("the wall bound: a checkpoint 2 s + a 1-s step past the window, before the baseline",
     run(written=11.0 + 3.1), NONE, "cpu", True, "after its training window closed"),
    ("the wall bound holds a run that sleeps (no CPU) past its window, whatever the baseline",
     run(written=11.0 + 3.5, tail_rate=0.0), CPU_BASE, "cpu", True, "after its training window closed"),
    ("a stockpile: trains 1.5 CPU-s past the window (1.75 allowed on the CPU)",
     run(written=11.0 + 1.9, tail_rate=1.0), CPU_BASE, "cpu", True, "trained past the budget"),
    ("a save that takes 1.5 s of the CPU after the window: allowed",
     run(written=11.0 + 1.5, tail_rate=1.0), CPU_BASE, "cpu", False, None),
    ("a save on a loaded host: 2.5 s of wall, 0.5 CPU-s",
     run(written=11.0 + 2.5, tail_rate=0.2), CPU_BASE, "cpu", False, None),
    ("on a GPU the finish is wall seconds: 1.6 s allowed",
     run(written=11.0 + 1.7, tail_rate=0.0), GPU_BASE, "cuda", True, "trained past the budget"),
    ("on a GPU, 1.5 s after the window is inside the allowance",
     run(written=11.0 + 1.5, tail_rate=0.0), GPU_BASE, "cuda", False, None),
    ("no CPU samples: the wall finish applies on the CPU too",
     run(written=11.0 + 1.9, samples=False), CPU_BASE, "cpu", True, "trained past the budget"),
    ("a run ar stopped keeps its own reason (no verdict)",
     run(written=11.0 + 4.0, tail_rate=1.0, stopped=True), CPU_BASE, "cpu", False, None),
    ("no window and a checkpoint past allowance + budget + slack",
     run(opened=None, written=30.0 + 10.0 + 2.0 + 0.5), NONE, "cpu", True, "past the start-up allowance"),
    ("no window, a checkpoint inside it", run(opened=None, written=41.0), NONE, "cpu", False, None),
    ("a last step of 5 typical steps buys the slack of 3 (2 s + 3 s), before the baseline",
     run(steps=[2.0 + i for i in range(9)] + [15.0], written=11.0 + 5.5, tail_rate=0.0), NONE, "cpu", True,
     "after its training window closed"),
    ("a run with long steps is told to raise the budget (the hint)",
     run(steps=[4.0, 8.0, 12.0, 16.0], written=11.0 + 6.5), NONE, "cpu", True, "raise the time budget"),
]


@pytest.mark.parametrize("name, timeline, credit, device, over, phrase", CASES, ids=[c[0] for c in CASES])
def test_verdict(name, timeline, credit, device, over, phrase):
    v = clock.verdict(timeline, credit, device)
    assert (v.over is not None) == over, v.over
    if phrase:
        assert phrase in v.over


def test_trained_is_the_window_up_to_the_checkpoint():
    assert clock.verdict(run(written=6.0), NONE, "cpu").trained == pytest.approx(5.0)       # stopped early
    assert clock.verdict(run(written=11.3), NONE, "cpu").trained == pytest.approx(10.0)     # at most the window
    assert clock.verdict(run(deadline=7.0, written=7.1), NONE, "cpu").trained == pytest.approx(6.0)  # a cut window
    t = run()
    assert clock.verdict(Timeline(**{**t.__dict__, "written": None}), NONE, "cpu").trained == 0.0


def test_step_lines_move_nothing():
    """The finish is measured by ar: a run that prints its step lines 2.5 s apart (so its steps look long) gets no
    more room after its window than one that prints every second."""
    honest = run(written=11.0 + 1.9, tail_rate=1.0)
    spaced = Timeline(**{**honest.__dict__, "steps": (3.5, 6.0, 8.5, 11.0)})
    for t in (honest, spaced):
        v = clock.verdict(t, CPU_BASE, "cpu")
        assert v.over and "trained past the budget" in v.over


def test_the_baselines_finish_is_one_step_and_its_tail():
    """What a baseline run records as its finish: its median step + its time past the window (wall), its CPU per
    step in the window + its CPU past the window."""
    v = clock.verdict(run(written=11.4, cpu_rate=1.0, tail_rate=0.5), NONE, "cpu")
    assert v.interval == pytest.approx(1.0)
    assert v.finish[0] == pytest.approx(1.0 + 0.4)
    assert v.finish[1] == pytest.approx(1.0 + 0.2, abs=0.06)      # one sample's resolution
    assert v.tail_cpu == pytest.approx(0.2, abs=0.06)


def test_steps_before_the_window_are_not_its_steps():
    """Step lines printed before the first batch (warm-up on made-up data) say nothing of a step in the window."""
    t = run(steps=[-50.0 + 5 * i for i in range(10)] + [1.0 + i for i in range(1, 11)])
    assert clock.verdict(t, NONE, "cpu").interval == pytest.approx(1.0)


@pytest.mark.parametrize("samples, a, b, expect", [
    ([(0.0, 0.0), (1.0, 1.0), (2.0, 1.5)], 0.0, 2.0, 1.5),
    ([(0.0, 0.0), (1.0, 1.0), (2.0, 1.5)], 0.5, 1.5, 0.5),     # each end read at the first sample at or after it
    ([(0.0, 0.0), (1.0, 1.0)], 0.5, 9.0, 0.0),                  # past the last sample: the last
    ([], 0.0, 1.0, 0.0),
    ([(0.0, 0.0), (1.0, 1.0)], 1.0, 0.5, 0.0),                  # an empty interval
])
def test_cpu_between(samples, a, b, expect):
    assert clock.cpu_between(samples, a, b) == pytest.approx(expect)
