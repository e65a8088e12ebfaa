"""GPU peak-FLOPs table and the MFU formula.

MFU divides achieved model FLOP/s by the GPU's dense BF16 peak from the packaged table
(autoresearch/resources/gpus.yaml, the only copy; never a hard-coded H100 figure). A user's override file —
$AR_GPUS_FILE if set, else ~/.config/ar/gpus.yaml if it exists — replaces rows of the same name and adds
others; `ar run`, `ar sweep` and `ar doctor` read it when they start (`check_override`), so a broken one is a
config error before anything runs. An unknown GPU, or a row whose peak is not published, gives MFU None
("unknown"), never a silently wrong number.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from .errors import ConfigError

PACKAGED_TABLE = Path(__file__).resolve().parents[1] / "resources" / "gpus.yaml"
USER_TABLE = "~/.config/ar/gpus.yaml"
ENV_VARS = ("AR_GPUS_FILE", "AR_GPU_TABLE")  # AR_GPU_TABLE: the older name, still read
HOW_TO_ADD = f"add a row (name, match, tflops) to {USER_TABLE} (or the file named by AR_GPUS_FILE)"


@dataclass(frozen=True)
class GpuRow:
    name: str
    match: tuple[str, ...]
    exclude: tuple[str, ...]
    tflops: float | None


@dataclass(frozen=True)
class Override:
    """The user's override file: where it is, what chose it (an environment variable or the default place)."""

    path: Path
    origin: str
    rows: list[GpuRow]


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
        return (f"GPU {self.device!r} is not in the peak-FLOPs table: MFU is unknown; {HOW_TO_ADD}, "
                "or set AR_PEAK_TFLOPS")


def _words(name: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", name.lower()))


def _parse_rows(raw, source: str) -> list[GpuRow]:
    if not isinstance(raw, list):
        raise ValueError(f"{source}: the GPU table must be a YAML list of rows like "
                         "- {name: My GPU, match: [my, gpu], tflops: 100}")
    rows = []
    for i, r in enumerate(raw, 1):
        if not isinstance(r, dict) or "name" not in r or "match" not in r or "tflops" not in r:
            raise ValueError(f"{source}: row {i} needs name, match and tflops")
        t, words, exclude = r["tflops"], r["match"], r.get("exclude") or []
        if not isinstance(words, list) or not isinstance(exclude, list):
            raise ValueError(f"{source}: row {i} ({r['name']}): match and exclude must be lists of words")
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ValueError(f"{source}: row {i} ({r['name']}): tflops must be a positive number, or null when "
                             "no figure is published")
        rows.append(GpuRow(str(r["name"]), tuple(str(w).lower() for w in words),
                           tuple(str(w).lower() for w in exclude), None if t is None else float(t)))
    return rows


def _read(path: Path, source: str, fix: str) -> list[GpuRow]:
    """Rows of one table file; anything wrong with it is one ValueError line naming the file and the fix."""
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"{source}: cannot read it ({e.strerror or e}); {fix}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{source}: not valid YAML{where}: {getattr(e, 'problem', None) or e}; {fix}") from None
    try:
        return _parse_rows([] if raw is None else raw, source)
    except ValueError as e:
        raise ValueError(f"{e}; {fix}") from None


def read_override(extra: str | os.PathLike | None = None) -> Override | None:
    """The user's override file: `extra`, else $AR_GPUS_FILE (which must exist), else ~/.config/ar/gpus.yaml
    if it exists; None when there is none."""
    if extra:
        path, origin = Path(extra), "argument"
    else:
        var = next((v for v in ENV_VARS if os.environ.get(v)), None)
        if var:
            path, origin = Path(os.environ[var]).expanduser(), var
        else:
            path, origin = Path(os.path.expanduser(USER_TABLE)), "default"
            if not path.exists():
                return None
    fix = "fix the file or move it away" if origin == "default" else f"fix the file or unset {origin}"
    if not path.exists():
        raise ValueError(f"GPU table {path} ({origin}) does not exist; create it or unset {origin}")
    return Override(path, origin, _read(path, f"GPU table {path}", fix))


def check_override() -> Override | None:
    """Read the override file (and AR_PEAK_TFLOPS) when a command starts: a mistake there is a config error (exit 2)
    before anything runs, rather than a crash of the first GPU experiment, which is where the table is first read."""
    peak = os.environ.get("AR_PEAK_TFLOPS")
    if peak:
        try:
            ok = math.isfinite(float(peak)) and float(peak) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"AR_PEAK_TFLOPS={peak!r} is not a positive number of TFLOP/s; set it to your GPU's "
                              "dense BF16 peak (e.g. 209.5) or unset it")
    try:
        return read_override()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def load_table(extra: str | os.PathLike | None = None) -> list[GpuRow]:
    """The packaged table with the override file's rows on top (see `read_override`): an override row
    replaces the packaged row of the same name, and wins a tie with any other."""
    rows = _read(PACKAGED_TABLE, str(PACKAGED_TABLE), "reinstall ar")
    own = read_override(extra)
    if own is None:
        return rows
    names = {r.name.lower() for r in own.rows}
    return own.rows + [r for r in rows if r.name.lower() not in names]


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
