"""Agent cost accounting: what one proposal's agent spent (tokens, USD), read from the agent's own output.

`UsageReader` is fed every output line of one agent run and recognises each format it knows, whatever the
agent command (a preset wrapped in a script still counts):

- `AR_USAGE {"input_tokens": N, "output_tokens": M, "usd": X}` — the line a custom agent prints (every key
  optional; several lines add up). When any such line is present, it alone counts: a wrapper that passes a
  preset's output through and reports its own total is not counted twice.
- claude `-p --output-format json`: one JSON object, `{"type": "result", ..., "result": "<final message>",
  "total_cost_usd": X, "usage": {"input_tokens", "output_tokens", "cache_creation_input_tokens",
  "cache_read_input_tokens"}, "modelUsage": {"<model>": {...}}}`.
- codex `exec --json`: JSONL events; usage in `{"type": "turn.completed", "usage": {"input_tokens",
  "cached_input_tokens", "output_tokens"}}`, older releases in `{"msg": {"type": "token_count", ...}}`. No cost:
  a price table (`agent_prices`) turns its tokens into USD, else the cost stays unknown.
- aider: `Tokens: 12k sent, 1.2k received. Cost: $0.05 message, $0.31 session.` after each model reply.

An unknown cost is None, never 0: it does not count toward `--max-usd` and reads as an empty field.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

USAGE_PREFIX = "AR_USAGE"
Prices = Mapping[str, Mapping[str, float]]   # model (or "default") -> {"input", "output"[, "cached_input"]}, USD/1M


@dataclass(frozen=True)
class Usage:
    """What one agent run used. Tokens in are everything sent to the model (cache reads and writes included)."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    usd: float | None = None
    cached_input_tokens: int = 0     # the part of input_tokens served from a prompt cache (for a price table)
    model: str | None = None

    @property
    def tokens(self) -> int | None:
        if self.input_tokens is None and self.output_tokens is None:
            return None
        return (self.input_tokens or 0) + (self.output_tokens or 0)

    def __add__(self, other: Usage) -> Usage:
        return Usage(_plus(self.input_tokens, other.input_tokens), _plus(self.output_tokens, other.output_tokens),
                     _plus(self.usd, other.usd), self.cached_input_tokens + other.cached_input_tokens,
                     self.model or other.model)

    def priced(self, prices: Prices | None) -> Usage:
        """With a USD cost from the price table when the agent reported tokens but no cost."""
        if self.usd is not None or self.tokens is None or not prices:
            return self
        p = price_for(prices, self.model)
        if p is None:
            return self
        cached = min(self.cached_input_tokens, self.input_tokens or 0)
        usd = ((self.input_tokens or 0) - cached) * p["input"] + cached * p.get("cached_input", p["input"])
        usd += (self.output_tokens or 0) * p["output"]
        return Usage(self.input_tokens, self.output_tokens, usd / 1e6, self.cached_input_tokens, self.model)


def price_for(prices: Prices, model: str | None) -> Mapping[str, float] | None:
    """The entry for the model the agent named, else `default`, else the only entry (a codex run that does not
    name its model in --json output still gets the one price its user gave)."""
    if model and model in prices:
        return prices[model]
    if "default" in prices:
        return prices["default"]
    return next(iter(prices.values())) if len(prices) == 1 else None


def _plus(a, b):
    return b if a is None else a if b is None else a + b


def _count(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return int(v)


def _usd(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


def _sum_counts(d: Mapping, *keys: str) -> int | None:
    found = [c for c in (_count(d.get(k)) for k in keys) if c is not None]
    return sum(found) if found else None


# --------------------------------------------------------------------------------------------- reading

_AIDER_TOKENS = r"([\d.,]+)\s*([kKmM]?)"
_AIDER_SENT = re.compile(rf"Tokens:\s*{_AIDER_TOKENS}\s+sent")
_AIDER_RECEIVED = re.compile(rf"{_AIDER_TOKENS}\s+received")
_AIDER_COST = re.compile(r"Cost:\s*\$\s*([\d.,]+)\s+message,\s*\$\s*([\d.,]+)\s+session")
# a claude result line longer than the runner's line cap (64 KB) arrives without its head: its cost and usage,
# which follow the result text, are read from the tail
_CLAUDE_TOKENS = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
_CLAUDE_COST = re.compile(r'"total_cost_usd"\s*:\s*([0-9.eE+-]+)')


class UsageReader:
    """Fed each output line of one agent run; `usage()` says what the run spent, `final_line()` its last word."""

    def __init__(self) -> None:
        self._declared: list[Usage] = []       # AR_USAGE lines
        self._claude: Usage | None = None      # the last result object
        self._codex_turn: Usage | None = None  # the last turn.completed (codex totals the thread in it)
        self._codex_total: Usage | None = None  # the last token_count with info.total_token_usage
        self._codex_each: list[Usage] = []     # older token_count events: one model response each
        self._aider: list[str] = []            # "Tokens: ... session." reports, wrapped lines joined
        self._aider_open = False
        self.model: str | None = None
        self.message = ""                      # the agent's final message, where its output is JSON

    def feed(self, line: str) -> bool:
        """Read one line; True when it was a machine-readable line (usage, JSON events), not the agent's words."""
        try:
            return self._feed(line)
        except Exception:   # runs in the agent's output pump: a line ar cannot read must never stop the agent
            return False

    def _feed(self, line: str) -> bool:
        s = line.strip()
        if not s:
            return False
        if self._aider_more(s):
            return True
        if s.startswith(USAGE_PREFIX):
            self._declare(s[len(USAGE_PREFIX):])
            return True
        if s.startswith("{"):
            try:
                obj = json.loads(s)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                self._event(obj)
                return True
        if '"total_cost_usd"' in s:   # the tail of a claude result line too long to arrive whole
            self._claude_tail(s)
            return True
        if s.startswith("Tokens:"):
            self._aider.append(s)
            self._aider_open = True
            return True
        return False

    def usage(self, prices: Prices | None = None) -> Usage | None:
        """What the run spent (USD from the price table where the agent gave tokens only); None: not reported."""
        if self._declared:
            found: Usage | None = sum(self._declared[1:], self._declared[0])
        else:
            found = self._claude or self._codex() or self._aider_usage()
        if found is None:
            return None
        if found.model is None and self.model:
            found = Usage(found.input_tokens, found.output_tokens, found.usd, found.cached_input_tokens, self.model)
        return found.priced(prices)

    def final_line(self) -> str:
        """The last non-empty line of the agent's final message (claude's result, codex's last agent message)."""
        lines = [ln.strip() for ln in self.message.splitlines() if ln.strip()]
        return lines[-1] if lines else ""

    # ------------------------------------------------------------------------------------------ formats
    def _declare(self, rest: str) -> None:
        try:
            d = json.loads(rest.strip().lstrip(":").strip())
        except ValueError:
            return      # a malformed AR_USAGE line reports nothing (the line stays in agent.log)
        if not isinstance(d, dict):
            return
        model = d.get("model") if isinstance(d.get("model"), str) else None
        u = Usage(_count(d.get("input_tokens")), _count(d.get("output_tokens")), _usd(d.get("usd")), model=model)
        if u.tokens is not None or u.usd is not None:
            self._declared.append(u)

    def _event(self, obj: dict) -> None:
        kind = obj.get("type")
        if isinstance(obj.get("model"), str):   # codex's older config summary line names the model
            self.model = obj["model"]
        if kind == "result" and ("total_cost_usd" in obj or "usage" in obj):          # claude
            self._claude = _claude_usage(obj.get("usage"), obj.get("total_cost_usd"), obj.get("modelUsage"))
            if isinstance(obj.get("result"), str):
                self.message = obj["result"]
        elif kind == "turn.completed" and isinstance(obj.get("usage"), dict):          # codex
            u = obj["usage"]
            self._codex_turn = Usage(_count(u.get("input_tokens")), _count(u.get("output_tokens")),
                                     cached_input_tokens=_count(u.get("cached_input_tokens")) or 0)
        elif kind == "item.completed" and isinstance(obj.get("item"), dict):
            item = obj["item"]
            if item.get("type") in ("agent_message", "assistant_message") and isinstance(item.get("text"), str):
                self.message = item["text"]
        msg = obj.get("msg") if isinstance(obj.get("msg"), dict) else obj.get("payload")
        if isinstance(msg, dict):                                                      # older codex events
            self._codex_event(msg)

    def _codex_event(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "token_count":
            info = msg.get("info")
            total = info.get("total_token_usage") if isinstance(info, dict) else None
            if isinstance(total, dict):   # cumulative for the session: the last one is the run's
                self._codex_total = _codex_counts(total)
            elif "input_tokens" in msg or "output_tokens" in msg:   # one response's usage: they add up
                self._codex_each.append(_codex_counts(msg))
        elif kind == "agent_message" and isinstance(msg.get("message"), str):
            self.message = msg["message"]
        elif kind == "session_configured" and isinstance(msg.get("model"), str):
            self.model = msg["model"]

    def _codex(self) -> Usage | None:
        if self._codex_turn is not None:
            return self._codex_turn
        if self._codex_total is not None:
            return self._codex_total
        return sum(self._codex_each[1:], self._codex_each[0]) if self._codex_each else None

    def _claude_tail(self, s: str) -> None:
        cost = _CLAUDE_COST.findall(s)
        tail = s[max(0, s.rfind('"usage"')):]
        usage = {k: int(m.group(1)) for k in _CLAUDE_TOKENS
                 if (m := re.search(rf'"{k}"\s*:\s*(\d+)', tail))}
        self._claude = _claude_usage(usage, _number(cost[-1]) if cost else None, None)

    def _aider_more(self, s: str) -> bool:
        """Aider prints its report through Rich, which wraps it at 80 columns when the output is not a terminal:
        a line that continues an unfinished report is joined to it."""
        if not self._aider_open or s.startswith("Tokens:"):
            return False
        report = self._aider[-1]
        unfinished = "received" not in report or ("Cost:" in report and "session" not in report)
        if (unfinished or s.startswith("Cost:")) and len(report) < 400:
            self._aider[-1] = f"{report} {s}"
            return True
        self._aider_open = False
        return False

    def _aider_usage(self) -> Usage | None:
        """Tokens add up over the replies; the cost is the last report's session total (one aider process per
        proposal), else the sum of its per-message costs. `cache hit` tokens are not added: aider counts them
        inside `sent` or apart depending on the provider."""
        total: Usage | None = None
        session: float | None = None
        for report in self._aider:
            sent, received, cost = _AIDER_SENT.search(report), _AIDER_RECEIVED.search(report), _AIDER_COST.search(report)
            u = Usage(_aider_count(sent), _aider_count(received),
                      _usd(_number(cost.group(1))) if cost else None)
            if cost:
                session = _usd(_number(cost.group(2)))
            if u.tokens is not None or u.usd is not None:
                total = u if total is None else total + u
        if total is not None and session is not None:
            total = Usage(total.input_tokens, total.output_tokens, session)
        return total


def _claude_usage(usage: Any, usd: Any, model_usage: Any) -> Usage:
    """Claude's input_tokens leave out the cache: tokens sent are input + cache creation + cache read."""
    usage = usage if isinstance(usage, dict) else {}
    models = list(model_usage) if isinstance(model_usage, dict) else []
    return Usage(_sum_counts(usage, "input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"),
                 _count(usage.get("output_tokens")), _usd(usd),
                 cached_input_tokens=_count(usage.get("cache_read_input_tokens")) or 0,
                 model=models[0] if len(models) == 1 else None)


def _codex_counts(d: dict) -> Usage:
    """OpenAI counts cached input inside input_tokens and reasoning inside output_tokens."""
    return Usage(_count(d.get("input_tokens")), _count(d.get("output_tokens")),
                 cached_input_tokens=_count(d.get("cached_input_tokens")) or 0)


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _aider_count(m: re.Match | None) -> int | None:
    """Aider's own rounding: 950, 1.2k, 12k (thousands)."""
    if m is None:
        return None
    n = _number(m.group(1))
    if n is None:
        return None
    return round(n * {"": 1, "k": 1e3, "m": 1e6}[m.group(2).lower()])


# --------------------------------------------------------------------------------------- over the ledger

def spent(rows: Iterable) -> float:
    """USD the agents spent over these rows (rows of unknown cost add nothing); rounded past the 4 decimals a row
    keeps, so that 3 x 0.04 reaches a limit of 0.12."""
    return round(sum(r.agent_usd for r in rows if getattr(r, "agent_usd", None) is not None), 6)


def summary(rows: Iterable) -> dict | None:
    """Total agent cost and tokens, and the cost per kept improvement (keeps after the baseline, whose commit is
    its own parent); None when no row has a cost or a token count."""
    rows = list(rows)
    costed = [r for r in rows if getattr(r, "agent_usd", None) is not None
              or getattr(r, "agent_tokens", None) is not None]
    if not costed:
        return None
    usd = [r.agent_usd for r in costed if r.agent_usd is not None]
    total = sum(usd) if usd else None
    keeps = sum(1 for r in rows if getattr(r.status, "value", r.status) == "keep" and r.commit != r.parent)
    return {"usd": total, "tokens": sum(r.agent_tokens or 0 for r in costed), "experiments": len(costed),
            "keeps": keeps, "usd_per_keep": total / keeps if total is not None and keeps else None}
