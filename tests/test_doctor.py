"""ar doctor: each check's failure path with faked inputs, the checklist on this CPU machine, and the probe's
choice and budget with injected timings and losses (no GPU needed)."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from collections import namedtuple
from dataclasses import replace
from pathlib import Path

import git
import pytest
from typer.testing import CliRunner

from autoresearch.views import doctor as dr
from autoresearch.views import probe as pr
from autoresearch.cli import app
from autoresearch.cli import doctor as cli_doctor
from autoresearch.errors import DataError
from autoresearch.harness import backend

Usage = namedtuple("Usage", "total used free percent")
GiB = 2**30
H200 = dr.Gpu("NVIDIA H200", (9, 0), 143_771.0)
GPU_FACTS = dr.TorchFacts("2.6.0+cu126", "12.6", True, H200, ("sm_80", "sm_90"))
CPU_FACTS = dr.TorchFacts("2.6.0+cpu", None, False, None, ())


@pytest.fixture(autouse=True)
def isolated(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("AR_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))  # no ~/.config/ar/gpus.yaml of the user's
    for var in ("AR_PEAK_TFLOPS", "AR_GPU_TABLE", "AR_GPUS_FILE", "AR_PROFILE", "AR_DATASET"):
        monkeypatch.delenv(var, raising=False)


def make_repo(path, files=None):
    path.mkdir(parents=True, exist_ok=True)
    repo = git.Repo.init(path)
    with repo.config_writer() as c:
        c.set_value("user", "name", "t").set_value("user", "email", "t@t")
    for name, text in (files or {"train.py": "print('hi')\n", ".gitignore": "runs/\n"}).items():
        (path / name).write_text(text)
    repo.index.add(list(files or ["train.py", ".gitignore"]))
    repo.index.commit("init")
    return repo


def by_name(checks):
    return {c.name: c for c in checks}


# ---------------------------------------------------------------------------------------------- checks
def test_python_and_torch_versions():
    assert dr.check_python((3, 11, 7)).state == dr.OK
    assert dr.check_python((3, 9, 1)).state == dr.FAIL
    assert dr.check_torch("2.6.0+cu126").state == dr.OK
    assert dr.check_torch("2.4.1").state == dr.FAIL
    missing = dr.check_torch(None)
    assert missing.state == dr.FAIL and "pip install torch" in missing.fix


def test_no_gpu_is_a_warning_not_a_failure():
    c = dr.check_cuda(CPU_FACTS)
    assert c.state == dr.WARN and "no GPU" in c.detail and "CUDA build" in c.fix
    c = dr.check_cuda(replace(CPU_FACTS, cuda_build="12.6"))
    assert c.state == dr.WARN and "nvidia-smi" in c.fix
    assert dr.check_cuda(GPU_FACTS).state == dr.OK


def test_gpu_line():
    assert dr.check_gpu(H200).detail == "NVIDIA H200, sm_90, 140.4 GiB"


@pytest.mark.parametrize("cap, archs, state", [
    ((9, 0), ("sm_80", "sm_90"), dr.OK),
    ((8, 9), ("sm_80", "sm_86"), dr.OK),             # same major, older minor: cubins run
    ((8, 0), ("sm_86",), dr.FAIL),                   # newer minor does not
    ((12, 0), ("sm_50", "sm_80", "sm_90"), dr.FAIL),  # RTX 5090 on a CUDA 12.4 build
    ((12, 0), ("sm_90", "sm_100", "sm_120"), dr.OK),
    ((9, 0), ("sm_80", "compute_80"), dr.WARN),      # PTX only: JIT at start-up
])
def test_kernels_for_this_gpu(cap, archs, state):
    c = dr.check_kernels(cap, archs, "12.4")
    assert c.state == state
    if cap == (12, 0) and state == dr.FAIL:
        assert "12.8" in c.fix and "sm_120" in c.fix


def test_peak_known_and_unknown():
    assert dr.check_peak("NVIDIA H200").state == dr.OK
    c = dr.check_peak("Imaginary GPU 9000")
    assert c.state == dr.WARN and "gpus.yaml" in c.fix and "AR_PEAK_TFLOPS" in c.fix


def test_peak_with_a_broken_override_file_is_a_warning(tmp_path, monkeypatch):
    (tmp_path / "gpus.yaml").write_text("- {name: X\n")
    monkeypatch.setenv("AR_GPUS_FILE", str(tmp_path / "gpus.yaml"))
    c = dr.check_peak("NVIDIA H200")
    assert c.state == dr.WARN and "gpu table" in c.fix


def test_gpu_table_names_the_override_file_in_use(tmp_path, monkeypatch):
    c = dr.check_gpu_table()
    assert c.state == dr.OK and "no override file" in c.detail and "~/.config/ar/gpus.yaml" in c.detail
    user = tmp_path / "home" / ".config" / "ar" / "gpus.yaml"
    user.parent.mkdir(parents=True)
    user.write_text("- {name: Future X1, match: [future, x1], tflops: 777}\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    c = dr.check_gpu_table()
    assert c.state == dr.OK and f"1 row(s) from {user}" in c.detail
    other = tmp_path / "mine.yaml"
    other.write_text("[]\n")
    monkeypatch.setenv("AR_GPUS_FILE", str(other))
    c = dr.check_gpu_table()
    assert c.state == dr.OK and f"from {other}, from AR_GPUS_FILE" in c.detail


@pytest.mark.parametrize("text, problem", [
    ("- {name: X, match: [x\n  bad: 1\n", "not valid YAML at line 2"),
    ("name: X\n", "must be a YAML list of rows"),
    ("- {name: X, match: x, tflops: 1}\n", "match and exclude must be lists"),
    ("- {name: X, match: [x], tflops: fast}\n", "tflops must be a positive number"),
])
def test_a_bad_override_file_is_one_line_naming_the_file(tmp_path, monkeypatch, text, problem):
    f = tmp_path / "gpus.yaml"
    f.write_text(text)
    monkeypatch.setenv("AR_GPUS_FILE", str(f))
    c = dr.check_gpu_table()
    assert c.state == dr.FAIL and str(f) in c.detail and problem in c.detail and "\n" not in c.detail
    assert c.detail.endswith("fix the file or unset AR_GPUS_FILE")
    monkeypatch.setenv("AR_GPUS_FILE", str(tmp_path / "missing.yaml"))
    c = dr.check_gpu_table()
    assert c.state == dr.FAIL and "does not exist" in c.detail and "AR_GPUS_FILE" in c.detail


def test_ar_on_path():
    ours = dr.check_command(lambda exe: None)
    assert ours.state == dr.WARN and "autoresearch" in ours.fix
    never = lambda path: pytest.fail("must not run")  # noqa: E731
    script = str(Path(sysconfig.get_path("scripts")) / "ar")  # pip's console script: known without running it
    assert dr.check_command(lambda exe: script, never).state == dr.OK
    binutils = dr.check_command(lambda exe: "/usr/bin/ar", lambda path: "GNU ar (GNU Binutils) 2.40")
    assert binutils.state == dr.WARN and "/usr/bin/ar (GNU ar (GNU Binutils) 2.40)" in binutils.detail
    assert "run `autoresearch` instead" in binutils.fix
    shim = dr.check_command(lambda exe: "/usr/bin/ar", lambda path: "ar 0.1.0")  # a pyenv-style shim to ours
    assert shim.state == dr.OK


def test_sdpa_backends():
    all_ok = dict.fromkeys(dr.SDPA_NAMES)
    assert dr.check_sdpa(all_ok).state == dr.OK
    some = {**all_ok, "flash": "RuntimeError: no kernel", "cudnn": "RuntimeError: no kernel"}
    c = dr.check_sdpa(some)
    assert c.state == dr.OK and "efficient, math work" in c.detail and "flash: RuntimeError" in c.detail
    only_math = {n: (None if n == "math" else "no kernel") for n in dr.SDPA_NAMES}
    assert dr.check_sdpa(only_math).state == dr.WARN
    assert dr.check_sdpa({}).state == dr.FAIL


def test_compile():
    assert dr.check_compile(True, "took 3 s").state == dr.OK
    assert dr.check_compile(None, "did not finish").state == dr.WARN
    failed = dr.check_compile(False, "failed: no C compiler")
    assert failed.state == dr.FAIL and "COMPILE_MODEL = False" in failed.fix


def test_data_prepared_or_not(tmp_path):
    def missing(cache, name, vocab):
        raise DataError(f"dataset {name!r} is not prepared; run `ar prepare {name}`")

    c = dr.check_data(tmp_path, "builtin", 2048, missing)
    assert c.state == dr.WARN and "ar prepare builtin" in c.detail and "ar run" in c.fix
    c = dr.check_data(tmp_path, "climbmix", 8192, missing)
    assert c.state == dr.FAIL and "ar prepare climbmix" in c.detail
    c = dr.check_data(tmp_path, "climbmix", 8192, lambda cache, name, vocab: cache / name)
    assert c.state == dr.OK and "8192" in c.detail


@pytest.mark.integration
def test_repo_states(tmp_path):
    assert dr.check_repo(tmp_path).state == dr.FAIL  # not a repository
    git.Repo.init(tmp_path / "empty")
    assert "no commits" in dr.check_repo(tmp_path / "empty").detail
    repo = make_repo(tmp_path / "r")
    clean = dr.check_repo(tmp_path / "r")
    assert clean.state == dr.OK and f"branch {repo.active_branch.name}" in clean.detail
    (tmp_path / "r" / "notes.txt").write_text("x")
    assert dr.check_repo(tmp_path / "r").state == dr.WARN
    (tmp_path / "r" / "train.py").write_text("print('changed')\n")
    dirty = dr.check_repo(tmp_path / "r")
    assert dirty.state == dr.FAIL and "train.py" in dirty.detail and "commit or stash" in dirty.fix
    repo.git.checkout("--", "train.py")
    repo.git.checkout(repo.head.commit.hexsha)
    assert "detached HEAD" in dr.check_repo(tmp_path / "r").detail


def test_train_py_present(tmp_path):
    assert dr.check_train(tmp_path).state == dr.FAIL
    (tmp_path / "train.py").write_text("")
    assert dr.check_train(tmp_path).state == dr.OK


@pytest.mark.parametrize("free_gb, state", [(0.5, dr.FAIL), (5, dr.WARN), (50, dr.OK)])
def test_disk(tmp_path, free_gb, state):
    usage = lambda path: Usage(100 * GiB, 0, free_gb * GiB, 0)  # noqa: E731
    assert dr.check_disk(tmp_path / "not" / "yet", usage).state == state


def test_agent_on_path():
    found = {"claude": "/usr/bin/claude", "mytool": "/opt/mytool"}.get
    assert dr.check_agent(None, found).state == dr.OK
    assert dr.check_agent("claude", found).detail == "claude -> /usr/bin/claude"
    assert dr.check_agent("mytool --prompt-file {prompt_file}", found).state == dr.OK
    missing = dr.check_agent("codex", found)
    assert missing.state == dr.FAIL and "'codex' not found" in missing.detail
    assert dr.check_agent("'unclosed", found).state == dr.FAIL


# ---------------------------------------------------------------------------------------------- checklist
def fake_inputs(**over):
    kw = dict(facts=GPU_FACTS, sdpa=lambda: dict.fromkeys(dr.SDPA_NAMES), compile_test=lambda: (True, "ok"),
              data_checker=lambda cache, name, vocab: cache / name, which=lambda exe: None,
              disk_usage=lambda p: Usage(100 * GiB, 0, 50 * GiB, 0),
              sandbox_facts=lambda: ((True, "Landlock ABI 7"), ("namespaces", "own namespaces")))
    return {**kw, **over}


@pytest.mark.integration
def test_checklist_on_a_gpu(tmp_path):
    make_repo(tmp_path)
    checks = dr.run_checks(tmp_path, **fake_inputs())
    assert [c.name for c in checks] == ["python", "torch", "cuda", "gpu", "kernels", "peak", "attention", "compile",
                                        "gpu table", "data", "train.py", "repo", "disk", "agent", "ar on PATH", "sandbox"]
    assert not dr.blocking(checks)
    assert "8192" in by_name(checks)["data"].detail  # the gpu profile's vocab


def test_the_sandbox_line_says_how_runs_are_kept_apart():
    ok = dr.check_sandbox((True, "Landlock ABI 7; namespaces"), ("namespaces", "namespaces"))
    fallback = dr.check_sandbox((True, "Landlock ABI 7; seccomp"), ("seccomp", "seccomp"))
    missing = dr.check_sandbox((False, "no Landlock"), ("none", ""))
    assert ok.state == dr.OK and fallback.state == dr.WARN and "namespaces" in fallback.fix
    assert missing.state == dr.WARN and "--unsandboxed" in missing.fix


@pytest.mark.integration
def test_checklist_unknown_gpu_and_missing_agent(tmp_path):
    make_repo(tmp_path)
    facts = replace(GPU_FACTS, gpu=replace(H200, name="Imaginary GPU 9000"))
    checks = by_name(dr.run_checks(tmp_path, agent="aider", **fake_inputs(facts=facts)))
    assert checks["peak"].state == dr.WARN and checks["agent"].state == dr.FAIL


@pytest.mark.integration
def test_checklist_without_kernels_skips_the_gpu_probes(tmp_path):
    make_repo(tmp_path)
    facts = replace(GPU_FACTS, gpu=replace(H200, capability=(12, 0)), arch_list=("sm_80", "sm_90"))
    boom = lambda: pytest.fail("must not run")  # noqa: E731
    checks = by_name(dr.run_checks(tmp_path, **fake_inputs(facts=facts, sdpa=boom, compile_test=boom)))
    assert checks["kernels"].state == dr.FAIL and "attention" not in checks and dr.blocking(checks.values())


@pytest.mark.integration
def test_checklist_on_cpu_has_no_gpu_lines(tmp_path):
    make_repo(tmp_path)
    checks = by_name(dr.run_checks(tmp_path, **fake_inputs(facts=CPU_FACTS)))
    assert checks["cuda"].state == dr.WARN and not {"gpu", "kernels", "attention", "compile"} & set(checks)
    assert "2048" in checks["data"].detail  # the cpu profile's vocab
    assert not dr.blocking(checks.values())


runner = CliRunner()


@pytest.mark.integration
def test_cli_doctor_on_this_machine(tmp_path):
    """Real torch, git, disk and data checks: no GPU is reported as ! and the exit code is 0."""
    make_repo(tmp_path)
    result = runner.invoke(app, ["doctor", "--repo", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "✓ python" in result.output and "✓ repo" in result.output
    if not dr.torch_facts().cuda_available:
        assert "! cuda       no GPU" in result.output
    result = runner.invoke(app, ["doctor", "--repo", str(tmp_path), "--probe"])
    if not dr.torch_facts().cuda_available:
        assert result.exit_code == 0 and "the probe needs a CUDA GPU" in result.output
    result = runner.invoke(app, ["doctor", "--repo", str(tmp_path), "--probe", "--json"])
    if not dr.torch_facts().cuda_available:
        assert json.loads(result.stdout)["probe"] == {"skipped": dr.NO_GPU}


def test_a_long_check_wraps_under_its_detail_and_loses_nothing():
    long = dr.check_sandbox((True, "Landlock ABI 7; " + "each sandboxed process gets its own namespace; " * 3),
                            ("namespaces", "namespaces"))
    cpu = dr.check_cuda(CPU_FACTS)                                         # a detail and a fix, both long
    for c in (long, cpu, dr.check_python((3, 11, 7))):
        lines = cli_doctor.check_lines(c)
        assert all(len(text) + (1 if text and dim else 0) + len(dim) <= 78 for text, dim in lines), lines
        joined = " ".join(" ".join(part.strip() for part in ln if part) for ln in lines)
        assert " ".join(joined.split()) == " ".join(f"{c.name} {c.detail} → {c.fix}".split()).removesuffix(" → None")
    assert len(cli_doctor.check_lines(dr.check_python((3, 11, 7)))) == 1        # a short one stays one line
    assert cli_doctor.check_lines(cpu)[-1][1].lstrip().endswith("whl/cu128)")    # the fix last, dim


@pytest.mark.integration
def test_piped_doctor_fits_80_columns():
    """`ar doctor | cat` with COLUMNS unset: every line ≤ 80 columns. The workspace and the cache lie under a
    short folder, as ~/myrun does (a path is never cut, and pytest's own temporary paths are long)."""
    short = Path(tempfile.mkdtemp(prefix="ar-"))                          # /tmp/ar-XXXXXXXX
    make_repo(short / "ws")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR")}
    try:
        r = subprocess.run([sys.executable, "-m", "autoresearch", "doctor"], cwd=short / "ws", capture_output=True,
                           text=True, env={**env, "AR_CACHE": str(short / "cache")}, timeout=120)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and "✓ python" in r.stdout and "\x1b" not in r.stdout, r.stdout + r.stderr
    assert all(len(ln) <= 80 for ln in lines), [ln for ln in lines if len(ln) > 80]
    if not dr.torch_facts().cuda_available:                              # the CPU machine's long cuda line, wrapped
        assert any(ln.startswith("! cuda ") for ln in lines) and any(ln.lstrip().startswith("→") for ln in lines)


@pytest.mark.integration
def test_cli_doctor_fails_on_a_dirty_repo_and_prints_json(tmp_path):
    make_repo(tmp_path)
    (tmp_path / "train.py").write_text("print('edited')\n")
    result = runner.invoke(app, ["doctor", "--repo", str(tmp_path), "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)  # the whole of stdout: one document, the verdict inside
    assert doc["ok"] is False and doc["exit_code"] == 1 and "check(s) failed (repo)" in doc["error"]
    assert {c["name"]: c["state"] for c in doc["checks"]}["repo"] == "fail"


@pytest.mark.integration
def test_cli_doctor_reads_the_agent_from_the_config(tmp_path):
    make_repo(tmp_path)
    cfg = tmp_path.parent / f"{tmp_path.name}-ar.yaml"
    cfg.write_text("agent: 'no-such-agent-binary {prompt_file}'\n")
    result = runner.invoke(app, ["doctor", "--repo", str(tmp_path), "--config", str(cfg)])
    assert result.exit_code == 1 and "'no-such-agent-binary' not found" in result.output
    result = runner.invoke(app, ["doctor", "--repo", str(tmp_path), "--agent", "another-missing-agent"])
    assert result.exit_code == 1 and "'another-missing-agent' not found" in result.output


# ---------------------------------------------------------------------------------------------- probe choice
REF_LOSSES = [9.0, 8.5, 8.0, 7.6, 7.2, 6.9]


def result(attn="cudnn", cm=False, co=False, batch=32, tps=1000.0, losses=REF_LOSSES, ok=True, error=None):
    return pr.ProbeResult(pr.Candidate(attn, cm, co, batch), ok=ok, error=error, losses=list(losses),
                          tokens_per_s=tps if ok else None, mfu=tps / 100 if ok else None)


def status(rows):
    return {r["label"]: r["status"] for r in rows}


def test_choose_picks_the_fastest_correct_path():
    ref = result("efficient", tps=800)
    results = [ref, result("cudnn", tps=1000), result("flash", tps=900), result("cudnn", True, True, tps=1400)]
    choice, rows = pr.choose(results, ref)
    assert choice == pr.Candidate("cudnn", True, True, 32)
    assert [r["status"] for r in rows] == ["correct", "correct", "correct", "chosen"]


def test_incorrect_is_never_chosen_even_when_fastest():
    ref = result("efficient", tps=500)
    wrong = result("flash", tps=5000, losses=[9.0, 8.5, 8.3, 7.9, 7.5, 7.2])  # drifts by > 2 %
    choice, rows = pr.choose([ref, wrong, result("cudnn", tps=900)], ref)
    assert choice.attention == "cudnn"
    row = rows[1]
    assert row["status"] == "incorrect" and "3.8% at step 2" in row["note"] and row["max_loss_diff"] > 0.02


def test_later_steps_may_drift_more_than_the_first():
    """Measured on an H200 (batch 64, 10 steps): the compiled model drifts from eager, more with each step."""
    eager = [9.0112, 9.4650, 9.0335, 8.8003, 8.4674, 8.0314, 7.5765, 7.0271, 6.4272, 5.8139]
    compiled = [9.0112, 9.4661, 9.0482, 8.8623, 8.5086, 8.0965, 7.6316, 7.0936, 6.4949, 5.8944]
    ok, diff, _ = pr.compare(compiled, eager)
    assert ok and 0.013 < diff < 0.014
    never_learns = eager[:3] + [8.9] * 7
    ok, _, why = pr.compare(never_learns, eager)
    assert not ok and "at step 5" in why
    early_jump = [9.0112, 9.1, 8.6] + eager[3:]
    assert not pr.compare(early_jump, eager)[0]
    assert pr.compare(early_jump, eager, rtol=0.05)[0]


def test_small_numerical_noise_is_correct():
    ref = result("efficient")
    close = result("cudnn", tps=2000, losses=[v * 1.01 for v in REF_LOSSES])
    assert pr.choose([ref, close], ref)[0].attention == "cudnn"


def test_alive_but_slow_failed_and_unverified_rows():
    ref = result("efficient", tps=400)
    results = [ref, result("cudnn", tps=1000), result("math", tps=100),
               result("fa3", ok=False, error="TrainFailure: needs flash_attn_interface"),
               result("cudnn", batch=64, tps=3000),  # no reference at batch 64
               pr.ProbeResult(pr.Candidate("flash", True, True, 32), ok=False, skipped="time budget of 180 s spent")]
    choice, rows = pr.choose(results, {32: ref})
    assert choice == pr.Candidate("cudnn", False, False, 32)
    assert [r["status"] for r in rows] == ["alive but slow", "chosen", "alive but slow", "failed", "unverified",
                                           "skipped"]
    assert "40% of the best" in rows[0]["note"] and "flash_attn_interface" in rows[3]["note"]


def test_a_tie_goes_to_the_defaults():
    """Measured on an H200: compiled model with compiled or eager optimizer, 0.2 % apart."""
    both = result("cudnn", True, True, batch=128, tps=1_541_926)
    eager_opt = result("cudnn", True, False, batch=128, tps=1_544_603)
    ref = result("efficient", batch=128, tps=543_479)
    assert pr.choose([ref, both, eager_opt], ref)[0] == eager_opt.candidate
    assert pr.choose([ref, both, eager_opt], ref, prefer=(both.candidate,))[0] == both.candidate
    slower_default = result("cudnn", True, True, batch=128, tps=1_400_000)
    assert pr.choose([ref, slower_default, eager_opt], ref, prefer=(slower_default.candidate,))[0] == \
        eager_opt.candidate


def test_nan_losses_and_a_failed_reference():
    ref = result("efficient")
    nan = result("cudnn", tps=9000, losses=[9.0, float("nan"), 8.0, 7.6, 7.2, 6.9])
    assert pr.choose([ref, nan], ref)[0] == ref.candidate
    broken_ref = result("efficient", ok=False, error="OOM")
    choice, rows = pr.choose([broken_ref, result("cudnn")], broken_ref)
    assert choice is None and rows[1]["status"] == "unverified"


# ---------------------------------------------------------------------------------------------- probe search
class FakeGpu:
    """execute() for run_probe: timings and losses from a table; a fake clock advanced by each run."""

    def __init__(self, speed, seconds=10.0, wrong=(), fails=()):
        self.speed, self.seconds, self.wrong, self.fails = speed, seconds, set(wrong), set(fails)
        self.now, self.calls, self.starts = 0.0, [], []

    def clock(self):
        return self.now

    def __call__(self, c, timeout):
        self.calls.append((c, timeout))
        self.starts.append(self.now)
        took = min(self.seconds, timeout)
        self.now += took
        if took < self.seconds:
            return pr.ProbeResult(c, ok=False, error=f"timed out after {timeout:.0f} s")
        if c in self.fails or c.attention in self.fails:
            return pr.ProbeResult(c, ok=False, error="RuntimeError: boom")
        losses = [v + (0.5 if c in self.wrong else 0.0) for v in REF_LOSSES]
        tps = self.speed(c)
        return pr.ProbeResult(c, ok=True, losses=losses, tokens_per_s=tps, mfu=tps / 1e4)


def speed(c):
    base = {"cudnn": 1000, "flash": 900, "efficient": 800, "math": 200, "fa3": 1100}[c.attention]
    return base * (1.3 if c.compile_model else 1) * (1.1 if c.compile_optimizer else 1) * (c.device_batch / 32) ** 0.2


DEFAULT = pr.Candidate("cudnn", True, True, 64)


def test_probe_search_finds_the_fastest_correct_path_and_runs_the_defaults():
    gpu = FakeGpu(speed, fails={"fa3"})
    report = pr.run_probe(gpu, DEFAULT, budget_s=1000, clock=gpu.clock)
    ran = [c for c, _ in gpu.calls]
    assert ran[0] == pr.Candidate("efficient", False, False, 32)  # the reference comes first
    assert DEFAULT in ran and pr.Candidate("math", False, False, 32) == ran[-1]
    assert report.choice == pr.Candidate("cudnn", True, True, 128)
    rows = status(report.rows)
    assert rows[pr.Candidate("fa3", False, False, 32).label] == "failed"
    assert rows[pr.Candidate("math", False, False, 32).label] == "alive but slow"
    assert len(ran) == len(set(ran))  # nothing measured twice


def test_probe_search_never_picks_a_wrong_fast_path():
    fast_wrong = pr.Candidate("cudnn", True, True, 32)
    gpu = FakeGpu(speed, wrong={fast_wrong}, fails={"fa3"})
    report = pr.run_probe(gpu, DEFAULT, budget_s=1000, clock=gpu.clock)
    assert status(report.rows)[fast_wrong.label] == "incorrect"
    assert report.choice == pr.Candidate("cudnn", True, False, 128)  # the best correct one


def test_probe_search_respects_its_budget():
    gpu = FakeGpu(speed, seconds=25.0)
    report = pr.run_probe(gpu, DEFAULT, budget_s=100, clock=gpu.clock, min_start=10)
    assert gpu.now <= 100
    assert all(timeout <= 100 - start for (_, timeout), start in zip(gpu.calls, gpu.starts))
    skipped = [r for r in report.rows if r["status"] == "skipped"]
    assert skipped and all("budget" in r["note"] for r in skipped)
    assert any("budget ran out" in n for n in report.notes)
    assert report.choice is not None  # what did run still yields a choice


def test_a_run_cut_short_by_the_budget_is_skipped_not_failed():
    gpu = FakeGpu(speed, seconds=40.0)
    report = pr.run_probe(gpu, DEFAULT, budget_s=100, clock=gpu.clock, min_start=10)
    assert [timeout for _, timeout in gpu.calls] == [100, 60, 20] and gpu.now == 100
    assert [r["status"] for r in report.rows][:3] == ["correct", "chosen", "skipped"]
    assert "cut short" in report.rows[2]["note"]


def test_probe_search_without_a_working_reference():
    gpu = FakeGpu(speed, fails={"efficient", "math"})
    report = pr.run_probe(gpu, DEFAULT, budget_s=1000, clock=gpu.clock)
    assert report.choice is None and "reference step failed" in report.notes[0]
    assert len(gpu.calls) == 2  # efficient, then math as the fallback reference; nothing else is measurable


def test_probe_search_stops_growing_the_batch_when_the_reference_fails():
    big_ref = pr.Candidate("efficient", False, False, 128)
    gpu = FakeGpu(speed, fails={big_ref, pr.Candidate("math", False, False, 128)})
    report = pr.run_probe(gpu, DEFAULT, budget_s=1000, clock=gpu.clock)
    assert report.choice.device_batch == 64
    assert any("does not run at batch 128" in n for n in report.notes)


# ---------------------------------------------------------------------------------------------- probe plumbing
FAKE_TRAIN = textwrap.dedent("""
    import sys, time
    def probe_step(*, attention, compile_model, compile_optimizer, device_batch, steps=6, seed=0):
        if attention == "fa3":
            raise SystemExit(3)                      # the process dies
        if attention == "math" and device_batch > 1:
            time.sleep(60)                           # hangs
        speed = {"cudnn": 3.0, "flash": 2.0, "efficient": 1.0}.get(attention, 0.5) * device_batch
        speed *= 1.5 if compile_model else 1.0
        losses = [9.0 - 0.3 * i for i in range(steps)]
        return {"ok": True, "error": None, "losses": losses, "tokens_per_s": speed * 1000, "mfu": speed,
                "peak_vram_mb": 100.0 * device_batch}
    if __name__ == "__main__":
        raise SystemExit("main must not run")
""")


@pytest.mark.integration
def test_subprocess_execute_reads_results_failures_and_timeouts(tmp_path):
    train = tmp_path / "train.py"
    train.write_text(FAKE_TRAIN)
    execute = pr.subprocess_execute(train)
    ok = execute(pr.Candidate("cudnn", True, False, 4), timeout=30)
    assert ok.ok and ok.tokens_per_s == 18000 and ok.losses[0] == 9.0 and ok.peak_vram_mb == 400
    died = execute(pr.Candidate("fa3", False, False, 4), timeout=30)
    assert not died.ok and died.error.startswith("exit 3")
    hung = execute(pr.Candidate("math", False, False, 4), timeout=1)
    assert not hung.ok and "timed out" in hung.error and hung.seconds < 10


@pytest.mark.integration
def test_probe_end_to_end_with_a_fake_train_py(tmp_path):
    """probe(): staged search over subprocesses, the choice written, and resolve() reading it back."""
    (tmp_path / "train.py").write_text(FAKE_TRAIN)
    facts = replace(GPU_FACTS, gpu=replace(H200, vram_mb=8 * 1024))  # default batch 8: small fake numbers
    seen = []
    report = pr.probe(tmp_path, budget_s=60, cache=tmp_path / "cache", facts=facts, progress=seen.append,
                      per_run_cap=1.5, min_start=0.5)  # the hanging math candidate costs 1.5 s
    assert [r.candidate.label for r in seen] == [row["label"] for row in report.rows]
    assert report.choice == pr.Candidate("cudnn", True, True, 16)
    chosen = backend.resolve("auto", "auto", "auto", device_name="NVIDIA H200", cache=tmp_path / "cache",
                             capability=(9, 0), vram_mb=8 * 1024, version=facts.version)
    assert chosen["source"]["attention"] == "probe" and chosen["device_batch"] == 16
    doc = json.loads(report.path.read_text())
    assert doc["measured"]["tokens_per_s"] == 3.0 * 1.5 * 16 * 1000
    statuses = {r["attention"]: r["status"] for r in doc["rows"] if r["device_batch"] == 4}
    assert statuses["fa3"] == "failed"


def test_probe_without_gpu_returns_none(tmp_path):
    assert pr.probe(tmp_path, facts=CPU_FACTS) is None


def test_probe_refuses_a_train_py_without_probe_step(tmp_path):
    (tmp_path / "train.py").write_text("print('old')\n")
    with pytest.raises(Exception, match="no probe_step"):
        pr.probe(tmp_path, facts=GPU_FACTS)


@pytest.mark.integration
@pytest.mark.gpu
def test_real_gpu_checks():
    if not dr.torch_facts().cuda_available:
        pytest.skip("needs a CUDA GPU")
    assert dr.check_sdpa(dr.sdpa_probe()).state != dr.FAIL
    assert dr.check_compile(*dr.compile_probe()).state == dr.OK
