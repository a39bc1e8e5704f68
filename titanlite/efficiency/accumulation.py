"""Gradient accumulation: a big batch as several small ones, with the same gradients.

    global batch = micro-batch × accumulation steps × data-parallel degree

Gradients add up across `backward()` calls, so running k micro-batches before one optimizer
step gives the gradient of their union — *if* each micro-batch's loss is scaled right. Dividing
each micro-batch's mean by k is only right when every micro-batch has the same number of
target tokens. torchtitan instead sums token losses and divides by the number of target tokens
in the whole global batch; then padding (`IGNORE_INDEX` targets) or ragged lengths cannot give
some tokens more weight than others.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import TitanliteError

IGNORE_INDEX = -100  # targets with this id (padding) count neither in the loss nor the divisor


def resolve_batch(micro_batch: int, grad_accum_steps: int, global_batch: int | None,
                  dp_degree: int = 1) -> tuple[int, int, int]:
    """(micro_batch, grad_accum_steps, global_batch) from either way of configuring it."""
    if grad_accum_steps < 1:
        raise TitanliteError(f"training.grad_accum_steps must be at least 1, got {grad_accum_steps}")
    per_step = micro_batch * dp_degree
    if global_batch is None:
        return micro_batch, grad_accum_steps, per_step * grad_accum_steps
    if global_batch <= 0 or global_batch % per_step:
        raise TitanliteError(
            f"training.global_batch_size={global_batch} is not a positive multiple of batch_size × "
            f"data-parallel degree = {micro_batch} × {dp_degree} = {per_step}: choose a multiple "
            f"such as {per_step * max(1, round(max(global_batch, 1) / per_step))}, or change batch_size")
    accum = global_batch // per_step
    if grad_accum_steps not in (1, accum):
        raise TitanliteError(
            f"training.grad_accum_steps={grad_accum_steps} contradicts global_batch_size={global_batch} "
            f"(which needs {accum} steps of {micro_batch} × {dp_degree}): set only one of the two")
    return micro_batch, accum, global_batch


def count_targets(targets: torch.Tensor) -> int:
    return int((targets != IGNORE_INDEX).sum())


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the real target tokens (fp32: the log-sum-exp over a large
    vocabulary loses digits in 16-bit)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")
