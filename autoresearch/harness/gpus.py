"""GPU peak-FLOPs table and the MFU formula.

MFU divides achieved model FLOP/s by the GPU's dense BF16 peak from configs/gpus.yaml (never a hard-coded
H100 figure). An unknown GPU, or a row whose peak is not published, gives MFU None ("unknown"), never a
silently wrong number.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

TABLE_PATH = Path(__file__).resolve().parents[2] / "configs" / "gpus.yaml"
PACKAGED_TABLE = Path(__file__).resolve().parents[1] / "resources" / "gpus.yaml"


@dataclass(frozen=True)
class GpuRow:
    name: str
    match: tuple[str, ...]
    exclude: tuple[str, ...]
    tflops: float | None


@dataclass(frozen=True)
class Peak:
    """The answer for one device name: the row it matched (or None) and the peak in TFLOP/s (or None)."""

    device: str
    row: str | None
    tflops: float | None
    source: str  # "table", "override", "unknown", "unpublished"

    @property
    def warning(self) -> str | None:
        if self.tflops is not None:
            return None
        if self.source == "unpublished":
            return (f"GPU {self.device!r} matches table row {self.row!r}, which has no published dense BF16 peak: "
                    "MFU is unknown; set AR_PEAK_TFLOPS to your card's figure")
        return (f"GPU {self.device!r} is not in the peak-FLOPs table: MFU is unknown; add a row to "
                "configs/gpus.yaml (or a file named by AR_GPU_TABLE) or set AR_PEAK_TFLOPS")


def _words(name: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", name.lower()))


def _parse_rows(raw, source: str) -> list[GpuRow]:
    if not isinstance(raw, list):
        raise ValueError(f"{source}: the GPU table must be a YAML list of rows")
    rows = []
    for i, r in enumerate(raw, 1):
        if not isinstance(r, dict) or "name" not in r or "match" not in r or "tflops" not in r:
            raise ValueError(f"{source}: row {i} needs name, match and tflops")
        t = r["tflops"]
        rows.append(GpuRow(str(r["name"]), tuple(str(w).lower() for w in r["match"]),
                           tuple(str(w).lower() for w in r.get("exclude", []) or []),
                           None if t is None else float(t)))
    return rows


def load_table(extra: str | os.PathLike | None = None) -> list[GpuRow]:
    """The shipped table, plus rows from `extra` (or AR_GPU_TABLE), which take precedence."""
    path = TABLE_PATH if TABLE_PATH.exists() else PACKAGED_TABLE
    rows = _parse_rows(yaml.safe_load(path.read_text()), str(path))
    extra = extra or os.environ.get("AR_GPU_TABLE")
    if extra:
        p = Path(extra)
        if not p.exists():
            raise ValueError(f"GPU table {p} does not exist; fix AR_GPU_TABLE or create the file")
        rows = _parse_rows(yaml.safe_load(p.read_text()) or [], str(p)) + rows
    return rows


def lookup(device_name: str, table: list[GpuRow] | None = None, override: float | None = None) -> Peak:
    """Match a device name (as torch.cuda.get_device_name reports it) to its dense BF16 peak."""
    if override is None and os.environ.get("AR_PEAK_TFLOPS"):
        override = float(os.environ["AR_PEAK_TFLOPS"])
    if override is not None:
        return Peak(device_name, None, float(override), "override")
    words = _words(device_name)
    best: GpuRow | None = None
    for row in table if table is not None else load_table():
        if set(row.match) <= words and not (set(row.exclude) & words):
            if best is None or len(row.match) > len(best.match):
                best = row
    if best is None:
        return Peak(device_name, None, None, "unknown")
    if best.tflops is None:
        return Peak(device_name, best.name, None, "unpublished")
    return Peak(device_name, best.name, best.tflops, "table")


def mfu_percent(tokens_per_s: float | None, flops_per_token: float | None, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation in percent; None when any input is unknown."""
    if tokens_per_s is None or flops_per_token is None or not peak_tflops:
        return None
    return 100.0 * tokens_per_s * flops_per_token / (peak_tflops * 1e12)
