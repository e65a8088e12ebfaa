"""The fault tests' isolation; their figures go to the `table` fixture (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated(prepared_cache, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    for var in ("AR_PROFILE", "AR_TIME_BUDGET", "AR_SEED", "AR_DATASET", "AR_TOK_DIR", "AR_CHECKPOINT_DIR", "AR_FAULT"):
        monkeypatch.delenv(var, raising=False)
