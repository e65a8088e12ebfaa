"""Proposers: what suggests the next change to train.py.

A proposer gets a Context (the repo, the knobs of the best kept train.py, the results so far) and returns
a Proposal, or None when it has nothing left to try. A built-in search proposer returns knob values and
the loop rewrites train.py; the agent proposer lets an external command edit the working tree itself.
Either way the loop checks, commits and runs the change the same way.
"""

from __future__ import annotations

from autoresearch.config import RunConfig
from autoresearch.errors import ConfigError
from autoresearch.proposers.base import Context, Proposal, ProposalFailed, Proposer  # noqa: F401  (the package's names)


def make_proposer(cfg: RunConfig, name: str | None = None) -> Proposer:
    """The proposer a config asks for: `name` (or cfg.proposer), else agent when an agent is set, else strategy."""
    from autoresearch.proposers.agent import AgentProposer
    from autoresearch.proposers.search import GridProposer, RandomProposer, StrategyProposer

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
