"""evaluate_bpb: bits per byte on a fixed number of validation tokens, and the evaluator record.

Bits per byte does not depend on the vocabulary: the summed cross-entropy (nats) of every target token is
divided by ln 2 times the UTF-8 bytes those tokens stand for. Special tokens (BOS) have no bytes and are left
out of both sums.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from .data import check_tok_dir
from .loader import PackedLoader

RECORD_KEYS = ("val_bpb", "eval_tokens", "eval_bytes", "dataset", "seq_len", "pid", "written_at")


def evaluate_bpb(model, tok_dir: Path, *, eval_tokens: int, batch_size: int, seq_len: int, device="cpu",
                 record_path: Path | None = None, dataset: str = "") -> float:
    """Bits per byte of `model` on the first `eval_tokens` target tokens of the validation split.

    `model(x, targets=y, reduction="none")` must return per-token cross-entropy in nats, shape [B, T].
    Rows come from the packing loader in a fixed order (no shuffle), so every call sees the same tokens.
    Exactly `eval_tokens` targets are counted, whatever the batch shape: the last batch is run whole and only
    its first targets (in row order) are counted; this keeps the record's `eval_tokens` equal to what the
    runner asked for. If the split holds fewer tokens than that, it is read again from its start (a warning
    says so). Runs under `torch.no_grad()`, with bf16 autocast on CUDA, in eval mode (the mode is restored).

    If `record_path` is given, writes the evaluator record there atomically (see docs/architecture.md);
    `dataset` defaults to the dataset folder's name. A non-finite result is recorded as null."""
    if eval_tokens < 1:
        raise ValueError(f"eval_tokens must be positive, not {eval_tokens}")
    tok_dir = Path(tok_dir)
    meta = check_tok_dir(tok_dir)
    device = torch.device(device)
    if eval_tokens > meta["val"]["tokens"]:
        warnings.warn(f"the validation split of {tok_dir} has {meta['val']['tokens']} tokens, fewer than the "
                      f"{eval_tokens} to evaluate: it is read more than once", stacklevel=2)
    token_bytes = torch.from_numpy(np.load(tok_dir / "token_bytes.npy").astype(np.int64)).to(device)
    per_batch = batch_size * seq_len
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    total_nats = torch.zeros((), dtype=torch.float64, device=device)
    total_bytes = torch.zeros((), dtype=torch.int64, device=device)
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    loader = PackedLoader(tok_dir, "val", batch_size, seq_len, device=device, shuffle=False, prefetch=2)
    try:
        with torch.no_grad(), autocast:
            left = eval_tokens
            while left > 0:
                x, y = next(loader)
                loss = model(x, targets=y, reduction="none").float().reshape(batch_size, seq_len)
                nbytes = token_bytes[y]
                if left < per_batch:  # count only the first `left` targets of this batch
                    keep = torch.arange(per_batch, device=device).view(batch_size, seq_len) < left
                    nbytes = nbytes * keep
                # where(), not a product: a masked-out inf/nan loss must not poison the sum
                total_nats += torch.where(nbytes > 0, loss, 0.0).sum(dtype=torch.float64)
                total_bytes += nbytes.sum()
                left -= min(left, per_batch)
    finally:
        loader.close()
        if hasattr(model, "train"):
            model.train(was_training)
    nats, nbytes = total_nats.item(), int(total_bytes.item())
    if nbytes == 0:
        raise ValueError(f"the {eval_tokens} evaluated targets stand for no bytes; evaluate more tokens")
    bpb = nats / (math.log(2) * nbytes)
    if record_path is not None:
        write_record(Path(record_path), {
            "val_bpb": bpb if math.isfinite(bpb) else None, "eval_tokens": eval_tokens, "eval_bytes": nbytes,
            "dataset": dataset or tok_dir.parent.name, "seq_len": seq_len, "pid": os.getpid(),
            "written_at": time.time(),
        })
    return bpb


def write_record(path: Path, record: dict) -> None:
    """Write the record as JSON through a temporary file in the same folder and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_record(path: Path) -> dict:
    return json.loads(Path(path).read_text())
