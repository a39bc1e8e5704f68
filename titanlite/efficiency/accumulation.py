"""Gradient accumulation: a big batch as several small ones, with the same gradients.

As in torchtitan, token losses are summed and divided by the whole global batch's target tokens, not
each micro-batch's mean by k, so padding (`IGNORE_INDEX`) and ragged lengths weigh every token alike."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import TitanliteError

IGNORE_INDEX = -100  # targets with this id (padding) count neither in the loss nor the divisor


def resolve_batch(
    micro_batch: int, grad_accum_steps: int, global_batch: int | None, dp_degree: int = 1
) -> tuple[int, int, int]:
    """(micro_batch, grad_accum_steps, global_batch) from either setting; global = micro × steps × dp."""
    if grad_accum_steps < 1:
        raise TitanliteError(
            f"training.grad_accum_steps must be at least 1, got {grad_accum_steps}"
        )
    per_step = micro_batch * dp_degree
    if global_batch is None:
        return micro_batch, grad_accum_steps, per_step * grad_accum_steps
    if global_batch <= 0 or global_batch % per_step:
        raise TitanliteError(
            f"training.global_batch_size={global_batch} is not a positive multiple of batch_size × "
            f"data-parallel degree = {micro_batch} × {dp_degree} = {per_step}: choose a multiple "
            f"such as {per_step * max(1, round(max(global_batch, 1) / per_step))}, or change batch_size"
        )
    accum = global_batch // per_step
    if grad_accum_steps not in (1, accum):
        raise TitanliteError(
            f"training.grad_accum_steps={grad_accum_steps} contradicts global_batch_size="
            f"{global_batch} (which needs {accum} steps of {micro_batch} × {dp_degree}): "
            f"set only one of the two"
        )
    return micro_batch, accum, global_batch


def count_targets(targets: torch.Tensor) -> int:
    return int((targets != IGNORE_INDEX).sum())


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the real targets, in fp32 (a large vocabulary's log-sum-exp needs it)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def global_tokens_per_rank(
    micro_batches: list, dims, device, distributed: bool
) -> float | torch.Tensor:
    """Divisor of each micro-batch's summed loss: global target tokens / (dp × cp), as DDP and FSDP
    average gradients over the dp × cp ranks (a cp rank holds a part of each of its sequences)."""
    if distributed:
        # Counted on the device from its own copy of the labels and summed there: a tensor made from a
        # Python number would wait for the GPU every step. The tp × pp ranks of a slice each count it.
        local = sum((y != IGNORE_INDEX).sum() for _, y, *_ in micro_batches).float()
        dist.all_reduce(local)  # a sum over every rank (torch, not distributed/: that imports this)
        return local / dims.world_size
    local = getattr(micro_batches, "num_targets", None)  # counted on the host (data/transfer.py)
    return float(local if local is not None else sum(count_targets(b[1]) for b in micro_batches))
