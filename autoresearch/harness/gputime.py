"""GPU seconds of a run's processes, read from the driver's per-process utilization samples (NVML).

On the CPU, ar charges a run's start-up in the CPU seconds of its processes (experiment/clock.py). GPU kernels
leave no CPU time, so on a GPU the same charge needs the GPU's own account: every sample period (0.2 s on an
H200 with driver 580) the driver records how busy the SMs were and for which process; a sample reads
(pid, time, SM %). The GPU seconds of a set of processes are the sum of SM % × period over their samples.
Measured against CUDA events on an H200 (docs/benchmarks.md): a lone burner's 4.9 busy seconds read 4.6–4.7;
two burners time-sharing the GPU are told apart period by period (each period goes to one of them), so each
reads within about a second of its own over 8 s.

This needs no setting changed on the card (accounting mode stays as it is) and works as an ordinary user. Where
it cannot be read (no NVML library, no driver, a refusal), `open_meter` says why in one line and the clock falls
back to a wall-clock rule (clock.py).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Callable, Iterable

from .sandbox import process_alive

DEFAULT_PERIOD = 0.2     # seconds: the driver's sample period until two samples show it
POLL = 0.05              # seconds between reads: well inside one period, so no sample is missed


def busy_seconds(samples: Iterable[tuple[int, int, int]], pids: set[int], period: float) -> float:
    """GPU seconds of `pids` from (pid, time µs, SM %) samples: one sample stands for one period. A sample the
    driver repeats (same pid, same time) counts once."""
    seen, total = set(), 0.0
    for pid, ts, sm in samples:
        if pid in pids and (pid, ts) not in seen:
            seen.add((pid, ts))
            total += min(max(sm, 0), 100) / 100 * period
    return total


def charged_seconds(samples: list[tuple[int, int, int]], pids: set[int], gone: dict[int, int],
                    period: float) -> float:
    """GPU seconds of `pids` on one GPU: each process's samples (busy_seconds), but a process found exited at
    `gone[pid]` (µs) is charged at least the time from its first sample to then, plus a period. The driver does
    not report all of the last samples of a process that has exited, so a helper that works on the GPU and exits
    just before the first batch would otherwise be read short (5.02 GPU-s read as 4.09 on an H100); an honest
    start-up's GPU work is the training process's own, which is still there."""
    total = 0.0
    for pid in pids:
        busy = busy_seconds(samples, {pid}, period)
        first = min((ts for p, ts, _ in samples if p == pid), default=None)
        if pid in gone and first is not None:
            busy = max(busy, max(0, gone[pid] - first) / 1e6 + period)
        total += busy
    return total


def sample_period(times: Iterable[int], default: float = DEFAULT_PERIOD) -> float:
    """The driver's sample period in seconds: the median gap between successive sample times (µs) under 1 s
    (longer gaps are idle stretches with no sample), or `default` before there are any."""
    ts = sorted(set(times))
    gaps = [(b - a) / 1e6 for a, b in zip(ts, ts[1:]) if 0 < b - a < 1_000_000]
    return statistics.median(gaps) if gaps else default


class GpuMeter:
    """Reads every GPU's per-process samples in a background thread from `start()`; `seconds()` is what the
    processes `pids_of()` names (asked at every read: a run's process tree changes) have used since then."""

    def __init__(self, nvml, handles: list, floor_exits: bool = True):
        self.nv, self.handles = nvml, handles
        self.samples: list[list[tuple[int, int, int]]] = [[] for _ in handles]   # per GPU, every process's: the
        # period is read per GPU (another GPU's samples, another slot's, would halve the gaps between them)
        self.pids: set[int] = set()                        # every process of the run seen at a read
        self.gone: dict[int, int] = {}                     # pid -> when (µs) a read first found it gone
        self.now: Callable[[], float] = time.time          # the clock (a test's own)
        self.alive: Callable[[int], bool] = process_alive  # whether a process still exists (a test's own)
        self.floor_exits = floor_exits   # charge an exited process from its first sample to its exit
        # (charged_seconds); off where the seconds are given back rather than charged (what the driver reported)
        self._last = [0] * len(handles)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pids_of: Callable[[], set[int]] = set

    def start(self, pids_of: Callable[[], set[int]]) -> None:
        """Count from now: samples before this instant are skipped."""
        self._pids_of = pids_of
        self._last = [int(self.now() * 1e6)] * len(self.handles)
        self._thread = threading.Thread(target=self._loop, name="ar-gpu-time", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(POLL):
            self.read()

    def read(self) -> None:
        """One read of every GPU's samples since the last."""
        pids, new = self._pids_of(), [[] for _ in self.handles]
        for i, h in enumerate(self.handles):
            try:
                got = self.nv.nvmlDeviceGetProcessUtilization(h, self._last[i])
            except self.nv.NVMLError:        # "Not Found": no process was busy since the last read
                continue
            for s in got:
                self._last[i] = max(self._last[i], s.timeStamp)
                new[i].append((s.pid, s.timeStamp, s.smUtil))
        now = int(self.now() * 1e6)
        with self._lock:
            for pid in self.pids - pids - set(self.gone):    # not listed: exited, or a read that missed it
                if not self.alive(pid):
                    self.gone[pid] = now
            self.pids |= pids
            for mine, more in zip(self.samples, new):
                mine += more

    def seconds(self) -> float:
        """GPU seconds of the run's processes so far, on every GPU (read first, so the last period counts); one
        that has left the run is charged at least from its first sample to its leaving (charged_seconds), unless
        `floor_exits` is off."""
        self.read()
        with self._lock:
            gone = self.gone if self.floor_exits else {}
            return sum(charged_seconds(got, self.pids, gone, sample_period(t for _, t, _ in got))
                       for got in self.samples)

    def memory(self, pids: set[int]) -> tuple[int, int, int] | None:
        """(free, total, held by `pids`) bytes on the GPU where `pids` hold memory; None where none of them does
        or the driver does not say (then nothing may be started beside them: experiment/headstart.py)."""
        for h in self.handles:
            try:
                held = sum(p.usedGpuMemory or 0 for p in self.nv.nvmlDeviceGetComputeRunningProcesses(h)
                           if p.pid in pids)
                if held:
                    info = self.nv.nvmlDeviceGetMemoryInfo(h)
                    return int(info.free), int(info.total), int(held)
            except (self.nv.NVMLError, AttributeError):     # refused, or bindings without these calls
                continue
        return None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)


def open_meter(nvml=None) -> tuple[GpuMeter | None, str | None]:
    """(a meter over every GPU, None) or (None, why GPU time cannot be read here), changing no setting. `nvml`:
    the bindings (default: pynvml, from nvidia-ml-py)."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return None, "the NVML bindings are not installed (pip install nvidia-ml-py)"
    handles: list = []
    try:
        nvml.nvmlInit()             # reference-counted by the library: one per meter is fine
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        if not handles:
            return None, "NVML sees no GPU"
        nvml.nvmlDeviceGetProcessUtilization(handles[0], int(time.time() * 1e6))
    except nvml.NVMLError as e:
        if getattr(e, "value", None) != nvml.NVML_ERROR_NOT_FOUND or not handles:   # nothing busy yet: fine
            return None, f"per-process GPU utilization cannot be read here (NVML: {e})"
    except Exception as e:                      # noqa: BLE001 - no driver library at all (a CPU machine)
        return None, f"NVML cannot start ({type(e).__name__}: {e})"
    return GpuMeter(nvml, handles), None
