"""Read and rewrite the knobs of train.py: its top-level UPPER_CASE constant assignments.

Values are read with `ast` and evaluated by a small safe evaluator (numbers, strings, booleans, None and
arithmetic such as `2**19` or `-1e-3`); assignments whose value is anything else (a call, a name) are not
knobs. Rewriting replaces only the source span of each value, so comments, spacing and every other line
stay as they were; a value written as `2**N` stays in that style.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from autoresearch.errors import ConfigError

KNOB_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
Value = int | float | str | bool | None

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_PARSE_LOCK = threading.RLock()
_ast_parse = ast.parse


def _one_at_a_time(*args, **kwargs):
    with _PARSE_LOCK:
        return _ast_parse(*args, **kwargs)


# ast.parse, one thread at a time, in the whole process: before 3.13, CPython keeps the AST conversion's recursion
# depth in shared state (gh-106905), and two threads converting at once can fail ("AST constructor recursion depth
# mismatch"). ar's slots are threads, and not only ar parses: the traceback module parses a source line to place
# its carets, so one slot's error message could fail another slot's train.py check (seen: a slot failed so).
if sys.version_info < (3, 13):
    ast.parse = _one_at_a_time


def parse_source(text: str, mode: str = "exec") -> ast.AST:
    """ast.parse, one thread at a time (above)."""
    return _one_at_a_time(text, mode=mode)


class _Unsafe(Exception):
    pass


def _eval(node: ast.AST) -> Value:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        v = _eval(node.operand)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return _UNARY[type(node.op)](v)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
            if isinstance(node.op, ast.Pow) and abs(b) > 256:
                raise _Unsafe
            try:
                return _BINOPS[type(node.op)](a, b)
            except (ZeroDivisionError, OverflowError):
                raise _Unsafe from None
    raise _Unsafe


def safe_eval(text: str) -> Value:
    """Evaluate a literal or simple arithmetic expression; ValueError when it is anything else."""
    try:
        return _eval(parse_source(text.strip(), mode="eval").body)
    except (SyntaxError, _Unsafe):
        raise ValueError(f"{text!r} is not a plain value (number, string, boolean, or arithmetic like 2**17)") from None


def parse_value(text: str) -> Value:
    """A knob value given on a command line or in YAML: `2**17`, `0.04`, `true`, `auto` (a bare word is a string)."""
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    try:
        return safe_eval(t)
    except ValueError:
        if re.fullmatch(r"[A-Za-z_][\w\-.]*", t):
            return t
        raise ConfigError(f"knob value {text!r} is not a number, string, boolean or arithmetic like 2**17") from None


@dataclass(frozen=True)
class Knob:
    name: str
    value: Value
    line: int            # 1-based line of the assignment
    source: str          # the value as written, e.g. "2**19"
    span: tuple[int, int, int, int]  # value's (lineno, col, end_lineno, end_col); cols are UTF-8 byte offsets


def _knob_nodes(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None and node.simple:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and KNOB_NAME.match(target.id):
            yield target.id, value


def _parse(text: str, path: Path | str) -> ast.Module:
    try:
        return parse_source(text)
    except SyntaxError as e:
        raise ConfigError(f"{path} does not parse (line {e.lineno}: {e.msg}); fix it or reset it to the best commit") \
            from None


def scan(text: str, path: Path | str = "train.py") -> dict[str, Knob]:
    """All knobs in source text, in file order. A name assigned twice at top level keeps its first assignment."""
    lines = text.splitlines(keepends=True)
    out: dict[str, Knob] = {}
    for name, node in _knob_nodes(_parse(text, path)):
        if name in out:
            continue
        try:
            value = _eval(node)
        except _Unsafe:
            continue
        out[name] = Knob(name, value, node.lineno, _segment(lines, node), (node.lineno, node.col_offset,
                                                                          node.end_lineno, node.end_col_offset))
    return out


def _segment(lines: list[str], node: ast.AST) -> str:
    b = [ln.encode() for ln in lines[node.lineno - 1:node.end_lineno]]
    if len(b) == 1:
        return b[0][node.col_offset:node.end_col_offset].decode()
    return (b[0][node.col_offset:] + b"".join(b[1:-1]) + b[-1][:node.end_col_offset]).decode()


def read_knobs(path: Path) -> dict[str, Value]:
    """Knob name -> value for the file at path."""
    return {k.name: k.value for k in scan(Path(path).read_text(), path).values()}


def render(value: Value, old_source: str | None = None) -> str:
    """Python source for a knob value. A power of two comes out as 2**N when the old value was written that
    way (or, with no old value, from 2**12 up); everything else as a plain literal."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        pow2 = value > 1 and value & (value - 1) == 0
        if pow2 and ("**" in old_source if old_source else value >= 2**12):
            return f"2**{value.bit_length() - 1}"
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"knob value {value} is not finite")
        return repr(value)
    if isinstance(value, str):
        quote = '"' if not old_source or old_source.lstrip()[:1] != "'" else "'"
        r = repr(value)
        if quote == '"' and "'" not in value and '"' not in value and "\\" not in value:
            return f'"{value}"'
        return r
    raise ConfigError(f"knob value {value!r} must be a number, string, boolean or None")


def rewrite(text: str, values: dict[str, Value], path: Path | str = "train.py") -> str:
    """Source text with the given knobs' values replaced, nothing else touched."""
    knobs = scan(text, path)
    unknown = sorted(set(values) - set(knobs))
    if unknown:
        raise ConfigError(f"unknown knob {unknown[0]} in {path}; its knobs are: {', '.join(knobs) or 'none'}")
    lines = [ln.encode() for ln in text.splitlines(keepends=True)]
    # replace from the bottom up so earlier spans stay valid
    for name in sorted(values, key=lambda n: knobs[n].span, reverse=True):
        k = knobs[name]
        new = render(values[name], k.source).encode()
        l0, c0, l1, c1 = k.span
        head, tail = lines[l0 - 1][:c0], lines[l1 - 1][c1:]
        lines[l0 - 1:l1] = [head + new + tail]
    out = b"".join(lines).decode()
    _parse(out, path)
    return out


def set_knobs(path: Path, values: dict[str, Value]) -> dict[str, Value]:
    """Rewrite the given knobs in the file at path; returns the previous values of those knobs."""
    path = Path(path)
    text = path.read_text()
    before = {k.name: k.value for k in scan(text, path).values()}
    new = rewrite(text, values, path)
    if new != text:
        path.write_text(new)
    return {k: before[k] for k in values}
