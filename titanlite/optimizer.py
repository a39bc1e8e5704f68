"""AdamW and its learning-rate schedule: linear warm-up, then cosine (or linear) decay.

optimizer = build_optimizer(model_parts, cfg.optimizer)
scheduler = build_schedule(optimizer, cfg.scheduler, cfg.training.steps)
"""

import math

import torch


def build_optimizer(parts: list[torch.nn.Module], o, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW over this rank's model parts, as [optimizer] `o` says. Matrices decay; norm gains and
    other vectors do not (shrinking a gain towards zero regularises nothing and hurts). `fused`: one
    kernel for the whole step (CUDA). Parameters sharded over different meshes (expert parallel:
    the experts) go in groups of their own: one multi-tensor kernel cannot mix them. A module with
    an `after_optimizer_step` (an MoE router's balancing) is called after every step."""
    groups = {}
    for p in (p for part in parts for p in part.parameters()):
        # a DTensor's mesh dimensions (expert parallel: the experts'); None for a plain tensor
        mesh_dims = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None)
        groups.setdefault((p.dim() >= 2, mesh_dims), []).append(p)
    optimizer = torch.optim.AdamW(
        [
            {"params": params, "weight_decay": o.weight_decay if decays else 0.0}
            for (decays, _), params in sorted(groups.items(), key=lambda kv: not kv[0][0])
        ],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        fused=fused or None,
    )
    for module in (m for part in parts for m in part.modules()):
        if hasattr(module, "after_optimizer_step"):
            optimizer.register_step_post_hook(lambda *_, m=module: m.after_optimizer_step())
    return optimizer


def build_schedule(optimizer, scheduler, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """torch's LambdaLR over `optimizer`: the peak lr times `lr_lambda`'s factor at each step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(scheduler, total))


def lr_lambda(scheduler, total: int):
    """The factor on the peak lr after `step` optimizer steps, as [scheduler] says: linear warm-up
    over `warmup_steps`, then cosine/linear decay to min_lr_ratio·peak at step `total` (or constant)."""
    warmup, floor, decay = scheduler.warmup_steps, scheduler.min_lr_ratio, scheduler.decay

    def factor(step: int) -> float:  # step counts completed optimizer steps (0-based)
        if step < warmup:
            return (step + 1) / warmup
        if decay == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
        return floor + (1 - floor) * shape

    return factor
