"""The trusted compile cache: torch.compile's caches (inductor's FX-graph/AOT/autotune entries and Triton's
kernels), kept between runs only where the code that filled them is code the runner trusts.

Every run compiles in its own scratch folder, deleted afterwards. Without more, every run compiles cold (about
30 s on an H200 for the default model). So:

- every training run compiles into a folder of its own, `run_root(cache)`, deleted with its workspace. Its path
  has the same length for every run on the machine, because compiled entries carry the absolute path they were
  made under (a run that loads an entry made elsewhere looks for that folder, which its sandbox denies);
- `seed(store, run_cache)` copies the store into a run's folder before it starts, with the store's placeholder
  path swapped for the run's own (same length: pickles and shared objects stay valid). A copy, never a link:
  whatever the run writes lands in its own files and dies with its folder. A run that waited for the baseline
  takes what the store gained meanwhile (`new_only`) when it goes, before train.py is loaded;
- `adopt(run_cache, store)` merges what a *trusted* run compiled into the store, after its process tree is
  gone, the run's path swapped for the placeholder: new files only, each written to a temporary name and
  renamed, so nothing already there is replaced.

Trusted means the run's tree is the user's baseline commit, or ar's own knob edits of a trusted commit (the
strategy/grid/random proposers, queued knob points, sweep points, re-runs): the process that wrote the cache ran
code the user wrote. An agent's commit, and everything built on it, is untrusted: its runs read a copy of the
store and nothing they write is kept. Cache entries are pickles and shared objects that a later run loads and
executes, which is why a proposal's writes must never reach the store (docs/reliability.md).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from filelock import FileLock

SUBDIRS = ("inductor", "triton")        # RunRequest.to_environ points TORCHINDUCTOR_/TRITON_CACHE_DIR here
MAX_BYTES = 8 * 2**30                    # a store past this takes nothing more (every run copies it in)


def store_dir(cache: Path) -> Path:
    """One store per torch version: the entries' own keys hold the GPU, the graph and the compiler options."""
    try:
        from importlib.metadata import version
        torch_version = version("torch")
    except Exception:  # no torch metadata (a command objective's host): one unversioned store
        torch_version = "unknown"
    return cache / "compile" / f"torch-{torch_version}"


RUNS = "runcache"


def run_root(cache: Path) -> Path:
    """A new run's compile folder: <cache>/runcache/<12 hex digits>, the same length for every run."""
    return Path(cache).resolve() / RUNS / uuid.uuid4().hex[:12]


def _placeholder(run_cache: Path) -> Path:
    return run_cache.parent / ("_" * len(run_cache.name))


def _copy_swapping(src: Path, dest: Path, old: bytes, new: bytes) -> int:
    data = src.read_bytes()
    dest.write_bytes(data.replace(old, new) if old in data else data)
    return len(data)


def seed(store: Path, run_cache: Path, new_only: bool = False) -> int:
    """Copy the store into a run's compile folder (made here); the bytes copied. `new_only`: only what the folder
    lacks (a run that waited for the baseline takes what the baseline compiled, before its own start)."""
    run_cache.mkdir(parents=True, exist_ok=True)
    old, new = str(_placeholder(run_cache)).encode(), str(run_cache).encode()
    copied = 0
    for sub in SUBDIRS:
        src = store / sub
        if not src.is_dir():
            continue
        for root, dirs, files in os.walk(src):
            rel = Path(root).relative_to(store)
            (run_cache / rel).mkdir(parents=True, exist_ok=True)
            for name in files:
                if name.startswith(".tmp-") or (new_only and os.path.lexists(run_cache / rel / name)):
                    continue
                try:
                    copied += _copy_swapping(Path(root) / name, run_cache / rel / name, old, new)
                except OSError:
                    pass       # an entry being renamed into place right now: the run compiles that one itself
    return copied


def size(store: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(store):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def adopt(run_cache: Path, store: Path) -> int:
    """Merge a trusted run's new cache files into the store (existing ones are never replaced); the number
    of files added. Symbolic links and lock files are skipped. Call once the run's processes are gone. A store
    that cannot be written (another user's, a full disk) takes nothing: the next run compiles what it lacks."""
    try:
        return _adopt(run_cache, store)
    except OSError:
        return 0


def _adopt(run_cache: Path, store: Path) -> int:
    store.mkdir(parents=True, exist_ok=True)
    old, new = str(run_cache).encode(), str(_placeholder(run_cache)).encode()
    added = 0
    with FileLock(str(store / ".lock"), timeout=60):
        if size(store) > MAX_BYTES:
            return 0
        for sub in SUBDIRS:
            src = run_cache / sub
            if not src.is_dir() or src.is_symlink():
                continue
            for root, dirs, files in os.walk(src):
                dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
                rel = Path(root).relative_to(run_cache)
                for name in files:
                    path = Path(root) / name
                    dest = store / rel / name
                    if path.is_symlink() or name.endswith(".lock") or dest.exists():
                        continue
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    tmp = dest.with_name(f".tmp-{os.getpid()}-{name}")
                    try:
                        _copy_swapping(path, tmp, old, new)
                        os.replace(tmp, dest)
                        added += 1
                    except OSError:
                        tmp.unlink(missing_ok=True)
    return added


def clear(cache: Path) -> None:
    """Drop every store and run folder."""
    shutil.rmtree(cache / "compile", ignore_errors=True)
    shutil.rmtree(cache / RUNS, ignore_errors=True)
