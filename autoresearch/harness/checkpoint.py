"""The checkpoint: what a training run hands over, and the only thing of it that counts.

A checkpoint is a folder with two files:
    model.json           {"format": 1, "factory": NAME, "config": {...}}
    weights.safetensors  the model's tensors (safetensors: no pickle, so loading runs no code)
NAME is a top-level function of the proposal's train file: `NAME(config: dict) -> torch.nn.Module`, whose
`forward(idx)` maps token ids [B, T] to logits [B, T, vocab]. The trusted evaluator builds the model that way in
a sandboxed worker, loads the weights, and computes the loss itself from the logits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FORMAT = 1
MODEL_JSON = "model.json"
WEIGHTS = "weights.safetensors"


def save(folder: Path, *, factory: str, config: dict, model=None, arrays: dict | None = None) -> None:
    """Write a checkpoint: a torch `model`'s tensors, or plain numpy `arrays` (name -> array)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if model is not None:
        from safetensors.torch import save_model
        save_model(model, str(folder / WEIGHTS))
    else:
        from safetensors.numpy import save_file
        save_file(dict(arrays or {}), str(folder / WEIGHTS))
    tmp = folder / f".{MODEL_JSON}.tmp"
    tmp.write_text(json.dumps({"format": FORMAT, "factory": factory, "config": config}))
    os.replace(tmp, folder / MODEL_JSON)       # model.json last: its presence means the checkpoint is whole


def read_meta(folder: Path) -> dict:
    """model.json, checked; ValueError saying what is wrong."""
    f = Path(folder) / MODEL_JSON
    if not f.is_file() or not (Path(folder) / WEIGHTS).is_file():
        raise ValueError("the run wrote no checkpoint (train.py must save one with autoresearch.harness.checkpoint.save)")
    try:
        meta = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"the checkpoint's {MODEL_JSON} is unreadable: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("factory"), str) \
            or not meta["factory"].isidentifier() or not isinstance(meta.get("config"), dict):
        raise ValueError(f"the checkpoint's {MODEL_JSON} is not format {FORMAT} with a factory name and a config")
    return meta
