"""Host → device: how a batch crosses over, and why only CUDA copies without waiting.

A non-blocking copy returns before the bytes have moved. On CUDA, from pinned (page-locked)
host memory, that lets the copy overlap the compute already queued, and torch's pinned-memory
allocator keeps the source alive until the copy is done. On MPS a non-blocking copy whose
source is freed before the copy runs reads freed memory: silently wrong batches, no error
(pytorch#189690). Fresh batches are freed at once, so everywhere but CUDA the copy blocks.
"""
from __future__ import annotations

import torch


def should_pin(device: torch.device | str) -> bool:
    """Pin the batch and copy it non-blocking: on CUDA only (see the module docstring)."""
    return torch.device(device).type == "cuda"


def to_device(batch: tuple[torch.Tensor, ...], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """`batch`'s tensors on `device`: pinned and non-blocking on CUDA, a plain (blocking) copy
    elsewhere (MPS, CPU, ...)."""
    device = torch.device(device)
    if should_pin(device):
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in batch)
    return tuple(t.to(device) for t in batch)
