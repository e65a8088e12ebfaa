"""The agent proposer: a coding agent (claude, codex, aider, or any command) edits train.py once per proposal.

Each proposal is a fresh invocation in the repo with a rendered prompt: program.md, then a compact context
(hardware, budget, knobs, best result, last N results, rules). The agent edits; it never runs training.
It runs in its own process group with a timeout (the whole group is killed), its output goes to
`agent.log` (capped). Its one-line description is the first line of the file named by
$AR_DESCRIPTION_FILE if it wrote one, else the last line of its final message (claude's and codex's JSON
output), else its last non-empty output line. What it spent (tokens, USD) is read from its output
(cost.UsageReader: each preset's own report, or an `AR_USAGE {...}` line) and recorded with the result.

A free-form command may name `{prompt}` (the prompt text as one argument) or `{prompt_file}` (a file
holding it); a command that names neither gets the prompt as its last argument.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import shlex
import shutil
from pathlib import Path
from typing import Callable

from autoresearch import faults
import autoresearch.proposers.memory as memory
from autoresearch.proposers.cost import Prices, UsageReader
from autoresearch.errors import ConfigError
from autoresearch.records.durable import write_json
from autoresearch.records.ledger import Row
from autoresearch.process import STOP_INTERRUPTED, run_training
from autoresearch.objective import shown
from autoresearch.proposers.base import Context, Proposal, ProposalFailed

PRESETS: dict[str, list[str]] = {
    # --output-format json / --json change only what is printed (a result object, JSONL events): the cost and
    # token counts ar records come from there; the final message stays readable inside it
    "claude": ["claude", "-p", "{prompt}", "--permission-mode", "acceptEdits", "--output-format", "json"],
    "codex": ["codex", "exec", "--full-auto", "--json", "{prompt}"],
    "aider": ["aider", "--yes-always", "--no-auto-commits", "--no-dirty-commits", "--message", "{prompt}",
              "train.py"],
}
AGENT_LOG_BYTES = 5 * 2**20
DESCRIPTION_MAX = 200
DEFAULT_PROGRAM = """# autoresearch
Lower val_bpb (validation bits per byte) of train.py within a fixed training-time budget.
Edit only train.py; never the harness, the data, the budget or the evaluation. Make one focused change
per proposal, keep the code simple, and describe the change in one line."""


def command_for(agent: str) -> list[str]:
    """argv template for a preset name or a free-form command (placeholders still in)."""
    if agent in PRESETS:
        argv = list(PRESETS[agent])
    else:
        try:
            argv = shlex.split(agent)
        except ValueError as e:
            raise ConfigError(f"cannot parse agent command {agent!r}: {e}") from None
        if not argv:
            raise ConfigError("the agent command is empty")
        if not any("{prompt}" in a or "{prompt_file}" in a for a in argv):
            argv.append("{prompt}")
    if shutil.which(argv[0]) is None and not Path(argv[0]).is_file():
        raise ConfigError(f"agent command {argv[0]!r} not found on PATH; install it, or pick another agent "
                          "(--agent claude|codex|aider|'COMMAND {prompt_file}') or --proposer strategy")
    return argv


def fill(argv: list[str], prompt: str, prompt_file: Path) -> list[str]:
    return [a.replace("{prompt_file}", str(prompt_file)).replace("{prompt}", prompt) for a in argv]


# ---------------------------------------------------------------------------------------------- hardware

@functools.lru_cache(maxsize=4)
def describe_hardware(profile_name: str, *, training: bool = True) -> str:
    """One or two lines about the machine an experiment runs on, for the prompt. `training`: train.py's
    profile applies (on a CPU its knobs drive a scaled-down model); a command objective has none."""
    if profile_name == "cpu":
        return f"CPU only ({os.cpu_count()} cores)" + (", `cpu` profile: the knobs drive a scaled-down model"
                                                       if training else "")
    try:
        import torch
        if not torch.cuda.is_available():
            return "no CUDA device visible"
        from autoresearch.harness.gpus import lookup
        p = torch.cuda.get_device_properties(0)
        peak = lookup(p.name)
        peak_s = f"peak {peak.tflops:g} TFLOP/s dense BF16" if peak.tflops else "peak unknown (MFU unknown)"
        backends = _attention_backends(p.name)
        return (f"{p.name} (compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB), {peak_s}, "
                f"{torch.cuda.device_count()} visible; attention backends: {backends}")
    except Exception as e:  # the prompt must not fail over a hardware query
        return f"GPU (details unavailable: {type(e).__name__})"


def _attention_backends(device_name: str) -> str:
    try:
        from autoresearch.harness.backend import probe_path, read_choice
        choice = read_choice(probe_path(device_name))
        if choice:
            return f"probed choice {choice.get('attention')} (compile {choice.get('compile_model')})"
    except Exception:
        pass
    return "not probed (run `ar doctor --probe`); train.py's ATTENTION=\"auto\" picks a safe default"


# ------------------------------------------------------------------------------------------------ prompt

def _fmt_bpb(v: float | None) -> str:
    return "-" if v is None else f"{v:.6f}"


def _result_line(r: Row) -> str:
    exp = f"{r.exp_id:04d}" if r.exp_id is not None else "----"
    extra = f" ({r.reason})" if r.reason and r.status.value != "keep" else ""
    return f"  {exp} {r.commit or '-------':7} {r.status.value:11} {_fmt_bpb(r.val_bpb):>9}  {r.description}{extra}"


def render_prompt(ctx: Context, *, program: str, last_n: int, description_file: Path, memory: str = "") -> str:
    knobs = "\n".join(f"  {k} = {v!r}" for k, v in ctx.knobs.items()) or "  (none found)"
    obj = ctx.objective
    best = ("none yet" if ctx.best is None else
            f"{_fmt_bpb(ctx.best.val_bpb)} {obj.name} at commit {ctx.best.commit} ({ctx.best.description})")
    recent = "\n".join(_result_line(r) for r in ctx.rows[-last_n:]) if last_n else ""
    allowed = ", ".join(ctx.allowed_paths)
    return f"""{program.rstrip()}

## This proposal (experiment {ctx.exp_id:04d}, tag {ctx.tag})
Hardware: {describe_hardware(ctx.profile.name, training=not obj.custom)}
{_measure_lines(ctx)}
Best so far: {best}
Knobs of the current {ctx.train_file} (the best kept version):
{knobs}
Last {min(last_n, len(ctx.rows))} results (exp, commit, status, {obj.name}, description):
{recent or "  (none yet)"}
{memory.rstrip() + chr(10) if memory.strip() else ""}
## Rules
- Change only {allowed}. Any other change (harness, data, configs, program.md, tests, .git, runs/) is
  rejected and reverted.
- {"Do not run training; the runner runs it after you finish, for the fixed budget." if not obj.custom else
   "Testing is fine, but what counts is the runner's own run of the gate and the benchmark after you finish."}
- Never read or change the time budget, evaluation size, seed or result file (AR_* variables).
- Write a one-line description of your change to {description_file} (or make it your last line of output).
"""


def _measure_lines(ctx: Context) -> str:
    """How the proposal is measured and kept: val_bpb after a fixed training budget, or the objective's command."""
    obj = ctx.objective
    if not obj.custom:
        return (f"Budget: {ctx.time_budget:g} s of training; evaluation on {ctx.eval_tokens} tokens (both fixed by "
                f"the runner)\nKeep threshold: a change is kept only if val_bpb improves by more than {ctx.noise:g}")
    better = "lower" if obj.direction == "min" else "higher"
    gate = f"the correctness gate `{shown(obj.gate)}` must pass, then " if obj.gate else ""
    share = (f"{obj.noise_share:.0%} of the best" if obj.noise_share is not None else
             f"{obj.threshold(ctx.noise, None):g} {obj.unit}".strip())
    return (f"Measure: {gate}the runner reads {obj.name} ({obj.unit or 'no unit'}, {better} is better) from its own "
            f"benchmark\nKeep threshold: a change is kept only if {obj.name} improves by more than {share}")


def load_program(root: Path, name: str) -> str:
    f = root / name
    return f.read_text() if f.is_file() else DEFAULT_PROGRAM


# ---------------------------------------------------------------------------------------------- proposer

class AgentProposer:
    name = "agent"

    def __init__(self, agent: str, *, timeout: float = 900.0, last_n: int = 10, program: str = "program.md",
                 plateau_after: int = 5, prices: Prices | None = None):
        self.agent = agent
        self.prices = prices
        self.plateau_after = plateau_after
        self.argv = command_for(agent)
        self.timeout = timeout
        self.last_n = last_n
        self.program = program

    def propose(self, ctx: Context) -> Proposal | None:
        ctx.exp_dir.mkdir(parents=True, exist_ok=True)
        description_file = ctx.exp_dir / "description.txt"
        prompt_file = ctx.exp_dir / "prompt.md"
        digest, record = self._memory(ctx)
        record()
        prompt = render_prompt(ctx, program=load_program(ctx.root, self.program), last_n=self.last_n,
                               description_file=description_file, memory=digest)
        prompt_file.write_text(prompt)
        description_file.unlink(missing_ok=True)
        last = [""]
        reader = UsageReader()

        def on_line(line: str) -> None:
            if not reader.feed(line) and line.strip():   # usage reports and JSON events are not its last words
                last[0] = line.strip()
            faults.point("agent")

        env = {k: v for k, v in os.environ.items() if not k.startswith("AR_") and k not in ("GIT_DIR", "GIT_WORK_TREE")}
        env.update(AR_PROMPT_FILE=str(prompt_file), AR_DESCRIPTION_FILE=str(description_file),
                   AR_EXPERIMENT=str(ctx.exp_id))
        argv = fill(self.argv, prompt, prompt_file)
        if ctx.sandbox is not None:   # the agent runs unsandboxed code of its own: it may not read the evaluation
            policy = ctx.exp_dir / "agent-policy.json"      # data nor change the installed package
            policy.write_text(json.dumps(ctx.sandbox))
            argv = [sys.executable, "-I", "-B", "-m", "autoresearch.harness.sandbox", str(policy), "--", *argv]
        try:
            result = run_training(argv, cwd=ctx.root, env=env,
                                  log_path=ctx.exp_dir / "agent.log", timeout=self.timeout, on_line=on_line,
                                  max_log_bytes=AGENT_LOG_BYTES, grace=2.0)
        finally:
            record()
        if result.stop_reason == STOP_INTERRUPTED:
            raise KeyboardInterrupt
        usage = reader.usage(self.prices)   # spent even when the proposal fails or is refused later
        if result.timed_out:
            raise ProposalFailed(f"agent timed out after {self.timeout:g}s (its process group was killed)", usage)
        if result.returncode != 0:
            why = result.stop_reason or f"exit code {result.returncode}"
            raise ProposalFailed(f"agent failed ({why}): {(last[0] or reader.final_line())[:160]}", usage)
        return Proposal(self._description(description_file, reader.final_line() or last[0]), usage=usage)

    def _memory(self, ctx: Context) -> tuple[str, Callable[[], None]]:
        """(the journal's digest for the prompt and, on a plateau, the strategy switch; a function that writes
        the records). The records — the experiment's strategy.json, runs/<tag>/journal.md — are written
        before the agent runs and again after it (the agent may write in its own folder: what it leaves
        there is replaced by the runner's)."""
        rows = [r for r in ctx.rows if r.reason != "in flight"]
        journal = memory.build(rows, tag=ctx.tag, source="results.tsv", noise=ctx.noise, noise_source="",
                               tag_dir=ctx.exp_dir.parent)
        text = memory.digest(journal)
        plateau = memory.plateau_strategy(journal, self.plateau_after)
        if plateau is not None:
            text += "\n\n" + memory.strategy_text(journal, plateau[0])
        doc = None if plateau is None else {"strategy": plateau[0], "phase": plateau[1],
                                            "since_keep": journal.since_keep, "plateau_after": self.plateau_after}

        def record() -> None:
            f = ctx.exp_dir / memory.STRATEGY_FILE
            try:
                memory.write(journal, ctx.exp_dir.parent)  # runs/<tag>/journal.md, kept current as the tag runs
                if doc is None:
                    f.unlink(missing_ok=True)
                else:
                    write_json(f, doc)
            except OSError:
                pass
        return text, record

    @staticmethod
    def _description(description_file: Path, last_line: str) -> str:
        text = ""
        if description_file.is_file():
            lines = [ln.strip() for ln in description_file.read_text(errors="replace").splitlines() if ln.strip()]
            text = lines[0] if lines else ""
        text = text or last_line or "agent proposal (no description)"
        return " ".join(text.split())[:DESCRIPTION_MAX]
