"""Checks on a proposal before it is committed: what changed, and what train.py now says.

Scope: only the allowed paths (default `train.py`) may differ from the parent commit. Anything else —
the harness, configs, program.md, tests, a new file, a deleted file, anything inside .git (config, hooks,
HEAD, refs) or the loop's own bookkeeping under runs/<tag>/ — rejects the proposal.
Content: train.py must parse, and must not touch what the runner owns: the AR_* run variables, writes to
os.environ with computed keys, the evaluator record path, or the time budget / evaluation size / seed of
the run environment. These content checks are a first line; the runner's own clock, the hard timeout and
the val_bpb cross-check with the evaluator record are what make the budget and the metric hold.
"""

from __future__ import annotations

import ast
import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

from autoresearch import faults
from autoresearch.errors import GitError
from autoresearch.knobs import parse_source
from autoresearch.records.durable import put_back
from autoresearch.records.layout import BOOKKEEPING, is_derived
from autoresearch.gitops import GitRepo, git_state, restore_git_state

RUNNER_ENV = ("AR_TIME_BUDGET", "AR_SEED", "AR_DATASET", "AR_CACHE", "AR_PROFILE", "AR_PEAK_TFLOPS", "AR_GPU_TABLE",
              "AR_GPUS_FILE", "AR_TOK_DIR", "AR_CHECKPOINT_DIR", "AR_UNTIMED_STEPS", "AR_DATA_FD")
RUNNER_FIELDS = ("time_budget", "seed", "tok_dir", "checkpoint_dir", "untimed_steps")


@dataclass
class Snapshot:
    """What must not change while a proposal is made, taken just before it."""

    parent: str
    untracked: dict[str, tuple[int, int]]
    git: dict[str, bytes]
    runs: dict[str, tuple[int, int]]               # files under runs/<tag>/ -> (size, mtime_ns)
    backups: dict[str, bytes] = field(default_factory=dict)  # bookkeeping files' bytes, to restore


def _runs_files(tag_dir: Path) -> dict[str, tuple[int, int]]:
    out = {}
    if tag_dir.is_dir():
        for f in tag_dir.rglob("*"):
            if f.is_file() and not is_derived(f.name):   # views, and the event stream ar appends to
                st = f.stat()
                out[str(f.relative_to(tag_dir))] = (st.st_size, st.st_mtime_ns)
    return out


def snapshot(repo: GitRepo, parent: str, tag_dir: Path) -> Snapshot:
    backups = {n: (tag_dir / n).read_bytes() for n in BOOKKEEPING if (tag_dir / n).is_file()}
    return Snapshot(parent, repo.untracked(), git_state(repo.git_dir), _runs_files(tag_dir), backups)


def allowed(path: str, allowed_paths: list[str]) -> bool:
    """Whether a proposal may change `path` (the config's allowed_paths: names or glob patterns)."""
    return any(path == a or fnmatch.fnmatch(path, a) for a in allowed_paths)


_allowed = allowed


def check_scope(repo: GitRepo, snap: Snapshot, allowed: list[str], tag_dir: Path,
                exclude_prefix: str | None = None) -> tuple[list[str], str | None]:
    """(changed paths, reason to reject or None). `exclude_prefix`: a folder under runs/<tag>/ the proposer
    may write to (its own log, its description)."""
    now_git = git_state(repo.git_dir)
    touched_git = sorted(k for k in set(now_git) | set(snap.git) if now_git.get(k) != snap.git.get(k))
    if touched_git:
        return [], f"the proposal changed .git/{touched_git[0]}" + (f" and {len(touched_git) - 1} more" if
                                                                  len(touched_git) > 1 else "")
    now_runs = _runs_files(tag_dir)
    own = exclude_prefix or "\0"
    touched_runs = sorted(k for k in set(now_runs) | set(snap.runs)
                          if now_runs.get(k) != snap.runs.get(k) and not k.startswith(own))
    if touched_runs:
        return [], f"the proposal changed {tag_dir.name}/{touched_runs[0]} under runs/ (the loop's records)"
    changed = repo.changed_paths(snap.parent, snap.untracked)
    outside = [p for p in changed if not _allowed(p, allowed)]
    if outside:
        more = f" and {len(outside) - 1} more" if len(outside) > 1 else ""
        return changed, f"the proposal changed {outside[0]}{more}; only {', '.join(allowed)} may change"
    return changed, None


def restore(repo: GitRepo, snap: Snapshot, tag_dir: Path) -> None:
    """Put .git, the working tree (at the parent commit) and the loop's bookkeeping back as they were.
    Untracked files the proposal created are deleted; ones that were there before are left alone."""
    restore_git_state(repo.git_dir, snap.git)
    new_untracked = [p for p in repo.untracked() if p not in snap.untracked]
    faults.point("reject")
    repo.reset_hard(snap.parent)
    repo.remove_untracked(new_untracked)
    tag_dir.mkdir(parents=True, exist_ok=True)
    for name, data in snap.backups.items():
        f = tag_dir / name
        if not f.is_file() or f.read_bytes() != data:
            put_back(f, data)            # in place: keep any open append handles pointing at the same file


def _runner_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        for name in RUNNER_ENV:
            if name in node.value:
                return name
    return None


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" or isinstance(node, ast.Name) and \
        node.id == "environ"


def _findings(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(kind, detail, line) for every construct in the source that reaches for what the runner owns."""
    out = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        name = _runner_name(node)
        if name:
            out.append(("names", name, line))
        elif isinstance(node, ast.Attribute) and node.attr == "result_file":
            out.append(("uses the evaluator record path", "result_file", line))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for sub in (s for t in targets for s in ast.walk(t)):
                if isinstance(sub, ast.Attribute) and sub.attr in RUNNER_FIELDS:
                    out.append(("assigns", "." + sub.attr, line))
                if isinstance(sub, ast.Subscript) and _is_environ(sub.value) and \
                        not isinstance(sub.slice, ast.Constant):
                    out.append(("writes os.environ with", "a computed key", line))
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if isinstance(f, ast.Attribute) and _is_environ(f.value) and fname in ("update", "pop", "clear"):
                out.append(("changes os.environ with", fname, line))
            if fname in ("putenv", "unsetenv", "__setattr__"):
                out.append(("calls", fname, line))
            if fname == "replace":
                for kw in node.keywords:
                    if kw.arg in RUNNER_FIELDS:
                        out.append(("replaces", kw.arg, line))
    return out


def check_source(text: str, path: str = "train.py", parent_text: str | None = None) -> str | None:
    """A reason to reject this train.py, or None. With `parent_text`, only constructs the parent did not
    already have count (the shipped train.py may legitimately hand the record path to the evaluator)."""
    try:
        tree = parse_source(text)
    except SyntaxError as e:
        return f"{path} does not parse: line {e.lineno}: {e.msg}"
    known: dict[tuple[str, str], int] = {}
    if parent_text is not None:
        try:
            for kind, detail, _ in _findings(parse_source(parent_text)):
                known[(kind, detail)] = known.get((kind, detail), 0) + 1
        except SyntaxError:
            pass
    for kind, detail, line in sorted(_findings(tree), key=lambda f: f[2]):
        if known.get((kind, detail), 0) > 0:
            known[(kind, detail)] -= 1
            continue
        return f"{path} line {line} {kind} {detail}, which belongs to the runner"
    return None


MAX_SOURCE_BYTES = 256 * 1024     # a train file larger than this is carrying something other than code
MAX_LITERAL_BYTES = 16 * 1024     # one string/bytes literal
DENSE_MIN_BYTES = 8 * 1024        # added text this large must compress like code does (≥ 2:1)


def check_payload(text: str, parent_text: str | None, path: str = "train.py") -> str | None:
    """A reason to reject a file that smuggles data in (weights trained elsewhere, e.g. in the agent's own
    process, or tables computed from the validation text), or None. Code compresses well; weights do not."""
    import zlib
    size = len(text.encode())
    if size > MAX_SOURCE_BYTES:
        return f"{path} is {size // 1024} KB, over the {MAX_SOURCE_BYTES // 1024} KB a training script may be"
    try:
        tree = parse_source(text)
    except SyntaxError:
        return None                          # check_source says so
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)) and \
                len(node.value) > MAX_LITERAL_BYTES:
            return (f"{path} line {node.lineno} holds a {len(node.value) // 1024} KB literal; a proposal changes "
                    "code, it does not carry data or weights")
    old = set((parent_text or "").splitlines())
    added = "\n".join(ln for ln in text.splitlines() if ln not in old).encode()
    if len(added) >= DENSE_MIN_BYTES:
        ratio = len(added) / max(1, len(zlib.compress(added, 9)))
        if ratio < 2.0:
            return (f"{path} adds {len(added) // 1024} KB that compresses only {ratio:.1f}:1 (code compresses "
                    "≥ 2:1); a proposal changes code, it does not carry data or weights")
    return None


def check_files(repo: GitRepo, parent: str, paths: list[str]) -> str | None:
    """Content checks for the changed allowed paths that are Python files, against their parent version."""
    for p in paths:
        f = repo.root / p
        if f.suffix == ".py" and f.is_file():
            try:
                parent_text = repo.file_at(parent, p)
            except GitError:
                parent_text = None
            text = f.read_text(errors="replace")
            reason = check_source(text, p, parent_text) or check_payload(text, parent_text, p)
            if reason:
                return reason
    return None


# ------------------------------------------------------------------------------------------ at run time

@dataclass
class RunWatch:
    """What a training run must leave alone, taken just before it: .git and the loop's records under runs/<tag>/
    (with their bytes, to put back). The sandbox already forbids both; this catches an unsandboxed run. The
    package and the data are integrity.Fingerprint's."""

    git: dict[str, bytes]
    runs: dict[str, tuple[int, int]]
    backups: dict[str, bytes]


def watch_run(repo: GitRepo, tag_dir: Path) -> RunWatch:
    backups = {n: (tag_dir / n).read_bytes() for n in BOOKKEEPING if (tag_dir / n).is_file()}
    return RunWatch(git_state(repo.git_dir), _runs_files(tag_dir), backups)


def run_changes(repo: GitRepo, w: RunWatch, tag_dir: Path, own: str) -> str | None:
    """What the run changed in .git or the loop's records (undo_run_changes puts them back), or None.
    `own`: the experiment's folder name under runs/<tag>/ (its log and record are written there)."""
    now_git = git_state(repo.git_dir)
    touched = sorted(k for k in set(now_git) | set(w.git) if now_git.get(k) != w.git.get(k))
    if touched:
        return f"the run changed .git/{touched[0]}"
    now_runs = _runs_files(tag_dir)
    touched = sorted(k for k in set(now_runs) | set(w.runs)
                     if now_runs.get(k) != w.runs.get(k) and not k.startswith(own + "/"))
    if touched:
        return f"the run changed {tag_dir.name}/{touched[0]} under runs/ (the loop's records)"
    return None


def undo_run_changes(repo: GitRepo, w: RunWatch, tag_dir: Path) -> None:
    """Put .git and the loop's records back as they were before the run (harness and data cannot be)."""
    restore_git_state(repo.git_dir, w.git)
    tag_dir.mkdir(parents=True, exist_ok=True)
    for name, data in w.backups.items():
        f = tag_dir / name
        if not f.is_file() or f.read_bytes() != data:
            put_back(f, data, sync=True)
