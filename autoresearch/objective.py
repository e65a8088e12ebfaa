"""What an experiment is measured by. The default is val_bpb from the trusted evaluator (train.py writes a
checkpoint, ar computes the loss itself). Any other objective is a **command** ar runs on each commit, in a
fresh copy of its tree, in the sandbox, on ar's clock; a **metric** read from the command's own output; and
an optional **correctness gate**, a command that must pass before the metric counts.

    objective:
      name: us_per_call               # what the number is called in results, reports and the dashboard
      unit: µs
      direction: min                  # min | max
      command: python bench.py        # prints the metric; it and the gate must not be editable
      metric: us_per_call             # the key of the last JSON object line printed, or {regex: '…([0-9.]+)'}
      gate: python check.py           # optional: exit 0 means the candidate is correct
      timeout: 300                    # seconds for gate + command together
      noise: 3%                       # keep only past this: a share of the best, or a number in the unit
      sandbox: ar                     # ar: gate and command run in ar's sandbox; command: they run the candidate
                                      # in a sandbox of their own (needed for CUDA in their subprocesses as root)

A command objective is trusted as far as its command is: the proposal may change only `allowed_paths`, so
the command and the gate run as committed at the start; they should run the candidate in a process of its own
and time it from outside (examples/kernel shows how). With `sandbox: command` ar does not wrap them in its own
sandbox: they are fixed code, and they put the candidate's process in one (autoresearch.harness.sandbox), as
the example does. That is what a GPU needs when ar runs as root: there a sandboxed process may write only its
own /proc entries, so the candidate's process, a child of the command, could not start CUDA inside ar's.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoresearch.errors import ConfigError

VAL_BPB = "val_bpb"
_KEYS = ("name", "unit", "direction", "command", "metric", "gate", "timeout", "noise", "sandbox")


@dataclass(frozen=True)
class Objective:
    name: str = VAL_BPB
    unit: str = "bits/byte"
    direction: str = "min"
    command: tuple[str, ...] = ()          # empty: train.py + the trusted evaluator
    json_key: str | None = None
    regex: str | None = None
    gate: tuple[str, ...] = ()
    timeout: float = 300.0
    noise_share: float | None = None       # "3%": the threshold is this share of the best value
    noise: float | None = None             # an absolute threshold in the unit
    sandbox: str = "ar"                    # who sandboxes the candidate: ar (around gate and command) or the command

    @property
    def custom(self) -> bool:
        return bool(self.command)

    @property
    def sign(self) -> float:
        """+1 when lower is better: `sign * value` is always a loss."""
        return 1.0 if self.direction == "min" else -1.0

    def loss(self, value: float) -> float:
        return self.sign * value

    def better(self, a: float, b: float | None) -> bool:
        return b is None or self.loss(a) < self.loss(b)

    def threshold(self, noise: float, best: float | None) -> float:
        """The keep threshold in the unit: a share of the best when the objective says so."""
        if self.noise_share is not None and best is not None:
            return abs(best) * self.noise_share
        return self.noise if self.noise is not None else noise

    def label(self) -> str:
        arrow = "lower" if self.direction == "min" else "higher"
        return f"{self.name} ({self.unit}, {arrow} is better)" if self.unit else f"{self.name} ({arrow} is better)"

    def describe(self) -> dict:
        """What reports and the dashboard show, and the journal's threshold (kept in the tag's meta.json)."""
        out = {"name": self.name, "unit": self.unit, "direction": self.direction}
        if self.noise_share is not None or self.noise is not None:
            out.update(noise_share=self.noise_share, noise=self.noise)
        return out

    def extract(self, text: str) -> float | None:
        """The metric from the command's output: the last JSON object line with the key, or the last match of
        the regex's first group. None when absent or not a finite number."""
        found = None
        if self.json_key is not None:
            for line in text.splitlines():
                line = line.strip()
                if line.startswith("{") and line.endswith("}"):
                    try:
                        doc = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(doc, dict) and self.json_key in doc:
                        found = doc[self.json_key]
        else:
            matches = re.findall(self.regex, text, flags=re.MULTILINE)
            if matches:
                found = matches[-1][0] if isinstance(matches[-1], tuple) else matches[-1]
        try:
            value = float(found) if found is not None and not isinstance(found, bool) else None
        except (TypeError, ValueError):
            return None
        return value if value is not None and math.isfinite(value) else None


DEFAULT = Objective()


def shown(cmd: tuple[str, ...]) -> str:
    """A command as the user wrote it: ar's interpreter shown as `python`."""
    return " ".join(("python" if i == 0 and c == sys.executable else c) for i, c in enumerate(cmd))


def parse(raw: Any, source: str) -> Objective:
    """The `objective:` block of a config file, checked; one-line errors naming the key."""
    where = f"objective in {source}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping with at least name, command and metric")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r} in {where}; known keys: {', '.join(_KEYS)}")
    for key in ("name", "command", "metric"):
        if raw.get(key) in (None, "", []):
            raise ConfigError(f"{where} needs {key}")
    name = raw["name"]
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
        raise ConfigError(f"objective.name in {source} must be a word like us_per_call, not {name!r}")
    direction = raw.get("direction", "min")
    if direction not in ("min", "max"):
        raise ConfigError(f"objective.direction in {source} must be min or max, not {direction!r}")
    unit = raw.get("unit", "")
    if not isinstance(unit, str):
        raise ConfigError(f"objective.unit in {source} must be a string")
    command, gate = _command(raw["command"], "command", source), _command(raw.get("gate"), "gate", source)
    json_key, regex = _metric(raw["metric"], source)
    timeout = raw.get("timeout", 300.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ConfigError(f"objective.timeout in {source} must be a positive number of seconds, not {timeout!r}")
    share, noise = _noise(raw.get("noise"), source)
    box = raw.get("sandbox", "ar")
    if box not in ("ar", "command"):
        raise ConfigError(f"objective.sandbox in {source} must be ar (ar sandboxes gate and command) or command (they "
                          f"sandbox the candidate themselves), not {box!r}")
    return Objective(name=name, unit=unit, direction=direction, command=command, json_key=json_key, regex=regex,
                     gate=gate, timeout=float(timeout), noise_share=share, noise=noise, sandbox=box)


def _command(value: Any, key: str, source: str) -> tuple[str, ...]:
    """The command as a list; a leading `python` is ar's own interpreter (the one with torch and ar's sandbox),
    as for train.py, whatever PATH finds inside the run's environment."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = shlex.split(value)
    if not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
        raise ConfigError(f"objective.{key} in {source} must be a command string or a non-empty list of strings")
    if value[0] in ("python", "python3"):
        value = [sys.executable, *value[1:]]
    return tuple(value)


def _metric(value: Any, source: str) -> tuple[str | None, str | None]:
    if isinstance(value, str) and value.strip():
        return value, None
    if isinstance(value, dict) and len(value) == 1:
        (kind, v), = value.items()
        if kind == "json" and isinstance(v, str) and v:
            return v, None
        if kind == "regex" and isinstance(v, str):
            try:
                groups = re.compile(v).groups
            except re.error as e:
                raise ConfigError(f"objective.metric.regex in {source} is not a valid regex: {e}") from None
            if groups < 1:
                raise ConfigError(f"objective.metric.regex in {source} needs a group around the number, "
                                  f"e.g. 'time: ([0-9.]+)'")
            return None, v
    raise ConfigError(f"objective.metric in {source} must be a JSON key, {{json: KEY}} or {{regex: PATTERN}}")


def _noise(value: Any, source: str) -> tuple[float | None, float | None]:
    if value is None:
        return None, None
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 <= share < 1:
            raise ConfigError(f"objective.noise in {source} must be a percentage like 3% or a number, not {value!r}")
        return share, None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ConfigError(f"objective.noise in {source} must be a percentage like 3% or a number >= 0, "
                          f"not {value!r}")
    return None, float(value)


def load(tag_dir: Path) -> Objective:
    """The objective a tag was run with (name, unit, direction), from its meta.json; val_bpb when none."""
    try:
        doc = json.loads((Path(tag_dir) / "meta.json").read_text()).get("objective") or {}
    except (OSError, ValueError):
        doc = {}
    if not doc:
        return DEFAULT
    num = lambda k: float(doc[k]) if isinstance(doc.get(k), (int, float)) else None  # noqa: E731
    return Objective(name=str(doc.get("name", VAL_BPB)), unit=str(doc.get("unit", "")),
                     direction="max" if doc.get("direction") == "max" else "min", noise_share=num("noise_share"),
                     noise=num("noise"))

