"""DDP: every rank holds the whole model; gradients are averaged with all-reduce.

    model = apply_ddp(model, dp_mesh, bucket_cap_mb=25)

Unlike `scratch_ddp.ScratchDataParallel`, gradients travel in ~25 MB buckets (few large messages beat
many small ones), each all-reduced as soon as it is complete, overlapping the rest of backward."""

import contextlib
import inspect

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(model: nn.Module, mesh=None, *, bucket_cap_mb: float = 25.0) -> nn.Module:
    """Wrap the model in DistributedDataParallel over the mesh's (1-D) data-parallel group (None:
    the default group, every rank)."""
    device = next(model.parameters()).device
    # The only buffers, the RoPE tables, are equal on every rank by construction: DDP would
    # otherwise re-broadcast them before every forward (torch >= 2.13 renamed the switch).
    buffer_switch = (
        "forward_sync_buffers"
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
        else "broadcast_buffers"
    )
    return DDP(
        model,
        # Not device_mesh=: on a slice of the whole mesh DDP would rewrite TP's DTensor weights
        process_group=mesh.get_group() if mesh is not None else None,
        bucket_cap_mb=bucket_cap_mb,
        device_ids=[device] if device.type == "cuda" else None,
        find_unused_parameters=False,
        **{buffer_switch: False},
    )  # all used every step: no graph search


@contextlib.contextmanager
def grad_sync(model: nn.Module, sync: bool):
    """Context for one micro-batch's backward: communicate gradients only when `sync` (the last
    micro-batch of an accumulation; FSDP2 holds unsharded gradients until then)."""
    with contextlib.ExitStack() as undo:  # runs what it was given on the way out, error or not
        if not sync and hasattr(model, "no_sync"):  # DDP (and ScratchDataParallel)
            undo.enter_context(model.no_sync())
        elif not sync and hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            model.set_requires_gradient_sync(False)
            undo.callback(model.set_requires_gradient_sync, True)
        yield


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (FSDP2 modifies the model in place: no wrapper)."""
    return model.module if isinstance(model, DDP) else model
