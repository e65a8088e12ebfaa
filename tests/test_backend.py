"""harness/backend.py: safe defaults, the probe file, and how `resolve` picks each "auto" knob."""

import json

import pytest

from autoresearch.harness import backend

H200 = dict(capability=(9, 0), vram_mb=143_771.0, cudnn=True, version="2.6.0+cu126")
RTX5090 = dict(capability=(12, 0), vram_mb=32_607.0, cudnn=True, version="2.7.0+cu128")
CHOICE = {"attention": "flash", "compile_model": False, "compile_optimizer": True, "device_batch": 32}


def test_probe_path_is_per_device_and_torch_version(tmp_path):
    p = backend.probe_path("NVIDIA GeForce RTX 5090", tmp_path, "2.7.0+cu128")
    assert p == tmp_path / "probe" / "nvidia-geforce-rtx-5090-torch2.7.0-cu128.json"


@pytest.mark.parametrize("vram_gb, batch", [(None, 8), (24, 32), (32, 64), (80, 128), (141, 256), (8, 8)])
def test_default_device_batch_rule_of_thumb(vram_gb, batch):
    assert backend.default_device_batch(vram_gb and vram_gb * 1024) == batch


def test_default_device_batch_scales_with_sequence():
    assert backend.default_device_batch(80 * 1024, seq_len=4096) == 64


@pytest.mark.parametrize("cap, cudnn, attention, compile_model", [
    ((9, 0), True, "cudnn", True),        # Hopper
    ((12, 0), True, "cudnn", False),      # consumer Blackwell: full-model compile off
    ((10, 0), True, "cudnn", True),       # B200
    ((9, 0), False, "flash", True),       # no cuDNN in this build
    ((8, 6), True, "flash", True),        # Ampere
    ((7, 5), True, "efficient", True),    # Turing
])
def test_defaults_per_architecture(cap, cudnn, attention, compile_model):
    d = backend.defaults(cap, 80 * 1024, cudnn=cudnn)
    assert (d["attention"], d["compile_model"], d["compile_optimizer"]) == (attention, compile_model, True)


def test_defaults_without_gpu():
    assert backend.defaults(None, None) == {"attention": "math", "compile_model": False,
                                            "compile_optimizer": False, "device_batch": 8}


def test_resolve_without_probe_file_uses_defaults(tmp_path):
    out = backend.resolve("auto", "auto", "auto", device_name="NVIDIA GeForce RTX 5090", cache=tmp_path, **RTX5090)
    assert (out["attention"], out["compile_model"], out["compile_optimizer"], out["device_batch"]) == \
        ("cudnn", False, True, 64)
    assert set(out["source"].values()) == {"default"} and out["probe_file"] is None


def test_resolve_keeps_explicit_knobs(tmp_path):
    backend.write_choice(CHOICE, device_name="NVIDIA H200", cache=tmp_path, version=H200["version"])
    out = backend.resolve("efficient", True, 16, device_name="NVIDIA H200", cache=tmp_path,
                          compile_optimizer=False, **H200)
    assert (out["attention"], out["compile_model"], out["device_batch"], out["compile_optimizer"]) == \
        ("efficient", True, 16, False)
    assert set(out["source"].values()) == {"knob"}


def test_resolve_reads_the_probe_file(tmp_path):
    path = backend.write_choice(CHOICE, device_name="NVIDIA H200", cache=tmp_path, version=H200["version"],
                                measured={"tokens_per_s": 1.0e6}, rows=[{"status": "chosen"}])
    doc = json.loads(path.read_text())
    assert doc["schema"] == 1 and doc["device"] == "NVIDIA H200" and doc["choice"] == CHOICE
    out = backend.resolve("auto", "auto", "auto", device_name="NVIDIA H200", cache=tmp_path, **H200)
    assert {k: out[k] for k in CHOICE} == CHOICE
    assert set(out["source"].values()) == {"probe"} and out["probe_file"] == str(path)


def test_resolve_mixes_probe_and_knobs(tmp_path):
    backend.write_choice(CHOICE, device_name="NVIDIA H200", cache=tmp_path, version=H200["version"])
    out = backend.resolve("cudnn", "auto", 64, device_name="NVIDIA H200", cache=tmp_path, **H200)
    assert out["source"] == {"attention": "knob", "compile_model": "probe", "compile_optimizer": "probe",
                             "device_batch": "knob"}
    assert (out["attention"], out["compile_model"], out["device_batch"]) == ("cudnn", False, 64)


def test_probe_file_of_another_torch_or_gpu_is_ignored(tmp_path):
    backend.write_choice(CHOICE, device_name="NVIDIA H200", cache=tmp_path, version="2.5.1+cu124")
    out = backend.resolve("auto", "auto", "auto", device_name="NVIDIA H200", cache=tmp_path, **H200)
    assert out["source"]["attention"] == "default"
    backend.write_choice(CHOICE, device_name="NVIDIA H100 80GB HBM3", cache=tmp_path, version=H200["version"])
    out = backend.resolve("auto", "auto", "auto", device_name="NVIDIA H200", cache=tmp_path, **H200)
    assert out["source"]["attention"] == "default"


@pytest.mark.parametrize("text", ["{not json", json.dumps({"schema": 99, "choice": CHOICE}), "[]"])
def test_unusable_probe_file_falls_back_to_defaults(tmp_path, text):
    path = backend.probe_path("NVIDIA H200", tmp_path, H200["version"])
    path.parent.mkdir(parents=True)
    path.write_text(text)
    out = backend.resolve("auto", "auto", "auto", device_name="NVIDIA H200", cache=tmp_path, **H200)
    assert out["attention"] == "cudnn" and out["source"]["attention"] == "default" and out["probe_file"] is None


def test_resolve_on_this_machine_without_gpu(tmp_path):
    """Device facts read from torch: no GPU here, so CPU defaults and no probe file."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    out = backend.resolve("auto", "auto", "auto", device_name="cpu", cache=tmp_path)
    assert (out["attention"], out["compile_model"], out["device_batch"]) == ("math", False, 8)
