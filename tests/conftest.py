"""Shared fixtures: an isolated cache, and one small prepared dataset for the whole test session."""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

from autoresearch.harness import data
from autoresearch.harness.env import resolve_profile


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch) -> Path:
    """AR_CACHE pointed at an empty temporary folder."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("AR_CACHE", str(cache))
    return cache


@dataclass(frozen=True)
class TinyDataset:
    cache: Path       # use as AR_CACHE
    name: str         # use as AR_DATASET
    vocab_size: int   # the cpu profile's, so that train.py on the cpu profile finds it
    tok_dir: Path
    path: Path        # the source folder of .txt files


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> TinyDataset:
    """A `files` dataset of ~300 KB of real text (standard library sources cut into ~2 KB documents),
    tokenized with the cpu profile's vocab. Read-only: copy it before changing anything."""
    root = tmp_path_factory.mktemp("tiny")
    src = root / "text"
    src.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total, n = 0, 0
    for f in sorted(stdlib.glob("*.py")):
        for piece in data.split_long(f.read_text(encoding="utf-8", errors="replace"), 2000):
            (src / f"doc_{n:05d}.txt").write_text(piece, encoding="utf-8")
            n += 1
            total += len(piece)
        if total >= 300_000:
            break
    vocab = resolve_profile("cpu").vocab_size
    tok_dir = data.prepare("files", cache=root / "cache", vocab_size=vocab, name="tiny", path=src)
    return TinyDataset(cache=root / "cache", name="tiny", vocab_size=vocab, tok_dir=tok_dir, path=src)
