"""RunRequest: everything one experiment's run needs, built in one place; `to_environ` is the only place the
training process's environment is made.

The training process inherits nothing of ar's environment but PATH, the locale and the slot's GPU: HOME,
TMPDIR and every cache point into the run's own scratch folder, which is deleted afterwards, so nothing one
proposal leaves behind reaches the next.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from autoresearch.harness.env import KEPT_ENV, Profile
from autoresearch.objective import DEFAULT as VAL_BPB, Objective

PASSED_THROUGH = KEPT_ENV + ("AR_PEAK_TFLOPS", "AR_GPU_MEMORY_GB", "CUDA_HOME", "LD_LIBRARY_PATH")


@dataclass(frozen=True, kw_only=True)
class RunRequest:
    tag: str
    exp_id: int
    commit: str
    time_budget: float
    seed: int
    profile: Profile
    dataset: str
    cache: Path
    tok_dir: Path | None                  # the prepared dataset (the run sees meta.json and the tokenizer of it; its tokens come from ar's feed); None: a
                                          # command objective, which reads no prepared data
    train_command: tuple[str, ...]
    train_file: str
    eval_tokens: int
    holdout_tokens: int
    startup_allowance: float              # seconds before training counts (imports, compile), already tightened
    eval_allowance: float
    eval_prestart: float = 0.0             # seconds before the window's end that the evaluator's workers start
    untimed_steps: int
    max_log_bytes: int
    sandbox: bool
    slot_env: dict[str, str] = field(default_factory=dict)
    objective: Objective = VAL_BPB        # a custom one: gate + command instead of train.py + the evaluator
    trusted_code: bool = False            # what this run compiles may join the compile store (compile_cache.py)
    compile_store: Path | None = None     # copied into the run's scratch cache before it starts; None: cold
    head_start: bool | str = "auto"       # slots taking turns on a GPU: start beside the running window's last
                                          # seconds (headstart.py); "auto": on a GPU
    session: str = ""                     # the `ar run` it belongs to (views/gpu_use.py: no gap across two)

    @property
    def device(self) -> str:
        return self.profile.device

    @property
    def eval_rows(self) -> int:
        """Rows per evaluation call: 2**16 tokens on a GPU (1 GiB of float32 logits at vocab 8192), 2**12 on CPU."""
        return max(1, (2**16 if self.device == "cuda" else 2**12) // self.profile.seq_len)

    def hard_limit(self) -> float:
        """Seconds after which the training process is killed, whatever it is doing."""
        return self.time_budget + self.startup_allowance + self.step_slack_cap()

    def step_slack_cap(self) -> float:
        """The most a last step that started inside the budget may run over it."""
        return 5.0 + 0.1 * self.time_budget

    def to_environ(self, *, tok_view: Path, checkpoint_dir: Path, scratch: Path,
                   cache: Path | None = None) -> dict[str, str]:
        """`cache`: the run's compile caches (default scratch/cache; compile_cache.run_root for training)."""
        env = {k: v for k, v in os.environ.items() if k in PASSED_THROUGH}
        env.update(self.slot_env)
        cache = cache or scratch / "cache"
        env.update(
            HOME=str(scratch), TMPDIR=str(scratch), XDG_CACHE_HOME=str(cache), PYTHONUNBUFFERED="1",
            PYTHONDONTWRITEBYTECODE="1",
            TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"),
            AR_TIME_BUDGET=f"{self.time_budget:g}", AR_SEED=str(self.seed), AR_PROFILE=self.profile.name,
            AR_DATASET=self.dataset, AR_CACHE=str(self.cache), AR_TOK_DIR=str(tok_view),
            AR_CHECKPOINT_DIR=str(checkpoint_dir), AR_UNTIMED_STEPS=str(self.untimed_steps),
        )
        return env
