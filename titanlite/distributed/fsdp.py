"""FSDP2 (ZeRO-3): every rank keeps 1/N of each parameter, gradient and optimizer state.

    model = apply_fsdp(model, dp_mesh, param_dtype=torch.bfloat16)

`fully_shard` turns each parameter into a DTensor sharded on dim 0 over the mesh. Before a
block's forward (and again before its backward) FSDP all-gathers the block's full weights, runs
it, and frees them again; after backward it reduce-scatters the gradients so each rank holds
only its shard's gradient, and the optimizer steps on shards only. One `fully_shard` call per
transformer block makes each block one communication group: while block i computes, block
i+1's weights are already being gathered (prefetch), which hides the communication.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from ..errors import TitanliteError

RESHARD_CHOICES = ("default", "always", "never")


def apply_fsdp(model: nn.Module, mesh, *, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: str = "default",
               cpu_offload: bool = False, pp: int = 1) -> nn.Module:
    """Shard each transformer block, then the root (embeddings, final norm, output), in place.

    param_dtype: the dtype FSDP gathers and computes in (bf16 halves all-gather bytes);
      the sharded master weights and the optimizer stay in the parameters' own dtype.
    reduce_dtype: the dtype gradients are reduce-scattered in; fp32 keeps the sum exact
      enough when many ranks add up small bf16 gradients.
    reshard_after_forward: "default" frees every block's gathered weights after its forward
      except the last block's (backward needs those at once), or none of them under pipeline
      parallelism (see `reshard_flags`); "always" frees all of them (least memory, one more
      all-gather); "never" keeps them until backward (ZeRO-2-like memory during the step, one
      all-gather per block instead of two).
    cpu_offload: sharded parameters, gradients and the optimizer step live in CPU memory.
    pp: the pipeline-parallel degree (this model is then one stage).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    flags = reshard_flags(reshard_after_forward, len(model.layers), pp)  # checks the choice first
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    common = {"mesh": mesh, "mp_policy": policy}
    if cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy()
    blocks = list(model.layers.values())
    for block, reshard in zip(blocks, flags):
        fully_shard(block, reshard_after_forward=reshard, **common)
    # The root group holds what no block owns: embeddings, final norm, output (tied or not).
    fully_shard(model, **common)
    return model


def reshard_flags(policy: str, n_blocks: int, pp: int = 1) -> list[bool]:
    """Per block: free its gathered weights after forward? (torchtitan's
    `reshard_after_forward_policy`). A pipeline stage runs forward once per micro-batch and
    backward later, so resharding would all-gather every block again for every micro-batch:
    under pipeline parallelism "default" keeps the weights gathered, as torchtitan does."""
    if policy not in RESHARD_CHOICES:
        raise TitanliteError(f"parallel.reshard_after_forward='{policy}' is not one of "
                             f"{', '.join(RESHARD_CHOICES)}")
    if policy != "default":
        return [policy == "always"] * n_blocks
    if pp > 1:
        return [False] * n_blocks
    # The last block's backward starts right after its forward: freeing and re-gathering its
    # weights in between would only cost an all-gather.
    return [i < n_blocks - 1 for i in range(n_blocks)]


def shard_and_init(model_on_meta: nn.Module, init_full_model, mesh, device: torch.device,
                   **fsdp_kwargs) -> nn.Module:
    """Meta-device init: shard a model that has no memory yet, then give each rank its shard.

    `init_full_model()` builds the full, initialised model on CPU; only rank 0 calls it, and
    its weights are broadcast shard by shard (DTensor's CPU random init would not reproduce a
    single process's weights, and we want runs comparable to one-process training).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = init_full_model().state_dict() if dist.get_rank() == 0 else {}
    model = apply_fsdp(model_on_meta, mesh, **fsdp_kwargs)
    model.to_empty(device=device)
    with torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators")
        model.init_weights()  # buffers (RoPE tables); the weights are overwritten next
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    return model


def precompute_fp8_scales(model: nn.Module) -> None:
    """With FP8 all-gather, compute every weight's FP8 scale once, for all ranks together,
    right after the optimizer changed the weights (one all-reduce of amaxes, not one per layer)."""
    if (getattr(model, "fp8_info", None) or {}).get("fsdp_all_gather"):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        precompute_float8_dynamic_scale_for_fsdp(model)


def local_bytes(tensors) -> int:
    """Bytes this rank actually stores for these (possibly sharded DTensor) tensors."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def describe_sharding(model: nn.Module, limit: int = 6) -> str:
    """Each parameter's global shape, local shard shape, placement and dtype: the FSDP2
    example's way of checking what fully_shard did."""
    rows = []
    for name, p in list(model.named_parameters())[:limit]:
        local = p.to_local() if hasattr(p, "to_local") else p
        placement = getattr(p, "placements", ("not sharded",))
        rows.append(f"{name:45s} {str(tuple(p.shape)):14s} → local {str(tuple(local.shape)):14s} "
                    f"{placement} {p.dtype}")
    return "\n".join(rows)
