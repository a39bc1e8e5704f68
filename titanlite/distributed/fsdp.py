"""FSDP2 (ZeRO-3): every rank keeps 1/N of each parameter, gradient and optimizer state.

    model = apply_fsdp(model, dp_mesh, param_dtype=torch.bfloat16)

Each block's weights are all-gathered before its forward and its backward and freed after; gradients
are reduce-scattered. One `fully_shard` per block lets block i+1's all-gather overlap block i's compute."""

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import Shard

from ..errors import TitanliteError

RESHARD_CHOICES = ("default", "always", "never")


def apply_fsdp(
    model: nn.Module,
    mesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
    pp: int = 1,
    expert_parallel: bool = False,
    expert_mesh=None,
) -> nn.Module:
    """Shard each transformer block, then the root (embeddings, final norm, output), in place.
    param_dtype: FSDP gathers and computes in it (bf16 halves all-gather bytes; the shards and the
    optimizer keep the parameters' dtype). reduce_dtype: of the gradients' reduce-scatter (fp32 keeps
    the sum of many small bf16 gradients exact). reshard_after_forward: "always" frees each block's
    gathered weights after forward (least memory, one more all-gather), "never" keeps them for
    backward (ZeRO-2-like), "default" all but the last block's (none under PP: `reshard_flags`).
    cpu_offload: shards, gradients and the optimizer step live in CPU memory; pp: the PP degree.
    expert_parallel: an MoE block's experts are split by ep already, and FSDP shards them apart from
    their block, over `expert_mesh` (the ranks holding the same experts; None: no other rank does,
    so they stay out of FSDP). Without it, experts are sharded with their block like any weight."""
    flags = reshard_flags(reshard_after_forward, len(model.layers), pp)  # checks the choice first
    common = {
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    # Under expert parallelism the experts are sharded apart from their block (else with it)
    experts = [
        b.feed_forward.experts
        for b in model.layers.values()
        if expert_parallel and hasattr(b.feed_forward, "experts")
    ]
    # No other rank holds the same experts: FSDP leaves them out
    ignored = {p for group in experts for p in group.parameters()} if expert_mesh is None else set()
    if expert_mesh is not None:
        for group in experts:  # dim 0 is ep's already: FSDP shards dim 1
            fully_shard(group, mesh=expert_mesh, shard_placement_fn=lambda p: Shard(1), **common)
    for block, reshard in zip(list(model.layers.values()), flags):
        fully_shard(
            block, mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored, **common
        )
    fully_shard(model, mesh=mesh, ignored_params=ignored, **common)
    return model


def reshard_flags(policy: str, n_blocks: int, pp: int = 1) -> list[bool]:
    """Per block: free its gathered weights after forward? A pipeline stage runs forward once per
    micro-batch and backward later, so under PP "default" keeps them gathered, as torchtitan does."""
    if policy not in RESHARD_CHOICES:
        raise TitanliteError(
            f"parallel.reshard_after_forward='{policy}' is not one of {', '.join(RESHARD_CHOICES)}"
        )
    if policy != "default" or pp > 1:  # under PP, "default" is all False
        return [policy == "always"] * n_blocks
    # The last block's backward starts right after its forward: resharding it only costs an all-gather.
    return [i < n_blocks - 1 for i in range(n_blocks)]


def shard_and_init(
    model_on_meta: nn.Module, init_full_model, mesh, device: torch.device, **fsdp_kwargs
) -> nn.Module:
    """Meta-device init: shard a model that has no memory yet, then give each rank its shard.
    Only rank 0 builds the full model (`init_full_model()`, on CPU) and broadcasts it shard by shard:
    DTensor's CPU random init would not reproduce a single process's weights."""
    full = init_full_model().state_dict() if dist.get_rank() == 0 else {}
    # Sharded first, so each rank allocates its shards only
    model = apply_fsdp(model_on_meta, mesh, **fsdp_kwargs).to_empty(device=device)
    with torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators")
        model.init_weights()  # buffers (RoPE tables); the weights are overwritten next
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    return model
