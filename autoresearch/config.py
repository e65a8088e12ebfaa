"""`ar run` configuration: YAML into a typed, validated RunConfig.

What overrides what: **command-line flags > the config file (`--config FILE`) > the defaults below.**
The keep threshold has one more layer: a flag or config value > `runs/<tag>/noise.json` (written by
`ar run --calibrate-noise K`) > the default 0.002.
Unknown keys and badly typed values are errors that name the key and the file, raised at load time.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import shlex
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from autoresearch.errors import ConfigError
from autoresearch.records.layout import NOISE
from autoresearch.objective import DEFAULT as DEFAULT_OBJECTIVE, Objective, parse as parse_objective

PROPOSERS = ("agent", "grid", "random", "strategy")
HOOK_EVENTS = ("run_started", "run_finished", "kept", "reverted", "crashed", "loop_finished")
DEFAULT_NOISE = 0.002


def _default_train_command() -> list[str]:
    return [sys.executable, "train.py"]


@dataclass(kw_only=True)
class RunConfig:
    """Everything `ar run` needs to know, with the defaults of a zero-config first run."""

    # what runs
    objective: Objective = DEFAULT_OBJECTIVE   # val_bpb by the trusted evaluator, or a command + metric (objective.py)
    train_command: list[str] = field(default_factory=_default_train_command)  # run in the repo root
    allowed_paths: list[str] = field(default_factory=lambda: ["train.py"])  # what a proposal may change
    profile: str = "auto"                  # gpu | cpu | auto (gpu when CUDA is available)
    time_budget: float | None = None       # training seconds; None: the profile's (300 gpu, 20 cpu)
    startup_allowance: float = 120.0       # the most a run's start-up may take (then it is killed); start-up past
                                           # what the baseline's allows comes off the window (experiment/clock.py)
    untimed_steps: int | None = None       # compile warm-up steps on random tokens before the window; None: 3 gpu, 0 cpu
    eval_allowance: float = 120.0          # seconds the trusted evaluator's model worker may take
    eval_prestart: float | None = None     # seconds before a training window's end at which the evaluator starts
                                           # its model workers (buffers, CUDA context; nothing of the proposal);
                                           # None: 10 on a GPU, 0 (at the checkpoint) on the CPU
    eval_tokens: int | None = None         # validation tokens; None: the profile's
    holdout_tokens: int | None = None      # private hold-out tokens that confirm a new best; None: eval_tokens / 8
    sandbox: bool = True                   # run proposal code under Landlock; false only by --unsandboxed, and
                                           # every result of the tag is then marked unsandboxed
    dataset: str = "builtin"               # cache subfolder; `builtin` is prepared automatically when missing
    prepare_data: bool = True              # check (and for `builtin`, prepare) the data before the first run
    seed: int = 42
    compile_cache: bool = True             # seed every run's compile caches from those of trusted runs
                                           # (compile_cache.py); false: every run compiles cold
    max_log_mb: float = 50.0               # train.log cap per experiment
    # deciding
    noise: float | None = None             # keep only when val_bpb beats the best by more than this
    confirm_new_best: bool = False         # re-run a would-be new best with another seed before keeping it
    keep_rule: str = "sequential"          # sequential: a candidate runs until its evidence decides (decide.py),
                                           # once the tag's noise is measured; single: one run past the threshold
    false_keep: float = 0.05               # sequential: the share of changes gaining nothing that are kept anyway
    min_gain: float = 0.0                  # sequential: a keep beats the best by this much (the objective's unit)
    min_mfu: float | None = None           # degraded floors (percent, tokens/s), checked after warm-up
    min_tokens_per_s: float | None = None
    degraded_warmup_steps: int = 10
    degraded_patience: int = 20
    max_consecutive_crashes: int = 5       # crash, timeout or rejected in a row stops the loop
    max_experiments: int | None = None     # stop after this many experiments (--max-experiments); None: no limit
    max_hours: float | None = None         # start no experiment after this many hours (--max-hours)
    # proposing
    proposer: str | None = None            # agent | grid | random | strategy; None: agent if `agent` is set
    agent: str | None = None               # preset (claude, codex, aider) or a command with {prompt}/{prompt_file}
    agent_timeout: float = 900.0
    last_n_results: int = 10               # results shown in the agent's prompt
    plateau_after: int = 5                 # proposals without a keep before the agent's prompt switches strategy
                                           # (memory.py); 0: never
    program: str = "program.md"            # the agent's instructions, relative to the repo
    max_usd: float | None = None           # stop before the next proposal once the tag's agents spent this (USD)
    agent_prices: dict[str, dict[str, float]] = field(default_factory=dict)  # model -> USD per 1M tokens
                                           # ({input, output, cached_input}), for agents that report tokens only
    search_space: dict[str, list] = field(default_factory=dict)  # knob -> values, for grid and random
    # around the loop
    hooks: dict[str, list[str]] = field(default_factory=dict)  # event -> shell commands
    hook_timeout: float = 30.0
    # several GPUs (docs/scale-out.md)
    gpus: str | None = None                # slots: "0,1", "all", "cpu:N"; None: one experiment at a time
    stale_policy: str = "rerun"            # a win whose parent is no longer the best: rerun | record (`stale`)
    head_start: bool | str = "auto"        # slots taking turns on one GPU: the next run starts in the running
                                           # window's last seconds (experiment/headstart.py); "auto": on a GPU
                                           # where its GPU seconds are read; true: the CPU too; false: never
    executor: str = "local"                # local (slots on this machine) | ray
    ray_address: str | None = None         # ray: cluster address; None: ray's own discovery / a local cluster
    ray_resource: str = "GPU"              # ray: the resource one experiment asks one unit of

    def noise_threshold(self, tag_dir: Path) -> tuple[float, str]:
        """The keep threshold and where it came from: config, noise.json or the default."""
        if self.noise is not None:
            return self.noise, "config"
        f = Path(tag_dir) / NOISE
        if f.exists():
            import json
            try:
                return float(json.loads(f.read_text())["noise"]), str(f)
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{f} is corrupt; delete it or re-run with --calibrate-noise K") from None
        return DEFAULT_NOISE, "default"


def _check_type(key: str, value: Any, source: str) -> Any:
    """Coerce and validate one value against RunConfig's field type."""
    where = f"{key} in {source}"
    num = (int, float)
    if value is None:
        if key in {"time_budget", "eval_tokens", "holdout_tokens", "untimed_steps", "noise", "min_mfu", "min_tokens_per_s", "proposer", "agent", "gpus",
                   "ray_address", "max_usd", "max_experiments", "max_hours"}:
            return None
        raise ConfigError(f"{where} may not be empty")
    if key == "objective":
        return value if isinstance(value, Objective) else parse_objective(value, source)
    if key == "train_command":
        if isinstance(value, str):
            value = shlex.split(value)
        if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise ConfigError(f"{where} must be a command string or a non-empty list of strings")
        return value
    if key == "allowed_paths":
        if not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
            raise ConfigError(f"{where} must be a non-empty list of paths")
        bad = [v for v in value if v.startswith("/") or ".." in Path(v).parts or Path(v).parts[:1] == (".git",)]
        if bad:
            raise ConfigError(f"{where}: {bad[0]!r} must be a relative path inside the repo, not under .git")
        return value
    if key == "profile":
        if value not in ("auto", "gpu", "cpu"):
            raise ConfigError(f"{where} must be auto, gpu or cpu, not {value!r}")
        return value
    if key == "proposer":
        if value not in PROPOSERS:
            raise ConfigError(f"{where} must be one of {', '.join(PROPOSERS)}, not {value!r}")
        return value
    if key in ("agent", "dataset", "program"):
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where} must be a non-empty string")
        return value
    if key in ("prepare_data", "confirm_new_best", "sandbox", "compile_cache"):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false")
        return value
    if key in ("seed", "eval_tokens", "holdout_tokens", "untimed_steps", "degraded_warmup_steps", "degraded_patience", "max_consecutive_crashes",
               "last_n_results", "plateau_after", "max_experiments"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, not {value!r}")
        if key != "seed" and value < (1 if key in ("eval_tokens", "max_consecutive_crashes", "max_experiments")
                                      else 0):
            raise ConfigError(f"{where} must be positive, not {value}")
        return value
    if key in ("time_budget", "startup_allowance", "eval_allowance", "eval_prestart", "noise", "min_mfu", "min_tokens_per_s",
               "min_gain", "agent_timeout", "hook_timeout", "max_log_mb", "max_usd", "max_hours"):
        if isinstance(value, bool) or not isinstance(value, num) or not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, not {value!r}")
        if value < 0 or (value == 0 and key in ("time_budget", "agent_timeout", "hook_timeout", "max_log_mb",
                                                "max_usd")):
            raise ConfigError(f"{where} must be positive, not {value}")
        return float(value)
    if key == "search_space":
        if not isinstance(value, dict) or not all(isinstance(v, list) and v for v in value.values()):
            raise ConfigError(f"{where} must map knob names to non-empty lists of values")
        from autoresearch.knobs import parse_value
        return {str(k): [parse_value(x) if isinstance(x, str) else x for x in v] for k, v in value.items()}
    if key == "agent_prices":
        return _check_prices(value, where)
    if key == "hooks":
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must map events to lists of commands")
        out = {}
        for event, cmds in value.items():
            if event not in HOOK_EVENTS:
                raise ConfigError(f"unknown hook event {event!r} in {source}; events: {', '.join(HOOK_EVENTS)}")
            cmds = [cmds] if isinstance(cmds, str) else cmds
            if not (isinstance(cmds, list) and all(isinstance(c, str) and c.strip() for c in cmds)):
                raise ConfigError(f"hooks.{event} in {source} must be a command or a list of commands")
            out[event] = cmds
        return out
    if key == "gpus":
        from autoresearch.slots import parse_gpus
        value = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
        parse_gpus(value, probe=False, where=where)
        return value
    if key == "head_start":
        if value not in (True, False, "auto"):
            raise ConfigError(f'{where} must be true, false or "auto", not {value!r}')
        return value
    if key == "false_keep":
        if isinstance(value, bool) or not isinstance(value, num) or not 0 < value < 0.5:
            raise ConfigError(f"{where} must be a share between 0 and 0.5 (0.05: one in twenty), not {value!r}")
        return float(value)
    if key in ("stale_policy", "executor", "keep_rule"):
        choices = {"stale_policy": ("rerun", "record"), "executor": ("local", "ray"),
                   "keep_rule": ("sequential", "single")}[key]
        if value not in choices:
            raise ConfigError(f"{where} must be {' or '.join(choices)}, not {value!r}")
        return value
    if key in ("ray_address", "ray_resource"):
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where} must be a non-empty string")
        return value
    raise AssertionError(f"no validation for {key}")  # every field must be handled above


def _check_prices(value: Any, where: str) -> dict[str, dict[str, float]]:
    """model -> {input, output[, cached_input]}: USD per million tokens, each a finite number >= 0."""
    shape = f"{where} must map model names (or default) to {{input: USD, output: USD}} per million tokens"
    if not isinstance(value, dict):
        raise ConfigError(shape)
    out = {}
    for model, p in value.items():
        if not isinstance(p, dict) or not {"input", "output"} <= set(p) or not set(p) <= {"input", "output",
                                                                                         "cached_input"}:
            raise ConfigError(f"{shape}; {model!r} has {p!r}")
        for k, v in p.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"{where}: {model}.{k} must be a finite number >= 0, not {v!r}")
        out[str(model)] = {k: float(v) for k, v in p.items()}
    return out


FIELD_NAMES = tuple(f.name for f in fields(RunConfig))


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Build a RunConfig: defaults, then the YAML file at `path`, then `overrides` (flags; None values ignored)."""
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{p}{line} is not valid YAML") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p} must be a YAML mapping of settings")
        for key, value in raw.items():
            if key not in FIELD_NAMES:
                near = difflib.get_close_matches(str(key), FIELD_NAMES, n=1, cutoff=0.6)
                hint = f"did you mean {near[0]!r}?" if near else "configs/run.yaml lists every key"
                raise ConfigError(f"unknown key {key!r} in {p}; {hint}")
            values[key] = _check_type(key, value, str(p))
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in FIELD_NAMES:
            raise AssertionError(f"unknown override {key}")
        values[key] = _check_type(key, value, "the command line")
    cfg = RunConfig(**values)
    if cfg.objective.custom:
        _check_objective_scope(cfg, "allowed_paths" in values, str(path or "the command line"))
    if cfg.proposer == "agent" and not cfg.agent:
        raise ConfigError("proposer agent needs an agent: pass --agent claude|codex|aider|'COMMAND {prompt_file}'")
    if cfg.proposer == "grid" and not cfg.search_space:
        raise ConfigError("proposer grid needs search_space (knob -> list of values) in the config file")
    return cfg


def _check_objective_scope(cfg: RunConfig, paths_given: bool, source: str) -> None:
    """A command objective measures what the proposal changes: the proposal must not be able to change it."""
    if not paths_given:
        raise ConfigError(f"an objective needs allowed_paths in {source}: the files the agent may change "
                          "(e.g. [kernel.py])")
    obj = cfg.objective
    for word in (*obj.command, *obj.gate):
        if any(word == p or word.startswith(p.rstrip("/") + "/") for p in cfg.allowed_paths):
            raise ConfigError(f"objective command or gate runs {word}, which a proposal may change (allowed_paths "
                              f"in {source}): keep what measures out of what is measured")


def replace(cfg: RunConfig, **changes: Any) -> RunConfig:
    """A copy of cfg with validated changes."""
    return dataclasses.replace(cfg, **{k: _check_type(k, v, "the command line") for k, v in changes.items()})
