"""Fault-injection points for the crash-consistency tests: `AR_FAULT=<point>:<n>` SIGKILLs this process the
n-th time the named point is reached (n defaults to 1).

The loop calls `point(name)` at each phase boundary of an experiment (start, propose, commit, train, parse,
decide, revert, recorded, done, hook, append.<file>). With AR_FAULT unset a point is one global lookup and
a return. `torn` is called just before the kill, to leave a half-written line behind (mid-append).
"""

from __future__ import annotations

import os
import signal
from typing import Callable

_target: str | None = None
_left = 0


def arm(spec: str | None) -> None:
    """Kill at the n-th hit of a point ('name:n' or 'name'); None or '' disarms."""
    global _target, _left
    if not spec:
        _target, _left = None, 0
        return
    name, _, n = spec.rpartition(":") if ":" in spec else (spec, "", "1")
    _target, _left = name, max(1, int(n or 1))


def point(name: str, torn: Callable[[], object] | None = None) -> None:
    global _left
    if _target is None or name != _target:
        return
    _left -= 1
    if _left == 0:
        if torn is not None:
            torn()
        os.kill(os.getpid(), signal.SIGKILL)


arm(os.environ.get("AR_FAULT"))
