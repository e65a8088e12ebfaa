"""The model side of an evaluation: untrusted code, run once, in the sandbox, never shown a target.

Runs in a child of the zygote (zygote.py), inside the sandbox, in a fresh process for every evaluation.

Maps the buffers first (trusted work only) and says "mapped", then waits for "go" (it may be started before
training ends); then loads the proposal's train file by path (not as __main__), builds the model with the
checkpoint's factory (on the GPU, there directly), loads its weights, says "ready" and answers the evaluator over
stdin/stdout, one line each way:
    evaluator: "run N"  -> the worker reads N rows of token ids from the shared input buffer, writes the logits
                           [N, T, V] into the shared output buffer, answers "ok" (or "err MESSAGE")
    evaluator: "exit"
The buffers are files in JOB_DIR on the CPU (the evaluator's), and on a GPU CUDA IPC handles in JOB_DIR/ipc.pkl
(the buffers of a trusted buffer owner of this worker's own, zygote.owner, which the evaluator maps too).
Anything the proposal prints goes to stderr (the evaluation log), never into the protocol.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import sys
import traceback
from pathlib import Path


def _load_module(path: Path):
    spec = importlib.util.spec_from_file_location("ar_proposal", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ar_proposal"] = module
    spec.loader.exec_module(module)
    return module


def main(job_dir: str) -> int:
    """Serve one evaluation on stdin/stdout (set up by the zygote: FIFOs to the evaluator)."""
    import os
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                                 # the proposal's prints land in the log, not the protocol
    sys.stdout = sys.stderr

    def say(msg: str) -> None:
        proto.write(msg.replace("\n", " ")[:2000] + "\n")
        proto.flush()

    try:
        import torch
        from safetensors.torch import load_model

        from . import checkpoint
        # before "go", only trusted work: the job, the buffers, the CUDA context (a fresh worker does this while
        # the main one still runs; nothing of the proposal is loaded until "go")
        job = json.loads((Path(job_dir) / "job.json").read_text())
        B, T, V = job["rows"], job["seq_len"], job["vocab"]
        device = torch.device(job["device"])
        if job.get("transfer") == "ipc":
            try:
                fn, args = pickle.loads((Path(job_dir) / "ipc.pkl").read_bytes())
                inp, out = fn(*args[0]), fn(*args[1])
            except Exception as e:
                raise RuntimeError(f"CUDA IPC: {e}") from None
        else:
            inp = torch.from_file(str(Path(job_dir) / "in.bin"), shared=True, size=B * T, dtype=torch.int64)
            out = torch.from_file(str(Path(job_dir) / "out.bin"), shared=True, size=B * T * V, dtype=torch.float32)
        say("mapped")
        if sys.stdin.readline().strip() != "go":  # "go": the checkpoint is complete (and, for a fresh worker,
            return 0                              # the main one is gone)
        meta = checkpoint.read_meta(Path(job["checkpoint"]))
        source = Path(job["source"])
        sys.path.insert(0, str(source))
        module = _load_module(source / job["train_file"])
        factory = getattr(module, meta["factory"], None)
        if not callable(factory):
            raise ValueError(f"{job['train_file']} has no function {meta['factory']}() (named by the checkpoint)")
        with torch.device(device):                # built where it runs: no pass over the weights on the host
            model = factory(dict(meta["config"]))
        load_model(model, str(Path(job["checkpoint"]) / checkpoint.WEIGHTS), strict=True)
        model = model.to(device).eval()
        inp, out = inp.view(B, T), out.view(B, T, V)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
            "cpu", enabled=False)
    except Exception as e:
        traceback.print_exc()
        say(f"err could not load the model: {type(e).__name__}: {e}")
        return 1
    say("ready")
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            break
        try:
            n = int(cmd[1])
            with torch.no_grad(), autocast:
                logits = model(inp[:n].to(device))
            if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (n, T, V):
                shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
                raise ValueError(f"forward(idx) must return logits of shape {(n, T, V)}, not {shape}")
            out[:n].copy_(logits)
            if device.type == "cuda":
                torch.cuda.synchronize()
            say("ok")
        except Exception as e:
            traceback.print_exc()
            say(f"err {type(e).__name__}: {e}")
            return 1
    return 0


