"""
train.py — the one file an experiment edits.

A small GPT (RMSNorm, rotary embeddings, QK-norm, ReLU² MLP, value embeddings, logit softcap) trained with
Muon (Polar-Express orthogonalisation) for the block matrices and AdamW for the rest, under bf16 autocast,
for a time budget the runner sets, then saves a checkpoint. The harness (autoresearch.harness) owns the data, the
tokenizer, the dataloader and the GPU table; the runner owns the clock and scores the checkpoint in its own
evaluator (`model_from_config` below is how it rebuilds the model). Nothing this file prints is a result.

Run directly:  python train.py      (AR_TIME_BUDGET, AR_DATASET, … are set by `ar run`; defaults work too)
"""

# =============================================================================================
# Knobs — every setting an experiment may change. UPPER_CASE constants, one per line.
# =============================================================================================
DEPTH = 8                    # transformer blocks
ASPECT_RATIO = 64            # model width = DEPTH * ASPECT_RATIO (512 at depth 8)
HEAD_DIM = 128               # attention head size; heads = width // HEAD_DIM
WINDOW_PATTERN = "L"         # per layer, cycled: L = full causal, S = sliding window of half the sequence
VALUE_EMBEDS = True          # value embeddings added into V on alternating layers
SOFTCAP = 15.0               # logit softcap (tanh); 0 disables
TOTAL_BATCH_SIZE = 2**19     # tokens per optimizer step
DEVICE_BATCH_SIZE = "auto"   # rows per micro-step, or "auto" to fit the GPU's memory
LR_MULT = 1.0                # scales every learning rate below
MATRIX_LR = 0.04             # Muon, block matrices
EMBEDDING_LR = 0.6           # AdamW, token and value embeddings (scaled by width)
UNEMBEDDING_LR = 0.004       # AdamW, lm_head (scaled by width)
SCALAR_LR = 0.5              # AdamW, per-layer scalars and gates
WEIGHT_DECAY = 0.2           # Muon, decoupled
ADAM_BETAS = (0.8, 0.95)
WARMUP_RATIO = 0.0           # fraction of the budget spent ramping the LR up
WARMDOWN_RATIO = 0.5         # fraction of the budget spent decaying the LR to FINAL_LR_FRAC
FINAL_LR_FRAC = 0.0
COMPILE_MODEL = "auto"       # True / False / "auto" (off on consumer Blackwell, where it has been broken)
COMPILE_OPTIMIZER = "auto"   # compile the fused Muon update (CUDA only): True / False / "auto"
ATTENTION = "auto"           # "auto", "cudnn", "flash", "efficient", "fa3" (Hopper, if installed), "math"
FUSED_CE = "auto"            # loss a chunk of rows at a time (lm_head + softcap + cross-entropy): no full fp32 logits;
                             # True / False / "auto" (on CUDA only: a CPU step is about 12 % slower with it)
CE_CHUNK_ROWS = 32768        # tokens per chunk when FUSED_CE
BF16_RESIDUAL = True         # CUDA: residual stream in bf16, half the traffic of the norm / residual kernels
RELU2_KEEPS_OUTPUT = True    # ReLU² as one autograd op that keeps only its output for backward (relu = √out)

# CPU profile (no GPU): the same knobs drive a model about 1/64 the size, so every experiment still means
# something on a laptop: depth - CPU_DEPTH_OFFSET, batch / CPU_BATCH_DIVISOR, head size / 4.
CPU_DEPTH_OFFSET = 6
CPU_BATCH_DIVISOR = 64

# =============================================================================================
# Imports — nothing heavy happens at import: tests and `ar doctor --probe` import this file.
# =============================================================================================
import dataclasses
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from autoresearch.harness import logfmt
from autoresearch.harness.backend import resolve as resolve_backend
from autoresearch.harness.env import RunEnv
from autoresearch.harness.gpus import lookup as lookup_peak, mfu_percent

ATTENTION_BACKENDS = ("cudnn", "flash", "efficient", "fa3", "math")
_SDPA = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
         "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


class TrainFailure(Exception):
    """A run that must stop at once with a clear message and a non-zero exit."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# =============================================================================================
# Model
# =============================================================================================
@dataclass
class ModelConfig:
    vocab_size: int
    seq_len: int
    depth: int
    width: int
    head_dim: int
    window_pattern: str
    value_embeds: bool
    softcap: float

    @property
    def n_head(self) -> int:
        return self.width // self.head_dim

    def window(self, layer: int) -> int:
        """Attention span of a layer in tokens; the last layer always sees everything."""
        kind = self.window_pattern[layer % len(self.window_pattern)].upper()
        if kind == "S" and layer != self.depth - 1:
            return self.seq_len // 2
        return self.seq_len

    def has_value_embed(self, layer: int) -> bool:
        return self.value_embeds and layer % 2 == (self.depth - 1) % 2  # alternate, last layer included


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rotary(seq_len: int, head_dim: int, base: float = 10000.0, device=None):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return angles.cos()[None, None], angles.sin()[None, None]       # [1, 1, T, D/2]


def apply_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class LinearSoftcapCE(torch.autograd.Function):
    """Mean cross-entropy of softcap(x @ weight.T), a chunk of rows at a time. Each chunk's gradients are made
    in the forward pass (the loss is all that leaves it), so the [rows, vocab] logits and their fp32 softmax
    exist for one chunk only; backward scales the two stored gradients. Matmuls follow autocast, as lm_head's do."""

    @staticmethod
    def forward(ctx, x, weight, targets, softcap: float, chunk_rows: int):
        n, vocab = x.size(0), torch.arange(weight.size(0), device=x.device)
        loss, grad_x, grad_w = x.new_zeros((), dtype=torch.float32), [], torch.zeros_like(weight)
        for start in range(0, n, chunk_rows):
            xc, tc = x[start:start + chunk_rows], targets[start:start + chunk_rows]
            logits = F.linear(xc, weight)
            z = logits.float()
            if softcap:
                t = torch.tanh(z / softcap)
                z = softcap * t
            lse = torch.logsumexp(z, dim=-1)
            loss = loss + (lse - z.gather(1, tc[:, None]).squeeze(1)).sum()
            g = (torch.exp(z - lse[:, None]) - (vocab == tc[:, None]).float()) / n   # d mean-loss / d z
            if softcap:
                g = g * (1 - t * t)
            g = g.to(logits.dtype)
            grad_x.append(g @ weight)
            grad_w += (g.mT @ xc).float()
        ctx.save_for_backward(torch.cat(grad_x).to(x.dtype), grad_w)
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_loss, grad_w * grad_loss, None, None, None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.n_head, self.head_dim, self.window = cfg.n_head, cfg.head_dim, cfg.window(layer)
        self.full = self.window >= cfg.seq_len
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)
        # value-embedding gate: a per-head mix in (0, 2), 1 at init
        self.ve_gate = nn.Linear(32, self.n_head, bias=False) if cfg.has_value_embed(layer) else None
        self.fa3 = None                       # set by GPT.set_attention when ATTENTION == "fa3"
        self.window_fn = None                 # flex-attention kernel for sliding-window layers on CUDA

    def forward(self, x, ve, cos, sin):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).unbind(2)   # [B, T, H, D]
        if self.ve_gate is not None:
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :32]))                      # [B, T, H]
            v = v + gate.unsqueeze(-1) * ve.view(B, T, self.n_head, self.head_dim)
        q, k = q.transpose(1, 2), k.transpose(1, 2)                                  # [B, H, T, D]
        q, k = norm(apply_rotary(q, cos, sin)), norm(apply_rotary(k, cos, sin))
        v = v.transpose(1, 2)
        if self.fa3 is not None:
            window = (-1, -1) if self.full else (self.window - 1, 0)
            y = self.fa3(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, window_size=window)
            y = y[0] if isinstance(y, tuple) else y
            y = y.reshape(B, T, C)
        else:
            if self.full:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            elif self.window_fn is not None:
                y = self.window_fn(q, k, v)
            else:  # CPU: an explicit banded mask (the only sliding-window path there; said once at start)
                i = torch.arange(T, device=x.device)
                mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            y = y.transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width, bias=False)
        self.proj = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        if RELU2_KEEPS_OUTPUT:
            return self.proj(ReluSquare.apply(self.fc(x)))
        return self.proj(F.relu(self.fc(x)).square())


class ReluSquare(torch.autograd.Function):
    """relu(x)², keeping for backward only its output, which proj's backward keeps anyway (the gradient is
    2·√out·grad). The compiled default writes and keeps relu(x) as well: one 4×width tensor per layer more."""

    @staticmethod
    def forward(ctx, x):
        out = F.relu(x).square()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return 2 * out.sqrt() * grad


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn = Attention(cfg, layer)
        self.mlp = MLP(cfg.width)

    def forward(self, x, ve, cos, sin):
        x = x + self.attn(norm(x), ve, cos, sin)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.depth))
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(cfg.vocab_size, cfg.width)
                                           for i in range(cfg.depth) if cfg.has_value_embed(i)})
        self.lm_head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        # per-layer residual scale and a skip from the embedding (x0), learned
        self.resid_lambdas = nn.Parameter(torch.ones(cfg.depth))
        self.x0_lambdas = nn.Parameter(torch.zeros(cfg.depth))
        cos, sin = rotary(cfg.seq_len, cfg.head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self):
        bound = 3**0.5 * self.cfg.width**-0.5
        nn.init.normal_(self.wte.weight, std=1.0)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        for ve in self.value_embeds.values():
            nn.init.uniform_(ve.weight, -bound, bound)
        for block in self.blocks:
            nn.init.uniform_(block.attn.qkv.weight, -bound, bound)
            nn.init.uniform_(block.mlp.fc.weight, -bound, bound)
            nn.init.zeros_(block.attn.proj.weight)       # every block starts as the identity
            nn.init.zeros_(block.mlp.proj.weight)
            if block.attn.ve_gate is not None:
                nn.init.zeros_(block.attn.ve_gate.weight)
        self.resid_lambdas.fill_(1.0)
        self.x0_lambdas.fill_(0.0)

    def forward(self, idx, targets=None, reduction="mean"):
        T = idx.size(1)
        cos, sin = self.cos[:, :, :T], self.sin[:, :, :T]
        x = x0 = norm(self.wte(idx))
        if BF16_RESIDUAL and x.is_cuda:
            x = x0 = x.bfloat16()                # every block's output is bf16 under autocast anyway
        for i, block in enumerate(self.blocks):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx) if str(i) in self.value_embeds else None
            x = block(x, ve, cos, sin)
        fused = FUSED_CE is True or (FUSED_CE == "auto" and x.is_cuda)
        if fused and targets is not None and reduction == "mean" and torch.is_grad_enabled():
            return LinearSoftcapCE.apply(norm(x).flatten(0, 1), self.lm_head.weight, targets.reshape(-1),
                                         self.cfg.softcap, CE_CHUNK_ROWS)
        logits = self.lm_head(norm(x)).float()
        if self.cfg.softcap:
            logits = self.cfg.softcap * torch.tanh(logits / self.cfg.softcap)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction)
        return loss.view_as(targets) if reduction == "none" else loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 × matmul weights (embedding lookups excluded) + 12 × width × span per
        layer for the attention scores — the usual convention (no discount for the causal mask), so MFU here
        compares directly with upstream's figures."""
        lookup = self.wte.weight.numel() + sum(e.weight.numel() for e in self.value_embeds.values())
        dense = 6 * (self.num_params() - lookup)
        attn = sum(12 * self.cfg.width * self.cfg.window(i) for i in range(self.cfg.depth))
        return float(dense + attn)

    def set_attention(self, backend: str, device_type: str):
        """Wire the attention kernels. Sliding-window layers never fall silently onto the math path."""
        fa3 = None
        if backend == "fa3":
            try:
                from flash_attn_interface import flash_attn_func as fa3  # FlashAttention-3 (Hopper)
            except ImportError:
                raise TrainFailure("ATTENTION='fa3' needs the flash_attn_interface package (FlashAttention-3, "
                                   "Hopper only); set ATTENTION = \"auto\"") from None
        for block in self.blocks:
            a = block.attn
            a.fa3 = fa3
            if not a.full and fa3 is None and device_type == "cuda":
                a.window_fn = sliding_window_kernel(self.cfg.seq_len, a.window)


def model_from_config(config: dict) -> GPT:
    """How the evaluator rebuilds this model from a checkpoint (weights are loaded after): forward(idx) -> logits."""
    model = GPT(ModelConfig(**config))
    model.init_weights()
    return model


def sliding_window_kernel(seq_len: int, window: int):
    """A compiled FlexAttention kernel with a block-sparse causal band (fused, not the math path)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def band(b, h, q, kv):
        return (kv <= q) & (q - kv < window)

    mask = create_block_mask(band, None, None, seq_len, seq_len, device="cuda")
    kernel = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: kernel(q, k, v, block_mask=mask)


# =============================================================================================
# Optimizer: Muon (Polar Express) for block matrices, AdamW for everything else
# =============================================================================================
# Polar Express coefficients for 5 iterations (Amsel et al., 2025, arXiv:2505.16932).
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def orthogonalize(g):
    """Approximate the polar factor U V^T of each matrix in a stack [N, rows, cols], in bf16."""
    x = g.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    for a, b, c in POLAR_EXPRESS:
        s = x @ x.mT
        x = a * x + (b * s + c * (s @ s)) @ x
    return x.mT if tall else x


def muon_update(params, grads, momentum_buf, momentum, lr, wd):
    """Nesterov momentum, orthogonalised update, decoupled weight decay — on a stack of same-shape matrices.
    momentum, lr and wd are 0-D CPU tensors so that new values never trigger a recompile."""
    momentum_buf.lerp_(grads, 1 - momentum)
    update = orthogonalize(grads.lerp(momentum_buf, momentum))
    scale = max(1.0, params.size(-2) / params.size(-1)) ** 0.5
    params.mul_(1 - lr * wd)
    params.sub_(update.to(params.dtype) * (lr * scale))


class MuonAdamW:
    """Muon on the stacked block matrices (one fused update per shape), torch AdamW (fused on CUDA) on the rest."""

    def __init__(self, model: GPT, *, lr_mult: float, compile_update: bool):
        width_scale = (model.cfg.width / 768) ** -0.5      # AdamW LRs were tuned at width 768
        matrices = [p for b in model.blocks for n, p in b.named_parameters() if p.ndim == 2 and "ve_gate" not in n]
        gates = [b.attn.ve_gate.weight for b in model.blocks if b.attn.ve_gate is not None]
        groups = [
            dict(params=[model.wte.weight, *[e.weight for e in model.value_embeds.values()]],
                 lr=EMBEDDING_LR * width_scale),
            dict(params=[model.lm_head.weight], lr=UNEMBEDDING_LR * width_scale),
            dict(params=[model.resid_lambdas, model.x0_lambdas, *gates], lr=SCALAR_LR),
        ]
        for g in groups:
            g["lr"] *= lr_mult
            g["base_lr"] = g["lr"]
        cuda = model.wte.weight.is_cuda
        self.adam = torch.optim.AdamW(groups, betas=ADAM_BETAS, eps=1e-10, weight_decay=0.0,
                                      fused=cuda, foreach=None if cuda else True)
        self.shapes: dict[tuple, list[nn.Parameter]] = {}
        for p in matrices:
            self.shapes.setdefault(tuple(p.shape), []).append(p)
        self.buffers = {s: torch.zeros(len(ps), *s, device=ps[0].device) for s, ps in self.shapes.items()}
        self.matrix_lr = MATRIX_LR * lr_mult
        self.hyper = {k: torch.tensor(0.0) for k in ("momentum", "lr", "wd")}
        self.update = torch.compile(muon_update, dynamic=False) if compile_update else muon_update

    def step(self, lr_scale: float, momentum: float):
        for g in self.adam.param_groups:
            g["lr"] = g["base_lr"] * lr_scale
        self.adam.step()
        h = self.hyper
        h["momentum"].fill_(momentum), h["lr"].fill_(self.matrix_lr * lr_scale), h["wd"].fill_(WEIGHT_DECAY)
        for shape, params in self.shapes.items():
            stacked = torch.stack([p.data for p in params])
            grads = torch.stack([p.grad for p in params])
            self.update(stacked, grads, self.buffers[shape], h["momentum"], h["lr"], h["wd"])
            torch._foreach_copy_([p.data for p in params], list(stacked.unbind(0)))

    def reset(self):
        """Forget every step taken (after the compile warm-up): moments and momentum buffers start again."""
        self.adam.state.clear()
        for buf in self.buffers.values():
            buf.zero_()

    def zero_grad(self):
        self.adam.zero_grad(set_to_none=True)
        for params in self.shapes.values():
            for p in params:
                p.grad = None


def step_fits(durations: list[float], left: float) -> bool:
    """Whether one more step ends within the `left` seconds of the window: a step takes the median of the last
    five; the first, with its one-time costs, is the estimate only until there is another."""
    recent = durations[max(1, len(durations) - 5):] or durations[:1]
    return not recent or sorted(recent)[len(recent) // 2] <= left


def lr_scale(progress: float) -> float:
    if progress < WARMUP_RATIO:
        return (progress + 1e-8) / WARMUP_RATIO
    if progress <= 1 - WARMDOWN_RATIO:
        return 1.0
    cooldown = (1 - progress) / WARMDOWN_RATIO
    return cooldown + (1 - cooldown) * FINAL_LR_FRAC


def muon_momentum(step: int) -> float:
    return 0.85 + 0.10 * min(step / 300, 1.0)


# =============================================================================================
# Setup
# =============================================================================================
def sizes_for(profile_name: str) -> dict:
    """The knobs as this profile uses them (the CPU profile scales the same knobs down)."""
    s = dict(depth=DEPTH, head_dim=HEAD_DIM, total_batch=TOTAL_BATCH_SIZE, device_batch=DEVICE_BATCH_SIZE)
    if profile_name == "cpu":
        s["depth"] = max(1, DEPTH - CPU_DEPTH_OFFSET)
        s["head_dim"] = max(8, HEAD_DIM // 4)
        s["total_batch"] = max(1, TOTAL_BATCH_SIZE // CPU_BATCH_DIVISOR)
        if DEVICE_BATCH_SIZE != "auto":
            s["device_batch"] = max(1, int(DEVICE_BATCH_SIZE) // 8)
    return s


def make_config(vocab_size: int, seq_len: int, profile_name: str) -> ModelConfig:
    s = sizes_for(profile_name)
    width = s["depth"] * ASPECT_RATIO
    if width % s["head_dim"]:
        raise TrainFailure(f"model width {width} (DEPTH × ASPECT_RATIO) is not a multiple of HEAD_DIM "
                           f"{s['head_dim']}; change ASPECT_RATIO or HEAD_DIM", 1)
    if any(c not in "SLsl" for c in WINDOW_PATTERN) or not WINDOW_PATTERN:
        raise TrainFailure(f"WINDOW_PATTERN {WINDOW_PATTERN!r} may only hold S and L", 1)
    return ModelConfig(vocab_size, seq_len, s["depth"], width, s["head_dim"], WINDOW_PATTERN,
                       bool(VALUE_EMBEDS), float(SOFTCAP))


def build_model(cfg: ModelConfig, device) -> GPT:
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    cos, sin = rotary(cfg.seq_len, cfg.head_dim, device=device)
    model.cos, model.sin = cos, sin
    model.init_weights()
    return model


def autocast(device_type: str):
    return torch.autocast(device_type, dtype=torch.bfloat16) if device_type == "cuda" else nullcontext()


def attention_context(backend: str):
    return sdpa_kernel([_SDPA[backend]]) if backend in _SDPA else nullcontext()


def fit_device_batch(model: GPT, rows_per_step: int, seq_len: int, backend: str, limit_bytes: int) -> int:
    """Largest power-of-two micro-batch dividing the step that fits: measured on two eager steps (eager
    uses more memory than compiled, so the estimate errs on the safe side), plus optimizer state."""
    def peak(rows):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        x = torch.randint(0, model.cfg.vocab_size, (rows, seq_len), device="cuda")
        with autocast("cuda"), attention_context(backend):
            model(x, x).backward()
        model.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated()

    p2, p4 = peak(2), peak(4)
    per_row = max(1, (p4 - p2) / 2)
    fixed = p2 - 2 * per_row + 3 * 4 * model.num_params()          # + grads, momentum, Adam moments
    rows = 1
    while rows * 2 <= rows_per_step and rows_per_step % (rows * 2) == 0 and fixed + rows * 2 * per_row <= 0.85 * limit_bytes:
        rows *= 2
    return rows


def setup_device(env: RunEnv):
    if not torch.cuda.is_available():
        # OMP_NUM_THREADS, when set, caps the threads (a shared machine); else every core
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)
        return torch.device("cpu"), "cpu", None
    device = torch.device("cuda")
    # AOTAutograd's compile cache skips a graph holding an autograd.Function unless told it is safe; ours are plain
    # tensor code, and without this every warm start traces the model's joint graph again (seconds, GPU idle)
    import torch._functorch.config as functorch_config
    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):
        functorch_config.autograd_cache_allow_custom_autograd_functions = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    total = torch.cuda.get_device_properties(0).total_memory
    limit = total
    if env.gpu_memory_gb:
        limit = min(total, int(env.gpu_memory_gb * 2**30))
        torch.cuda.set_per_process_memory_fraction(limit / total)
    return device, torch.cuda.get_device_name(0), limit


# =============================================================================================
# Training
# =============================================================================================
def train(env: RunEnv, t_start: float) -> dict:
    from autoresearch.harness import checkpoint
    from autoresearch.harness.data import check_prepared
    from autoresearch.harness.loader import PackedLoader, WindowClosed
    from autoresearch.harness.tokenizer import Tokenizer

    if FUSED_CE not in (True, False, "auto"):
        raise TrainFailure(f'FUSED_CE = {FUSED_CE!r}: use True, False or "auto" (on CUDA only)', 1)
    torch.manual_seed(env.seed)
    device, gpu_name, mem_limit = setup_device(env)
    seq_len = env.profile.seq_len
    tok_dir = env.tok_dir or check_prepared(env.cache, env.dataset, env.profile.vocab_size)
    vocab = Tokenizer.load(tok_dir).vocab_size
    cfg = make_config(vocab, seq_len, env.profile.name)
    model = build_model(cfg, device)

    # "auto" knobs come from `ar doctor --probe`'s measured choice for this GPU and torch, else safe defaults
    choice = resolve_backend(ATTENTION, COMPILE_MODEL, DEVICE_BATCH_SIZE, device_name=gpu_name, cache=env.cache,
                             compile_optimizer=COMPILE_OPTIMIZER, seq_len=seq_len)
    attention, compile_model = choice["attention"], bool(choice["compile_model"]) and device.type == "cuda"
    compile_optimizer = bool(choice["compile_optimizer"]) and device.type == "cuda"
    if device.type == "cpu":
        attention = "math" if ATTENTION == "auto" else attention
        if "S" in WINDOW_PATTERN.upper():
            print("note: CPU run: sliding-window layers use an explicit mask on the math path", flush=True)
    model.set_attention(attention, device.type)

    sizes = sizes_for(env.profile.name)
    total_batch, rows_per_step = sizes["total_batch"], sizes["total_batch"] // seq_len
    if total_batch % seq_len or rows_per_step == 0:
        raise TrainFailure(f"TOTAL_BATCH_SIZE {TOTAL_BATCH_SIZE} is not a multiple of the sequence length "
                           f"{seq_len}; use a power of two ≥ {seq_len}", 1)
    device_batch = sizes["device_batch"]
    if device_batch == "auto" and choice["source"]["device_batch"] == "probe" and device.type == "cuda":
        device_batch = choice["device_batch"]
        while rows_per_step % device_batch:       # the probe measured one size; keep a divisor of this step
            device_batch //= 2
    if device_batch == "auto":
        device_batch = (fit_device_batch(model, rows_per_step, seq_len, attention, mem_limit)
                        if device.type == "cuda" else min(rows_per_step, 16))
    device_batch = int(device_batch)
    if rows_per_step % device_batch:
        raise TrainFailure(f"DEVICE_BATCH_SIZE × sequence ({device_batch} × {seq_len}) does not divide "
                           f"TOTAL_BATCH_SIZE ({total_batch}); make DEVICE_BATCH_SIZE a divisor of "
                           f"{rows_per_step} or set it to \"auto\"", 1)
    accum = rows_per_step // device_batch

    peak = lookup_peak(gpu_name, override=env.peak_tflops) if device.type == "cuda" else None
    if peak is not None and peak.warning:
        print(f"warning: {peak.warning}", flush=True)
    peak_tflops = peak.tflops if peak is not None else None
    flops_per_token = model.flops_per_token()
    print(f"model: depth {cfg.depth}, width {cfg.width}, heads {cfg.n_head}, params {model.num_params() / 1e6:.1f}M | "
          f"batch {total_batch} tokens = {accum} × {device_batch} × {seq_len} | attention {attention} "
          f"({choice['source']['attention']}) | compile model {compile_model}, optimizer {compile_optimizer} | "
          f"device {gpu_name}", flush=True)

    optimizer = MuonAdamW(model, lr_mult=LR_MULT, compile_update=compile_optimizer)
    step_model = torch.compile(model, dynamic=False) if compile_model else model
    if compile_model or compile_optimizer:
        warm_up(model, step_model, optimizer, env.untimed_steps if env.untimed_steps is not None else 3,
                device_batch, seq_len, cfg.vocab_size, attention, device)
    # under ar the window opens with the first batch the loader asks for, and closes at ar's deadline
    loader = PackedLoader(tok_dir, "train", device_batch, seq_len, device=device, seed=env.seed, served=env.data_fd)

    step, training_time, progress, tokens, durations = 0, 0.0, 0.0, 0, []
    try:
        while progress < 1.0:
            # ar's window ends at its deadline and only saving may follow it: no step that would end past it
            if not step_fits(durations, loader.deadline - time.time() if loader.deadline is not None else math.inf):
                break
            t0 = time.time()
            for _ in range(accum):
                x, y = next(loader)                        # WindowClosed: the step in progress is dropped
                with autocast(device.type), attention_context(attention):
                    loss = step_model(x, y)
                (loss / accum).backward()
            optimizer.step(lr_scale(progress), muon_momentum(step))
            optimizer.zero_grad()
            loss_value = loss.item()                       # also the per-step sync for honest timing
            if step == 0 and loader.window_start:          # a first batch that waited for the GPU's turn: the
                t0 = max(t0, loader.window_start)          # wait came before ar's window and is not training
            dt = time.time() - t0
            if not math.isfinite(loss_value) or loss_value > 100:
                raise TrainFailure(f"loss is {loss_value} at step {step}: training diverged; lower LR_MULT "
                                   f"or the learning rates", 2)
            step += 1
            tokens += total_batch
            training_time += dt
            durations.append(dt)
            progress = env.progress(training_time, loader.deadline)
            tps = total_batch / dt
            print(logfmt.format_step(step, 100 * progress, loss_value, tps,
                                     mfu_percent(tps, flops_per_token, peak_tflops), dt,
                                     env.time_budget * (1 - progress)), flush=True)
    except WindowClosed:
        pass
    except torch.cuda.OutOfMemoryError:
        raise TrainFailure(f"out of memory at step {step} with DEVICE_BATCH_SIZE={device_batch}; lower "
                           f"DEVICE_BATCH_SIZE (or set it to \"auto\")", 3) from None
    finally:
        loader.close()

    checkpoint.save(env.checkpoint_dir, factory="model_from_config", config=dataclasses.asdict(cfg), model=model)
    steady_tps = tokens / training_time if training_time > 0 else None
    return dict(
        training_seconds=training_time, total_seconds=time.time() - t_start,
        peak_vram_mb=torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
        mfu_percent=mfu_percent(steady_tps, flops_per_token, peak_tflops),
        total_tokens_M=tokens / 1e6, num_steps=step, num_params_M=model.num_params() / 1e6,
        depth=cfg.depth, gpu=gpu_name, peak_tflops=peak_tflops,
    )


def warm_up(model, step_model, optimizer, steps: int, device_batch: int, seq_len: int, vocab: int, attention: str,
            device) -> None:
    """Compile (and let autotuning settle) on random tokens before the first real batch: the window opens with
    that batch, so compiling costs the run no training. The weights and the optimizer's state are put back."""
    if steps <= 0:
        return
    saved = [p.detach().clone() for p in model.parameters()]
    # laid out as the loader's batches are (x and y side by side in one buffer): the same strides, so the
    # compiled graph is the one the real steps use (a sliced row would compile a second one in the window)
    buf = torch.randint(0, vocab, (2, device_batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    x, y = buf[0], buf[1]
    for _ in range(steps):
        with autocast(device.type), attention_context(attention):
            loss = step_model(x, y)
        loss.backward()
        optimizer.step(0.0, muon_momentum(0))
        optimizer.zero_grad()
    loss.item()
    with torch.no_grad():
        torch._foreach_copy_(list(model.parameters()), saved)
    optimizer.reset()


def probe_step(*, attention: str, compile_model: bool, compile_optimizer: bool, device_batch: int,
               steps: int = 6, seed: int = 0) -> dict:
    """A few training steps of the default model on fixed synthetic tokens, for `ar doctor --probe`."""
    result = dict(ok=False, error=None, losses=[], tokens_per_s=None, mfu=None, peak_vram_mb=None)
    try:
        env = RunEnv.from_environ()
        torch.manual_seed(seed)
        device, gpu_name, _ = setup_device(env)
        cfg = make_config(env.profile.vocab_size, env.profile.seq_len, env.profile.name)
        model = build_model(cfg, device)
        model.set_attention(attention, device.type)
        optimizer = MuonAdamW(model, lr_mult=LR_MULT, compile_update=compile_optimizer and device.type == "cuda")
        step_model = torch.compile(model, dynamic=False) if compile_model else model
        gen = torch.Generator().manual_seed(seed)
        data = torch.randint(0, cfg.vocab_size, (device_batch, cfg.seq_len + 1), generator=gen).to(device)
        times = []
        for i in range(steps):
            t0 = time.time()
            with autocast(device.type), attention_context(attention):
                loss = step_model(data[:, :-1], data[:, 1:])
            loss.backward()
            optimizer.step(1.0, muon_momentum(i))
            optimizer.zero_grad()
            result["losses"].append(loss.item())
            times.append(time.time() - t0)
        steady = sorted(times[2:]) or times
        tps = device_batch * cfg.seq_len / steady[len(steady) // 2]
        peak = lookup_peak(gpu_name, override=env.peak_tflops) if device.type == "cuda" else None
        result.update(ok=all(math.isfinite(v) for v in result["losses"]), tokens_per_s=tps,
                      mfu=mfu_percent(tps, model.flops_per_token(), peak.tflops if peak else None),
                      peak_vram_mb=torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None)
    except Exception as e:  # the probe reports every failure as data; the caller decides
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return result


def main() -> int:
    t_start = time.time()
    try:
        env = RunEnv.from_environ()
        summary = train(env, t_start)
    except TrainFailure as e:
        print(f"{logfmt.FAIL_PREFIX} {e}", flush=True)
        return e.code
    except (ValueError, OSError) as e:     # bad environment, missing data: one line, no traceback
        print(f"{logfmt.FAIL_PREFIX} {e}", flush=True)
        return 1
    except Exception as e:
        if type(e).__name__ in ("DataError", "ArError", "ConfigError"):
            print(f"{logfmt.FAIL_PREFIX} {e}", flush=True)
            return 1
        raise
    print(logfmt.format_summary(**summary), flush=True)
    if env.tok_dir is None:   # run by hand (ar always passes its training view): no score here, say where it is
        print(f"to score it: `ar eval {env.checkpoint_dir}` (the trusted evaluator), or `ar try` to train this tree "
              "the way ar does and compare it with the best", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)      # everything is written: skip the teardown of torch and CUDA (seconds on a GPU)
