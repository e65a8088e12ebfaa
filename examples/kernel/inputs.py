"""The inputs of one call, made from a seed: the timing harness and the worker make the same ones, so the
worker's outputs can be checked against the reference without ever sending it the reference's answers.
Fixed harness code: a proposal may not change it (ar.yaml's allowed_paths is kernel.py only)."""

import torch


def make(seed: int, n: int, v: int, dtype: str, device: str):
    """(logits [n, v] in `dtype`, targets [n] int64, softcap). Logit scales vary by row so that the softcap
    matters: a kernel that skips it is wrong on the rows with large logits."""
    g = torch.Generator(device=device).manual_seed(seed)
    scale = torch.rand(n, 1, generator=g, device=device) * 40 + 0.5
    logits = (torch.randn(n, v, generator=g, device=device) * scale).to(getattr(torch, dtype))
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    cap = 15.0
    return logits, targets, cap
