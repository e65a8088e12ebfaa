"""What every proposer takes and gives: the Context it reads, the Proposal it returns (or ProposalFailed), and
the Proposer protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from autoresearch.proposers.cost import Usage
from autoresearch.harness.env import Profile
from autoresearch.knobs import Value
from autoresearch.records.ledger import Row
from autoresearch.objective import DEFAULT as DEFAULT_OBJECTIVE, Objective


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
