"""Proposers: what suggests the next change to train.py.

A proposer gets a Context (the repo, the knobs of the best kept train.py, the results so far) and returns
a Proposal, or None when it has nothing left to try. A built-in search proposer returns knob values and
the loop rewrites train.py; the agent proposer lets an external command edit the working tree itself.
Either way the loop checks, commits and runs the change the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..config import RunConfig
from ..cost import Usage
from ..errors import ConfigError
from ..harness.env import Profile
from ..knobs import Value
from ..ledger import Row
from ..objective import DEFAULT as DEFAULT_OBJECTIVE, Objective


class ProposalFailed(Exception):
    """The proposer could not produce a change (agent crashed, timed out, …); the loop records `rejected`, with
    what the agent spent on the way (`usage`)."""

    def __init__(self, message: str, usage: Usage | None = None):
        super().__init__(message)
        self.usage = usage


@dataclass
class Proposal:
    description: str
    knobs: dict[str, Value] | None = None   # a knob edit for the loop to apply; None: the tree was edited
    usage: Usage | None = None              # what the agent spent on it (tokens, USD); None: not reported


@dataclass
class Context:
    root: Path                  # the repo's working tree (at the best kept commit)
    train_file: str             # path of the editable file, relative to root
    knobs: dict[str, Value]     # its knobs now
    best: Row | None
    rows: list[Row]             # every result so far, in order
    exp_id: int
    exp_dir: Path               # where the proposer may write its own log
    tag: str
    profile: Profile
    time_budget: float
    eval_tokens: int
    noise: float
    allowed_paths: list[str] = field(default_factory=lambda: ["train.py"])
    sandbox: dict | None = None  # the agent's sandbox policy (harness/sandbox.py): what it may not read or change
    objective: Objective = DEFAULT_OBJECTIVE   # what the results measure (val_bpb unless the config names another)
    built: dict | None = None   # the model the best built (its checkpoint's config), when known


class Proposer(Protocol):
    name: str

    def propose(self, ctx: Context) -> Proposal | None: ...


def make_proposer(cfg: RunConfig, name: str | None = None) -> Proposer:
    """The proposer a config asks for: `name` (or cfg.proposer), else agent when an agent is set, else strategy."""
    from .agent import AgentProposer
    from .search import GridProposer, RandomProposer, StrategyProposer

    name = name or cfg.proposer or ("agent" if cfg.agent else "strategy")
    if name == "agent":
        if not cfg.agent:
            raise ConfigError("the agent proposer needs --agent claude|codex|aider|'COMMAND {prompt_file}'")
        return AgentProposer(cfg.agent, timeout=cfg.agent_timeout, last_n=cfg.last_n_results,
                             program=cfg.program, plateau_after=cfg.plateau_after, prices=cfg.agent_prices)
    if name == "grid":
        if not cfg.search_space:
            raise ConfigError("the grid proposer needs search_space (knob -> list of values) in the config file")
        return GridProposer(cfg.search_space)
    if name == "random":
        if not cfg.search_space:
            raise ConfigError("the random proposer needs search_space (knob -> list of values) in the config file")
        return RandomProposer(cfg.search_space, seed=cfg.seed)
    if name == "strategy":
        return StrategyProposer()
    raise ConfigError(f"unknown proposer {name!r}; use agent, grid, random or strategy")
