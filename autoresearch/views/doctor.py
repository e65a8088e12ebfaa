"""`ar doctor`: a checklist of what a run needs (`--probe`, the backend measurement, is in probe.py).

Each check is a small function of its inputs that returns a Check; `run_checks` gathers the real inputs
(torch, git, disk, PATH) and passes them in, so tests fake any of them. Anything that can hang or poison a
CUDA context (SDPA kernels, torch.compile, the probe's training steps) runs in a subprocess with a timeout
(`run_script`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping

from autoresearch.errors import ArError, ConfigError
from autoresearch.harness import gpus
from autoresearch.harness.env import default_cache, resolve_profile
from autoresearch.views.probe import Gpu, ProbeReport, TorchFacts, last_line, run_script, torch_facts  # noqa: F401

OK, WARN, FAIL = "ok", "warn", "fail"
HEAD_DIM = 128  # the default model's head size
AGENT_PRESETS = {"claude": "claude", "codex": "codex", "aider": "aider"}  # preset -> executable


@dataclass(frozen=True)
class Check:
    name: str
    state: str  # ok / warn / fail
    detail: str
    fix: str | None = None


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
    try:
        peak = lookup(device_name)
    except ValueError:  # a broken override file: the gpu table line names it
        return Check("peak", WARN, "unknown: the GPU table does not load", "see the gpu table line")
    if peak.tflops is not None:
        where = f"table row {peak.row!r}" if peak.row else peak.source
        return Check("peak", OK, f"{peak.tflops:g} TFLOP/s dense BF16 ({where})")
    return Check("peak", WARN, "unknown: MFU will read 'unknown'", f"{gpus.HOW_TO_ADD}, or set AR_PEAK_TFLOPS")


GPU_TABLE = "gpu table"


def check_gpu_table(read_override: Callable[[], gpus.Override | None] = gpus.check_override) -> Check:
    """Which override file of the peak table is in use, if any; a broken one (or a bad AR_PEAK_TFLOPS) is one
    line with its fix, and makes `ar doctor` exit 2 like any bad config file (`config_error`)."""
    try:
        own = read_override()
    except (ValueError, ConfigError) as e:
        return Check(GPU_TABLE, FAIL, str(e))
    if own is None:
        return Check(GPU_TABLE, OK, f"the packaged table; no override file (AR_GPUS_FILE unset, no "
                                      f"{gpus.USER_TABLE})")
    how = "" if own.origin == "default" else f", from {own.origin}"
    return Check(GPU_TABLE, OK, f"the packaged table with {len(own.rows)} row(s) from {own.path}{how}")


AR_SCRIPT_MARK = b"autoresearch.cli"  # what pip's console script for ar imports


def ar_version_line(path: str, timeout: float = 30) -> str:
    """First line of `PATH --version` (a shim such as pyenv's runs the real ar behind it)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"did not answer --version ({type(e).__name__})"
    return ((out.stdout or out.stderr).strip().splitlines() or [""])[0]


def check_command(which: Callable[[str], str | None] = shutil.which,
                  version_line: Callable[[str], str] = ar_version_line) -> Check:
    """Is the first `ar` on PATH this tool? binutils installs an `ar` (the archiver) in /usr/bin."""
    found = which("ar")
    if found is None:
        return Check("ar on PATH", WARN, "no `ar` on PATH", "use `autoresearch` (the same commands) or "
                     f"`python -m autoresearch`, or add {Path(sys.executable).parent} to PATH")
    try:
        with open(os.path.realpath(found), "rb") as f:
            ours = AR_SCRIPT_MARK in f.read(4096)
    except OSError:
        ours = False
    line = "" if ours else version_line(found)
    if ours or re.fullmatch(r"ar \S+", line):
        return Check("ar on PATH", OK, found)
    return Check("ar on PATH", WARN, f"the first `ar` on PATH is {found} ({line[:60] or 'no version'}), "
                 "not this tool", "run `autoresearch` instead: the same commands under a name nothing else uses")


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


def sdpa_probe(timeout: float = 60) -> dict[str, str | None]:
    rc, out = run_script(SDPA_SCRIPT, [], timeout)
    found = dict(json.loads(ln[len("AR_SDPA "):]) for ln in out.splitlines() if ln.startswith("AR_SDPA "))
    died = "timed out" if rc is None else f"the probe process died: {last_line(out)}"
    return {n: found[n] if n in found else died for n in SDPA_NAMES}


def compile_probe(timeout: float = 120) -> tuple[bool | None, str]:
    rc, out = run_script(COMPILE_SCRIPT, [], timeout)
    if rc is None:
        return None, f"a tiny torch.compile did not finish in {timeout:g} s"
    for ln in out.splitlines():
        if ln.startswith("AR_COMPILE_OK "):
            return True, f"a tiny compiled forward/backward took {ln.split()[1]} s"
    return False, f"a tiny torch.compile failed: {last_line(out)}"


# ---------------------------------------------------------------------------------------------------------
# The checklist
# ---------------------------------------------------------------------------------------------------------
def _data_checker():
    try:
        from autoresearch.harness.data import check_prepared
    except ImportError:
        return None
    return check_prepared


def check_sandbox(available: tuple[bool, str], isolation: tuple[str, str]) -> Check:
    """Landlock, and how runs are kept apart (sandbox.isolation): namespaces, else seccomp, else nothing."""
    ok, why = available
    if not ok:
        return Check("sandbox", WARN, why, "`ar run` refuses to run proposal code unsandboxed; fix that, or pass "
                                           "--unsandboxed (every result is then marked)")
    mode, how = isolation
    if mode == "namespaces":
        return Check("sandbox", OK, why)
    return Check("sandbox", WARN, why, "allow unprivileged user namespaces (kernel.unprivileged_userns_clone=1, "
                                       "or an AppArmor/container profile that permits unshare) to keep "
                                       "multiprocessing in train.py")


def _sandbox_facts() -> tuple[tuple[bool, str], tuple[str, str]]:
    from autoresearch.harness import sandbox
    return sandbox.available(), (sandbox.isolation() if sandbox.abi_version() else ("none", ""))


def run_checks(repo: Path, *, dataset: str = "builtin", agent: str | None = None, profile: str | None = None,
               cache: Path | None = None, facts: TorchFacts | None = None, sdpa: Callable = sdpa_probe,
               compile_test: Callable = compile_probe, data_checker: Callable | None | str = "import",
               which: Callable = shutil.which, disk_usage: Callable | None = None,
               lookup: Callable = gpus.lookup, read_override: Callable = gpus.check_override,
               version_line: Callable = ar_version_line,
               sandbox_facts: Callable = _sandbox_facts) -> list[Check]:
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
    checks += [check_gpu_table(read_override), check_data(cache, dataset, vocab, checker), check_train(repo),
               check_repo(repo), check_disk(cache, disk_usage), check_agent(agent, which),
               check_command(which, version_line), check_sandbox(*sandbox_facts())]
    return checks


def blocking(checks: list[Check]) -> bool:
    return any(c.state == FAIL for c in checks)


def config_error(checks: list[Check]) -> ConfigError | None:
    """A broken GPU table override file (or AR_PEAK_TFLOPS) is bad input: exit 2, as for `ar run` (its ✗ line
    names the file and the fix)."""
    bad = next((c for c in checks if c.name == GPU_TABLE and c.state == FAIL), None)
    return ConfigError(bad.detail) if bad else None


def blocking_error(checks: list[Check], probe: ProbeReport | None = None) -> ArError | None:
    """Why a run would not work, as the error to exit with: bad input (exit 2) first, else a failed check or a
    probe that found no correct path (exit 1); None when nothing blocks."""
    bad = config_error(checks)
    if bad:
        return bad
    failed = [c.name for c in checks if c.state == FAIL]
    if failed:
        return ArError(f"{len(failed)} check(s) failed ({', '.join(failed)}): fix the ✗ lines before `ar run`")
    if probe is not None and probe.choice is None:
        return ArError("the probe found no path that runs correctly; see its table; train.py keeps its defaults")
    return None


def raise_if_blocking(checks: list[Check], probe: ProbeReport | None = None) -> None:
    error = blocking_error(checks, probe)
    if error:
        raise error


NO_GPU = "the probe needs a CUDA GPU; nothing to measure here (CPU runs use fixed settings)"


def as_json(checks: list[Check], probed: bool = False, probe: ProbeReport | None = None) -> dict:
    """The checklist as one JSON-ready dict; when a run would not work, also `error` and `exit_code` (1, or 2 for
    a broken GPU table), the keys every `--json` error has."""
    doc = {"ok": not blocking(checks), "checks": [asdict(c) for c in checks]}
    if probed:
        doc["probe"] = probe.as_dict() if probe is not None else {"skipped": NO_GPU}
    error = blocking_error(checks, probe)
    if error:
        doc.update(error=str(error), exit_code=error.exit_code)
    return doc
