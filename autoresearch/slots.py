"""What `--gpus` means: the slots experiments run in, and the GPUs this machine has.

    "0,1"   GPUs 0 and 1 (CUDA_VISIBLE_DEVICES pinned per slot, a machine-wide lock per GPU)
    "0,0"   two slots on GPU 0 that take turns training (executors/local.py: GpuTurn); "0,0,0" three, for
            short budgets, where an agent and an evaluation take longer than the other slot's window
    "all"   every GPU nvidia-smi lists
    "cpu:N" N slots without a GPU (CUDA_VISIBLE_DEVICES empty): tests, CPU-only machines, the cpu profile
    "ray:N" (Ray only) N experiments in flight on the cluster
Here, not in executors/, because the config checks a `gpus` value when it loads, and views read the config.
"""


from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from autoresearch.errors import ConfigError, GpuError


@dataclass(frozen=True)
class Slot:
    index: int
    gpu: int | None          # the GPU index on this machine; None for a CPU or Ray slot
    kind: str = "gpu"        # gpu | cpu | ray | inline (the repo itself, the GPUs the process sees)

    @property
    def label(self) -> str:
        return f"GPU {self.gpu}" if self.gpu is not None else f"{self.kind} slot {self.index}"

    @property
    def env(self) -> dict[str, str]:
        """What train.py's environment gets: the slot's GPU, and nothing else visible."""
        if self.kind in ("ray", "inline"):
            return {}
        return {"CUDA_VISIBLE_DEVICES": "" if self.gpu is None else str(self.gpu)}


def turns_on_one_gpu(environ: dict | None = None) -> str | None:
    """`--gpus` for two slots that take turns on this machine's one GPU ("0,0"), or None when there is not
    exactly one: the default for an agent on one GPU, so that it thinks while the GPU trains."""
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = [x.strip() for x in env["CUDA_VISIBLE_DEVICES"].split(",") if x.strip()]
        return f"{ids[0]},{ids[0]}" if len(ids) == 1 and ids[0].isdigit() else None
    found = visible_gpus()
    return f"{found[0]},{found[0]}" if len(found) == 1 else None


def visible_gpus() -> list[int]:
    """GPU indices nvidia-smi lists (empty without a driver)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(x) for x in out.split() if x.strip().isdigit()]


def parse_gpus(spec: str, *, probe: bool = True, where: str = "--gpus") -> list[Slot]:
    """Slots for a `--gpus` value; `probe=False` checks the syntax only (config load time)."""
    spec = str(spec).strip().lower()
    m = re.fullmatch(r"(cpu|ray):(\d+)", spec)
    if m:
        n = int(m.group(2))
        if not 1 <= n <= 64:
            raise ConfigError(f"{where}: {spec!r} needs 1 to 64 slots")
        return [Slot(i, None, m.group(1)) for i in range(n)]
    if spec == "all":
        if not probe:
            return []
        found = visible_gpus()
        if not found:
            raise GpuError(f"{where} all: nvidia-smi lists no GPU here; use --gpus cpu:N for CPU slots")
        return [Slot(i, g) for i, g in enumerate(found)]
    if not re.fullmatch(r"\d+(,\d+)*", spec):
        raise ConfigError(f"{where} must be GPU indices (0,1,…), all, cpu:N or ray:N, not {spec!r}")
    ids = [int(x) for x in spec.split(",")]
    if any(ids.count(g) > 3 for g in ids):
        raise ConfigError(f"{where}: a GPU may be listed three times at most (slots that take turns on it)")
    if probe:
        found = visible_gpus()
        missing = [g for g in ids if g not in found]
        if missing:
            raise GpuError(f"{where}: GPU {missing[0]} is not on this machine (nvidia-smi lists "
                           f"{', '.join(map(str, found)) or 'none'}); use --gpus cpu:N for CPU slots")
    return [Slot(i, g) for i, g in enumerate(ids)]
