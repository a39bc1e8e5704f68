"""Data parallelism from scratch: what `DistributedDataParallel` does, in plain Python.

    model = ScratchDataParallel(model, bucket_cap_mb=25)   # replicas now equal rank 0's
    loss_fn(model(x_local), y_local).backward()            # each rank: its own slice of data
    model.sync_gradients()                                 # average gradients over ranks
    optimizer.step()                                       # identical step on every rank

Every rank keeps a full copy of the model and sees a different slice of the global batch.
If the replicas start equal and every rank applies the *same* gradient — the mean of the
ranks' gradients, i.e. the gradient of the mean loss over the global batch — they stay equal
forever, without ever sending weights again. The only communication is one all-reduce of the
gradients per optimizer step.

Sending each parameter's gradient on its own would pay a collective's fixed latency once per
tensor (hundreds of tiny messages). So gradients are packed into flat *buckets* of about
`bucket_cap_mb` and each bucket is all-reduced as one message. Buckets are filled in reverse
parameter order, because backward produces the last layers' gradients first: that is what
lets torch's DDP start all-reducing a full bucket while backward is still computing the rest
(this teaching version waits for backward to finish, so it shows the buckets, not the overlap).
`test_comm_and_scratch_ddp.py` checks the gradients equal DDP's bit for bit at 2 ranks.

What torch's DDP does beyond this (all visible with `comm.CommCounter`): its first step uses
one bucket of everything, then it rebuilds the buckets in the order gradients really arrived
(two small broadcasts from rank 0, so all ranks agree); with `bucket_cap_mb` left at its
default the first bucket is only 1 MiB, so the first all-reduce starts early; and it
re-broadcasts rank 0's buffers before every forward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn


def allreduce_mean_(tensors, group=None) -> None:
    """Average each tensor over the ranks, in place: the unbucketed version, one collective
    per tensor. Dividing *before* summing (as DDP does) keeps fp16 sums from overflowing."""
    world = dist.get_world_size(group)
    for t in tensors:
        t.mul_(1.0 / world)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def assign_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters, in the order given, into buckets of about `cap_bytes`.

    DDP's rule (`dist._compute_bucket_assignment_by_size`): add a tensor, and close the bucket
    once it holds at least `cap_bytes`. So a bucket can exceed the cap by its last tensor, and a
    tensor bigger than the cap gets a bucket of its own. One flat buffer holds one dtype, so
    each dtype (and device) fills its own bucket.
    """
    buckets, open_buckets = [], {}
    for p in params:
        key = (p.dtype, p.device)
        bucket = open_buckets.setdefault(key, [])
        bucket.append(p)
        if sum(q.numel() * q.element_size() for q in bucket) >= cap_bytes:
            buckets.append(open_buckets.pop(key))
    return buckets + list(open_buckets.values())  # the last, partly filled ones


class ScratchDataParallel(nn.Module):
    """Wrap `module` for data parallelism over `process_group` (default: all ranks)."""

    def __init__(self, module: nn.Module, process_group=None, bucket_cap_mb: float = 25.0):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self._sync_enabled = True
        self._broadcast_from_first_rank()
        params = [p for p in module.parameters() if p.requires_grad]  # shared weights once
        # Reverse order: roughly the order backward finishes the gradients.
        self.buckets = assign_buckets(params[::-1], int(bucket_cap_mb * 2**20))

    @torch.no_grad()
    def _broadcast_from_first_rank(self) -> None:
        # Each rank may have initialised its own random weights; copying rank 0's parameters
        # and buffers everywhere makes the replicas start equal (DDP does this too). DDP also
        # re-broadcasts buffers before every forward (broadcast_buffers=True, for BatchNorm's
        # running statistics); a Llama's buffers are constant rotary tables, so once is enough.
        for t in [*self.module.parameters(), *self.module.buffers()]:
            dist.broadcast(t, group_src=0, group=self.process_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes in each bucket, in the order they are all-reduced."""
        return [sum(p.numel() * p.element_size() for p in b) for b in self.buckets]

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, `sync_gradients()` does nothing: gradients keep adding up locally in `.grad`.

        For gradient accumulation over k micro-batches, sync once after the last one. Averaging
        over ranks is linear, so the mean of the summed gradients is the sum of the per-micro-
        batch means: mean_r(Σ_k g[r,k]) = Σ_k mean_r(g[r,k]). Same gradient, k−1 fewer
        all-reduces (equal up to the rounding of a different summation order).
        """
        before, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = before

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Replace every gradient by its mean over the ranks: one all-reduce per bucket."""
        if not self._sync_enabled:
            return
        for bucket in self.buckets:
            # A parameter unused on this rank still takes part: other ranks may have a
            # gradient for it, and every rank must send buffers of the same size.
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])  # one contiguous message
            flat.mul_(1.0 / self.world_size)  # divide first, then sum: DDP's order
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
            offset = 0
            for p in bucket:
                averaged = flat[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = averaged.clone()
                else:
                    p.grad.copy_(averaged)
                offset += p.numel()
