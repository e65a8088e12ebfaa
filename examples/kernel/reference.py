"""The reference: softcapped cross-entropy per row, in float64. Only the gate and the timing harness read
this file; the candidate's process cannot (the worker runs in a sandbox that sees kernel.py, worker.py and
inputs.py only)."""

import torch


def softcap_ce(logits: torch.Tensor, targets: torch.Tensor, cap: float) -> torch.Tensor:
    z = cap * torch.tanh(logits.double() / cap)
    return torch.logsumexp(z, dim=-1) - z.gather(1, targets[:, None]).squeeze(1)


def close(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """Whether out matches the reference (float32 accuracy of a float32 computation), and the worst error."""
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return False, float("inf")
    err = (out.double() - ref).abs()
    return bool((err <= 1e-3 + 1e-3 * ref.abs()).all()), float(err.max()) if err.numel() else 0.0
