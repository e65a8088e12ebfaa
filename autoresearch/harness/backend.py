"""Which attention backend, compile mode and device batch train.py uses when a knob says "auto".

`ar doctor --probe` measures the real model on this GPU and writes its choice to
`<cache>/probe/<device-slug>-torch<version>.json`; `resolve` reads that file when it exists, else falls back
to safe defaults for the device. A knob set to anything but "auto" is used as written.

Probe file (schema 1):
    {"schema": 1, "device": "NVIDIA H200", "torch": "2.6.0+cu126", "written_at": "2025-01-01T00:00:00Z",
     "choice": {"attention": "cudnn", "compile_model": true, "compile_optimizer": true, "device_batch": 128},
     "measured": {"tokens_per_s": 1.9e6, "mfu": 55.1, "peak_vram_mb": 61000.0},
     "rows": [{...one per candidate the probe ran or skipped...}]}
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from .env import default_cache

AUTO = "auto"
KNOBS = ("attention", "compile_model", "compile_optimizer", "device_batch")
SCHEMA = 1
MB_PER_ROW_2048 = 350.0  # rule of thumb: the default model's peak memory per sequence of 2048 tokens
RESERVED_MB = 2048.0  # CUDA context, weights, optimizer state
MAX_AUTO_BATCH = 256


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "unknown"


def torch_version() -> str:
    import torch
    return torch.__version__


def probe_path(device_name: str, cache: Path | None = None, version: str | None = None) -> Path:
    version = version or torch_version()
    return Path(cache or default_cache()) / "probe" / f"{slug(device_name)}-torch{slug(version)}.json"


def default_device_batch(vram_mb: float | None, seq_len: int = 2048) -> int:
    """The largest power of two whose rule-of-thumb memory fits in 85 % of the GPU's memory."""
    if not vram_mb:
        return 8
    per_row = MB_PER_ROW_2048 * seq_len / 2048
    fits = (0.85 * vram_mb - RESERVED_MB) / per_row
    batch = 1
    while batch * 2 <= min(fits, MAX_AUTO_BATCH):
        batch *= 2
    return batch


def defaults(capability: tuple[int, int] | None, vram_mb: float | None, *, cudnn: bool = True,
             seq_len: int = 2048) -> dict:
    """Safe choices without a probe. capability None means no GPU (the CPU profile)."""
    if capability is None:
        return {"attention": "math", "compile_model": False, "compile_optimizer": False, "device_batch": 8}
    major = capability[0]
    if major >= 9 and cudnn:
        attention = "cudnn"
    elif major >= 8:
        attention = "flash"
    else:
        attention = "efficient"
    return {
        "attention": attention,
        "compile_model": major != 12,  # full-model compile is reported broken on consumer Blackwell (sm_120)
        "compile_optimizer": True,
        "device_batch": default_device_batch(vram_mb, seq_len),
    }


def read_choice(path: Path) -> dict | None:
    """The probe's choice from `path`, or None when there is no usable file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    choice = data.get("choice") if isinstance(data, dict) else None
    if not isinstance(choice, dict) or data.get("schema") != SCHEMA:
        return None
    return {k: choice[k] for k in KNOBS if k in choice}


def write_choice(choice: dict, *, device_name: str, cache: Path | None = None, version: str | None = None,
                 measured: dict | None = None, rows: list[dict] | None = None) -> Path:
    """Write the probe's choice atomically; returns the file's path."""
    missing = [k for k in KNOBS if k not in choice]
    assert not missing, f"choice lacks {missing}"
    version = version or torch_version()
    path = probe_path(device_name, cache, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, "device": device_name, "torch": version,
           "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "choice": {k: choice[k] for k in KNOBS}, "measured": measured or {}, "rows": rows or []}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def _device_facts() -> tuple[tuple[int, int] | None, float | None, bool]:
    import torch
    if not torch.cuda.is_available():
        return None, None, False
    props = torch.cuda.get_device_properties(0)
    return (props.major, props.minor), props.total_memory / 2**20, torch.backends.cudnn.is_available()


def resolve(attention, compile_model, device_batch, *, device_name: str, cache: Path | None = None,
            compile_optimizer=AUTO, seq_len: int = 2048, capability: tuple[int, int] | None | str = AUTO,
            vram_mb: float | None = None, cudnn: bool | None = None, version: str | None = None) -> dict:
    """Replace each "auto" knob from the probe file, else from `defaults`.

    Returns the four values plus `source` (knob / probe / default for each) and `probe_file` (the file read,
    or None). Device facts not passed in are read from torch.
    """
    if capability == AUTO:
        capability, queried_vram, queried_cudnn = _device_facts()
        vram_mb = queried_vram if vram_mb is None else vram_mb
        cudnn = queried_cudnn if cudnn is None else cudnn
    given = {"attention": attention, "compile_model": compile_model,
             "compile_optimizer": compile_optimizer, "device_batch": device_batch}
    path = probe_path(device_name, cache, version) if capability is not None else None
    probed = read_choice(path) if path is not None else None
    fallback = defaults(capability, vram_mb, cudnn=True if cudnn is None else cudnn, seq_len=seq_len)
    out: dict = {"source": {}, "probe_file": str(path) if probed else None}
    for knob, value in given.items():
        if value != AUTO:
            out[knob], out["source"][knob] = value, "knob"
        elif probed and knob in probed:
            out[knob], out["source"][knob] = probed[knob], "probe"
        else:
            out[knob], out["source"][knob] = fallback[knob], "default"
    return out
