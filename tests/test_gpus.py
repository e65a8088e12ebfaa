"""The GPU peak table: every row, every naming trap, overrides, and the MFU formula."""

import json
import os
import subprocess
import sys

import git
import pytest
import yaml

from autoresearch.errors import ConfigError
from autoresearch.harness import gpus
from autoresearch.workspace import init_workspace

# (device name as torch reports it, expected dense BF16 TFLOP/s or None for "unknown")
CASES = [
    ("NVIDIA GeForce RTX 5090", 209.5),
    ("NVIDIA GeForce RTX 5090 D", None),            # capped SKU: no published figure, never the 5090's
    ("NVIDIA GeForce RTX 5090 Laptop GPU", None),   # a different chip
    ("NVIDIA GeForce RTX 5080", 112.6),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 503.8),
    ("NVIDIA GeForce RTX 4090", 165.2),
    ("NVIDIA GeForce RTX 4090 D", None),
    ("NVIDIA GeForce RTX 3090", 71.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA A10", 125.0),
    ("NVIDIA L4", 121.0),
    ("NVIDIA L40S", 362.0),                           # not the L4
    ("NVIDIA H100 80GB HBM3", 989.5),
    ("NVIDIA H100 PCIe", 756.5),                      # not the SXM part
    ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", 989.5),
    ("NVIDIA H200 NVL", 835.5),                       # not the SXM part
    ("NVIDIA B200", 2250.0),
    ("NVIDIA GB200", 2500.0),
    ("AMD Instinct MI300X", 1307.4),
    ("NVIDIA GeForce GTX 1080", None),
    ("Some Future GPU", None),
]


@pytest.mark.parametrize("name,tflops", CASES)
def test_lookup(name, tflops, monkeypatch, tmp_path):
    monkeypatch.delenv("AR_PEAK_TFLOPS", raising=False)
    monkeypatch.delenv("AR_GPU_TABLE", raising=False)
    monkeypatch.delenv("AR_GPUS_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))            # no developer's own override file
    peak = gpus.lookup(name)
    assert peak.tflops == tflops
    if tflops is None:
        assert peak.warning and "AR_PEAK_TFLOPS" in peak.warning


def test_5090_is_not_the_sparse_figure(monkeypatch):
    monkeypatch.delenv("AR_PEAK_TFLOPS", raising=False)
    assert gpus.lookup("NVIDIA GeForce RTX 5090").tflops != 419


def test_every_table_row_is_reachable_by_its_own_name(monkeypatch, tmp_path):
    monkeypatch.delenv("AR_GPU_TABLE", raising=False)
    monkeypatch.delenv("AR_GPUS_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    for row in gpus.load_table():
        assert gpus.lookup(row.name, override=None).row == row.name


def test_override_and_extra_table(tmp_path, monkeypatch):
    monkeypatch.setenv("AR_PEAK_TFLOPS", "123.4")
    assert gpus.lookup("Some Future GPU").tflops == 123.4
    monkeypatch.delenv("AR_PEAK_TFLOPS")
    extra = tmp_path / "extra.yaml"
    extra.write_text(yaml.safe_dump([{"name": "Future X1", "match": ["future", "x1"], "tflops": 777}]))
    monkeypatch.setenv("AR_GPU_TABLE", str(extra))
    assert gpus.lookup("ACME Future X1").tflops == 777.0
    assert gpus.lookup("NVIDIA H200").tflops == 989.5


def test_missing_extra_table_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("AR_GPU_TABLE", "/nonexistent/table.yaml")
    with pytest.raises(ValueError, match="AR_GPU_TABLE"):
        gpus.load_table()


def test_mfu_formula():
    # 1e6 tokens/s × 1e8 FLOPs/token = 1e14 FLOP/s = 100 TFLOP/s; on a 200 TFLOP/s card that is 50 %
    assert gpus.mfu_percent(1e6, 1e8, 200.0) == pytest.approx(50.0)
    # the same throughput on an RTX 5090 reads 4.72x higher than against an H100's peak
    on_5090 = gpus.mfu_percent(1e6, 1e8, 209.5)
    on_h100 = gpus.mfu_percent(1e6, 1e8, 989.5)
    assert on_5090 / on_h100 == pytest.approx(989.5 / 209.5)
    assert gpus.mfu_percent(None, 1e8, 200.0) is None
    assert gpus.mfu_percent(1e6, 1e8, None) is None


# ------------------------------------------------------------------ a broken override file stops a command at start
def _ar(args, cwd, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("AR_GPUS_FILE", "AR_GPU_TABLE", "AR_PEAK_TFLOPS")}
    return subprocess.run([sys.executable, "-m", "autoresearch", *args], cwd=cwd, env={**full, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def workspace(tmp_path):
    """A workspace from `ar init`, and a HOME without the developer's own override file."""
    init_workspace(tmp_path / "ws")
    (tmp_path / "home").mkdir()
    return tmp_path / "ws"


@pytest.mark.e2e
@pytest.mark.parametrize("command", [["run", "--max-experiments", "1"], ["sweep", "configs/sweep-cpu-small.yaml"],
                                     ["doctor"]])
def test_a_bad_override_file_is_a_config_error_before_anything_runs(workspace, command):
    bad = workspace.parent / "gpus.yaml"
    bad.write_text("- {name: My GPU, match: [my, gpu], tflops: fast}\n")
    r = _ar(command, workspace, AR_GPUS_FILE=str(bad), HOME=str(workspace.parent / "home"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"GPU table {bad}" in r.stderr and "tflops must be a positive number" in r.stderr, r.stderr
    assert r.stderr.strip().endswith("fix the file or unset AR_GPUS_FILE"), r.stderr
    assert not (workspace / "runs").exists()                                  # nothing started
    assert len(git.Repo(workspace).branches) == 1                             # no experiment branch


@pytest.mark.e2e
def test_the_default_override_file_is_checked_too(workspace):
    home = workspace.parent / "home"
    (home / ".config" / "ar").mkdir(parents=True)
    user = home / ".config" / "ar" / "gpus.yaml"
    user.write_text("name: My GPU\n")
    r = _ar(["run"], workspace, HOME=str(home))
    assert r.returncode == 2 and f"GPU table {user}" in r.stderr and "YAML list of rows" in r.stderr, r.stderr
    assert "fix the file or move it away" in r.stderr and not (workspace / "runs").exists()
    r = _ar(["doctor", "--json"], workspace, HOME=str(home))
    doc = json.loads(r.stdout)
    assert r.returncode == 2 and doc["exit_code"] == 2 and str(user) in doc["error"], r.stdout
    assert any(c["name"] == "gpu table" and c["state"] == "fail" for c in doc["checks"])     # the checklist stays


@pytest.mark.parametrize("value", ["fast", "0", "-5", "nan", "inf"])
def test_a_bad_peak_override_is_a_config_error(value, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("AR_GPUS_FILE", raising=False)
    monkeypatch.delenv("AR_GPU_TABLE", raising=False)
    monkeypatch.setenv("AR_PEAK_TFLOPS", value)
    with pytest.raises(ConfigError, match="AR_PEAK_TFLOPS=.*positive number.*unset it"):
        gpus.check_override()
    monkeypatch.setenv("AR_PEAK_TFLOPS", "209.5")
    assert gpus.check_override() is None
