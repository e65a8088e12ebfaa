"""Built-in proposers that need no LLM: grid, random, and strategy (one knob at a time from the best).

Each returns knob values for the loop to write into train.py, skipping points already in the results.
"""

from __future__ import annotations

import itertools
import json
import random
from typing import Iterable

from autoresearch.knobs import Value
from autoresearch.records.ledger import Row, Status
from autoresearch.proposers.base import Context, Proposal


def _norm(v: Value) -> Value:
    if isinstance(v, float):
        return float(f"{v:.6g}")
    return v


def _key(knobs: dict, names: Iterable[str] | None = None) -> str:
    names = sorted(knobs) if names is None else sorted(names)
    return json.dumps({n: _norm(knobs.get(n)) for n in names}, sort_keys=True)


def tried(rows: list[Row], names: Iterable[str] | None = None) -> set[str]:
    """Knob points that have a result already (restricted to `names` when given); rejected ones don't count."""
    return {_key(r.knobs, names) for r in rows if r.knobs and r.status is not Status.REJECTED}


def _show(v: Value) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v >= 256 and v & (v - 1) == 0:
        return f"2**{v.bit_length() - 1}"
    return repr(v) if isinstance(v, str) else str(v)


def describe_change(before: dict, after: dict) -> str:
    parts = [f"{k} {_show(before.get(k))} -> {_show(v)}" for k, v in after.items() if before.get(k) != v]
    return ", ".join(parts) or "no knob change"


class GridProposer:
    """Every combination of search_space, in listed order, each applied to the best kept train.py."""

    name = "grid"

    def __init__(self, space: dict[str, list]):
        self.space = space

    def points(self) -> Iterable[dict]:
        names = list(self.space)
        for combo in itertools.product(*(self.space[n] for n in names)):
            yield dict(zip(names, combo))

    def propose(self, ctx: Context) -> Proposal | None:
        done = tried(ctx.rows, self.space)
        for point in self.points():
            if _key({**ctx.knobs, **point}, self.space) not in done:
                return Proposal(f"grid: {describe_change(ctx.knobs, point)}", knobs=point)
        return None


class RandomProposer(GridProposer):
    """Random points of search_space (seeded, so a resumed run draws the same sequence), never repeated."""

    name = "random"

    def __init__(self, space: dict[str, list], seed: int = 42):
        super().__init__(space)
        self.seed = seed

    def propose(self, ctx: Context) -> Proposal | None:
        points = list(self.points())
        random.Random(self.seed).shuffle(points)
        done = tried(ctx.rows, self.space)
        for point in points:
            if _key({**ctx.knobs, **point}, self.space) not in done:
                return Proposal(f"random: {describe_change(ctx.knobs, point)}", knobs=point)
        return None


# (knob, kind, amount): kind "mul" multiplies (and divides for the opposite move), "add" adds (and subtracts)
MOVES: tuple[tuple[str, str, float], ...] = (
    ("TOTAL_BATCH_SIZE", "mul", 2), ("LR_MULT", "mul", 1.5), ("DEPTH", "add", 1),
    ("DEVICE_BATCH_SIZE", "mul", 2), ("WARMDOWN_RATIO", "add", 0.1), ("WARMUP_RATIO", "add", 0.05),
    ("ASPECT_RATIO", "mul", 2), ("WEIGHT_DECAY", "mul", 2), ("MATRIX_LR", "mul", 1.5),
)
_BOUNDS = {"WARMDOWN_RATIO": (0.0, 1.0), "WARMUP_RATIO": (0.0, 0.5), "DEPTH": (1, 64)}


def _step(value: Value, kind: str, amount: float, up: bool) -> Value | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if kind == "mul":
        new = value * amount if up else value / amount
    else:
        new = value + amount if up else value - amount
    if isinstance(value, int) and (kind == "add" or amount == int(amount)):
        if new != int(new):
            return None
        new = int(new)
    return _norm(new) if isinstance(new, float) else new


class StrategyProposer:
    """From the best kept config, change one knob at a time: TOTAL_BATCH_SIZE ×2/÷2, LR_MULT ×1.5/÷1.5,
    DEPTH ±1, DEVICE_BATCH_SIZE ×2/÷2 (when not "auto"), WARMDOWN_RATIO ±0.1, … — skipping points already
    tried and batch sizes that do not divide. The move that produced the current best is tried again first
    (a winning direction is followed), as in the published 5090 search."""

    name = "strategy"

    def candidates(self, ctx: Context) -> list[tuple[str, Value]]:
        knobs = ctx.knobs
        moves = [(name, kind, amount, up) for name, kind, amount in MOVES for up in (False, True)]
        last = self._last_move(ctx)
        if last:
            moves.sort(key=lambda m: (m[0], m[3]) != last)
        out = []
        for name, kind, amount, up in moves:
            if name not in knobs:
                continue
            new = _step(knobs[name], kind, amount, up)
            if new is None or new == knobs[name]:
                continue
            lo, hi = _BOUNDS.get(name, (None, None))
            if (lo is not None and new < lo) or (hi is not None and new > hi) or (kind == "mul" and new <= 0):
                continue
            if not self._divides({**knobs, name: new}, ctx.profile.seq_len):
                continue
            if self._below_floor(ctx.built, name, knobs[name], new):
                continue
            out.append((name, new))
        return out

    @staticmethod
    def _below_floor(built: dict | None, name: str, old: Value, new: Value) -> bool:
        """Shrinking a size the best's model already has at 1 (the CPU profile builds DEPTH 7 as one layer)
        builds the same model again: a move that changes nothing in it."""
        size = (built or {}).get(name.lower())
        return isinstance(size, int) and not isinstance(size, bool) and size <= 1 and new < old

    @staticmethod
    def _divides(k: dict, seq_len: int) -> bool:
        total, dev = k.get("TOTAL_BATCH_SIZE"), k.get("DEVICE_BATCH_SIZE")
        if not isinstance(total, int) or isinstance(total, bool):
            return True
        if total < seq_len:
            return False
        if isinstance(dev, int) and not isinstance(dev, bool):
            return dev > 0 and total % (dev * seq_len) == 0
        return True

    @staticmethod
    def _last_move(ctx: Context) -> tuple[str, bool] | None:
        """(knob, up) that turned the best's parent into the best, when it was a single-knob change."""
        best = ctx.best
        if best is None or not best.parent or not best.knobs:
            return None
        parent = next((r for r in ctx.rows if r.commit == best.parent and r.knobs), None)
        if parent is None:
            return None
        diff = [k for k in best.knobs if parent.knobs.get(k) != best.knobs[k]]
        if len(diff) != 1:
            return None
        k = diff[0]
        a, b = parent.knobs.get(k), best.knobs[k]
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
            return None
        return k, b > a

    def propose(self, ctx: Context) -> Proposal | None:
        done = tried(ctx.rows)
        for name, new in self.candidates(ctx):
            point = {**ctx.knobs, name: new}
            if _key(point) not in done:
                return Proposal(f"strategy: {describe_change(ctx.knobs, {name: new})}", knobs={name: new})
        return None
