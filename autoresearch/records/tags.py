"""Tags: which one a command runs or reads, and what a tag's results compare under.

One rule, for every command (`ar run`, `try`, `eval`, `report`, `status`, `journal`, `serve`; `ar sweep` takes its
sweep's name), in order:
  1. --tag, when given;
  2. the tag of the branch you are on (autoresearch/<tag>) — for a command that reads, the running loop's first
     (the same tag once it has checked out its branch); a command that runs experiments (`ar run`, `ar try`,
     `ar eval`) passes over a sweep's branch and, for `ar run`, a tag whose settings differ from its own;
  3. else today's tag, as `ar run` takes it: today's (nov30), or the first of today-2, today-3, … whose settings
     match this run's; a command that only reads (`report`, `status`, `journal`, `serve`) does not know the
     flags `ar run` will get, and takes the latest of today's tags that has results;
  4. a command that only reads, where today has none: the newest tag with results (a folder that is no git
     repository, upstream's runs/, reads so too).
`Choice.why` says which step chose it; every command says it in one line.

A tag's results compare only under the same settings (`settings`: budget, dataset, profile, eval tokens, the
objective), kept in runs/<tag>/meta.json when the tag starts, and on the same data: the validation split and the
tokenizer its first result was scored on, kept in runs/<tag>/data.json (`check_data`). A change of either is
refused in one line that says what changed and the way forward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from autoresearch.errors import ArError, ConfigError, DataError
from autoresearch.gitops import GitRepo, branch_name, check_tag, default_tag
from autoresearch.records.layout import DATA, RESULTS, RunsLayout
from autoresearch.records.durable import write_atomic
from autoresearch.records.ledger import now_iso, read_results

Settings = Callable[[], dict]    # computed only when a tag's meta.json is there to compare with


@dataclass(frozen=True)
class Choice:
    tag: str
    why: str          # how it was chosen, said in one line: "--tag", "the branch you are on, …", "today's …"
    note: str = ""    # `ar run`: why a fresh tag (its first line says it)
    exists: bool = True

    def line(self) -> str:
        return f"tag {self.tag} ({self.why})"


def settings(*, time_budget: float, dataset: str, profile: str, eval_tokens: int, sweep: bool,
             objective: str | None) -> dict:
    """What must stay the same for a tag's results to compare (a sweep varies the budget itself; a command
    objective's name joins them, val_bpb tags stay as they were)."""
    out = {"time_budget": time_budget, "dataset": dataset, "profile": profile, "eval_tokens": eval_tokens}
    if sweep:
        del out["time_budget"]
    if objective:
        out["objective"] = objective
    return out


def of_config(cfg, command: str = "ar run") -> dict:
    """The comparable settings of a run of `cfg` (a RunConfig): its budget, dataset, profile, eval tokens."""
    from autoresearch.harness.env import resolve_profile
    profile = resolve_profile(None if cfg.profile == "auto" else cfg.profile)
    return settings(time_budget=float(cfg.time_budget or profile.time_budget), dataset=cfg.dataset,
                    profile=profile.name, eval_tokens=cfg.eval_tokens or profile.eval_tokens,
                    sweep=command.startswith("ar sweep"),
                    objective=cfg.objective.name if cfg.objective.custom else None)


def _meta(root: Path, tag: str) -> dict | None:
    try:
        doc = json.loads(RunsLayout(root).tag(tag).meta.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def differs(root: Path, tag: str, now: dict | Settings) -> tuple[str, str] | None:
    """(how, which setting) the settings `now` differ from those `tag` was started with; None: they match, or
    the tag is new."""
    meta = _meta(root, tag)
    if meta is None:
        return None
    was = meta.get("settings") or {}
    for key, value in (now() if callable(now) else now).items():
        if was.get(key, value) != value:
            return f"tag {tag} was run with {key} {was[key]}, this run asks for {value}", key
    return None


def refuse_incomparable(root: Path, tag: str, now: dict | Settings) -> None:
    d = differs(root, tag, now)
    if d:
        raise ConfigError(f"{d[0]}: their results are not comparable; pick a new tag (--tag) or the same {d[1]}")


def is_sweep(root: Path, tag: str) -> bool:
    """Whether tag is a sweep's (meta.json says which command started it; older tags: the sweep- prefix)."""
    kind = (_meta(root, tag) or {}).get("kind")
    return kind == "sweep" if kind else tag.startswith("sweep-")


def branch_tag(root: Path) -> str | None:
    """The tag of the branch checked out in root (autoresearch/<tag>), if it is one."""
    try:
        branch = GitRepo(root).current_branch()
    except ArError:
        return None
    prefix = branch_name("")
    if not branch or not branch.startswith(prefix):
        return None
    try:
        return check_tag(branch[len(prefix):])      # a branch of that name that is no tag's is passed over
    except ArError:
        return None


def _running(root: Path) -> str | None:
    """The tag of the `ar run` or `ar sweep` that holds the repo's lock (not an `ar try`: it checks out nothing)."""
    from autoresearch.records.lock import read_holder
    lock = RunsLayout(root).lock
    holder = read_holder(lock) if lock.exists() else None
    command = str((holder or {}).get("command") or "")
    return holder.get("tag") if holder and not command.startswith(("ar try", "ar eval")) else None


def _todays(root: Path, now: Settings, passed: str = "") -> Choice:
    """Step 3: today's tag, or the first of today-2, today-3, … whose settings match."""
    today = default_tag()
    why = "today's, as `ar run` takes it" + (f"; {passed}" if passed else "")
    d = differs(root, today, now)
    if d is None:
        return Choice(today, why, exists=RunsLayout(root).tag(today).dir.is_dir())
    for i in range(2, 1000):
        tag = f"{today}-{i}"
        if differs(root, tag, now) is None:
            return Choice(tag, f"{why}; {d[0]}", note=f" ({d[0]}: a fresh tag)",
                          exists=RunsLayout(root).tag(tag).dir.is_dir())
    raise ConfigError(f"999 tags of today ({today}-N) were run with other settings; pass --tag")


def for_run(root: Path, now: Settings, asked: str | None = None, *, compare: bool = True) -> Choice:
    """The tag a command that runs experiments takes (steps 1-3). Asked for by name: that tag, refused here
    (before any data or lock) when its results would not compare. `compare`: also pass over the branch's tag
    when its settings differ (`ar run`; `ar try` takes the tag's settings instead)."""
    if asked:
        check_tag(asked)
        if compare:
            refuse_incomparable(root, asked, now)
        return Choice(asked, "--tag")
    on, passed = branch_tag(root), ""
    if on:
        d = differs(root, on, now) if compare else None
        if is_sweep(root, on):
            passed = f"not {on}, the sweep of the branch you are on"
        elif d is None:
            return Choice(on, f"the branch you are on, {branch_name(on)}",
                          exists=RunsLayout(root).tag(on).dir.is_dir())
        elif on != default_tag():
            passed = f"not {on}, the branch you are on: {d[0]}"
    return _todays(root, now, passed)


def for_reading(root: Path, asked: str | None = None, *, have: tuple[str, ...] = (RESULTS,)) -> Choice:
    """The tag a command that reads takes (steps 1-4). Step 3 for a reader is today's tag, or the latest of
    today-2, today-3, … that has results (which of them `ar run` takes depends on its flags, which a reader does
    not know). `have`: the files that make a tag readable (results.tsv; for `ar status` the event stream too)."""
    if asked:
        return Choice(asked, "--tag", exists=RunsLayout(root).tag(asked).dir.is_dir())
    running = _running(root)
    if running:        # it has checked out its branch, or is about to (while it prepares data)
        return Choice(running, "the running loop's", exists=RunsLayout(root).tag(running).dir.is_dir())
    on = branch_tag(root)
    if on:
        return Choice(on, f"the branch you are on, {branch_name(on)}", exists=RunsLayout(root).tag(on).dir.is_dir())
    found, today = newest(root, have), default_tag()
    todays = [t for t in found if t == today or (t.startswith(f"{today}-") and t[len(today) + 1:].isdigit())]
    if todays:
        return Choice(todays[0], "today's, as `ar run` takes it: no tag's branch is checked out")
    if found:
        return Choice(found[0], f"the newest tag with {' or '.join(have)}: no tag's branch is checked out and no "
                                f"tag of today's ({today}) has one")
    return Choice(today, "today's, as `ar run` takes it", exists=False)


def newest(root: Path, have: tuple[str, ...] = (RESULTS,)) -> list[str]:
    """Tags under runs/ that have one of the `have` files, newest first (by the file's last change)."""
    runs = RunsLayout(Path(root))
    found: dict[str, float] = {}
    for name in have:
        for p in runs.tags_with(name):
            found[p.parent.name] = max(found.get(p.parent.name, 0.0), p.stat().st_mtime)
    return sorted(found, key=lambda t: (found[t], t), reverse=True)


def oldest_first(root: Path, tags: list[str]) -> list[str]:
    """Tags in the order they were started (meta.json's created_at, else their first row's start, else the
    results file's first write as far as the file system knows)."""
    runs = RunsLayout(Path(root))

    def started(tag: str) -> str:
        created = (_meta(root, tag) or {}).get("created_at")
        if created:
            return str(created)
        try:
            rows = read_results(runs.tag(tag).results, warn=lambda m: None)
        except OSError:
            rows = []
        first = next((r.started_at for r in rows if getattr(r, "started_at", None)), None)
        if first:
            return str(first)
        try:
            import datetime as _dt
            st = runs.tag(tag).results.stat()
            return _dt.datetime.fromtimestamp(st.st_mtime).astimezone().isoformat(timespec="seconds")
        except OSError:
            return ""
    return sorted(tags, key=lambda t: (started(t), t))


def first_line(root: Path, tag: str, why_new: str = "") -> str:
    """What `ar run` says first about its tag: resuming it (with how many results) or new."""
    paths = RunsLayout(root).tag(tag)
    n = len(read_results(paths.results, warn=lambda m: None)) if paths.results.exists() else 0
    if n or paths.meta.exists():
        return f"resuming tag {tag} ({n} result{'s' * (n != 1)}; branch {branch_name(tag)})"
    return f"new tag {tag}{why_new}: branch {branch_name(tag)}, results in runs/{tag}/"


# ------------------------------------------------------------------------------------- the tag's data

def data_identity(tok_dir: Path) -> dict:
    """What a score depends on in the prepared data: the dataset, its validation split (documents, tokens,
    sha256 of the tokens) and the tokenizer."""
    from autoresearch.harness.data import load_meta
    meta = load_meta(tok_dir)
    val = meta.get("val") or {}
    return {"dataset": meta.get("dataset"), "source": meta.get("source"), "vocab_size": meta.get("vocab_size"),
            "val": {k: val.get(k) for k in ("docs", "tokens", "sha256")},
            "tokenizer_sha256": meta.get("tokenizer_sha256")}


def _what(d: dict) -> str:
    val = d.get("val") or {}
    return f"{val.get('docs')} validation documents (sha256 {str(val.get('sha256'))[:12]})"


def check_data(tag_dir: Path, tok_dir: Path | None, has_results: bool, key: Path, *, pin: bool = True) -> None:
    """Refuse data other than the tag was scored on; `pin`: record it when the tag has no result yet (or when a
    tag of an older ar has none recorded)."""
    if tok_dir is None:            # a command objective reads no prepared data
        return
    path = Path(tag_dir) / DATA
    now = data_identity(tok_dir)
    try:
        was = json.loads(path.read_text())
    except (OSError, ValueError):
        was = None
    if isinstance(was, dict) and has_results:
        keys = ("dataset", "val", "tokenizer_sha256")
        if {k: was.get(k) for k in keys} != {k: now.get(k) for k in keys}:
            tag = Path(tag_dir).name
            other = "another tokenizer" if was.get("val") == now.get("val") else _what(now)
            raise DataError(
                f"tag {tag} was scored on dataset {was.get('dataset')}'s {_what(was)}, the prepared data now has "
                f"{other}: another split (the cache prepared again with a new split key?), so its results would not "
                f"compare; start a new tag (--tag NAME), or put the key the tag was scored with back in {key} and "
                f"prepare the data again")
        return
    if pin and (was is None or not has_results):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({**now, "pinned_at": now_iso()}, indent=1))
