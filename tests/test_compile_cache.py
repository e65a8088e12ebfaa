"""The trusted compile cache through the real loop: real repos, the real sandbox, the scripted train stand-in.

The stand-in lists what it finds in its inductor cache folder, then writes an entry named after its knobs. What
a trusted run (the baseline, ar's knob edits of it) writes reaches later runs as a copy; what an agent's run
writes reaches none; nothing a run writes into its copy changes the store."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

from autoresearch.experiment import compile_cache
from autoresearch.harness.env import default_cache
from autoresearch.proposers.agent import AgentProposer
from autoresearch.session.loop import Loop

from test_loop import AGENTS, _isolated, cfg, make_repo, statuses  # noqa: F401  (autouse fixture)
import pytest

PROBE = '''
def _probe():
    _cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    print("cache saw:", json.dumps(sorted(os.listdir(_cache)) if os.path.isdir(_cache) else []), flush=True)
    os.makedirs(_cache, exist_ok=True)
    for _name in os.listdir(_cache):      # entries name the folder they were made in: now this run's own
        with open(os.path.join(_cache, _name)) as _f:
            print("cache path:", "own" if _f.read() == f"compiled in {_cache}" else "foreign", flush=True)
    with open(os.path.join(_cache, f"entry-lr{LR_MULT}"), "w") as _f:
        _f.write(f"compiled in {_cache}")
    for _name in os.listdir(_cache):          # a run may scribble over its copy: the store must not change
        if _name != f"entry-lr{LR_MULT}":
            with open(os.path.join(_cache, _name), "w") as _f:
                _f.write("poisoned")
'''


def probe_repo(tmp_path: Path) -> Path:
    root = make_repo(tmp_path)
    text = (root / "train.py").read_text().replace('if __name__ == "__main__":', PROBE + '\nif __name__ == "__main__":\n    _probe()')
    (root / "train.py").write_text(text)
    import subprocess
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "probe"], cwd=root, check=True)
    return root


def seen(root: Path, tag: str = "t") -> dict[int, list[str]]:
    out = {}
    for log in sorted((root / "runs" / tag).glob("[0-9][0-9][0-9][0-9]-*/train.log")):
        m = re.search(r"cache saw: (\[.*\])", log.read_text())
        out[int(log.parent.name[:4])] = json.loads(m.group(1)) if m else None
    return out


@pytest.mark.e2e
def test_trusted_runs_fill_the_store_an_agents_run_does_not(tmp_path):
    root = probe_repo(tmp_path)
    agent = " ".join(shlex.quote(a) for a in (sys.executable, str(AGENTS / "by_experiment.py"),
                                              json.dumps({"3": {"LR_MULT": "2.0"}}), "{prompt_file}"))
    with Loop(cfg(), root, "t", AgentProposer(agent, timeout=30)) as lp:
        lp.enqueue_knobs({"LR_MULT": 0.9})          # ar's own knob edit of the baseline: trusted
        lp.run(max_experiments=3)                   # 1 baseline, 2 the knob edit, 3 the agent's LR_MULT 2.0
    with Loop(cfg(), root, "t") as lp:              # a later session: a knob edit of the best again
        lp.enqueue_knobs({"LR_MULT": 1.2})
        lp.run(max_experiments=1)
    assert len(statuses(root)) == 4
    s = seen(root)
    assert s[1] == []                                       # the first run of all compiles cold
    assert s[2] == ["entry-lr1.0"]                          # the baseline's entry, as a copy
    assert s[3] == ["entry-lr0.9", "entry-lr1.0"]           # the agent's run reads the trusted store...
    assert "entry-lr2.0" not in s[4]                        # ...but what it compiled reaches no later run
    assert s[4] == ["entry-lr0.9", "entry-lr1.0"]
    store = compile_cache.store_dir(default_cache())
    assert sorted(p.name for p in (store / "inductor").iterdir()) == ["entry-lr0.9", "entry-lr1.0", "entry-lr1.2"]
    placeholder = f"compiled in {default_cache().resolve()}/runcache/{'_' * 12}/inductor"
    assert {p.read_text() for p in (store / "inductor").iterdir()} == {placeholder}   # scribbles stayed in copies
    logs = " ".join(p.read_text() for p in (root / "runs" / "t").glob("*/train.log"))
    assert logs.count("cache path: own") == 5 and "foreign" not in logs
    timing = json.loads(next((root / "runs" / "t").glob("0003-*/timing.json")).read_text())
    assert timing["trusted_code"] is False and timing["cache_adopted_files"] == 0
    timing = json.loads(next((root / "runs" / "t").glob("0002-*/timing.json")).read_text())
    assert timing["trusted_code"] is True and timing["cache_adopted_files"] == 1
    assert timing["process_start"] <= timing["window_start"] <= timing["checkpoint"] <= timing["eval_done"]


@pytest.mark.integration
def test_the_agent_cannot_reach_the_store(tmp_path):
    """The agent runs outside the training sandbox: its own sandbox denies the store like the dataset."""
    from autoresearch.experiment.propose import _agent_policy
    root = probe_repo(tmp_path)
    with Loop(cfg(), root, "t") as lp:
        deny = _agent_policy(lp)["deny"]
    assert str(compile_cache.store_dir(default_cache()).parent) in deny
    assert compile_cache.store_dir(default_cache()).is_dir()    # made at open, so the sandbox denies it as it is


@pytest.mark.e2e
def test_a_run_beside_the_baseline_starts_with_what_the_baseline_compiled(tmp_path):
    """Two slots on one GPU: the run prepared beside the baseline made its workspace while the store was still
    empty, but it starts after the baseline trained, whose entries are in the store by then: it takes them
    before its start (compiling cold again would put a cold compile between the first two windows)."""
    from autoresearch.executors.local import LocalExecutor
    from autoresearch.slots import Slot
    root = probe_repo(tmp_path)
    with Loop(cfg(gpus="cpu:2", time_budget=2.0), root, "t", executor=LocalExecutor([Slot(0, 0), Slot(1, 0)])) as lp:
        lp.enqueue_knobs({"LR_MULT": 0.9})
        lp.run(max_experiments=2)
    assert statuses(root) == ["keep", "discard"]
    assert seen(root) == {1: [], 2: ["entry-lr1.0"]}
    timing = json.loads(next((root / "runs" / "t").glob("0002-*/timing.json")).read_text())
    assert timing["cache_seeded_bytes"] == 0 and timing["cache_seeded_late"] > 0, timing   # seeded when it went


@pytest.mark.e2e
def test_no_compile_cache_means_cold(tmp_path):
    root = probe_repo(tmp_path)
    with Loop(cfg(compile_cache=False), root, "t") as lp:
        lp.enqueue_knobs({"LR_MULT": 0.9})
        lp.run(max_experiments=2)
    assert seen(root) == {1: [], 2: []}


ATTACK = '''
def _attack():
    """The agent's run (LR_MULT 2.0) goes for the store itself: it names the entries (its seeded copies bear
    their names; the store lies beside the run's folder, one level up), hard-links them into its own folder to write through the link, and opens them
    for writing directly. Each try is counted; what succeeds is said."""
    from importlib.metadata import version
    _cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    _root = os.path.dirname(os.path.dirname(os.path.dirname(_cache)))     # <cache>/runcache/<hex>/inductor
    _store = os.path.join(_root, "compile", "torch-" + version("torch"), "inductor")
    tried, done = 0, []
    for _name in [n for n in os.listdir(_cache) if n.startswith("entry-") and n != f"entry-lr{LR_MULT}"]:
        _entry = os.path.join(_store, _name)      # the seeded copies name the store's entries
        for _how in ("link", "open"):
            tried += 1
            try:
                _dest = _entry
                if _how == "link":
                    _dest = os.path.join(_cache, "hl-" + os.path.basename(_entry))
                    os.link(_entry, _dest)
                with open(_dest, "w") as _f:
                    _f.write("poisoned through " + _how)
                done.append(_how)
            except OSError as e:
                print("attack refused:", _how, type(e).__name__, flush=True)
    print("attack:", json.dumps({"tried": tried, "done": done}), flush=True)
'''


@pytest.mark.e2e
def test_an_agents_run_cannot_write_the_store_through_a_hard_link_or_directly(tmp_path):
    """Compile-store attack: the store's entries are files the agent's run can name (its own folder's path gives
    the store's away); a hard link made in its own writable folder would reach the store's inode. Landlock refuses
    a link across folders and any write outside the run's own: every try fails, and the store is unchanged."""
    root = probe_repo(tmp_path)
    text = (root / "train.py").read_text().replace("    _probe()", "    _probe()\n    if LR_MULT == 2.0:\n        _attack()")
    (root / "train.py").write_text(text.replace('if __name__ == "__main__":', ATTACK + '\nif __name__ == "__main__":'))
    import subprocess
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "attack"], cwd=root, check=True)
    agent = " ".join(shlex.quote(a) for a in (sys.executable, str(AGENTS / "by_experiment.py"),
                                              json.dumps({"2": {"LR_MULT": "2.0"}}), "{prompt_file}"))
    with Loop(cfg(), root, "t", AgentProposer(agent, timeout=30)) as lp:
        lp.run(max_experiments=2)                   # 1 the baseline (fills the store), 2 the agent's attack
    store = compile_cache.store_dir(default_cache())
    before = {p.name: p.read_text() for p in (store / "inductor").iterdir()}
    log = next((root / "runs" / "t").glob("0002-*/train.log")).read_text()
    said = json.loads(re.search(r"attack: (\{.*\})", log).group(1))
    assert said["tried"] == 2 * len(before) >= 2 and said["done"] == [], log
    assert {p.name: p.read_text() for p in (store / "inductor").iterdir()} == before
    assert all("poisoned" not in text for text in before.values())
