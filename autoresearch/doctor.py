"""`ar doctor`: a checklist of what a run needs, and `--probe`: the fastest correct backend, measured.

Each check is a small function of its inputs that returns a Check; `run_checks` gathers the real inputs
(torch, git, disk, PATH) and passes them in, so tests fake any of them. Anything that can hang or poison a
CUDA context (SDPA kernels, torch.compile, the probe's training steps) runs in a subprocess with a timeout.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping

from .errors import ArError
from .harness import backend, gpus
from .harness.env import default_cache, resolve_profile

OK, WARN, FAIL = "ok", "warn", "fail"
HEAD_DIM = 128  # the default model's head size
AGENT_PRESETS = {"claude": "claude", "codex": "codex", "aider": "aider"}  # preset -> executable


@dataclass(frozen=True)
class Check:
    name: str
    state: str  # ok / warn / fail
    detail: str
    fix: str | None = None


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]
    vram_mb: float


@dataclass(frozen=True)
class TorchFacts:
    version: str | None  # None: torch does not import
    cuda_build: str | None  # torch.version.cuda; None for a CPU-only build
    cuda_available: bool
    gpu: Gpu | None
    arch_list: tuple[str, ...]


def torch_facts() -> TorchFacts:
    try:
        import torch
    except ImportError:
        return TorchFacts(None, None, False, None, ())
    if not torch.cuda.is_available():
        return TorchFacts(torch.__version__, torch.version.cuda, False, None, ())
    p = torch.cuda.get_device_properties(0)
    gpu = Gpu(p.name, (p.major, p.minor), p.total_memory / 2**20)
    return TorchFacts(torch.__version__, torch.version.cuda, True, gpu, tuple(torch.cuda.get_arch_list()))


# ---------------------------------------------------------------------------------------------------------
# Checks: each a function of its inputs
# ---------------------------------------------------------------------------------------------------------
def check_python(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> Check:
    text = ".".join(map(str, version))
    if version < (3, 10):
        return Check("python", FAIL, text, "ar needs Python 3.10 or newer; install it and reinstall ar")
    return Check("python", OK, text)


def check_torch(version: str | None) -> Check:
    if version is None:
        return Check("torch", FAIL, "not installed", "pip install torch (a CUDA build for GPU runs)")
    major_minor = tuple(int(x) for x in version.split("+")[0].split(".")[:2] if x.isdigit())
    if major_minor < (2, 5):
        return Check("torch", FAIL, version, "ar needs torch 2.5 or newer: pip install -U torch")
    return Check("torch", OK, version)


def check_cuda(facts: TorchFacts) -> Check:
    if facts.cuda_available:
        return Check("cuda", OK, f"CUDA {facts.cuda_build} build, GPU visible")
    if facts.cuda_build is None:
        return Check("cuda", WARN, "no GPU: this torch build is CPU-only; runs use the small cpu profile",
                     "for GPU runs install a CUDA build of torch (pip install torch --index-url "
                     "https://download.pytorch.org/whl/cu128)")
    return Check("cuda", WARN, f"no GPU visible to this CUDA {facts.cuda_build} build; runs use the cpu profile",
                 "check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES")


def check_gpu(gpu: Gpu) -> Check:
    major, minor = gpu.capability
    return Check("gpu", OK, f"{gpu.name}, sm_{major}{minor}, {gpu.vram_mb / 1024:.1f} GiB")


def _sm_numbers(arch_list, prefix: str) -> list[int]:
    return [int("".join(c for c in a.split("_", 1)[1] if c.isdigit()))
            for a in arch_list if a.startswith(prefix) and any(c.isdigit() for c in a)]


def check_kernels(capability: tuple[int, int], arch_list, cuda_build: str | None) -> Check:
    """Does this torch build ship kernels for the GPU? Cubins run on the same major, equal or newer minor."""
    major, minor = capability
    sm = f"sm_{major}{minor}"
    cubins = [s for s in _sm_numbers(arch_list, "sm_") if s // 10 == major and s % 10 <= minor]
    if cubins:
        return Check("kernels", OK, f"this build has {sm} kernels (CUDA {cuda_build})")
    fix = (f"install a torch build whose arch list includes {sm}"
           + (" — sm_120 (RTX 50xx) needs CUDA 12.8 or newer: pip install torch --index-url "
              "https://download.pytorch.org/whl/cu128" if major == 12 else ""))
    if any(s <= major * 10 + minor for s in _sm_numbers(arch_list, "compute_")):
        return Check("kernels", WARN, f"no {sm} kernels, only PTX to compile at start-up (slow, may fail)", fix)
    return Check("kernels", FAIL, f"this build (CUDA {cuda_build}, {' '.join(arch_list) or 'no archs'}) "
                 f"has no kernels for {sm}", fix)


def check_peak(device_name: str, lookup: Callable[[str], gpus.Peak] = gpus.lookup) -> Check:
    peak = lookup(device_name)
    if peak.tflops is not None:
        where = f"table row {peak.row!r}" if peak.row else peak.source
        return Check("peak", OK, f"{peak.tflops:g} TFLOP/s dense BF16 ({where})")
    return Check("peak", WARN, "unknown: MFU will read 'unknown'",
                 "add a row (name, match, tflops) to a YAML file named by AR_GPU_TABLE (or to configs/gpus.yaml "
                 "in a clone), or set AR_PEAK_TFLOPS")


SDPA_NAMES = ("cudnn", "flash", "efficient", "math")


def check_sdpa(results: Mapping[str, str | None]) -> Check:
    """results: backend -> None when a forward and backward at head dim 128 worked, else why not."""
    works = [n for n in SDPA_NAMES if n in results and results[n] is None]
    broken = "; ".join(f"{n}: {results.get(n) or 'no answer (the probe process died)'}"
                       for n in SDPA_NAMES if n not in works)
    detail = f"head dim {HEAD_DIM}: {', '.join(works) or 'none'} work" + (f" — {broken}" if broken else "")
    if not works:
        return Check("attention", FAIL, detail, "no SDPA backend runs; check the torch build (kernels line)")
    if works == ["math"]:
        return Check("attention", WARN, detail, "only the unfused math path works: runs will be slow; "
                     "install a torch build with kernels for this GPU")
    return Check("attention", OK, detail)


def check_compile(ok: bool | None, detail: str) -> Check:
    """ok None: the probe timed out."""
    if ok:
        return Check("compile", OK, detail)
    if ok is None:
        return Check("compile", WARN, detail, "torch.compile may hang here; set COMPILE_MODEL = False in "
                     "train.py, or run `ar doctor --probe` to measure both paths")
    return Check("compile", FAIL, detail, "train.py compiles its optimizer step: fix triton / the C compiler, "
                 "or set COMPILE_MODEL = False and COMPILE_OPTIMIZER = False in train.py")


def check_data(cache: Path, dataset: str, vocab_size: int, checker: Callable | None) -> Check:
    if checker is None:
        return Check("data", WARN, "cannot check: this installation has no data module", None)
    try:
        where = checker(cache, dataset, vocab_size)
    except (ArError, OSError, ValueError) as e:  # the message names the fix
        if dataset == "builtin":
            return Check("data", WARN, str(e), "or let `ar run` prepare builtin on first use")
        return Check("data", FAIL, str(e))
    return Check("data", OK, f"{dataset!r} with a {vocab_size}-token tokenizer at {where}")


def check_train(repo: Path) -> Check:
    if (repo / "train.py").is_file():
        return Check("train.py", OK, str(repo / "train.py"))
    return Check("train.py", FAIL, f"no train.py in {repo}",
                 "run ar in a workspace (`ar init DIR` makes one) or pass --repo PATH")


def check_repo(repo: Path) -> Check:
    import git
    try:
        r = git.Repo(repo)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return Check("repo", FAIL, f"{repo} is not a git repository",
                     "git init && git add -A && git commit -m init (or `ar init DIR`)")
    if not r.head.is_valid():
        return Check("repo", FAIL, "no commits yet", "git add -A && git commit -m init")
    branch = "detached HEAD" if r.head.is_detached else f"branch {r.active_branch.name}"
    if r.is_dirty(untracked_files=False):
        changed = sorted({d.a_path for d in r.index.diff(None)} | {d.a_path for d in r.index.diff("HEAD")})
        return Check("repo", FAIL, f"{branch}, uncommitted changes: {', '.join(changed[:5])}",
                     "commit or stash them: ar run refuses a dirty tree")
    untracked = r.untracked_files
    if untracked:
        return Check("repo", WARN, f"{branch}, clean, {len(untracked)} untracked file(s): {', '.join(untracked[:3])}",
                     "commit them or add them to .gitignore")
    return Check("repo", OK, f"{branch}, clean")


def check_disk(path: Path, usage: Callable = None, *, low_gb: float = 2.0, warn_gb: float = 10.0) -> Check:
    import psutil
    usage = usage or psutil.disk_usage
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    free_gb = usage(str(p)).free / 2**30
    detail = f"{free_gb:.1f} GiB free at {p}"
    if free_gb < low_gb:
        return Check("disk", FAIL, detail, f"free at least {warn_gb:g} GiB (data, tokenizer, logs) or set AR_CACHE")
    if free_gb < warn_gb:
        return Check("disk", WARN, detail, "climbmix shards need several GiB; free space or set AR_CACHE")
    return Check("disk", OK, detail)


def check_agent(agent: str | None, which: Callable[[str], str | None] = shutil.which) -> Check:
    if not agent:
        return Check("agent", OK, "none configured: the built-in strategy proposer needs none")
    try:
        exe = AGENT_PRESETS.get(agent) or shlex.split(agent)[0]
    except (ValueError, IndexError):
        return Check("agent", FAIL, f"cannot parse agent command {agent!r}", "fix its quoting in the config")
    found = which(exe)
    if found:
        return Check("agent", OK, f"{agent} -> {found}")
    return Check("agent", FAIL, f"{exe!r} not found on PATH",
                 f"install {exe} or put it on PATH, or choose another agent (claude, codex, aider, a command)")


# ---------------------------------------------------------------------------------------------------------
# Subprocess probes (GPU only)
# ---------------------------------------------------------------------------------------------------------
SDPA_SCRIPT = r"""
import json, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
kinds = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
         "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, 256, %d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
for name, kind in kinds.items():
    try:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(kind):
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            out.float().sum().backward()
        torch.cuda.synchronize()
        err = (out.float() - ref).abs().max().item()
        why = None if err < 5e-2 else "wrong output (max error %%.3g)" %% err
    except Exception as e:
        why = (type(e).__name__ + ": " + (str(e).strip().splitlines() or [""])[0])[:160]
    print("AR_SDPA " + json.dumps([name, why]), flush=True)
""" % HEAD_DIM

COMPILE_SCRIPT = r"""
import time, torch
t = time.time()
lin = torch.nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16)
f = torch.compile(lambda x: torch.relu(lin(x)).square().sum())
x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
f(x).backward()
torch.cuda.synchronize()
print("AR_COMPILE_OK %.1f" % (time.time() - t), flush=True)
"""

PROBE_SCRIPT = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("ar_probe_train", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
print("\nAR_PROBE " + json.dumps(mod.probe_step(**json.loads(sys.argv[2]))), flush=True)
"""


def run_script(script: str, args: list[str], timeout: float, cwd: Path | None = None) -> tuple[int | None, str]:
    """Run `python -c script args` in its own process group; (exit code or None on timeout, output)."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out or ""


def _last_line(out: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no output"


def sdpa_probe(timeout: float = 60) -> dict[str, str | None]:
    rc, out = run_script(SDPA_SCRIPT, [], timeout)
    found = dict(json.loads(ln[len("AR_SDPA "):]) for ln in out.splitlines() if ln.startswith("AR_SDPA "))
    died = "timed out" if rc is None else f"the probe process died: {_last_line(out)}"
    return {n: found[n] if n in found else died for n in SDPA_NAMES}


def compile_probe(timeout: float = 120) -> tuple[bool | None, str]:
    rc, out = run_script(COMPILE_SCRIPT, [], timeout)
    if rc is None:
        return None, f"a tiny torch.compile did not finish in {timeout:g} s"
    for ln in out.splitlines():
        if ln.startswith("AR_COMPILE_OK "):
            return True, f"a tiny compiled forward/backward took {ln.split()[1]} s"
    return False, f"a tiny torch.compile failed: {_last_line(out)}"


# ---------------------------------------------------------------------------------------------------------
# The checklist
# ---------------------------------------------------------------------------------------------------------
def _data_checker():
    try:
        from .harness.data import check_prepared
    except ImportError:
        return None
    return check_prepared


def run_checks(repo: Path, *, dataset: str = "builtin", agent: str | None = None, profile: str | None = None,
               cache: Path | None = None, facts: TorchFacts | None = None, sdpa: Callable = sdpa_probe,
               compile_test: Callable = compile_probe, data_checker: Callable | None | str = "import",
               which: Callable = shutil.which, disk_usage: Callable | None = None,
               lookup: Callable = gpus.lookup) -> list[Check]:
    """Every check, in order; the GPU ones only when a GPU is visible."""
    repo, cache = Path(repo).resolve(), Path(cache or default_cache())
    facts = facts or torch_facts()
    checks = [check_python(), check_torch(facts.version)]
    if facts.version is not None:
        checks.append(check_cuda(facts))
    if facts.gpu is not None:
        kernels = check_kernels(facts.gpu.capability, facts.arch_list, facts.cuda_build)
        checks += [check_gpu(facts.gpu), kernels, check_peak(facts.gpu.name, lookup)]
        if kernels.state != FAIL:
            checks += [check_sdpa(sdpa()), check_compile(*compile_test())]
    gpu = facts.gpu is not None
    vocab = resolve_profile(profile if profile not in (None, "auto") else ("gpu" if gpu else "cpu")).vocab_size
    checker = _data_checker() if data_checker == "import" else data_checker
    checks += [check_data(cache, dataset, vocab, checker), check_train(repo), check_repo(repo),
               check_disk(cache, disk_usage), check_agent(agent, which)]
    return checks


def blocking(checks: list[Check]) -> bool:
    return any(c.state == FAIL for c in checks)


def raise_if_blocking(checks: list[Check], probe: "ProbeReport | None" = None) -> None:
    failed = [c.name for c in checks if c.state == FAIL]
    if failed:
        raise ArError(f"{len(failed)} check(s) failed ({', '.join(failed)}): fix the ✗ lines before `ar run`")
    if probe is not None and probe.choice is None:
        raise ArError("the probe found no path that runs correctly; see its table; train.py keeps its defaults")


NO_GPU = "the probe needs a CUDA GPU; nothing to measure here (CPU runs use fixed settings)"


def as_json(checks: list[Check], probed: bool = False, probe: "ProbeReport | None" = None) -> dict:
    doc = {"ok": not blocking(checks), "checks": [asdict(c) for c in checks]}
    if probed:
        doc["probe"] = probe.as_dict() if probe is not None else {"skipped": NO_GPU}
    return doc


# ---------------------------------------------------------------------------------------------------------
# The probe: candidates, the pure choice, and the budgeted search
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    attention: str
    compile_model: bool
    compile_optimizer: bool
    device_batch: int

    @property
    def label(self) -> str:
        mode = lambda on: "compiled" if on else "eager"  # noqa: E731
        return (f"{self.attention}, {mode(self.compile_model)} model, {mode(self.compile_optimizer)} optimizer, "
                f"batch {self.device_batch}")


@dataclass
class ProbeResult:
    candidate: Candidate
    ok: bool
    error: str | None = None
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    mfu: float | None = None  # percent
    peak_vram_mb: float | None = None
    seconds: float | None = None
    skipped: str | None = None  # why it never ran


def compare(losses: list[float], reference: list[float], rtol: float = 2e-2, first_steps: int = 3,
            later_rtol: float = 0.1) -> tuple[bool, float | None, str]:
    """Do the losses match the reference's? (ok, largest relative difference, why not).

    Within `rtol` on each of the first steps, within `later_rtol` after them: a few full-LR steps on one batch
    drift apart chaotically (on an H200 a compiled model was 2.7 % off eager by step 4 at batch 128, 0.2 % at
    step 2), while a broken path is off from the first update on or never learns.
    """
    if not losses or len(losses) != len(reference):
        return False, None, f"{len(losses)} losses against the reference's {len(reference)}"
    diffs = []
    for i, (a, b) in enumerate(zip(losses, reference)):
        if not math.isfinite(a):
            return False, None, f"loss {a} at step {i}"
        diffs.append(abs(a - b) / max(abs(b), 1e-8))
    for i, d in enumerate(diffs):
        if d > (rtol if i < first_steps else later_rtol):
            return False, max(diffs), (f"loss off by {100 * d:.1f}% at step {i} "
                                       f"({losses[i]:.4f} vs {reference[i]:.4f})")
    return True, max(diffs), ""


def choose(results: list[ProbeResult], reference: ProbeResult | Mapping[int, ProbeResult], *,
           slow_fraction: float = 0.5, prefer: tuple[Candidate, ...] = (), tie: float = 0.02,
           **tolerance) -> tuple[Candidate | None, list[dict]]:
    """The fastest candidate whose losses match the reference at its batch size (`compare`, with `tolerance`),
    and one row per result. A candidate in `prefer` (the defaults) wins when within `tie` of the fastest: a
    difference that small is noise.

    Statuses: chosen, correct, alive but slow (correct, under slow_fraction of the best tokens/s), incorrect,
    failed, unverified (no working reference at that batch), skipped.
    """
    refs = {reference.candidate.device_batch: reference} if isinstance(reference, ProbeResult) else dict(reference)
    rows = []
    for r in results:
        row = {**asdict(r.candidate), "label": r.candidate.label, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu,
               "peak_vram_mb": r.peak_vram_mb, "max_loss_diff": None, "status": "", "note": "",
               "losses": [round(v, 4) for v in r.losses]}
        ref = refs.get(r.candidate.device_batch)
        if r.skipped:
            row.update(status="skipped", note=r.skipped)
        elif not r.ok:
            row.update(status="failed", note=r.error or "failed")
        elif ref is None or not ref.ok:
            row.update(status="unverified", note=f"no working reference at batch {r.candidate.device_batch}")
        else:
            good, diff, why = compare(r.losses, ref.losses, **tolerance)
            row.update(max_loss_diff=diff, status="correct" if good else "incorrect", note=why)
            if good and r.tokens_per_s is None:
                row.update(status="unverified", note="no tokens/s measured")
        rows.append(row)
    correct = [(row, r) for row, r in zip(rows, results) if row["status"] == "correct"]
    if not correct:
        return None, rows
    best_row, best = max(correct, key=lambda pair: pair[0]["tokens_per_s"])
    floor = (1 - tie) * best_row["tokens_per_s"]
    close = {r.candidate: (row, r) for row, r in correct if row["tokens_per_s"] >= floor}
    best_row, best = next((close[c] for c in prefer if c in close), (best_row, best))
    for row, _ in correct:
        if row["tokens_per_s"] < slow_fraction * best_row["tokens_per_s"]:
            row.update(status="alive but slow",
                       note=f"{100 * row['tokens_per_s'] / best_row['tokens_per_s']:.0f}% of the best tokens/s")
    best_row["status"] = "chosen"
    return best.candidate, rows


@dataclass
class ProbeReport:
    choice: Candidate | None
    rows: list[dict]
    notes: list[str]
    seconds: float
    path: Path | None = None  # the probe file written

    def as_dict(self) -> dict:
        return {"choice": asdict(self.choice) if self.choice else None, "rows": self.rows, "notes": self.notes,
                "seconds": round(self.seconds, 1), "file": str(self.path) if self.path else None}


def run_probe(execute: Callable[[Candidate, float], ProbeResult], default: Candidate, *, budget_s: float = 180,
              clock: Callable[[], float] = time.monotonic, attentions=("cudnn", "flash", "fa3"),
              last_attentions=("math",), per_run_cap: float = 150, min_start: float = 10,
              progress: Callable[[ProbeResult], None] | None = None) -> ProbeReport:
    """Measure candidates in stages within `budget_s`, each against an eager reference at its batch size.

    1. the reference (efficient attention, eager everything) and each attention backend, eager, at half the
       default batch; 2. compiled optimizer / compiled model with the best attention so far; 3. the best
       config at the default batch and twice it (capped), plus the defaults themselves; 4. `last_attentions`.
    A candidate that would start with less than `min_start` seconds left is skipped, and so says its row.
    `progress` is called with each result as it comes.
    """
    start = clock()
    results: list[ProbeResult] = []
    refs: dict[int, ProbeResult] = {}
    notes: list[str] = []

    def attempt(c: Candidate) -> ProbeResult:
        left = budget_s - (clock() - start)
        if left < min_start:
            return ProbeResult(c, ok=False, skipped=f"time budget of {budget_s:g} s spent")
        r = execute(c, min(left, per_run_cap))
        if not r.ok and left < per_run_cap and budget_s - (clock() - start) < 1:
            r = replace(r, skipped=f"cut short: the time budget of {budget_s:g} s ran out while it ran")
        return r

    def run(c: Candidate) -> ProbeResult:
        for r in results:
            if r.candidate == c:
                return r
        r = attempt(c)
        results.append(r)
        if progress is not None:
            progress(r)
        return r

    def reference_at(batch: int) -> ProbeResult:
        if batch not in refs:
            for attn in ("efficient", "math"):
                refs[batch] = run(Candidate(attn, False, False, batch))
                if refs[batch].ok or refs[batch].skipped:
                    break
        return refs[batch]

    base = max(1, default.device_batch // 2)
    prefer = (default, replace(default, device_batch=base))

    def best() -> Candidate | None:
        return choose(results, refs, prefer=prefer)[0]

    ref = reference_at(base)
    if not ref.ok:
        notes.append(f"the reference step failed ({ref.skipped or ref.error}): nothing can be verified")
    else:
        for a in attentions:
            run(Candidate(a, False, False, base))
        top = best() or ref.candidate
        for cm, co in ((False, True), (True, True), (True, False)):
            run(replace(top, compile_model=cm, compile_optimizer=co))
        top = best() or top
        for batch in sorted({default.device_batch, min(2 * default.device_batch, backend.MAX_AUTO_BATCH)} - {base}):
            if not reference_at(batch).ok:
                if not refs[batch].skipped:
                    why = (refs[batch].error or "failed")[:70]
                    notes.append(f"the eager reference does not run at batch {batch} ({why}): batches from "
                                 f"{batch} up cannot be verified, so none is chosen")
                break
            scaled = run(replace(top, device_batch=batch))
            if batch == default.device_batch:
                run(default)
            if not scaled.ok and not scaled.skipped:
                break
        if default.device_batch in refs and refs[default.device_batch].ok:
            run(default)
        for a in last_attentions:
            run(Candidate(a, False, False, base))
    if any(r.skipped and "budget" in r.skipped for r in results):
        notes.append(f"the {budget_s:g} s budget ran out: some candidates were skipped (raise --probe-budget)")
    choice, rows = choose(results, refs, prefer=prefer)
    return ProbeReport(choice, rows, notes, clock() - start)


def subprocess_execute(train_path: Path) -> Callable[[Candidate, float], ProbeResult]:
    """Run train.probe_step for one candidate in a fresh process (a compile can hang, a CUDA error poisons)."""
    def execute(c: Candidate, timeout: float) -> ProbeResult:
        t0 = time.monotonic()
        rc, out = run_script(PROBE_SCRIPT, [str(train_path), json.dumps(asdict(c))], timeout, cwd=train_path.parent)
        took = time.monotonic() - t0
        if rc is None:
            return ProbeResult(c, ok=False, error=f"timed out after {timeout:.0f} s", seconds=took)
        for ln in reversed(out.splitlines()):
            if ln.startswith("AR_PROBE "):
                d = json.loads(ln[len("AR_PROBE "):])
                return ProbeResult(c, ok=bool(d.get("ok")), error=d.get("error"), losses=d.get("losses") or [],
                                   tokens_per_s=d.get("tokens_per_s"), mfu=d.get("mfu"),
                                   peak_vram_mb=d.get("peak_vram_mb"), seconds=took)
        return ProbeResult(c, ok=False, error=f"exit {rc}: {_last_line(out)}", seconds=took)
    return execute


def probe(repo: Path, *, budget_s: float = 180, cache: Path | None = None, facts: TorchFacts | None = None,
          **search) -> ProbeReport | None:
    """Measure, choose and write the probe file (`search`: run_probe's options). None when there is no GPU."""
    facts = facts or torch_facts()
    if facts.gpu is None:
        return None
    train_path = Path(repo).resolve() / "train.py"
    if "def probe_step" not in (train_path.read_text() if train_path.is_file() else ""):
        raise ArError(f"{train_path} has no probe_step(); run the probe in a workspace whose train.py has one "
                      "(`ar init DIR` makes one)")
    d = backend.defaults(facts.gpu.capability, facts.gpu.vram_mb)
    default = Candidate(d["attention"], d["compile_model"], d["compile_optimizer"], d["device_batch"])
    report = run_probe(subprocess_execute(train_path), default, budget_s=budget_s, **search)
    if report.choice is not None:
        best = next(r for r in report.rows if r["status"] == "chosen")
        report.path = backend.write_choice(
            asdict(report.choice), device_name=facts.gpu.name, cache=cache, version=facts.version,
            measured={k: best[k] for k in ("tokens_per_s", "mfu", "peak_vram_mb")}, rows=report.rows)
    return report
