"""Repos, configs, ways to start `ar`, and the audit that counts what a fault broke."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import autoresearch.cli as cli
from autoresearch import faults
from autoresearch.gitops import GitRepo
from autoresearch.records.ledger import Row, Status, read_results
from autoresearch.records.queue import ExperimentQueue
from test_loop import EVAL_TOKENS, Cycle, make_repo  # noqa: F401  (re-exported: one stand-in repo for every suite)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
AGENTS = FIXTURES / "agents"
HERE = Path(__file__).resolve().parent


def write_cfg(path: Path, **kw) -> Path:
    base = dict(profile="cpu", time_budget=0.1, startup_allowance=10, eval_allowance=30, prepare_data=False,
                max_consecutive_crashes=1000, eval_tokens=EVAL_TOKENS)
    base.update(kw)
    path.write_text(yaml.safe_dump(base))
    return path


def agent_cmd(name: str, *extra: str) -> str:
    folder = HERE if (HERE / name).exists() else AGENTS
    return " ".join([sys.executable, str(folder / name), *extra, "{prompt_file}"])


def ar_proc(*args: str, cwd: Path, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autoresearch", *args], cwd=cwd,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def fork_ar(*args: str, fault: str | None = None, log: Path, timeout: float = 60.0) -> int:
    """`ar ARGS` in a forked copy of this (already imported) interpreter: a real process that a fault point
    SIGKILLs, without paying Python's start-up for each kill. Returns the exit code, or -signal."""
    return reap(spawn_ar(*args, fault=fault, log=log), timeout, f"ar {' '.join(args)} (fault {fault}), log {log}")


def spawn_ar(*args: str, fault: str | None = None, log: Path) -> int:
    """Start `ar ARGS` in a forked child (see fork_ar); returns its pid at once."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 70
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = open(1, "w", closefd=False, buffering=1)
            sys.stderr = open(2, "w", closefd=False, buffering=1)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            faults.arm(fault)
            sys.argv = ["ar", *args]
            cli.main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def poll(pid: int) -> int | None:
    """The exit code (or -signal) of a spawned child that has ended, else None."""
    done, status = os.waitpid(pid, os.WNOHANG)
    return os.waitstatus_to_exitcode(status) if done else None


def reap(pid: int, timeout: float, what: str = "ar") -> int:
    deadline = time.monotonic() + timeout
    while True:
        rc = poll(pid)
        if rc is not None:
            return rc
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"{what} did not finish in {timeout:g}s")
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------- the audit

@dataclass
class History:
    """What was ever seen recorded: a row or a queue entry seen once must never disappear or change."""

    rows: dict[int, list[str]] = field(default_factory=dict)   # exp_id -> the row's fields
    specs: set[int] = field(default_factory=set)
    done: dict[int, str] = field(default_factory=dict)
    hooks_seen: set[tuple] = field(default_factory=set)

    def observe(self, root: Path, tag: str) -> None:
        for r in read_results(root / "runs" / tag / "results.tsv", warn=lambda m: None):
            self.rows.setdefault(r.exp_id, r.to_fields())
        q = ExperimentQueue(root / "runs" / tag / "queue.jsonl", warn=lambda m: None)
        for s in q.all():
            self.specs.add(s.id)
            if q.is_done(s.id):
                self.done.setdefault(s.id, q.status(s.id))


@dataclass
class Counts:
    lost: int = 0
    duplicated: int = 0
    wrongly_kept: int = 0
    inconsistent: int = 0
    notes: list[str] = field(default_factory=list)

    def bad(self, kind: str, n: int, note: str) -> None:
        if n:
            setattr(self, kind, getattr(self, kind) + n)
            self.notes.append(f"{kind}: {note}")


def audit(root: Path, tag: str, hist: History, noise: float) -> Counts:
    """Count what is wrong with a repo after a resume (ar not running)."""
    c = Counts()
    tag_dir = root / "runs" / tag
    rows = read_results(tag_dir / "results.tsv", warn=lambda m: None)
    q = ExperimentQueue(tag_dir / "queue.jsonl", warn=lambda m: None)
    by_id: dict[int, list[Row]] = {}
    for r in rows:
        by_id.setdefault(r.exp_id, []).append(r)
    c.bad("duplicated", sum(len(v) - 1 for v in by_id.values()), "an experiment recorded twice")
    c.bad("lost", sum(1 for i, f in hist.rows.items() if i not in by_id or by_id[i][0].to_fields() != f),
          "a recorded row vanished or changed")
    c.bad("lost", len(hist.specs - {s.id for s in q.all()}), "a queue entry vanished")
    c.bad("duplicated", sum(1 for i in hist.done if not q.is_done(i)), "a done spec is pending again")
    c.bad("inconsistent", sum(1 for r in rows if not q.is_done(r.exp_id)), "a recorded spec not marked done")
    # decisions: every keep beat the best before it by more than the noise
    best = None
    for r in rows:
        if r.status is Status.KEEP:
            if best is not None and not (r.val_bpb < best - noise):
                c.bad("wrongly_kept", 1, f"experiment {r.exp_id} kept at {r.val_bpb} against {best}")
            best = r.val_bpb if best is None else min(best, r.val_bpb)
    g = GitRepo(root)
    branch = f"autoresearch/{tag}"
    on = g.current_branch() == branch   # another tag's loop may have run last: then check the branch's tip
    tip = g.head_sha() if on else g.resolve(branch)
    base = json.loads((tag_dir / "meta.json").read_text())["base"]
    kept = [r.commit for r in rows if r.status is Status.KEEP and r.commit != base[:7]]
    on_branch = [s[:7] for s in g._git("rev-list", "--reverse", f"{base}..{tip}").split()]
    c.bad("wrongly_kept", len(set(on_branch) - set(kept)), f"commits on the branch that are not kept: {on_branch}")
    c.bad("inconsistent", int(on_branch != kept), f"branch {on_branch} != kept {kept}")
    best_row = min((r for r in rows if r.status is Status.KEEP), key=lambda r: r.val_bpb, default=None)
    want = g.resolve(best_row.commit) if best_row else base
    c.bad("inconsistent", int(tip != want), "branch head is not the best kept commit")
    if on or not any(m.parent.name != tag for m in (root / "runs").glob("*/meta.json")):
        c.bad("inconsistent", int(not on), "not on the experiment branch")
        c.bad("inconsistent", int((root / "train.py").read_text() != g.file_at(want, "train.py")), "train.py != best")
        c.bad("inconsistent", len(g.dirty_paths()), f"dirty tree {g.dirty_paths()}")
    c.bad("inconsistent", len(set(g.exp_refs(tag)) - set(by_id)), "an experiment ref without a row")
    hist.observe(root, tag)
    return c


def hook_firings(journal: Path) -> list[tuple]:
    """(event, key, i) of every 'start' line of the hooks journal."""
    out = []
    if journal.exists():
        for line in journal.read_text(errors="replace").splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("phase") == "start":
                out.append((e["event"], e["key"], e["i"]))
    return out


def own_copies(tmp_path: Path, monkeypatch, tiny_dataset, name: str) -> tuple[Path, Path, Path]:
    """This test's own copy of the data (as `builtin`, in AR_CACHE) and of the installed package (what the
    fingerprint watches): attacks aim at these, never at the shared dataset or the checkout. (cache, pkg, tok)"""
    import shutil

    import autoresearch
    import autoresearch.trust.integrity as integrity
    cache = tmp_path / name
    tok = cache / "builtin" / tiny_dataset.tok_dir.name
    shutil.copytree(tiny_dataset.tok_dir, tok)
    pkg = tmp_path / "pkg" / "autoresearch"
    shutil.copytree(Path(autoresearch.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(integrity, "PACKAGE_DIR", pkg)
    monkeypatch.setenv("AR_CACHE", str(cache))
    return cache, pkg, tok
