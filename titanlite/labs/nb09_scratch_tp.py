"""Tensor parallelism from scratch: what `ColwiseParallel` + `RowwiseParallel` do to an MLP.

    mlp = ScratchParallelMLP(model.layers["0"].feed_forward, group)   # rank r: its slice
    y = mlp(x)                     # every rank: the whole input in, the whole output out

A SwiGLU MLP is down(silu(gate(x)) * up(x)). Its hidden units are independent of each other
until `down` adds them up, so n ranks can each keep h/n of them: rows of gate and up
(column-parallel: each rank computes its own columns of the hidden activation, no
communication) and the matching columns of down (row-parallel: each rank's product is a
*partial sum* of the output). One all-reduce adds the partial sums. Per rank, the weights and
the MLP's matmul work shrink n times; the price is that all-reduce, once per MLP per forward
(and one more, of the input's gradient, in backward).

Megatron-LM writes the two communication points as two autograd functions, conjugate to each
other: f (`CopyToTP`: identity forward, all-reduce backward) where the whole input enters the
parallel region, g (`ReduceFromTP`: all-reduce forward, identity backward) where it leaves.

What torch's `apply_tp` (tensor_parallel.py) does beyond this: the same split with DTensor
placements (Shard(0) for gate/up, Shard(1) for down), the attention split by heads, sequence
parallelism (the all-reduce becomes a reduce-scatter + all-gather pair so the norms work on
a slice of the sequence) and loss parallelism. Notebook 09 asserts this module's outputs and
gradients equal both the single-process MLP's and `apply_tp`'s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class CopyToTP(torch.autograd.Function):
    """Megatron's f: every rank uses the whole input (forward: identity); each rank's slice
    contributes part of the input's gradient, so backward adds them up (all-reduce)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # all_reduce works in place: leave autograd's buffer alone
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: forward adds the ranks' partial outputs (all-reduce); the sum's gradient
    with respect to each part is the whole gradient (backward: identity)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScratchParallelMLP(nn.Module):
    """A SwiGLU MLP split over the ranks by hand: rank r keeps hidden units
    [r·h/n, (r+1)·h/n) — those rows of gate/up (column-parallel) and those columns of down
    (row-parallel) — and the whole forward needs one all-reduce."""

    def __init__(self, full, group=None):
        super().__init__()
        self.group, n, r = group, dist.get_world_size(group), dist.get_rank(group)
        rows = slice(
            r * full.gate_proj.out_features // n, (r + 1) * full.gate_proj.out_features // n
        )
        take = lambda w: nn.Parameter(w.detach().clone())  # noqa: E731
        self.gate = take(full.gate_proj.weight[rows])
        self.up = take(full.up_proj.weight[rows])
        self.down = take(full.down_proj.weight[:, rows])

    def forward(self, x):
        x = CopyToTP.apply(x, self.group)
        hidden = torch.nn.functional.silu(x @ self.gate.T) * (x @ self.up.T)  # local units only
        return ReduceFromTP.apply(hidden @ self.down.T, self.group)  # partial sums → whole
