"""Shared fixtures: an isolated cache, one small prepared dataset for the whole test session, and a per-test
cache in which the configs' default dataset (`builtin`) is that shared dataset.

The run's order and its figures: pytest-xdist hands each worker a whole test file at a time (module-scoped
fixtures such as the Ray cluster start once), in collection order, and modules with a test marked `slow` are
collected first, so that the two workers start on the long ones rather than one ending the run alone with them. The fault tests add rows
(fault, trials, lost, duplicated, wrongly kept, inconsistent) through the `table` fixture; each xdist worker
hands its rows to the controller when it finishes, and one table of their sums is printed at the end."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

# One torch thread a process: two workers share two cores, and a CPU train.py or evaluator would otherwise take
# both for its whole window, stealing the other worker's core (the suite is CPU-bound). Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from autoresearch.harness import data  # noqa: E402
from autoresearch.harness.env import resolve_profile
from fixtures.corpus import write_stdlib_docs  # noqa: E402
from tiers import add_fixture_tiers, marked_tier, pytest_configure, pytest_runtest_call, pytest_runtest_protocol  # noqa: E402,F401  (hooks)


def pytest_sessionstart(session):
    """Ctrl-C as a terminal sends it: a suite started in the background by a non-interactive shell inherits SIGINT
    ignored, and so would every `ar` a test interrupts (they would run on to the end)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _matplotlib_font_cache()
    if not hasattr(session.config, "workerinput"):      # once, before the workers start
        _package_bytecode()


def _package_bytecode() -> None:
    """The package's .pyc, written once before any test: an `ar` session sets PYTHONDONTWRITEBYTECODE for all it
    starts (its package fingerprint must not move), and so may the machine (CI's does), so without these every
    process the suite starts (each run's training process, evaluator, `ar` itself) compiles the package's
    sources again: ~0.1 CPU-s each. Written before any fingerprint is taken; nothing writes one afterwards."""
    import compileall
    import re

    import autoresearch
    compileall.compile_dir(Path(autoresearch.__file__).parent, quiet=2, rx=re.compile(r"/resources/"))


def _matplotlib_font_cache() -> None:
    """matplotlib builds its font cache on its first import in a new HOME (as CI's), running `fc-list`: built
    here, before any test, a fast test that draws a plot starts no process."""
    import matplotlib
    if not any(Path(matplotlib.get_cachedir()).glob("fontlist-*.json")):
        import matplotlib.font_manager  # noqa: F401  (builds and saves the cache)


@pytest.fixture(scope="session", autouse=True)
def _split_key_home(tmp_path_factory):
    """The session's own split-key folder ($AR_SECRET_DIR, inherited by every `ar` the tests start): a test never
    reads or makes the user's key in ~/.config/ar/secret."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AR_SECRET_DIR", str(tmp_path_factory.mktemp("split-key") / "secret"))
        yield


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
    src = write_stdlib_docs(root / "text")
    vocab = resolve_profile("cpu").vocab_size
    # the same split every session (tests compare figures of it): an empty split key in the cache is the unkeyed
    # rule. Other caches split by the installation's secret key ($AR_SECRET_DIR here: data.split_key); the hostile
    # tests prepare their own data with it
    secret = root / "cache" / ".secret"
    secret.mkdir(parents=True, mode=0o700)
    (secret / "split.key").write_text("")
    tok_dir = data.prepare("files", cache=root / "cache", vocab_size=vocab, name="tiny", path=src)
    shutil.copytree(tok_dir, root / "pristine")
    for f in tok_dir.iterdir():
        f.chmod(0o444)            # a reminder more than a lock: tests run as root in CI containers
    return TinyDataset(cache=root / "cache", name="tiny", vocab_size=vocab, tok_dir=tok_dir, path=src)


def _digest(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


@pytest.fixture(scope="session")
def _tiny_digest(tiny_dataset) -> dict[str, str]:
    return _digest(tiny_dataset.tok_dir)


@pytest.fixture
def prepared_cache(tmp_path, monkeypatch, tiny_dataset, _tiny_digest) -> Path:
    """AR_CACHE pointed at a fresh folder whose `builtin` dataset (the default of RunConfig.dataset) is a link
    to the session's shared tiny dataset: every Loop finds prepared data, nothing is tokenized per test.
    The shared dataset must not change: a test that changes it fails, and the dataset is put back."""
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    (cache / "builtin").symlink_to(tiny_dataset.cache / tiny_dataset.name, target_is_directory=True)
    monkeypatch.setenv("AR_CACHE", str(cache))
    yield cache
    if _digest(tiny_dataset.tok_dir) != _tiny_digest:
        for f in tiny_dataset.tok_dir.iterdir():
            f.chmod(0o644)
        shutil.rmtree(tiny_dataset.tok_dir)
        shutil.copytree(tiny_dataset.tok_dir.parent.parent.parent / "pristine", tiny_dataset.tok_dir)
        pytest.fail(f"the test changed the shared dataset {tiny_dataset.tok_dir} (restored for the next tests); "
                    "copy it before changing anything")


def pytest_collection_modifyitems(items):
    """Every test without a tier's marker is `fast` (tests/tiers.py), so `pytest -m fast` selects them. Modules
    with a slow test first, each module kept whole (its module-scoped fixtures, such as the Ray cluster, start
    once); file order otherwise."""
    add_fixture_tiers(items)
    for item in items:
        if marked_tier(item) == "fast":
            item.add_marker(pytest.mark.fast)
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow)


COLUMNS = ("fault", "trials", "lost", "duplicated", "wrongly kept", "inconsistent")
ROWS: dict[str, list[int]] = {}   # fault -> [trials, lost, duplicated, wrongly kept, inconsistent]


class Table:
    def add(self, fault: str, trials: int = 1, lost: int = 0, duplicated: int = 0, wrongly_kept: int = 0,
            inconsistent: int = 0) -> None:
        _merge({fault: [trials, lost, duplicated, wrongly_kept, inconsistent]})


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


def _merge(rows: dict[str, list[int]]) -> None:
    for fault, vals in rows.items():
        row = ROWS.setdefault(fault, [0, 0, 0, 0, 0])
        for i, v in enumerate(vals):
            row[i] += int(v)


def pytest_sessionfinish(session):
    out = getattr(session.config, "workeroutput", None)     # set only in an xdist worker
    if out is not None:
        out["fault_rows"] = dict(ROWS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _merge(getattr(node, "workeroutput", {}).get("fault_rows", {}))


def pytest_terminal_summary(terminalreporter):
    lines = render()
    if lines:
        terminalreporter.section("fault-injection summary")
        for line in lines:
            terminalreporter.write_line(line)
