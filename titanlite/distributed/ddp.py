"""DDP: every rank holds the whole model; gradients are averaged with all-reduce.

    model = apply_ddp(model, dp_mesh, bucket_cap_mb=25)

torch's DistributedDataParallel does what `scratch_ddp.ScratchDataParallel` does by hand
(broadcast the weights once, all-reduce gradients after backward), plus two speed tricks:
gradients are packed into ~25 MB buckets (few large messages beat many small ones), and
a bucket's all-reduce starts the moment its last gradient is ready, overlapping the
communication with the rest of backward.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


def apply_ddp(model: nn.Module, mesh=None, *, bucket_cap_mb: float = 25.0,
              process_group=None) -> nn.Module:
    """Wrap the model in DistributedDataParallel over the mesh's (1-D) data-parallel group."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    group = process_group if process_group is not None else (mesh.get_group() if mesh is not None else None)
    import inspect
    device = next(model.parameters()).device
    # The only buffers are the RoPE tables, equal on every rank by construction: DDP would
    # otherwise re-broadcast them before every forward (torch >= 2.13 renamed the switch).
    no_buffer_sync = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                      else {"broadcast_buffers": False})
    return DDP(model, process_group=group, bucket_cap_mb=bucket_cap_mb,
               device_ids=[device] if device.type == "cuda" else None,
               # The model's parameters are all used every step: no need to search the
               # autograd graph for unused ones (which costs time).
               find_unused_parameters=False, **no_buffer_sync)


def grad_sync(model: nn.Module, sync: bool):
    """Context for one micro-batch's backward: communicate gradients only when `sync`.

    During gradient accumulation only the last micro-batch needs reduced gradients; the
    others just add into .grad locally. DDP: `no_sync()`. FSDP2: the gradients' reduce-scatter
    is switched off the same way, at the price of holding unsharded gradients until then.
    """
    if sync:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP (and ScratchDataParallel)
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (FSDP2 modifies the model in place: no wrapper)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
