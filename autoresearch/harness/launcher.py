"""Start a training run before its turn on a shared GPU, with nothing of the proposal running early.

    python -I -B -m autoresearch.harness.launcher GO_FD SCRIPT

runs inside the sandbox, in the run's workspace, as the training command's stand-in when two slots take turns on
one GPU (executors/local.py). Before its turn it does only trusted work that every run repeats — the
interpreter's start, importing torch and the harness, creating the CUDA context — and then blocks on GO_FD.
It says READY on stdout when that is done; the runner then waits for the GPU and writes `go` there when the
GPU is the run's: only then does SCRIPT run (as `python SCRIPT` would run it), and only then does ar's clock
start (the training window itself opens with the first batch of ar's feed, harness/feed.py). So a proposal cannot
move compute before its clock (it is not loaded until then), and the next run's start-up overlaps the current
one's training instead of following it. `-I` keeps the workspace off sys.path until SCRIPT runs, so a
proposal's tree cannot replace this module or what it imports.
"""

from __future__ import annotations

import os
import runpy
import sys


def warm() -> None:
    """What every run would do first anyway; none of it depends on the proposal."""
    import numpy  # noqa: F401
    import torch

    from . import checkpoint, data, env, gpus, loader, logfmt, tokenizer  # noqa: F401
    try:
        import torch._dynamo  # noqa: F401        # torch.compile's front end: a second or more to import
        import torch._inductor.compile_fx  # noqa: F401
    except Exception:  # an older torch or a CPU-only build: nothing to warm
        pass
    if torch.cuda.is_available():
        torch.cuda.init()
        x = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
        (x @ x).sum().item()                     # cuBLAS's handle and workspace
        del x


READY = "[ar] launcher ready"        # said once the trusted start-up is done: the runner then waits for the GPU


def wait_for_go(fd: int) -> str | None:
    """The runner's message ('go'), or None when it closed the pipe (the run is called off)."""
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = os.read(fd, 256)
        if not chunk:
            return None
        buf += chunk
    os.close(fd)
    return buf.decode().strip()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[0].isdigit():
        print("usage: python -I -B -m autoresearch.harness.launcher GO_FD SCRIPT", file=sys.stderr)
        return 2
    fd, script = int(argv[0]), argv[1]
    warm()
    print(READY, flush=True)
    message = wait_for_go(fd)
    if message is None or not message.startswith("go"):
        return 0                                  # called off before its turn: nothing of the proposal ran
    script_dir = os.path.dirname(os.path.abspath(script))
    sys.path.insert(0, script_dir)               # as `python SCRIPT` would have it
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
