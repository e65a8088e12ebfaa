"""The suite's figures: each fault test adds rows (fault, trials, lost, duplicated, wrongly kept,
inconsistent) through the `table` fixture; one table is printed at the end of the run."""

from __future__ import annotations

import pytest

COLUMNS = ("fault", "trials", "lost", "duplicated", "wrongly kept", "inconsistent")
ROWS: dict[str, list[int]] = {}   # fault -> [trials, lost, duplicated, wrongly kept, inconsistent]


class Table:
    def add(self, fault: str, trials: int = 1, lost: int = 0, duplicated: int = 0, wrongly_kept: int = 0,
            inconsistent: int = 0) -> None:
        row = ROWS.setdefault(fault, [0, 0, 0, 0, 0])
        for i, v in enumerate((trials, lost, duplicated, wrongly_kept, inconsistent)):
            row[i] += int(v)


@pytest.fixture(autouse=True)
def _isolated(prepared_cache, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    for var in ("AR_PROFILE", "AR_TIME_BUDGET", "AR_SEED", "AR_DATASET", "AR_TOK_DIR", "AR_CHECKPOINT_DIR", "AR_FAULT"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="session")
def table() -> Table:
    return Table()


def render() -> list[str]:
    if not ROWS:
        return []
    width = max(len(COLUMNS[0]), *(len(f) for f in ROWS))
    head = f"| {COLUMNS[0]:<{width}} | " + " | ".join(COLUMNS[1:]) + " |"
    rule = f"| {'-' * width} | " + " | ".join("-" * (len(c) - 1) + ":" for c in COLUMNS[1:]) + " |"
    lines = [head, rule]
    for fault, vals in ROWS.items():
        lines.append(f"| {fault:<{width}} | " + " | ".join(f"{v:>{len(c)}}" for v, c in zip(vals, COLUMNS[1:]))
                     + " |")
    total = [sum(v[i] for v in ROWS.values()) for i in range(5)]
    lines.append(f"| {'total':<{width}} | " + " | ".join(f"{v:>{len(c)}}" for v, c in zip(total, COLUMNS[1:]))
                 + " |")
    return lines


def pytest_terminal_summary(terminalreporter):
    lines = render()
    if lines:
        terminalreporter.section("fault-injection summary")
        for line in lines:
            terminalreporter.write_line(line)
