"""What the runner passes to train.py, read in one place. train.py never reads os.environ itself."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


# What every process of a run keeps from ar's environment besides what the runner sets: the locale, the GPUs
# visible to the slot, and switches some GPU hosts require to stay set in every process (NVLink multicast off).
KEPT_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
            "OMP_NUM_THREADS")   # a CPU run's thread cap on a shared machine (train.py and the evaluator's torch)


@dataclass(frozen=True)
class Profile:
    name: str
    seq_len: int
    vocab_size: int
    eval_tokens: int
    time_budget: float

    @property
    def device(self) -> str:
        """The torch device a run of this profile trains and is scored on."""
        return "cuda" if self.name == "gpu" else "cpu"


PROFILES = {
    "gpu": Profile("gpu", seq_len=2048, vocab_size=8192, eval_tokens=10 * 2**20, time_budget=300.0),
    "cpu": Profile("cpu", seq_len=256, vocab_size=2048, eval_tokens=2**15, time_budget=20.0),
}


def default_cache() -> Path:
    return Path(os.environ.get("AR_CACHE") or Path.home() / ".cache" / "autoresearch")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve_profile(name: str | None = None) -> Profile:
    name = (name or os.environ.get("AR_PROFILE") or "auto").lower()
    if name == "auto":
        name = "gpu" if cuda_available() else "cpu"
    if name not in PROFILES:
        raise ValueError(f"AR_PROFILE={name!r} is not a profile; use one of: auto, {', '.join(PROFILES)}")
    return PROFILES[name]


@dataclass(frozen=True)
class RunEnv:
    """A training run's settings. Under `ar run` the data folder is a view without tokens (they come from ar's feed) and the checkpoint folder
    is where the run's weights must go; run by hand, the cache's dataset and ./checkpoint are used."""

    profile: Profile
    time_budget: float
    dataset: str
    cache: Path
    seed: int
    peak_tflops: float | None
    gpu_memory_gb: float | None  # emulate a smaller card (e.g. 32 for an RTX 5090) on a larger one
    tok_dir: Path | None         # AR_TOK_DIR: the training split (a view without validation data)
    checkpoint_dir: Path         # AR_CHECKPOINT_DIR: where the weights go; nothing else of the run counts
    untimed_steps: int | None    # AR_UNTIMED_STEPS: compile warm-up steps on synthetic tokens before the first batch
    data_fd: int | None = None   # AR_DATA_FD: ar's training feed (harness/feed.py); None: the files (a hand run)

    def progress(self, training_time: float, deadline: float | None = None, now: float | None = None) -> float:
        """How far through its budget the run is, 0..1: run by hand, its own training time over the budget; under
        ar, the share of the budget that ar's window has used (the loader's `deadline`, known from the first
        batch). Ar's window alone: the run's own step times may hold time outside it, such as a first batch that
        waited for the GPU's turn before the window opened, and would end the run that much early."""
        if self.time_budget <= 0:
            return 1.0
        if deadline is None:
            done = training_time / self.time_budget
        else:
            import time
            done = 1.0 - (deadline - (time.time() if now is None else now)) / self.time_budget
        return min(1.0, max(0.0, done))

    @property
    def data_dir(self) -> Path:
        return self.cache / self.dataset

    @classmethod
    def from_environ(cls, environ: dict | None = None) -> "RunEnv":
        e = os.environ if environ is None else environ
        profile = resolve_profile(e.get("AR_PROFILE"))

        def num(key, cast, default):
            raw = e.get(key)
            if raw in (None, ""):
                return default
            try:
                return cast(raw)
            except ValueError:
                raise ValueError(f"{key}={raw!r} is not a number; unset it or give a number") from None

        tok = e.get("AR_TOK_DIR")
        return cls(
            profile=profile,
            time_budget=num("AR_TIME_BUDGET", float, profile.time_budget),
            dataset=e.get("AR_DATASET") or "builtin",
            cache=Path(e.get("AR_CACHE") or Path.home() / ".cache" / "autoresearch"),
            seed=num("AR_SEED", int, 42),
            peak_tflops=num("AR_PEAK_TFLOPS", float, None),
            gpu_memory_gb=num("AR_GPU_MEMORY_GB", float, None),
            tok_dir=Path(tok) if tok else None,
            checkpoint_dir=Path(e.get("AR_CHECKPOINT_DIR") or "checkpoint"),
            untimed_steps=num("AR_UNTIMED_STEPS", int, None),
            data_fd=num("AR_DATA_FD", int, None),
        )
