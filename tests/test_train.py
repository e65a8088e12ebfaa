"""train.py on the CPU profile: the summary and the checkpoint end to end, the fast failures."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from autoresearch.harness import checkpoint, data, logfmt
from autoresearch.harness.feed import Feed

ROOT = Path(__file__).resolve().parents[1]


def load_train(path: Path = ROOT / "train.py"):
    spec = importlib.util.spec_from_file_location("train_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_train(tmp_path, tiny_dataset, budget="3", knobs: dict | None = None, feed: Feed | None = None):
    script = ROOT / "train.py"
    if knobs:
        text = script.read_text()
        for name, value in knobs.items():
            text = re.sub(rf"^{name} = [^#\n]*", f"{name} = {value!r}  ", text, count=1, flags=re.M)
        script = tmp_path / "train.py"
        script.write_text(text)
    ckpt = tmp_path / "checkpoint"
    view = tmp_path / "data"          # what a run under `ar run` sees: no tokens, which come from ar's feed
    data.train_view(tiny_dataset.tok_dir, view)
    feed = feed or Feed(tiny_dataset.tok_dir, seed=42, budget=float(budget))
    env = dict(os.environ, AR_CACHE=str(tmp_path / "no-cache"), AR_DATASET=tiny_dataset.name, AR_PROFILE="cpu",
               AR_TIME_BUDGET=budget, AR_TOK_DIR=str(view), AR_CHECKPOINT_DIR=str(ckpt), PYTHONPATH=str(ROOT),
               AR_DATA_FD=str(feed.child_fd))
    try:
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300, pass_fds=(feed.child_fd,))
    finally:
        feed.close()
    return proc, ckpt


def summary_of(stdout: str) -> dict:
    lines = stdout.splitlines()
    assert "---" in lines, stdout[-2000:]
    out = {}
    for line in lines[lines.index("---") + 1:]:
        m = logfmt.SUMMARY_LINE_RE.match(line)
        out[m["key"]] = m["value"]
    return out


@pytest.mark.integration
def test_cpu_run_prints_summary_and_saves_a_checkpoint_that_loads_by_its_factory(tmp_path, tiny_dataset):
    from safetensors.torch import load_model

    # enough steps to learn on a loaded CPU (8 s gave 3 steps of ~2 s beside a busy test worker: too few; at 12 s a
    # first step of 6.4 s left 5 s, and train.py rightly did not start a second that would end past the window)
    budget = 20
    proc, ckpt = run_train(tmp_path, tiny_dataset, budget=str(budget))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    s = summary_of(proc.stdout)
    assert tuple(s) == logfmt.SUMMARY_KEYS and "val_bpb" not in s    # no score of its own: the evaluator's counts
    assert float(s["training_seconds"]) >= 3.0
    assert s["gpu"] == "cpu" and s["mfu_percent"] == "unknown"
    steps = [ln for ln in proc.stdout.splitlines() if logfmt.STEP_RE.match(ln)]
    assert len(steps) == int(s["num_steps"]) >= 2, proc.stdout[-2000:]
    for ln in steps:     # one clock: the remaining time is the budget's share the percentage leaves (ar's window)
        m = logfmt.STEP_RE.match(ln)
        share = budget * (1 - float(m["pct"]) / 100)
        assert abs(int(m["remaining"]) - share) <= logfmt.step_clock_slack(budget) + 1e-9, ln
    # what the evaluator's worker does: import the file by path, build by the named factory, load strictly
    meta = checkpoint.read_meta(ckpt)
    assert meta["factory"] == "model_from_config" and json.loads(json.dumps(meta["config"])) == meta["config"]
    model = getattr(load_train(), meta["factory"])(dict(meta["config"]))
    load_model(model, str(ckpt / checkpoint.WEIGHTS), strict=True)
    model.eval()
    tokens = np.fromfile(tiny_dataset.tok_dir / "val.bin", dtype=np.uint16)[:4 * 65].astype(np.int64)
    rows = torch.from_numpy(tokens).view(4, 65)
    with torch.no_grad():
        logits = model(rows[:, :-1])
    assert logits.shape == (4, 64, tiny_dataset.vocab_size) and torch.isfinite(logits).all()
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
    assert loss < math.log(tiny_dataset.vocab_size) - 0.5        # trained: well below a uniform guess


@pytest.mark.integration
def test_a_wait_for_the_gpu_before_the_window_opens_is_not_counted_as_training(tmp_path, tiny_dataset):
    """A run that took a head start asks for its first batch and waits there for its turn (the feed's
    `before_open`); ar's window opens after the wait. train.py's own clock must start there too: counted in its
    first step, the wait made it think its budget spent that much early (it stopped 7 s short of a 60-s window
    on an H100) and printed a training time longer than its window."""
    wait, budget = 4.0, 6

    def turn() -> bool:
        time.sleep(wait)
        return True

    feed = Feed(tiny_dataset.tok_dir, seed=42, budget=float(budget), before_open=turn)
    proc, _ = run_train(tmp_path, tiny_dataset, budget=str(budget), feed=feed)
    ended = time.time()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert feed.opened_at is not None
    # everything train.py counted as training lies between the window's opening and its own exit
    assert float(summary_of(proc.stdout)["training_seconds"]) <= ended - feed.opened_at


@pytest.mark.parametrize("budget, trained, left, expected", [
    (60.0, 10.0, None, 10 / 60),      # run by hand: its own training time
    (60.0, 10.0, 50.0, 10 / 60),      # under ar, one and the same
    (60.0, 17.4, 50.0, 10 / 60),      # its first step held a 7.4-s wait for the turn: ar's window decides
    (60.0, 5.0, 45.0, 15 / 60),       # the window opened 5 s short (a start-up's charge): the window decides
    (60.0, 70.0, None, 1.0),
    (60.0, 1.0, -3.0, 1.0),           # past the deadline
    (0.0, 1.0, 5.0, 1.0),
])
def test_progress_under_ar_is_the_share_of_its_window(budget, trained, left, expected):
    from autoresearch.harness.env import RunEnv, resolve_profile
    env = RunEnv(resolve_profile("cpu"), budget, "tiny", Path("."), 0, None, None, None, Path("."), None)
    now = 1000.0
    deadline = now + left if left is not None else None
    assert env.progress(trained, deadline, now=now) == pytest.approx(expected)


@pytest.mark.integration
def test_nan_fails_fast_with_a_clear_line(tmp_path, tiny_dataset):
    proc, ckpt = run_train(tmp_path, tiny_dataset, budget="60", knobs={"LR_MULT": 1e9, "SOFTCAP": 0.0})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert any(ln.startswith("FAIL:") and "diverged" in ln for ln in proc.stdout.splitlines())
    assert "---" not in proc.stdout.splitlines() and not (ckpt / checkpoint.MODEL_JSON).exists()


@pytest.mark.integration
def test_batch_that_does_not_divide_is_one_line(tmp_path, tiny_dataset):
    proc, _ = run_train(tmp_path, tiny_dataset, knobs={"DEVICE_BATCH_SIZE": 24})
    assert proc.returncode == 1
    fail = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL:")]
    assert len(fail) == 1 and "DEVICE_BATCH_SIZE" in fail[0] and "Traceback" not in proc.stderr


@pytest.mark.integration
def test_a_fused_ce_that_is_not_true_false_or_auto_is_one_line(tmp_path, tiny_dataset):
    proc, _ = run_train(tmp_path, tiny_dataset, knobs={"FUSED_CE": "yes"})
    fail = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL:")]
    assert proc.returncode == 1 and len(fail) == 1 and "FUSED_CE" in fail[0] and '"auto"' in fail[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.integration
def test_missing_data_is_one_line(tmp_path):
    env = dict(os.environ, AR_CACHE=str(tmp_path / "empty"), AR_PROFILE="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "train.py")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "ar prepare" in proc.stdout


def test_import_has_no_side_effects_and_model_shapes():
    train = load_train()
    cfg = train.make_config(vocab_size=256, seq_len=32, profile_name="cpu")
    model = train.build_model(cfg, "cpu")
    x = torch.randint(0, 256, (2, 32))
    loss = model(x, x, reduction="none")
    assert loss.shape == (2, 32) and torch.isfinite(loss).all()
    # fresh model: roughly uniform over the vocab
    assert abs(model(x, x).item() - math.log(256)) < 0.5
    assert model.flops_per_token() > 6 * 0.5 * model.num_params() - 1


def test_orthogonalize_gives_near_orthogonal_rows():
    train = load_train()
    g = torch.randn(3, 64, 256)
    o = train.orthogonalize(g).float()
    sv = torch.linalg.svdvals(o)
    assert sv.min() > 0.5 and sv.max() < 1.3      # Polar Express lands singular values near 1


def test_cpu_profile_scales_the_same_knobs():
    train = load_train()
    s = train.sizes_for("cpu")
    assert s["depth"] == max(1, train.DEPTH - train.CPU_DEPTH_OFFSET)
    assert s["total_batch"] == train.TOTAL_BATCH_SIZE // train.CPU_BATCH_DIVISOR
    assert train.sizes_for("gpu")["depth"] == train.DEPTH


def test_sliding_window_layers_on_cpu_use_a_banded_mask():
    train = load_train()
    train.WINDOW_PATTERN = "SL"
    cfg = train.make_config(vocab_size=256, seq_len=32, profile_name="cpu")
    assert [cfg.window(i) for i in range(cfg.depth)] == [16 if i % 2 == 0 and i != cfg.depth - 1 else 32
                                                         for i in range(cfg.depth)]
    model = train.build_model(cfg, "cpu")
    model.set_attention("math", "cpu")
    attn = model.blocks[0].attn
    assert not attn.full and attn.window_fn is None          # CPU: the explicit banded mask
    torch.manual_seed(0)
    x = torch.randn(1, 32, cfg.width)
    cos, sin = model.cos[:, :, :32], model.sin[:, :, :32]
    with torch.no_grad():
        nn = torch.nn
        nn.init.normal_(attn.proj.weight, std=0.02)
        windowed = attn(x, None, cos, sin)
        attn.full = True
        full = attn(x, None, cos, sin)
    # the first 16 positions see the same keys either way; later ones must differ
    assert torch.allclose(windowed[:, :16], full[:, :16], atol=1e-5)
    assert not torch.allclose(windowed[:, 16:], full[:, 16:], atol=1e-5)


def _tiny_step(train, *, fused: bool, softcap: float = 15.0, chunk: int = 100, compile_backend: str | None = None,
               relu2: bool = False):
    """Loss and gradients of one backward on a tiny model whose weights are all non-zero (at init the blocks are
    the identity and some gradients are pure rounding noise, which would compare nothing)."""
    train.FUSED_CE, train.CE_CHUNK_ROWS, train.SOFTCAP, train.RELU2_KEEPS_OUTPUT = fused, chunk, softcap, relu2
    torch.manual_seed(0)
    cfg = train.make_config(vocab_size=512, seq_len=64, profile_name="cpu")
    model = train.build_model(cfg, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x, y = torch.randint(0, 512, (3, 64)), torch.randint(0, 512, (3, 64))
    step = torch.compile(model, backend=compile_backend, fullgraph=True) if compile_backend else model
    loss = step(x, y)
    (0.5 * loss).backward()                              # a gradient-accumulation scale goes through backward
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("softcap, chunk", [(15.0, 100), (0.0, 192), (15.0, 4096)])
def test_fused_ce_matches_the_reference_loss_and_gradients(softcap, chunk):
    """FUSED_CE (row chunks of 100: the last one short; one chunk; no softcap) against the default path, fp32 on
    CPU: loss within 1e-5, every parameter's gradient within 1e-4 of its norm."""
    ref_loss, ref = _tiny_step(load_train(), fused=False, softcap=softcap)
    loss, grads = _tiny_step(load_train(), fused=True, softcap=softcap, chunk=chunk)
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    assert set(grads) == set(ref)
    for name, g in ref.items():
        assert grads[name] is not None and (grads[name] - g).norm() <= 1e-4 * g.norm(), name


def test_relu2_keeping_its_output_matches_the_reference_gradients():
    ref_loss, ref = _tiny_step(load_train(), fused=False)
    loss, grads = _tiny_step(load_train(), fused=False, relu2=True)
    assert abs(loss.item() - ref_loss.item()) < 1e-6
    for name, g in ref.items():
        assert (grads[name] - g).norm() <= 1e-5 * g.norm(), name


def test_fused_ce_and_relu2_trace_whole_under_torch_compile():
    """The chunk loop and both autograd.Functions compile as one graph (fullgraph: no graph break), same numbers."""
    ref_loss, ref = _tiny_step(load_train(), fused=False)
    loss, grads = _tiny_step(load_train(), fused=True, chunk=64, compile_backend="aot_eager", relu2=True)
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    assert all((grads[n] - g).norm() <= 1e-4 * g.norm() for n, g in ref.items())


@pytest.mark.parametrize("setting, device_cuda, fused", [
    ("auto", False, False), ("auto", True, True), (True, False, True), (True, True, True), (False, True, False)])
def test_fused_ce_auto_means_cuda_only(setting, device_cuda, fused, monkeypatch):
    """The default, "auto", takes the chunked loss on CUDA alone (a CPU step is slower with it); True and False
    hold everywhere. Counted at the mechanism: whether LinearSoftcapCE runs, on a CPU tensor that says CUDA."""
    train = load_train()
    assert train.FUSED_CE == "auto" and train.BF16_RESIDUAL is True and train.RELU2_KEEPS_OUTPUT is True
    train.FUSED_CE = setting
    cfg = train.make_config(vocab_size=256, seq_len=32, profile_name="cpu")
    model = train.build_model(cfg, "cpu")
    calls = []
    real = train.LinearSoftcapCE.apply
    monkeypatch.setattr(train.LinearSoftcapCE, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: device_cuda))
    x = torch.randint(0, 256, (2, 32))
    if device_cuda:                                             # BF16_RESIDUAL's cast is CUDA-only too
        monkeypatch.setattr(train, "BF16_RESIDUAL", False)
    loss = model(x, x)
    assert bool(calls) == fused and loss.requires_grad


def test_fused_ce_leaves_evaluation_and_per_token_losses_alone():
    train = load_train()
    train.FUSED_CE = True
    cfg = train.make_config(vocab_size=256, seq_len=32, profile_name="cpu")
    model = train.build_model(cfg, "cpu")
    x = torch.randint(0, 256, (2, 32))
    assert model(x).shape == (2, 32, 256)                      # what the evaluator calls
    assert model(x, x, reduction="none").shape == (2, 32)
    with torch.no_grad():                                       # no gradients wanted: the plain path
        assert torch.allclose(model(x, x), model(x, x, reduction="none").mean())


@pytest.mark.integration
def test_cpu_profile_trains_with_the_mfu_knobs_on(tmp_path, tiny_dataset):
    """FUSED_CE, RELU2_KEEPS_OUTPUT and BF16_RESIDUAL (a no-op on CPU) through the runner's knob rewrite, a whole
    CPU run."""
    proc, ckpt = run_train(tmp_path, tiny_dataset, budget="6",
                           knobs={"FUSED_CE": True, "BF16_RESIDUAL": True, "RELU2_KEEPS_OUTPUT": True})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    s = summary_of(proc.stdout)
    assert int(s["num_steps"]) >= 1 and (ckpt / checkpoint.MODEL_JSON).exists()     # a step: each knob's path ran


def test_the_compile_warm_up_leaves_no_trace():
    """The warm-up before the first batch (random tokens, to compile off the window) puts the weights back and
    forgets every optimizer step: a run cannot train on it."""
    t = load_train()
    cfg = t.make_config(2048, 64, "cpu")
    model = t.build_model(cfg, torch.device("cpu"))
    model.set_attention("math", "cpu")
    opt = t.MuonAdamW(model, lr_mult=1.0, compile_update=False)
    before = [p.detach().clone() for p in model.parameters()]
    t.warm_up(model, model, opt, 2, 4, 64, cfg.vocab_size, "math", torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.adam.state and all(float(b.abs().sum()) == 0 for b in opt.buffers.values())
    assert all(p.grad is None for p in model.parameters())


def test_a_step_that_would_end_past_the_window_is_not_started():
    """train.py plans its last step: the median of its last five steps, the first one (with its one-time costs)
    only until there is another. A CPU baseline whose first step took 8 s of an 8-s window started a second and
    wrote its checkpoint 8.3 s past the window (a timeout) when only later steps were counted."""
    fits = load_train().step_fits
    assert fits([], 0.5)                                     # nothing known yet: the first step starts
    assert not fits([8.0], 0.5) and fits([8.0], 8.5)         # the first step is the estimate while it is alone
    assert fits([8.0, 1.0], 1.5) and not fits([8.0, 1.0], 0.9)   # then only later steps count
    assert fits([9.0, 1.0, 1.0, 5.0, 1.0, 1.0, 5.0], 1.0)     # the last five: 1, 5, 1, 1, 5 -> 1
    assert not fits([0.1, 1.0, 5.0, 5.0, 1.0, 5.0], 4.0)      # 1, 5, 5, 1, 5 -> 5
