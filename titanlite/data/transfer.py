"""Host → device: how a batch crosses over, and why only CUDA copies without waiting.

On CUDA a non-blocking copy from pinned (page-locked) host memory overlaps the compute already queued,
and torch's pinned-memory allocator keeps the source alive until the copy is done. On MPS a non-blocking
copy whose source is freed before the copy runs reads freed memory: silently wrong batches, no error
(pytorch#189690). Fresh batches are freed at once, so everywhere but CUDA the copy blocks."""

import torch


def should_pin(device: torch.device | str) -> bool:
    """Pin the batch and copy it non-blocking: on CUDA only (see the module docstring)."""
    return torch.device(device).type == "cuda"


def to_device(
    batch: tuple[torch.Tensor, ...], device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    """`batch`'s tensors on `device`: pinned and non-blocking on CUDA, a plain (blocking) copy elsewhere."""
    if should_pin(device):
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in batch)
    return tuple(t.to(device) for t in batch)


class MicroBatches(list):
    """One optimizer step's (x, y) micro-batches on the device, and their target tokens,
    counted on the host before the copy (counting on the device would wait for it)."""

    num_targets: int | None = None


def micro_batches_to(
    batches: list[tuple[torch.Tensor, torch.Tensor]], device, ignore_index: int = -100
) -> MicroBatches:
    """`batches` on `device` (see `to_device`), with their real target tokens counted first."""
    on_device = MicroBatches(to_device(batch, device) for batch in batches)
    on_device.num_targets = host_target_count(batches, ignore_index)
    return on_device


def host_target_count(batches, ignore_index: int = -100) -> int:
    """The real target tokens of `batches`, counted on their host copies: nothing waits for the
    device (the one read in titanlite/data the host-sync counter lets pass, by name)."""
    count = 0
    for _, y, *_ in batches:  # a loop, not a generator: the counter names the function it read in
        count += int((y != ignore_index).sum())
    return count
