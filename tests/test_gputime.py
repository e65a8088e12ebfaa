"""GPU seconds from the driver's per-process samples (harness/gputime.py), on samples an H200 gave while burners of
known busy time ran (tests/data/nvml_samples_h200.json, from bench/diag_gpu_time.py), and a scripted stand-in
for the NVML library where the question is what the meter does with what the driver says."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from autoresearch.harness import gputime

from fixtures.nvml import NvmlStandIn

pytestmark = pytest.mark.fast
DATA = json.loads((Path(__file__).parent / "data" / "nvml_samples_h200.json").read_text())


def test_the_driver_period_is_read_from_the_samples():
    for case in ("one_burner", "two_burners"):
        assert gputime.sample_period(t for _, t, _ in DATA[case]["samples"]) == pytest.approx(0.2, abs=0.002)
    assert gputime.sample_period([]) == gputime.DEFAULT_PERIOD
    assert gputime.sample_period([0, 5_000_000]) == gputime.DEFAULT_PERIOD      # an idle gap is not a period


@pytest.mark.parametrize("case, each_within", [("one_burner", 0.4), ("two_burners", 0.9)])
def test_what_the_samples_integrate_to_against_what_the_burners_measured(case, each_within):
    samples = [tuple(s) for s in DATA[case]["samples"]]
    period = gputime.sample_period(t for _, t, _ in samples)
    busy = {int(pid): v for pid, v in DATA[case]["busy"].items()}
    got = {pid: gputime.busy_seconds(samples, {pid}, period) for pid in busy}
    for pid in busy:          # alone: 6 % under; side by side each period goes to one of them: within a second
        assert got[pid] == pytest.approx(busy[pid], abs=each_within), (got, busy)
    assert sum(got.values()) == pytest.approx(sum(busy.values()), rel=0.1)
    assert gputime.busy_seconds(samples, set(), period) == 0.0


@pytest.mark.parametrize("samples, pids, expect", [
    ([(1, 10, 100), (1, 20, 50)], {1}, 0.3),                  # SM % × period, summed
    ([(1, 10, 100), (1, 10, 100)], {1}, 0.2),                 # a sample the driver repeats counts once
    ([(1, 10, 100), (2, 20, 100)], {1}, 0.2),                 # another process's samples are not the run's
    ([(1, 10, 250), (1, 20, -5)], {1}, 0.2),                  # clamped to 0-100 %
])
def test_busy_seconds_rules(samples, pids, expect):
    assert gputime.busy_seconds(samples, pids, 0.2) == pytest.approx(expect)


def test_the_meter_counts_the_runs_processes_as_they_come_and_skips_what_came_before():
    nv = NvmlStandIn()
    meter, why = gputime.open_meter(nv)
    assert why is None
    pids = {10}
    meter.start(lambda: set(pids))
    t0 = meter._last[0]
    nv.samples = [(10, t0 - 1, 100)]                                   # before the clock: not counted
    meter.read()                                                       # "Not Found" is no error
    nv.samples += [(10, t0 + 200_000, 100), (99, t0 + 400_000, 100)]   # 99: another process (the evaluator)
    meter.read()
    pids.add(11)                                                       # a child of the run, started later
    nv.samples += [(11, t0 + 600_000, 50), (10, t0 + 800_000, 100)]
    assert meter.seconds() == pytest.approx(0.2 + 0.1 + 0.2)
    meter.stop()


def test_another_gpus_samples_do_not_shorten_the_period():
    """Two GPUs sampled 0.2 s apart each, offset by 0.1 s: merged, the gaps would read 0.1 s and halve the run's
    GPU seconds (another slot training on the other GPU)."""
    nv = NvmlStandIn(gpus=2)
    meter, _ = gputime.open_meter(nv)
    meter.start(lambda: {10})
    t0 = meter._last[0]
    nv.samples = [(10, t0 + k * 200_000, 100) for k in range(1, 11)]           # the run: 2 s at 100 % on GPU 0
    nv.other = [(20, t0 + 100_000 + k * 200_000, 100) for k in range(1, 11)]   # another slot on GPU 1
    assert meter.seconds() == pytest.approx(2.0)
    meter.stop()


@pytest.mark.parametrize("nv, says", [
    (NvmlStandIn(refuse=NvmlStandIn.NVML_ERROR_NO_PERMISSION), "cannot be read here (NVML: Insufficient Permissions)"),
    (types.SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(OSError("libnvidia-ml.so.1: no such file")),
                           NVMLError=NvmlStandIn.NVMLError), "NVML cannot start (OSError"),
])
def test_a_meter_that_cannot_read_says_why_in_one_line(nv, says):
    meter, why = gputime.open_meter(nv)
    assert meter is None and says in why and "\n" not in why


@pytest.mark.parametrize("samples, gone, expect", [
    ([(1, 1_000_000, 100), (1, 1_200_000, 100)], {}, 0.4),                 # alive: its samples
    ([(1, 1_000_000, 100), (1, 1_200_000, 100)], {1: 3_000_000}, 2.2),      # exited: first sample to exit, + a period
    ([(1, 1_000_000, 100)] * 1 + [(1, 1_000_000 + k * 200_000, 100) for k in range(1, 20)], {1: 1_100_000}, 4.0),
    ([(2, 1_000_000, 100)], {1: 3_000_000}, 0.0),                          # exited with no sample: nothing
])
def test_a_process_that_exited_is_charged_from_its_first_sample_to_its_exit(samples, gone, expect):
    assert gputime.charged_seconds(samples, {1}, gone, 0.2) == pytest.approx(expect)


def test_a_helper_that_exits_before_the_first_batch_is_charged_what_the_driver_did_not_report():
    """The driver reported 1 s of a helper's 3 s on the GPU, then nothing (it exited): the meter charges it from
    its first sample to the read that found it gone. The training process, listed at every read, keeps its
    samples' count; a process a read did not list but which still exists is not charged as gone."""
    nv = NvmlStandIn()
    meter, _ = gputime.open_meter(nv)
    clock = [100.0]
    meter.now = lambda: clock[0]
    alive = {10, 11, 12}
    meter.alive = lambda pid: pid in alive
    listed = {10, 11, 12}
    meter.start(lambda: set(listed))
    t0 = meter._last[0]
    nv.samples = [(11, t0 + k * 200_000, 100) for k in range(1, 6)] + [(10, t0 + 200_000, 50)] + \
                 [(12, t0 + 200_000, 100)]
    clock[0] += 1.0
    meter.read()
    clock[0] += 2.0                        # 11 worked on, unreported, then exited; 12 went unlisted, alive
    alive.discard(11)
    listed -= {11, 12}
    assert meter.seconds() == pytest.approx((3.0 - 0.2 + 0.2) + 0.1 + 0.2)
    meter.stop()


@pytest.mark.parametrize("procs, refuse, pids, expect", [
    ({1: {7: 20, 8: 9, 99: 5}}, None, {7, 8}, (40, 100, 29)),   # the GPU the processes are on, their bytes summed
    ({0: {99: 5}, 1: {7: 20}}, None, {7}, (40, 100, 20)),       # another process on GPU 0 is not theirs
    ({0: {7: None}}, None, {7}, None),                           # the driver does not say how much: no reading
    ({1: {99: 5}}, None, {7}, None),                             # none of them holds GPU memory (another pid space)
    ({1: {7: 20}}, 4, {7}, None),                                # refused
])
def test_the_memory_beside_a_run_is_read_where_its_processes_are(procs, refuse, pids, expect):
    """What the head start weighs (experiment/headstart.py): free and total bytes of the GPU the running run is on,
    and what its processes hold there; None where that cannot be said (then there is no head start)."""
    nv = NvmlStandIn(gpus=2)
    nv.procs, nv.memory = procs, {0: (70, 100), 1: (40, 100)}
    meter, _ = gputime.open_meter(nv)
    nv.refuse = refuse
    assert meter.memory(pids) == expect
