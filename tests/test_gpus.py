"""The GPU peak table: every row, every naming trap, overrides, and the MFU formula."""

import pytest
import yaml

from autoresearch.harness import gpus

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
