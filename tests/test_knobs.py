"""knobs.py: reading and rewriting train.py's UPPER_CASE constants, comments and layout kept."""

import sys
from pathlib import Path

import pytest

from autoresearch.errors import ConfigError
from autoresearch.knobs import parse_value, read_knobs, render, rewrite, safe_eval, scan, set_knobs

ROOT = Path(__file__).resolve().parents[1]

SOURCE = '''"""doc"""
# ---- knobs ----
DEPTH = 8                    # transformer blocks
TOTAL_BATCH_SIZE = 2**19     # tokens per step
DEVICE_BATCH_SIZE = "auto"   # rows, or "auto"
LR_MULT = 1.0                # scales every LR
NEG = -1e-3
MODE = 'fast'  # single quotes
COMPILE = True
NOTHING = None
WIDTH = (
    512
)
NAME = "héllo"   # ünïcode comment
ADAM_BETAS = (0.8, 0.95)     # a tuple: not a knob
FROM_ENV = int("3")          # a call: not a knob
lower_case = 3
import os
if os.name == "nt":
    DEPTH = 2                # nested: not the top-level knob
DEPTH = 9                    # a second top-level assignment: the first one counts
'''


def test_scan_reads_top_level_constants_only():
    knobs = {k.name: k.value for k in scan(SOURCE).values()}
    assert knobs == {"DEPTH": 8, "TOTAL_BATCH_SIZE": 2**19, "DEVICE_BATCH_SIZE": "auto", "LR_MULT": 1.0,
                     "NEG": -1e-3, "MODE": "fast", "COMPILE": True, "NOTHING": None, "WIDTH": 512, "NAME": "héllo"}
    assert scan(SOURCE)["TOTAL_BATCH_SIZE"].source == "2**19"
    assert scan(SOURCE)["DEPTH"].line == 3


def test_rewrite_changes_only_the_values():
    out = rewrite(SOURCE, {"TOTAL_BATCH_SIZE": 2**17, "LR_MULT": 1.5, "MODE": "slow", "DEPTH": 6,
                           "NAME": "wörld", "WIDTH": 1024})
    before, after = SOURCE.splitlines(), out.splitlines()
    assert len(before) == len(after)
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert ("TOTAL_BATCH_SIZE = 2**19     # tokens per step", "TOTAL_BATCH_SIZE = 2**17     # tokens per step") in changed
    assert ("LR_MULT = 1.0                # scales every LR", "LR_MULT = 1.5                # scales every LR") in changed
    assert ("MODE = 'fast'  # single quotes", "MODE = 'slow'  # single quotes") in changed
    assert ("NAME = \"héllo\"   # ünïcode comment", "NAME = \"wörld\"   # ünïcode comment") in changed
    assert "WIDTH = (\n    1024\n)" in out  # the parentheses and their layout stay
    assert "    DEPTH = 2                # nested" in out and "DEPTH = 9 " in out  # untouched
    assert {k.name: k.value for k in scan(out).values()}["DEPTH"] == 6


def test_set_knobs_writes_file_and_returns_previous(tmp_path):
    f = tmp_path / "train.py"
    f.write_text(SOURCE)
    assert set_knobs(f, {"DEVICE_BATCH_SIZE": 32, "COMPILE": False}) == {"DEVICE_BATCH_SIZE": "auto", "COMPILE": True}
    k = read_knobs(f)
    assert k["DEVICE_BATCH_SIZE"] == 32 and k["COMPILE"] is False
    assert "DEVICE_BATCH_SIZE = 32   # rows, or \"auto\"" in f.read_text()


def test_unknown_knob_is_a_config_error_naming_it(tmp_path):
    f = tmp_path / "train.py"
    f.write_text(SOURCE)
    with pytest.raises(ConfigError, match="unknown knob DEPTHH"):
        set_knobs(f, {"DEPTHH": 3})
    with pytest.raises(ConfigError, match="unknown knob ADAM_BETAS"):
        set_knobs(f, {"ADAM_BETAS": 1})


def test_render_keeps_powers_of_two_style():
    assert render(2**17) == "2**17" and render(2**17, "131072") == "131072"
    assert render(128) == "128" and render(256, "128") == "256"
    assert render(8, "2**3") == "2**3"
    assert render(12, "2**3") == "12"
    assert render(0.5) == "0.5" and render(True) == "True" and render("auto") == '"auto"'
    with pytest.raises(ConfigError):
        render([1, 2])
    with pytest.raises(ConfigError):
        render(float("nan"))


def test_values_and_safe_eval():
    assert parse_value("2**17") == 131072
    assert parse_value("auto") == "auto"
    assert parse_value("true") is True and parse_value("False") is False
    assert parse_value("1e-3") == 0.001 and parse_value("-2") == -2
    assert parse_value('"x y"') == "x y"
    for bad in ("__import__('os')", "2**100000", "open('f')", "a b"):
        with pytest.raises((ValueError, ConfigError)):
            safe_eval(bad) if bad != "a b" else parse_value(bad)


def test_syntax_error_is_a_config_error(tmp_path):
    f = tmp_path / "train.py"
    f.write_text("DEPTH = (\n")
    with pytest.raises(ConfigError, match="does not parse"):
        read_knobs(f)


def test_real_train_py_knobs_and_a_one_line_rewrite():
    text = (ROOT / "train.py").read_text()
    knobs = {k.name: k.value for k in scan(text).values()}
    for name in ("DEPTH", "TOTAL_BATCH_SIZE", "DEVICE_BATCH_SIZE", "LR_MULT", "WARMUP_RATIO", "WARMDOWN_RATIO",
                 "COMPILE_MODEL", "ATTENTION"):
        assert name in knobs
    out = rewrite(text, {"TOTAL_BATCH_SIZE": knobs["TOTAL_BATCH_SIZE"] // 2})
    diff = [(a, b) for a, b in zip(text.splitlines(), out.splitlines()) if a != b]
    assert len(diff) == 1 and diff[0][1].startswith("TOTAL_BATCH_SIZE = 2**")


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="the AST conversion keeps its depth per call from 3.13 on")
def test_every_ast_parse_in_ars_process_takes_one_lock(monkeypatch):
    """Slots are threads: before 3.13 two AST conversions at once can fail (a slot failed with "AST constructor
    recursion depth mismatch" while another thread parsed). ar's own parses and any other module's ast.parse (the
    traceback module's, placing carets) take the same lock."""
    import ast

    from autoresearch import knobs
    held = []
    real = knobs._ast_parse
    monkeypatch.setattr(knobs, "_ast_parse", lambda *a, **k: (held.append(knobs._PARSE_LOCK._is_owned()),
                                                               real(*a, **k))[1])
    ast.parse("x = 1\n")                               # as any module calls it
    scan("DEPTH = 8\n")                                # ar's knob block
    assert held == [True, True]
