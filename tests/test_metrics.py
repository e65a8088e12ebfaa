import json
import time
from pathlib import Path

import pytest

from autoresearch.harness import gpus
from autoresearch.harness.logfmt import format_step, format_summary
from autoresearch.experiment.metrics import (DegradedWatch, Metrics, StepPoint, parse_log, parse_log_file, parse_step,
                                  recompute_mfu)

LOGS = Path(__file__).parent / "data" / "logs"


def summary(**kw):
    args = dict(training_seconds=300.0, total_seconds=320.0, peak_vram_mb=1024.0, mfu_percent=40.0,
                total_tokens_M=100.0, num_steps=100, num_params_M=50.0, depth=8, gpu="NVIDIA H200",
                peak_tflops=989.5)
    args.update(kw)
    return format_summary(**args)


def test_ok_log():
    m = parse_log_file(LOGS / "ok.log")
    assert m.has_summary and m.fail_message is None
    assert m.val_bpb is None             # printed (0.997900), never read: only the trusted evaluator's counts
    assert m.training_seconds == 300.1 and m.total_seconds == 325.9
    assert m.peak_vram_mb == 45060.2 and m.memory_gb == pytest.approx(44.004, abs=1e-3)
    assert m.mfu_percent == 39.8 and m.peak_tflops == 989.5 and m.gpu == "NVIDIA H200"
    assert m.num_steps == 953 and isinstance(m.num_steps, int) and m.depth == 8
    assert len(m.steps) == 30 and m.steps[0].step == 0 and m.last_step.step == 29
    # the median leaves out the slow warm-up steps
    assert 1_600_000 <= m.tokens_per_s <= 1_605_000
    d = m.to_dict()
    assert d["val_bpb"] is None and len(d["steps"]) == 30
    json.dumps(d)


def test_crash_log_has_no_summary():
    m = parse_log_file(LOGS / "crash.log")
    assert not m.has_summary and m.val_bpb is None and m.fail_message is None
    assert len(m.steps) == 12 and m.tokens_per_s is not None


def test_nan_log():
    m = parse_log_file(LOGS / "nan.log")
    assert not m.has_summary and m.val_bpb is None
    assert m.fail_message.startswith("loss is NaN at step 17")
    assert m.steps[-1].loss != m.steps[-1].loss  # NaN


def test_truncated_log_is_not_a_summary():
    m = parse_log_file(LOGS / "truncated.log")
    assert not m.has_summary
    assert m.training_seconds == 300.0  # what was there is still read
    assert m.total_seconds is None and m.num_steps is None and m.val_bpb is None


def test_unknown_mfu_log():
    m = parse_log_file(LOGS / "unknown_mfu.log")
    assert m.has_summary
    assert m.mfu_percent is None and m.peak_tflops is None and m.peak_vram_mb is None and m.memory_gb is None
    assert m.gpu == "cpu" and m.val_bpb is None and m.training_seconds == 20.0
    assert all(p.mfu is None for p in m.steps)


def test_empty_log():
    m = parse_log("")
    assert m == Metrics() and m.tokens_per_s is None


def test_parse_step():
    p = parse_step(format_step(42, 14.0, 4.123456, 1234567, 41.2, 0.312, 258))
    assert p == StepPoint(42, 14.0, 4.123456, 1234567.0, 41.2, 312, 258)
    assert parse_step("step 00042 | 14.0% | loss 4.1 | tok/s 12 | mfu unknown | dt 1ms | remaining 0s").mfu is None
    assert parse_step("step 42 is nice") is None
    assert parse_step("  " + format_step(1, 1, 1, 1, None, 0.001, 1) + "\r") is not None


def test_last_summary_block_counts():
    text = "\n".join([summary(training_seconds=12.5), "more output", summary(training_seconds=300.5), "bye"])
    m = parse_log(text)
    assert m.training_seconds == 300.5 and m.has_summary


def test_dashes_without_keys_do_not_hide_the_summary():
    m = parse_log(summary(num_steps=7) + "\n---\nsomething else\n")
    assert m.num_steps == 7 and m.has_summary


def test_a_printed_val_bpb_is_not_read():
    """Upstream's train.py prints val_bpb first in its summary: the block still parses, the number is dropped."""
    text = summary().replace("---\n", "---\nval_bpb:          0.500000\n", 1)
    m = parse_log(text)
    assert m.has_summary and m.val_bpb is None and m.training_seconds == 300.0


def test_upstream_summary_without_gpu_keys_counts():
    text = "\n".join(summary().split("\n")[:-2])
    m = parse_log(text)
    assert m.has_summary and m.gpu is None and m.peak_tflops is None


def test_non_finite_values_are_none():
    m = parse_log(summary().replace("total_seconds:    320.0", "total_seconds:    nan"))
    assert m.total_seconds is None and m.training_seconds == 300.0
    assert m.has_summary                 # the keys are there; a value that is no number is None


def test_recompute_mfu():
    h200 = gpus.Peak("NVIDIA H200", "H200", 989.5, "table")
    r5090 = gpus.Peak("NVIDIA GeForce RTX 5090", "RTX 5090", 209.5, "table")
    unknown = gpus.Peak("Mystery", None, None, "unknown")
    m = parse_log_file(LOGS / "ok.log")
    assert recompute_mfu(m, h200) == pytest.approx(39.8)
    # printed against a wrong (H100-style) peak on a 5090: rescaled to the table's
    assert recompute_mfu(m, r5090) == pytest.approx(39.8 * 989.5 / 209.5)
    assert recompute_mfu(m, unknown) is None
    assert recompute_mfu(m, h200, flops_per_token=3e8) == pytest.approx(
        100 * m.tokens_per_s * 3e8 / 989.5e12)
    assert recompute_mfu(parse_log_file(LOGS / "unknown_mfu.log"), h200) is None


def pt(step, tps=1000.0, mfu=None):
    return StepPoint(step, 0.0, 1.0, tps, mfu, 10, 10)


def test_degraded_watch_tokens_floor():
    w = DegradedWatch(min_mfu=None, min_tokens_per_s=500, warmup_steps=10, patience=3)
    assert all(w.feed(pt(s, tps=1)) is None for s in range(10))  # warm-up ignored
    assert w.feed(pt(10, tps=1)) is None and w.feed(pt(11, tps=1)) is None
    reason = w.feed(pt(12, tps=1))
    assert reason and "tokens/s" in reason and "floor 500" in reason


def test_degraded_watch_resets_on_a_good_step():
    w = DegradedWatch(min_mfu=30, min_tokens_per_s=None, warmup_steps=0, patience=3)
    for s, mfu in enumerate([10, 10, 35, 10, 10]):
        assert w.feed(pt(s, mfu=mfu)) is None
    assert "MFU" in w.feed(pt(5, mfu=10))


def test_degraded_watch_unknown_mfu_is_no_evidence():
    w = DegradedWatch(min_mfu=30, min_tokens_per_s=None, warmup_steps=0, patience=1)
    assert all(w.feed(pt(s, mfu=None)) is None for s in range(50))


def test_many_dashes_parse_in_linear_time():
    text = "---\n" * 200_000 + summary(num_steps=8) + "\n---\n" * 1000
    t = time.monotonic()
    m = parse_log(text)
    assert m.num_steps == 8 and time.monotonic() - t < 2


def test_to_dict_is_strict_json():
    d = parse_log_file(LOGS / "nan.log").to_dict()
    json.dumps(d, allow_nan=False)
    assert d["steps"][-1]["loss"] is None
