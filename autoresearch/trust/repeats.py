"""Repeat detection: has this proposal been tried already? Judged from the runner's records only.

Two fingerprints, both blind to whitespace, blank lines and comments (Python's own tokenizer tells a `#` in
a string from a comment):

- the **change**: the lines a diff removes and adds (`diff.patch` of each experiment, or the proposal's
  `git diff` against its parent), without line numbers or context, so the same edit made again from another
  parent is recognised;
- the **program**: the editable file as a whole, with its knobs compared by value (`2**19`, `524288` and
  `524_288` are one value), so a different edit that lands on a train.py already run, or a knob point a
  built-in proposer already tried, is recognised too.

Tried means run to an outcome: keep, discard, crash, timeout, degraded, pruned or stale. A rejected
proposal, an interrupted run or a validation re-run tried nothing new.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import threading
import tokenize
from pathlib import Path

from autoresearch.errors import ArError
from autoresearch.gitops import GitRepo
from autoresearch.knobs import scan
from autoresearch.records.layout import TagLayout
from autoresearch.records.ledger import Row, Status

TRIED = frozenset({Status.KEEP, Status.DISCARD, Status.CRASH, Status.TIMEOUT, Status.DEGRADED, Status.PRUNED,
                   Status.STALE})
REFUSED = "refused as a repeat"     # how a refusal's reason starts (the journal counts them by it)
_LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER}
_cache: dict[tuple[str, str, str], str | None] = {}     # (git dir, sha, path) or (folder, file, stamp) -> fingerprint
_cache_lock = threading.Lock()


def built_config(exp_dir: Path | None) -> dict | None:
    """The model an experiment built: the config of its checkpoint's model.json (copied beside its record), or
    None when it saved none."""
    try:
        doc = json.loads((Path(exp_dir) / "model.json").read_text())
    except (OSError, TypeError, ValueError):
        return None
    return doc.get("config") if isinstance(doc, dict) and isinstance(doc.get("config"), dict) else None


def model_knob(name: str, config: dict) -> bool:
    """A knob the built model's config records under its own name (DEPTH -> depth): what it changes shows there."""
    return name.lower() in config


def same_build(best_dir: Path | None, best_knobs: dict, cand_dir: Path | None, cand_knobs: dict) -> str | None:
    """Why the candidate built and trained the same as the best, or None. The same when both checkpoints hold the
    same model config and every knob that differs is one that config records (a profile that clamps DEPTH 7 and
    6 to one layer builds one model from both): then only the machine made the difference. A knob outside the
    config (LR, batch, schedule) may change the training, so it is never called the same."""
    a, b = built_config(best_dir), built_config(cand_dir)
    if a is None or b is None or a != b:
        return None
    moved = sorted(k for k in set(best_knobs) | set(cand_knobs) if best_knobs.get(k) != cand_knobs.get(k))
    if not moved or not all(model_knob(k, a) for k in moved):
        return None
    shown = ", ".join(f"{k} {v}" for k, v in a.items() if not isinstance(v, (dict, list)))[:120]
    return (f"it builds the same model as the best ({shown}): {', '.join(moved)} changes nothing in it on this "
            "profile, so the difference is the machine's (throughput), not the change's")


def _tokens(text: str) -> list[str]:
    """The tokens of Python source without comments, blank lines and spacing; indentation is kept as block
    structure (INDENT/DEDENT), not as a width. Source that does not tokenize (an unterminated string) is
    compared as its words, comments cut off."""
    out: list[str] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE):
                out.append(tokenize.tok_name[tok.type])
            elif tok.type not in _LAYOUT:
                out.append(tok.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        if not out or "\n" in text.strip():
            out = re.sub(r"(^|\s)#.*$", "", text, flags=re.M).split()
    return out


def normalise_line(line: str) -> str:
    """One line of a diff: its indentation width, then its tokens ('' for a blank or comment-only line)."""
    body = [t for t in _tokens(line.strip() + "\n") if t not in ("NEWLINE", "INDENT", "DEDENT")]
    if not body:
        return ""
    return f"{len(line.expandtabs(4)) - len(line.expandtabs(4).lstrip())}|" + " ".join(body)


def change_fingerprint(diff: str) -> str | None:
    """The fingerprint of what a unified diff changes, or None when it changes only whitespace or comments."""
    parts: list[str] = []
    for line in diff.splitlines():
        if line.startswith("+++ ") or line.startswith("--- "):
            parts.append("F" + line[4:].strip().removeprefix("a/").removeprefix("b/"))
        elif line[:1] in ("+", "-"):
            norm = normalise_line(line[1:])
            if norm:
                parts.append(line[0] + norm)
    if not any(p[0] in "+-" for p in parts):
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def program_fingerprint(text: str) -> str:
    """The fingerprint of a whole editable file: its code without layout or comments, its knobs by value."""
    try:
        knobs = scan(text)
    except ArError:          # does not parse: compare it as text
        knobs = {}
    lines = text.splitlines()
    for k in knobs.values():
        for i in range(k.line - 1, k.span[2]):
            lines[i] = ""
    values = {n: (f"{k.value:.12g}" if isinstance(k.value, float) else k.value) for n, k in sorted(knobs.items())}
    body = " ".join(_tokens("\n".join(lines) + "\n"))
    return hashlib.sha256((json.dumps(values, sort_keys=True, default=str) + "\n" + body).encode()).hexdigest()[:20]


def _program_at(git: GitRepo, sha: str, path: str) -> str | None:
    key = (str(git.git_dir), sha, path)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    try:
        fp = program_fingerprint(git.file_at(sha, path))
    except ArError:
        fp = None            # the commit is gone (an upstream ledger, a pruned repo): compare the change only
    with _cache_lock:
        _cache[key] = fp
    return fp


def _exp_dir(paths: TagLayout, row: Row) -> Path | None:
    if row.exp_id is None:
        return None
    d = paths.exp_dir(row.exp_id, row.commit)
    return d if d.is_dir() else None


def recorded_change(paths: TagLayout, row: Row) -> str:
    """The diff the runner recorded for a row ('' when none)."""
    d = _exp_dir(paths, row)
    try:
        return (d / "diff.patch").read_text(errors="replace") if d else ""
    except OSError:
        return ""


def _recorded_fingerprint(paths: TagLayout, row: Row) -> str | None:
    d = _exp_dir(paths, row)
    try:
        st = (d / "diff.patch").stat() if d else None
    except OSError:
        st = None
    if st is None:
        return None
    key = (str(d), "diff.patch", f"{st.st_size}:{st.st_mtime_ns}")
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    fp = change_fingerprint(recorded_change(paths, row))
    with _cache_lock:
        _cache[key] = fp
    return fp


def _label(row: Row) -> str:
    exp = f"experiment {row.exp_id:04d}" if row.exp_id is not None else f"commit {row.commit}"
    bpb = f", val_bpb {row.val_bpb:.6f}" if row.val_bpb is not None else ""
    return f"{exp} ({row.status.value}{bpb}, commit {row.commit or '-'})"


def find_repeat(git: GitRepo, tag_dir: Path, parent: str, train_file: str, rows: list[Row], *,
                same_change: bool = True) -> str | None:
    """Why the proposal now in `git`'s working tree repeats a tried experiment of the tag, or None.

    `same_change=False` (a built-in proposer's knob edit) judges the program only: a search moves one knob
    from wherever the best is now, and the same move from a new best is a new point, not a repeat.

    A proposal that changes nothing, or files other than `train_file`, is left to the guards, which reject
    those in their own words."""
    diff = git.diff(parent)
    touched = set(re.findall(r"^diff --git a/(\S+) b/(\S+)$", diff, flags=re.M))
    if not diff.strip() or any(a != train_file or b != train_file for a, b in touched):
        return None          # nothing changed, or other files too: the guards' call, in their own words
    paths = TagLayout(Path(tag_dir))
    try:
        program = program_fingerprint((git.root / train_file).read_text(errors="replace"))
    except OSError:
        program = None
    change = change_fingerprint(diff)
    for row in rows:
        if row.status not in TRIED or not row.commit:
            continue
        if program is not None and _program_at(git, row.commit, train_file) == program:
            same = ("is the same train.py" if change is not None else "changes only whitespace or comments: it is "
                    "the same train.py")
            return (f"{REFUSED}: the proposal {same} as {_label(row)} (whitespace, comments and how knob values "
                    "are written ignored); propose a change that was not tried")
        if same_change and change is not None and _recorded_fingerprint(paths, row) == change:
            return (f"{REFUSED}: the proposal makes the same change as {_label(row)}, whitespace and comments "
                    "ignored; propose a change that was not tried, or combine it with a new one")
    return None
