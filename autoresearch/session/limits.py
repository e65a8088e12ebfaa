"""A session's limits and stop rules, in one place: what it has run and kept, the failures in a row, and whether
--max-experiments, --max-hours or --max-usd leaves room for another experiment. The scheduler asks before it
dispatches and tells it each recorded row; a rule that ends the session raises Stop with the line to say."""

from __future__ import annotations

import time

from autoresearch.proposers import cost
from autoresearch.records.ledger import Row, Status

FAILURES = (Status.CRASH, Status.TIMEOUT, Status.REJECTED)    # in a row, these stop the loop


class Stop(Exception):
    """The loop ends here, for the given reason (said as one line)."""

    def __init__(self, reason: str, *, failed: bool = False, interrupted: bool = False):
        super().__init__(reason)
        self.failed, self.interrupted = failed, interrupted


class Limits:
    """The tally of one session and the rules it is held to."""

    def __init__(self, loop, max_experiments: int | None, max_hours: float | None, clock=time):
        """`clock`: where --max-hours is timed (the `time` module, or a clock a test moves)."""
        self.loop, self.max_experiments, self.max_hours, self.clock = loop, max_experiments, max_hours, clock
        self.n = self.kept = self.failures = 0
        self.t0 = clock.monotonic()
        self.max_usd = loop.cfg.max_usd
        self.cost_unknown_said = False

    def count(self, kind: str, row: Row) -> None:
        """Tally one recorded row (of an experiment of this `kind`) and apply the stop rules."""
        lp = self.loop
        self.n += 1
        self.kept += row.status is Status.KEEP
        if row.status in FAILURES:
            self.failures += 1
        elif row.status in (Status.KEEP, Status.DISCARD):
            self.failures = 0
        if lp.halted:
            raise Stop(f"{lp.halted}; restore them (reinstall ar, `ar prepare` the data) before running again",
                       failed=True)
        if kind == "baseline" and row.status is not Status.KEEP:
            raise Stop(f"the baseline did not run cleanly ({row.status.value}: {row.reason}); fix train.py or the "
                       f"setup, see {lp.exp_dir_of(row)}/train.log", failed=True)
        if (self.max_usd is not None and row.agent_usd is None and not self.cost_unknown_said
                and kind == "propose" and getattr(lp.proposer, "name", "") == "agent"):
            self.cost_unknown_said = True
            lp.say(f"the agent reported no cost for experiment {row.exp_id:04d}: it does not count toward --max-usd "
                   "(an agent that prints tokens only needs agent_prices in the config)", "warn")
        if self.failures >= lp.cfg.max_consecutive_crashes:
            raise Stop(f"{self.failures} crashed, timed-out or rejected experiments in a row "
                       f"(--max-consecutive-crashes {lp.cfg.max_consecutive_crashes}); last: {row.reason}", failed=True)

    def say_budget(self) -> None:
        """With --max-usd: what the tag has spent already, or that this proposer spends nothing."""
        lp = self.loop
        if self.max_usd is None:
            return
        if getattr(lp.proposer, "name", "") != "agent":
            lp.say(f"--max-usd {self.max_usd:g} has nothing to count: only an agent proposer reports a cost", "warn")
            return
        spent = cost.spent(lp.ledger.rows())
        if spent:
            lp.say(f"agent cost so far on tag {lp.tag}: ${spent:.4f} of --max-usd {self.max_usd:g}")

    def no_room(self, in_flight: int) -> str:
        """Why no further experiment may start ("" while there is room), with `in_flight` already dispatched."""
        if self.max_experiments is not None and self.n + in_flight >= self.max_experiments:
            return f"reached --max-experiments {self.max_experiments}"
        if self.max_hours is not None and self.clock.monotonic() - self.t0 >= self.max_hours * 3600:
            return f"reached --max-hours {self.max_hours:g}"
        if self.max_usd is not None:   # from the ledger: the spend of earlier sessions of the tag counts
            spent = cost.spent(self.loop.ledger.rows())
            if spent >= self.max_usd:
                return f"reached --max-usd {self.max_usd:g}: the agents of tag {self.loop.tag} spent ${spent:.4f}"
        return ""
