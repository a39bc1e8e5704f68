"""AdamW and its learning-rate schedule: linear warm-up, then cosine (or linear) decay.

optimizer = build_optimizer(model_parts, cfg)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
"""

from __future__ import annotations

import math

import torch


def build_optimizer(
    parts: list[torch.nn.Module], cfg, fused: bool = False
) -> torch.optim.Optimizer:
    """AdamW over this rank's model parts. Matrices decay; norm gains and other vectors do not (shrinking
    a gain towards zero regularises nothing and hurts). `fused`: one kernel for the whole step (CUDA)."""
    params = [p for part in parts for p in part.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    o = cfg.optimizer
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": o.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        fused=fused or None,
    )


def lr_lambda(cfg):
    """The factor on the peak lr after `step` optimizer steps: linear warm-up over
    `scheduler.warmup_steps`, then cosine/linear decay to min_lr_ratio·peak (or constant)."""
    warmup, total = cfg.scheduler.warmup_steps, cfg.training.steps
    floor, decay = cfg.scheduler.min_lr_ratio, cfg.scheduler.decay

    def factor(step: int) -> float:  # step counts completed optimizer steps (0-based)
        if step < warmup:
            return (step + 1) / warmup
        if decay == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
        return floor + (1 - floor) * shape

    return factor
