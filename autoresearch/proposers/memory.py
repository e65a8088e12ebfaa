"""Research memory: the journal of a tag, its prompt digest, and the plateau strategy.

Everything here is derived from the runner's own records — results.tsv (ours or upstream's five columns),
each experiment's `diff.patch` and `strategy.json`, noise.json, and git when a commit has no folder — so it
works the same on a running tag, a finished one and an upstream results file, and nothing needs migrating.
What a proposer says about its change (the description) is shown as its idea, labelled as its own words,
cut to one line of at most IDEA_MAX characters; outcomes and lessons come from the records alone.

- near miss: not kept, and val_bpb within the noise threshold of the best it was measured against (the best
  kept before it), or, decided on several runs, not worse but not shown better ("not yet decided"): a
  candidate to combine with another change or to re-test;
- dead end: worse than that best by more than the noise, or a crash/timeout/degraded run; grouped by idea
  (the knobs it moved and which way, else the functions its diff touches);
- plateau: `since_keep` proposals in a row without a keep; from `plateau_after` on the agent's prompt
  switches strategy (combine near misses, a bigger architectural change, the biggest win's neighbourhood),
  one strategy per `plateau_after` proposals, and each proposal's strategy is written to its folder.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from autoresearch.errors import ArError, ConfigError
from autoresearch.gitops import GitRepo
from autoresearch.knobs import KNOB_NAME, safe_eval
from autoresearch.records.layout import RESULTS, RunsLayout, TagLayout
from autoresearch.records.ledger import Row, Status, read_results
from autoresearch.records.durable import write_atomic
from autoresearch.trust.repeats import REFUSED, TRIED, recorded_change
from autoresearch import objective
from autoresearch.objective import DEFAULT, Objective

if TYPE_CHECKING:
    from autoresearch.records.tags import Choice

IDEA_MAX = 160
DIGEST_MAX = 2500          # bytes of the digest in the agent's prompt
STRATEGY_FILE = "strategy.json"
FAILED = (Status.CRASH, Status.TIMEOUT, Status.DEGRADED)
STRATEGIES = {
    "combine": "Plateau: combine two or more of the near misses above into one change (each came within noise "
               "of the best on its own).",
    "bigger": "Plateau: stop nudging knobs; make one bigger architectural change (attention, MLP, normalisation, "
              "embeddings, the optimizer's structure or schedule).",
    "revisit": "Plateau: go back to the neighbourhood of the biggest win so far ({win}); try a variation of that "
               "change (further in the same direction, or the same idea elsewhere in the model).",
}
_CTRL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")


def clean_text(text: str, limit: int = IDEA_MAX) -> str:
    """Untrusted text (a proposer's description) as one bounded line: no control characters or newlines."""
    one = " ".join(_CTRL.sub(" ", str(text)).split())
    return one if len(one) <= limit else one[:limit - 1] + "…"


@dataclass
class Entry:
    exp_id: int
    commit: str
    status: str
    val_bpb: float | None
    idea: str                     # the proposer's description: its own words, bounded, one line
    change: str                   # what the recorded diff does (knob moves, functions touched, line counts)
    outcome: str                  # status and the difference to the best it was measured against
    lesson: str                   # one line, from the records
    group: str                    # the idea it belongs to, for grouping dead ends
    delta: float | None = None    # val_bpb - the best before it (negative: better)
    near_miss: bool = False
    dead_end: bool = False
    strategy: str | None = None   # the plateau strategy its prompt carried, if any
    phase: int | None = None      # which plateau phase it was (memory.plateau_strategy)
    reason: str = ""


@dataclass
class Switch:
    exp_id: int
    strategy: str
    since_keep: int


@dataclass
class Journal:
    tag: str
    source: str                   # the results file it was read from
    noise: float
    noise_source: str
    entries: list[Entry] = field(default_factory=list)
    best: Entry | None = None
    switches: list[Switch] = field(default_factory=list)
    since_keep: int = 0

    @property
    def near_misses(self) -> list[Entry]:
        return [e for e in self.entries if e.near_miss]

    @property
    def dead_ends(self) -> dict[str, list[Entry]]:
        groups: dict[str, list[Entry]] = {}
        for e in self.entries:
            if e.dead_end:
                groups.setdefault(e.group, []).append(e)
        return groups

    @property
    def refused(self) -> list[Entry]:
        return [e for e in self.entries if e.reason.startswith(REFUSED)]

    def biggest_win(self) -> Entry | None:
        wins = [e for e in self.entries if e.status == "keep" and e.delta is not None]
        return min(wins, key=lambda e: e.delta) if wins else None

    def to_dict(self) -> dict:
        return {"tag": self.tag, "source": self.source, "noise": self.noise, "noise_source": self.noise_source,
                "since_keep": self.since_keep, "best": asdict(self.best) if self.best else None,
                "entries": [asdict(e) for e in self.entries],
                "near_misses": [e.exp_id for e in self.near_misses],
                "dead_ends": {g: [e.exp_id for e in es] for g, es in self.dead_ends.items()},
                "refused": [e.exp_id for e in self.refused],
                "switches": [asdict(s) for s in self.switches]}


# ------------------------------------------------------------------------------------------- the diff

def _knob_moves(diff: str) -> list[tuple[str, str, str]]:
    """(knob, old, new) for each top-level UPPER_CASE assignment the diff rewrites."""
    old: dict[str, str] = {}
    new: dict[str, str] = {}
    for line in diff.splitlines():
        if line[:1] in "+-" and not line.startswith(("+++", "---")):
            m = re.match(r"([A-Z][A-Z0-9_]*)\s*(?::[^=]+)?=\s*([^#]*)", line[1:])
            if m and KNOB_NAME.match(m.group(1)):
                (old if line[0] == "-" else new)[m.group(1)] = m.group(2).strip()
    return [(k, old.get(k, "-"), v) for k, v in new.items() if old.get(k) != v] + [
        (k, v, "-") for k, v in old.items() if k not in new]


def _places(diff: str) -> list[str]:
    """The functions or classes a diff's hunks sit in (git's hunk headers), in order, once each."""
    out: list[str] = []
    for m in re.finditer(r"^@@[^@]*@@ ?(.*)$", diff, flags=re.M):
        m2 = re.match(r"\s*(?:async\s+)?(def|class)\s+(\w+)", m.group(1))
        place = f"{m2.group(1)} {m2.group(2)}" if m2 else ""
        if place and place not in out:
            out.append(place)
    return out


def _counts(diff: str) -> tuple[int, int, list[str]]:
    added = removed = 0
    files: list[str] = []
    for line in diff.splitlines():
        if line.startswith("+++ "):
            name = line[4:].strip().removeprefix("b/")
            if name != "/dev/null":
                files.append(name)
        elif line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed, files


def _direction(old: str, new: str) -> str:
    try:
        a, b = safe_eval(old), safe_eval(new)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return "up" if b > a else "down" if b < a else "same"
    except ValueError:
        pass
    return f"-> {new}"


def describe_diff(diff: str) -> tuple[str, str]:
    """(what the diff changes, the idea it belongs to) in the runner's words."""
    if not diff.strip():
        return "no diff recorded", "no diff recorded"
    moves = _knob_moves(diff)
    added, removed, files = _counts(diff)
    knob_lines = 2 * len(moves)
    places = _places(diff)
    parts = [f"{k} {a} -> {b}" for k, a, b in moves]
    code = added + removed - knob_lines > 0
    if code:
        where = ", ".join(places[:3]) + (" …" if len(places) > 3 else "") if places else ", ".join(files[:3])
        parts.append(f"code +{added - len(moves)}/-{removed - len(moves)} in {where or 'the file'}")
    if moves and not code:
        group = ", ".join(f"{k} {_direction(a, b)}" for k, a, b in moves[:3])
    else:
        group = "code: " + (", ".join(places[:2]) if places else ", ".join(files[:2]) or "train.py")
    return clean_text("; ".join(parts), 240), clean_text(group, 120)


def _diff_of(paths: TagLayout, git: GitRepo | None, row: Row) -> str:
    text = recorded_change(paths, row)
    if text or git is None or not row.commit or row.exp_id is not None:
        return text             # ar's own rows: diff.patch or nothing (a baseline, a rejected proposal)
    try:          # an upstream ledger: the commit's own diff, when git still has it
        return git._git("show", "--format=", "--no-color", row.commit)[:1 << 20]
    except ArError:
        return ""


def _strategy_of(paths: TagLayout, row: Row) -> dict | None:
    if row.exp_id is None:
        return None
    f = paths.exp_dir(row.exp_id, row.commit) / STRATEGY_FILE
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("strategy") in STRATEGIES else None


# ------------------------------------------------------------------------------------------- building

def counts_since_keep(rows: list[Row]) -> int:
    """Proposals since the last keep (rejected ones included: a refused repeat is a stuck proposer too);
    validation re-runs and interrupted runs do not count, nor slots' proposals still in flight."""
    n = 0
    for r in rows:
        if r.status is Status.KEEP:
            n = 0
        elif r.status not in (Status.VALIDATION, Status.INTERRUPTED) and r.reason != "in flight":
            n += 1
    return n


def _lesson(e: Entry, row: Row, noise: float) -> str:
    if row.status is Status.KEEP:
        return ("the starting point" if e.delta is None else
                f"worked: {-e.delta:.6f} better than the best before it; build on it")
    if row.status is Status.REJECTED:
        return "not run: " + clean_text(row.reason, 140) if row.reason else "not run"
    if row.status in FAILED:
        return f"failed ({row.status.value}): " + clean_text(row.reason or "see train.log", 140)
    if row.status is Status.VALIDATION:
        return "a re-run of a kept commit with another seed (measures noise, changes nothing)"
    if row.status is Status.INTERRUPTED:
        return "cut short; not a result"
    if e.delta is None:
        return clean_text(row.reason, 140) or "no score"
    if e.delta < -noise:     # a win not kept (the hold-out slice, a stale parent, a failed confirmation)
        return "beat the best but was not kept: " + clean_text(row.reason, 140)
    if e.near_miss and undecided_by_evidence(row.reason):
        return ("not yet decided: its runs did not settle it either way (not worse); combine it with another "
                "change or re-test it")
    if e.near_miss:
        return (f"near miss: within the noise ({noise:g}) of the best; combine it with another change or "
                "re-test it")
    return f"dead end: {e.delta:+.6f} against the best, beyond the noise ({noise:g}); do not try it again"


def undecided_by_evidence(reason: str) -> bool:
    """A sequential decision (decide.SequentialRule) that discarded a candidate because its runs ran out or the
    best moved, not because it was worse: a near miss, not a dead end."""
    return reason.startswith("discarded: ") and ("under the bar" in reason or "the best changed" in reason
                                                 or "failed (" in reason)


def build(rows: list[Row], *, tag: str, source: str, noise: float, noise_source: str,
          tag_dir: Path | None = None, git: GitRepo | None = None, objective: Objective = DEFAULT) -> Journal:
    """The journal of rows in ledger order; experiment folders and git (when given) add diffs and strategies.
    Deltas are oriented so that negative is better, whichever way the objective goes."""
    paths = TagLayout(Path(tag_dir)) if tag_dir is not None else None
    j = Journal(tag, source, objective.threshold(noise, None), noise_source)
    base_noise, best = noise, None
    last_strategy: str | None = None
    for i, row in enumerate(rows):
        exp_id = row.exp_id if row.exp_id is not None else i + 1
        diff = _diff_of(paths, git, row) if paths is not None else ""
        change, group = describe_diff(diff) if row.status is not Status.VALIDATION else ("re-run", "re-run")
        delta = None if row.val_bpb is None or best is None else objective.sign * (row.val_bpb - best)
        noise = objective.threshold(base_noise, best)
        e = Entry(exp_id=exp_id, commit=row.commit, status=row.status.value, val_bpb=row.val_bpb,
                  idea=clean_text(row.description) or "(no description)", change=change, outcome="",
                  lesson="", group=group, delta=None if delta is None else round(delta, 6),
                  reason=clean_text(row.reason, 300))
        ran = row.status in TRIED and row.status is not Status.KEEP
        undecided = ran and undecided_by_evidence(row.reason)
        e.near_miss = undecided or (ran and delta is not None and abs(delta) <= noise and row.status is not Status.STALE
                                    and not row.reason.startswith("discarded: "))
        e.dead_end = (ran and not undecided and delta is not None and
                      (delta > noise or row.reason.startswith("discarded: "))) or row.status in FAILED
        e.outcome = row.status.value + ("" if row.val_bpb is None else f" {row.val_bpb:.6f}") + (
            "" if delta is None else f" ({delta:+.6f} vs best)")
        e.lesson = _lesson(e, row, noise)
        doc = _strategy_of(paths, row) if paths is not None else None
        if doc:
            e.strategy = doc["strategy"]
            e.phase = doc.get("phase") if isinstance(doc.get("phase"), int) else None
            if e.strategy != last_strategy:
                j.switches.append(Switch(exp_id, e.strategy, int(doc.get("since_keep") or 0)))
        last_strategy = e.strategy if doc else (None if row.status is Status.KEEP else last_strategy)
        if row.status is Status.KEEP and row.val_bpb is not None and objective.better(row.val_bpb, best):
            best = row.val_bpb
            j.best = e
        j.entries.append(e)
    j.since_keep = counts_since_keep(rows)
    return j


def load(tag_dir: Path | None = None, *, results: Path | None = None, repo: Path | None = None,
         noise: float | None = None) -> Journal:
    """The journal of runs/<tag>/ (or of any results.tsv, upstream's too). Missing results: an ArError."""
    from autoresearch.config import RunConfig
    path = Path(results) if results is not None else TagLayout(Path(tag_dir)).results
    started = tag_dir is not None and TagLayout(Path(tag_dir)).meta.is_file()   # a tag before its first row
    if not path.is_file() and not started:
        raise ArError(f"no results file at {path}; run `ar run` first, or pass --results FILE")
    rows = read_results(path, warn=lambda m: None)
    folder = Path(tag_dir) if tag_dir is not None else path.parent
    if noise is not None:
        threshold, where = noise, "given"
    else:
        threshold, where = RunConfig().noise_threshold(folder)
        if where != "default":
            where = "noise.json"
    git = None
    try:
        git = GitRepo(repo or folder)
    except ArError:
        pass
    tag = folder.name if results is None or (folder / "meta.json").exists() else path.stem
    obj = objective.load(folder)
    if obj.noise is not None or obj.noise_share is not None:
        where = "objective.noise"
    return build(rows, tag=tag, source=str(path), noise=threshold, noise_source=where, tag_dir=folder, git=git,
                 objective=obj)


def for_repo(repo: Path, tag: str | None = None, results: Path | None = None,
             noise: float | None = None) -> tuple[Journal, Path | None, "Choice | None"]:
    """(the journal, the tag folder to write it to, or None for a results file outside runs/, and how the tag was
    chosen: tags.py's rule; None for --results)."""
    from autoresearch.records import tags
    if results is not None:
        if tag is not None:
            raise ConfigError("--tag and --results exclude each other; pass one")
        return load(results=results, repo=repo if (Path(repo) / ".git").exists() else None, noise=noise), None, None
    runs = RunsLayout(Path(repo))
    if tag is None and not tags.newest(Path(repo)):
        raise ArError(f"no results yet: no {runs.runs}/<tag>/results.tsv; run `ar run` first, or pass "
                      "--results FILE (upstream's results.tsv works too)")
    choice = tags.for_reading(Path(repo), tag)
    tag_dir = runs.tag(choice.tag).dir
    if not (tag_dir / RESULTS).is_file() and not runs.tag(choice.tag).meta.is_file():
        others = ", ".join(tags.newest(Path(repo)))
        why = f" ({choice.why})" if choice.why != "--tag" else ""
        raise ArError(f"no results for tag {choice.tag!r}{why} in {runs.runs}" + (
            f"; tags with results: {others} (--tag NAME)" if others else "; run `ar run` first"))
    return load(tag_dir, repo=repo, noise=noise), tag_dir, choice


# ------------------------------------------------------------------------------------------ rendering

def _bpb(v: float | None) -> str:
    return "-" if v is None else f"{v:.6f}"


def markdown(j: Journal) -> str:
    """journal.md: the whole journal for a person."""
    out = [f"# Research journal: {j.tag}", "",
           f"From `{j.source}` ({len(j.entries)} experiments). Keep threshold (noise) {j.noise:g} val_bpb "
           f"({j.noise_source}). Ideas are the proposers' own words; outcomes and lessons are the runner's.", ""]
    if j.best:
        out += [f"**Best:** {_bpb(j.best.val_bpb)} at {j.best.commit} (experiment {j.best.exp_id:04d}: "
                f"{j.best.idea})", ""]
    out += [f"{j.since_keep} proposal(s) since the last keep.", "", "## Near misses", ""]
    out += [f"- {e.exp_id:04d} {e.commit} {_bpb(e.val_bpb)} ({e.delta:+.6f}): {e.change} — idea: {e.idea}"
            for e in j.near_misses] or ["(none)"]
    out += ["", "## Dead ends, by idea", ""]
    out += [f"- **{g}**: " + ", ".join(f"{e.exp_id:04d} ({e.status}" + (f" {e.delta:+.6f}" if e.delta is not None
                                                                       else "") + ")" for e in es)
            for g, es in j.dead_ends.items()] or ["(none)"]
    out += ["", "## Strategy switches", ""]
    out += [f"- {s.exp_id:04d}: {s.strategy} (after {s.since_keep} proposals without a keep)"
            for s in j.switches] or ["(none)"]
    out += ["", "## Experiments", ""]
    for e in j.entries:
        out += [f"### {e.exp_id:04d} {e.commit or '-'} — {e.outcome}", "",
                f"- idea: {e.idea}", f"- change: {e.change}", f"- lesson: {e.lesson}"]
        if e.strategy:
            out.append(f"- strategy: {e.strategy}")
        out.append("")
    return "\n".join(out)


def write(j: Journal, tag_dir: Path) -> tuple[Path, Path]:
    """runs/<tag>/journal.md and journal.json, each replaced atomically (the guards leave them alone: they are
    views, rewritten from the records whenever asked)."""
    paths = TagLayout(Path(tag_dir))
    for path, text in ((paths.journal, markdown(j)), (paths.journal_json, json.dumps(j.to_dict(), indent=1) + "\n")):
        write_atomic(path, text)
    return paths.journal, paths.journal_json


def _fit(lines: list[str], budget: int) -> list[str]:
    out: list[str] = []
    used = 0
    for i, ln in enumerate(lines):
        if used + len(ln.encode()) + 1 > budget:
            out.append(f"  … ({len(lines) - i} more)")
            break
        out.append(ln)
        used += len(ln.encode()) + 1
    return out


def digest(j: Journal, limit: int = DIGEST_MAX) -> str:
    """The journal for the agent's prompt, at most `limit` bytes: near misses, dead ends by idea, refusals."""
    head = [f"## Research journal ({len(j.entries)} experiments; ideas in quotes are proposers' own words)",
            f"Best: {_bpb(j.best.val_bpb)} (experiment {j.best.exp_id:04d}). " if j.best else "Best: none yet. ",
            f"{j.since_keep} proposal(s) since the last keep. The runner refuses a train.py or a change it has "
            "run before (whitespace, comments and knob spelling ignored)."]
    head = [head[0], head[1] + head[2]]
    near = [f"  {e.exp_id:04d} {e.delta:+.6f}  {clean_text(e.change, 100)}  \"{clean_text(e.idea, 80)}\""
            for e in sorted(j.near_misses, key=lambda e: e.delta or 0)]
    dead = [f"  {clean_text(g, 60)}: " + ", ".join(
        f"{e.exp_id:04d}" + (f" {e.delta:+.4f}" if e.delta is not None else f" {e.status}") for e in es[-6:])
        + (f" (+{len(es) - 6} more)" if len(es) > 6 else "") for g, es in reversed(list(j.dead_ends.items()))]
    refused = [f"  {e.exp_id:04d}: {clean_text(e.reason.removeprefix(REFUSED + ': '), 110)}" for e in j.refused[-3:]]
    body_budget = limit - sum(len(h.encode()) + 1 for h in head) - 200
    sections = [("Near misses (within noise of the best; combine or re-test):", near),
                ("Dead ends by idea (worse beyond noise, or failed; don't repeat):", dead),
                ("Refused repeats (latest):", refused)]
    out = list(head)
    for title, lines in sections:
        if not lines:
            continue
        share = max(120, body_budget // 3)
        out += [title, *_fit(lines, share)]
    text = "\n".join(out)
    return text if len(text.encode()) <= limit else text.encode()[:limit - 4].decode(errors="ignore") + " …"


def plateau_strategy(j: Journal, plateau_after: int) -> tuple[str, int] | None:
    """(strategy, phase) for the next proposal, or None while it is not a plateau (fewer than plateau_after
    proposals since the last keep). Phase p covers proposals plateau_after·(p+1) … plateau_after·(p+2)-1 since
    the keep and keeps one strategy; each new phase takes the next one in the cycle combine -> bigger ->
    revisit, skipping `combine` without near misses and `revisit` without a past win."""
    if plateau_after <= 0 or j.since_keep < plateau_after:
        return None
    phase = (j.since_keep - plateau_after) // plateau_after
    last = None
    for e in reversed(j.entries):
        if e.status == "keep":
            break
        if e.strategy:
            last = e
            break
    if last is not None and last.phase == phase:
        return last.strategy, phase
    cycle = list(STRATEGIES)
    ok = [s for s in cycle if (s != "combine" or j.near_misses) and (s != "revisit" or j.biggest_win())]
    start = cycle.index(last.strategy) + 1 if last is not None else 0
    turn = [cycle[(start + k) % len(cycle)] for k in range(len(cycle))]
    return next(s for s in turn if s in ok), phase


def strategy_text(j: Journal, strategy: str) -> str:
    win = j.biggest_win()
    where = (f"experiment {win.exp_id:04d}, {win.delta:+.6f}: {clean_text(win.change, 100)}" if win else "")
    return (f"## Strategy ({j.since_keep} proposals without a keep): {strategy}\n"
            + STRATEGIES[strategy].format(win=where))
