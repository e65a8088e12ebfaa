"""The first hour at the command line: --version, -h, completion, the `autoresearch` name beside binutils' `ar`,
plain output into pipes and under NO_COLOR, the exit-code table, and --json that stays JSON when a command fails;
help text (the Ray extra by the package's name, flags without a value, bare `ar`) and one-line errors (a bad
budget, outside a repository, a dirty tree with no git identity).

Through the installed console scripts in real subprocesses where the entry point matters (exit codes, pipes,
terminals, PATH); through Typer's runner where it adds nothing."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from autoresearch.cli import app
from autoresearch.records.ledger import Ledger, Row, Status

from test_loop import no_ar_settings  # noqa: F401  (a fixture, asked for by name)

SCRIPTS = Path(sysconfig.get_path("scripts"))
AR, AUTORESEARCH = str(SCRIPTS / "ar"), str(SCRIPTS / "autoresearch")
VERSION = metadata.version("autoresearch-ar")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def env(tmp_path) -> dict:
    """A user with no config of their own, no colour forced, and this Python's scripts first on PATH."""
    home = tmp_path / "home"
    home.mkdir()
    keep = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE",
                                                             "AR_GPUS_FILE", "AR_GPU_TABLE", "AR_PEAK_TFLOPS")}
    return {**keep, "HOME": str(home), "AR_CACHE": str(tmp_path / "cache"), "COLUMNS": "80",
            "PATH": f"{SCRIPTS}{os.pathsep}{os.environ.get('PATH', '')}"}


def ar(*args, env, script=AR, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([script, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def doctor_checks(stdout: str) -> list[str]:
    """`ar doctor`'s checks, one string each: a check wraps onto lines that start with two spaces."""
    checks: list[str] = []
    for ln in stdout.splitlines():
        if ln.startswith("  ") and checks:
            checks[-1] += " " + ln.strip()
        else:
            checks.append(ln)
    return checks


def on_a_terminal(*args, env) -> str:
    """Run the `ar` script with stdout and stderr on a pseudo-terminal; everything it wrote."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([AR, *map(str, args)], stdout=follower, stderr=follower, stdin=subprocess.DEVNULL, env=env)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the process has closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=120)
    os.close(leader)
    return out.decode("utf-8", errors="replace")


def results_repo(root: Path, description: str = "baseline") -> Path:
    """A git repository with runs/t/results.tsv of two rows (no event stream: as an older `ar` leaves it)."""
    root.mkdir(parents=True)
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "start"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True)
    led = Ledger(root / "runs" / "t")
    for i, (val, status) in enumerate([(1.10, "keep"), (1.20, "discard")], 1):
        led.append(Row(commit=f"{i:07x}", val_bpb=val, memory_gb=1.0, status=Status(status),
                       description=f"{description} {i}", exp_id=i, tag="t"))
    return root


# ------------------------------------------------------------------------------------ 1. version, -h, completion

@pytest.mark.integration
def test_version_from_the_package_metadata_under_both_names(env):
    for script in (AR, AUTORESEARCH):
        r = ar("--version", env=env, script=script)
        assert r.returncode == 0 and r.stdout == f"ar {VERSION}\n" and r.stderr == ""


def test_h_is_help_on_every_command():
    runner = CliRunner()
    commands = sorted(typer.main.get_command(app).commands)
    assert {"run", "status", "sweep", "report", "doctor", "init", "prepare"} <= set(commands)
    for args in ([], *([c] for c in commands)):
        short, long = runner.invoke(app, [*args, "-h"]), runner.invoke(app, [*args, "--help"])
        assert short.exit_code == 0 and "Usage:" in short.output, (args, short.output)
        assert short.output == long.output


@pytest.mark.integration
def test_shell_completion_is_offered_and_completes(env):
    out = ar("--help", env=env).stdout
    assert "--install-completion" in out and "--show-completion" in out
    # the flag takes no shell name: it asks shellingham which shell started ar, so bash starts it here ("; true"
    # keeps bash from exec-ing it); under pytest's workers with no shell close above it said "Shell  not supported."
    script = subprocess.run(["bash", "-c", f"{AR} --show-completion; true"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert script.returncode == 0 and "_AR_COMPLETE" in script.stdout, script.stderr
    # what the installed bash function asks: complete `ar rep` and `autoresearch report --j`
    r = ar(env={**env, "_AR_COMPLETE": "complete_bash", "COMP_WORDS": "ar rep", "COMP_CWORD": "1"})
    assert r.stdout.split() == ["report"]
    r = ar(script=AUTORESEARCH, env={**env, "_AUTORESEARCH_COMPLETE": "complete_bash",
                                     "COMP_WORDS": "autoresearch report --j", "COMP_CWORD": "2"})
    assert r.stdout.split() == ["--json"]


# ------------------------------------------------------------------------------------ 2. binutils' ar first on PATH

@pytest.mark.integration
def test_doctor_warns_when_another_ar_comes_first_on_path(tmp_path, env):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ar").write_text("#!/bin/sh\necho 'GNU ar (GNU Binutils) 2.40'\n")
    (fake / "ar").chmod(0o755)
    r = ar("doctor", "--repo", tmp_path, env={**env, "PATH": f"{fake}{os.pathsep}{env['PATH']}"},
           script=AUTORESEARCH)
    line = next(ln for ln in doctor_checks(r.stdout) if "ar on PATH" in ln)
    assert line.startswith(f"! ar on PATH the first `ar` on PATH is {fake / 'ar'} (GNU ar (GNU Binutils) 2.40)")
    assert "run `autoresearch` instead" in line
    r = ar("doctor", "--repo", tmp_path, env=env)  # this installation's ar first: no warning
    assert f"✓ ar on PATH {SCRIPTS / 'ar'}" in doctor_checks(r.stdout)


# ------------------------------------------------------------------------------------ 3. pipes, NO_COLOR, --no-color

@pytest.mark.integration
def test_piped_output_is_plain_and_unwrapped(tmp_path, env):
    long = "a description far longer than any terminal is wide, " * 5
    root = results_repo(tmp_path / "repo", description=long)
    r = ar("report", "--repo", root, env=env)
    assert r.returncode == 0 and "\x1b" not in r.stdout + r.stderr
    rows = [ln for ln in r.stdout.splitlines() if long.strip() in ln]
    assert [ln.split("\t")[0] for ln in rows] == ["1", "2"]          # one line per row, however long
    r = ar("doctor", "--repo", tmp_path, env=env)
    assert "\x1b" not in r.stdout + r.stderr and all(ln[:2] in ("✓ ", "! ", "✗ ") for ln in doctor_checks(r.stdout))


@pytest.mark.integration
def test_no_color_and_NO_COLOR_write_no_escape_codes_on_a_terminal(tmp_path, env):
    root = results_repo(tmp_path / "repo")
    coloured = on_a_terminal("report", "--repo", root, env=env)
    assert "\x1b[" in coloured and "top 2 of 2 experiments" in coloured  # the control: a terminal gets styles
    for text in (on_a_terminal("--no-color", "report", "--repo", root, env=env),
                 on_a_terminal("report", "--repo", root, env={**env, "NO_COLOR": "1"}),
                 on_a_terminal("--no-color", "report", "--repo", tmp_path / "nothing", env=env),
                 on_a_terminal("--no-color", "-h", env=env)):
        assert "\x1b" not in text and ("experiments" in text or "no results yet" in text or "Usage" in text)


# ------------------------------------------------------------------------------------ 4. exit codes

@pytest.mark.integration
def test_exit_codes_usage_bad_input_failure(tmp_path, env):
    for args, code, says in ((["report", "--bogus"], 2, "No such option: --bogus (see `ar report -h`)"),
                             (["report", "--top", "x"], 2, "Invalid value for '--top'"),
                             (["report", "--tag", "a", "--all"], 2, "--tag and --all exclude each other"),  # ConfigError
                             (["run", "--config", tmp_path / "missing.yaml"], 2, "does not exist"),        # ConfigError
                             (["report", "--repo", tmp_path], 1, "no results yet")):
        r = ar(*args, env=env, cwd=tmp_path)
        assert r.returncode == code and says in r.stderr, (args, r.stderr)
        assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    r = ar("report", "--repo", tmp_path, env=env)
    assert "run `ar run` (or `ar sweep FILE`)" in r.stderr  # and how to get results


@pytest.mark.integration
def test_ctrl_c_exits_130(tmp_path, env):
    # `ar doctor` asks the first `ar` on PATH for its version: a fake one that hangs holds it still for the signal
    fake, started = tmp_path / "bin", tmp_path / "started"
    fake.mkdir()
    (fake / "ar").write_text(f"#!/bin/sh\ntouch {started}\nexec sleep 60\n")
    (fake / "ar").chmod(0o755)
    proc = subprocess.Popen([AUTORESEARCH, "doctor", "--repo", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**env, "PATH": f"{fake}{os.pathsep}{env['PATH']}"})
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err


# ------------------------------------------------------------------------------------ 5. --json, errors included

@pytest.mark.integration
def test_json_errors_are_json_on_stdout(tmp_path, env):
    for args, code in ((["report", "--repo", tmp_path, "--json"], 1),
                       (["report", "--json", "--top", "x"], 2),
                       (["report", "--json", "--tag", "a", "--all"], 2),
                       (["status", "--json", "--repo", tmp_path], 1)):
        r = ar(*args, env=env, cwd=tmp_path)
        doc = json.loads(r.stdout)
        assert r.returncode == code and doc["exit_code"] == code and set(doc) == {"error", "exit_code"}, args
        assert r.stderr == ""
    assert "not a git repository" in doc["error"]


@pytest.mark.integration
def test_status_json(tmp_path, env):
    root = results_repo(tmp_path / "repo")
    r = ar("status", "--json", "--repo", root, env=env)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["running"] is False and doc["holder"] is None and doc["tag"] == "t"
    assert doc["best"]["commit"] == "0000001" and doc["best"]["val_bpb"] == 1.10
    assert doc["counts"] == {"keep": 1, "discard": 1}
    assert doc["status"]["state"] is None and doc["status"]["experiment"] is None and doc["status"]["step"] is None
    empty = tmp_path / "empty"
    empty.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=empty, check=True)
    doc = json.loads(ar("status", "--json", "--repo", empty, env=env).stdout)
    assert doc["running"] is False and doc["tag"] is None and doc["best"] is None


# ------------------------------------------------------------------------------------ 6. the GPU table override

@pytest.mark.integration
def test_user_gpu_table_overrides_and_extends_and_doctor_names_it(tmp_path, env):
    user = Path(env["HOME"]) / ".config" / "ar" / "gpus.yaml"
    user.parent.mkdir(parents=True)
    user.write_text("- {name: Future X1, match: [future, x1], tflops: 777}\n"
                    "- {name: H200, match: [h200], exclude: [nvl], tflops: 1000}\n")
    probe = ("from autoresearch.harness import gpus\n"
             "print(*(gpus.lookup(n).tflops for n in ('ACME Future X1', 'NVIDIA H200', 'NVIDIA GeForce RTX 5090')))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout.split() == ["777.0", "1000.0", "209.5"], r.stderr
    r = ar("doctor", "--repo", tmp_path, env=env)
    assert f"✓ gpu table  the packaged table with 2 row(s) from {user}" in "\n".join(doctor_checks(r.stdout))
    user.write_text("- {name: Future X1, match: [future, x1\n  tflops: 777}\n")
    r = ar("doctor", "--repo", tmp_path, env=env)
    line = next(ln for ln in doctor_checks(r.stdout) if "gpu table" in ln)
    assert line.startswith(f"✗ gpu table  GPU table {user}: not valid YAML at line 2") and "Traceback" not in r.stderr


# -------------------------------------------------------------------------------------- 7. help text, one-line errors

# `python -m autoresearch ARGS` in a subprocess
def run_ar(*args, cwd, timeout=180, env=None):
    return subprocess.run([sys.executable, "-m", "autoresearch", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


BOX = set("─│┃━┏┓┗┛╭╮╰╯┌┐└┘├┤┬┴┼")


@pytest.mark.e2e
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_non_finite_or_non_positive_budgets_are_one_line(tmp_path, value):
    r = run_ar("run", "--repo", str(tmp_path), "--time-budget", value, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert "time_budget" in out and ("finite" in out or "positive" in out), out
    (tmp_path / "run.yaml").write_text(f"time_budget: {value if value not in ('nan', 'inf') else '.' + value}\n")
    r = run_ar("run", "--repo", str(tmp_path), "--config", str(tmp_path / "run.yaml"), cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "time_budget" in out and "Traceback" not in out, out


def test_help_keeps_the_ray_extra_in_brackets():
    out = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "250"}).output
    assert "autoresearch-ar[ray]" in out, out


@pytest.mark.e2e
def test_help_and_a_sweeps_plan_into_a_pipe_are_plain_lines(tmp_path):
    from test_loop import make_repo

    r = run_ar("run", "--help", cwd=tmp_path)
    assert r.returncode == 0 and not BOX & set(r.stdout), r.stdout
    assert "--max-consecutive-crashes" in r.stdout and "autoresearch-ar[ray]" in r.stdout
    assert max(map(len, r.stdout.splitlines())) > 100                     # not wrapped at 80 columns
    root = make_repo(tmp_path)
    (root / "s.yaml").write_text("name: lr\nprofile: cpu\naxes: {LR_MULT: [1.0, 2.0]}\n")
    r = run_ar("sweep", "s.yaml", "--dry-run", cwd=root)
    assert r.returncode == 0, r.stderr
    assert not BOX & set(r.stdout), r.stdout
    assert "plan (listed)" in r.stdout and "#\tstate\tbudget\tpoint" in r.stdout


@pytest.mark.e2e
def test_flags_in_rich_help_take_no_value(tmp_path):
    import os
    import re
    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "150"}          # Rich's help, as on a terminal
    r = subprocess.run([sys.executable, "-m", "autoresearch", "run", "-h"], cwd=tmp_path, capture_output=True,
                       text=True, env=env, timeout=60)
    text = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout)
    lines = {ln.split()[1]: ln for ln in text.splitlines() if ln.startswith("│ --")}
    assert "<bool>" not in lines["--unsandboxed"] and "<bool>" not in lines["--help"], text
    assert "<path>" in lines["--repo"] and "autoresearch-ar[ray]" in text


def test_every_pip_install_of_an_extra_names_the_package():
    import re
    import tomllib
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "configs").glob("*.yaml"),
             *(ROOT / "autoresearch").rglob("*.py")]
    found = {(p.name, m) for p in texts
             for m in re.findall(r"pip install\s+(?:-e\s+)?[\"']?([A-Za-z0-9_.-]+)\\{0,2}\[", p.read_text())}
    assert found and all(m in (name, ".") for _, m in found), sorted(found)


@pytest.mark.integration
@pytest.mark.usefixtures("no_ar_settings")
def test_bare_ar_prints_the_usage_into_a_pipe_too():
    r = run_ar(cwd=ROOT)
    assert "Usage:" in r.stdout + r.stderr and " run " in r.stdout + r.stderr, (r.returncode, r.stdout, r.stderr)
    assert r.returncode == 2


@pytest.mark.e2e
def test_outside_a_repository_one_message_says_all_the_way(tmp_path):
    (tmp_path / "train.py").write_text("DEPTH = 1\n")
    r = run_ar("run", cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "`ar init DIR`" in r.stderr and "git init && git add train.py && git commit -m baseline" in r.stderr


@pytest.mark.e2e
def test_with_no_git_identity_the_dirty_tree_advice_works(tmp_path, prepared_cache):
    import os
    from test_loop import make_repo

    root = make_repo(tmp_path)                                  # committed with -c user.*: no identity stored
    (root / "train.py").write_text((root / "train.py").read_text() + "\n# my edit\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(HOME=str(tmp_path), GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    r = subprocess.run([sys.executable, "-m", "autoresearch", "run"], cwd=root, capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 1 and "uncommitted changes (train.py)" in r.stderr, r.stderr
    assert "git -c user.name=you -c user.email=you@example.com commit -am" in r.stderr and "ar try" in r.stderr
