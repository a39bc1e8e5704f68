"""ZeRO's memory model: what each data-parallel rank stores, predicted and measured.

Training keeps three things per parameter: the weight, its gradient and the optimizer state.
Plain data parallelism (DDP) replicates all three on every rank. ZeRO (Rajbhandari et al.,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020) shards them over
the N data-parallel ranks one at a time. For Ψ parameters, in bytes per rank:

    stage              sharded                 fp32 + AdamW (4, 4, 8)    paper's mixed (2, 2, K=12)
    0  DDP             nothing                 16·Ψ                      16·Ψ
    1  ZeRO-1 (P_os)   optimizer state         8·Ψ + 8·Ψ/N               4·Ψ + 12·Ψ/N
    2  ZeRO-2 (P_os+g) + gradients             4·Ψ + 12·Ψ/N              2·Ψ + 14·Ψ/N
    3  ZeRO-3 (FSDP)   + parameters            16·Ψ/N                    16·Ψ/N

The paper's mixed precision keeps bf16/fp16 weights and gradients (2 + 2 bytes) and K = 12
bytes of fp32 optimizer state (master weights, momentum, variance); titanlite on CPU trains in
fp32, where AdamW's momentum and variance are the 8 bytes and the weights are their own master.

    zero_bytes_per_rank(num_params, world_size=64, stage=2, precision="mixed")  # the formula
    measure_state_bytes(model, optimizer)  # what this rank really stores, from its tensors

Real shards are not exactly Ψ/N: FSDP2 splits every parameter along dim 0 into ceil(d0/N)
rows and pads the last shards to that size (`fsdp_shard_numel`); torch's
ZeroRedundancyOptimizer gives whole tensors to ranks, greedily (`zero1_partition`).
"""

from __future__ import annotations

import math

import torch

from ..._compat.torch_tools import is_traceable_wrapper_subclass
from ...errors import TitanliteError

# precision -> bytes per parameter for (weights, gradients, optimizer state)
PRECISIONS = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}


def zero_bytes_per_rank(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    precision: str = "fp32",
    param_bytes: int | None = None,
    grad_bytes: int | None = None,
    optim_bytes: int | None = None,
) -> dict[str, int]:
    """Bytes one rank stores at ZeRO `stage` (0 = DDP): {"params", "grads", "optimizer", "total"}.

    A sharded state is one flat buffer of Ψ elements split into N equal slices of ceil(Ψ/N)
    (DeepSpeed pads the buffer to a multiple of N), so the result is whole bytes.
    Explicit *_bytes override the `precision` preset (e.g. optim_bytes=4 for SGD with momentum).
    """
    if stage not in (0, 1, 2, 3):
        raise TitanliteError(f"ZeRO stage {stage} does not exist: use 0 (DDP), 1, 2 or 3")
    if precision not in PRECISIONS:
        raise TitanliteError(f"precision '{precision}' is not one of {', '.join(PRECISIONS)}")
    if num_params < 0 or world_size < 1:
        raise TitanliteError(
            f"need num_params >= 0 and world_size >= 1, got {num_params}, {world_size}"
        )
    default_p, default_g, default_o = PRECISIONS[precision]
    per_param = {
        "params": default_p if param_bytes is None else param_bytes,
        "grads": default_g if grad_bytes is None else grad_bytes,
        "optimizer": default_o if optim_bytes is None else optim_bytes,
    }
    # Stage s shards the first s of these (in ZeRO's order: optimizer, then grads, then params).
    sharded = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    shard = math.ceil(num_params / world_size)
    out = {
        k: per_param[k] * (shard if sharded[k] else num_params)
        for k in ("params", "grads", "optimizer")
    }
    out["total"] = sum(out.values())
    return out


def fsdp_shard_numel(shape, world_size: int, rank: int | None = None) -> int:
    """Elements of one parameter that FSDP2 keeps on a rank (dim-0 sharding, `torch.chunk`).

    rank=None: the padded shard every rank allocates, ceil(d0/N) rows (what all-gather and
    reduce-scatter move). With a rank: the rows that rank really owns (the last ranks own
    fewer, possibly none) - the size of its optimizer state, which is not padded.
    """
    shape = tuple(shape)
    if not shape:
        raise TitanliteError(
            "FSDP shards along dim 0, but this parameter is a scalar: "
            "give it at least one dimension"
        )
    rows = math.ceil(shape[0] / world_size)
    if rank is not None:
        rows = max(0, min(rows, shape[0] - rank * rows))
    return rows * math.prod(shape[1:])


def zero1_partition(numels, world_size: int) -> list[int]:
    """Elements each rank's optimizer owns in torch's ZeroRedundancyOptimizer: largest tensor
    first, each to the rank with the fewest so far. Whole tensors, so one big embedding can
    leave the ranks far from Ψ/N each."""
    sizes = [0] * world_size
    for n in sorted(numels, reverse=True):
        sizes[sizes.index(min(sizes))] += n
    return sizes


# ----- measuring --------------------------------------------------------------------------
def _plain(t: torch.Tensor):
    """The plain tensors that hold a tensor's data: a DTensor's local shard, and inside tensor
    subclasses such as torchao's FP8 weights, the tensors they wrap."""
    t = t.to_local() if hasattr(t, "to_local") else t
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            yield from _plain(getattr(t, name))
    else:
        yield t


def _storage_bytes(tensors) -> tuple[int, int]:
    """(bytes of the distinct storages behind these tensors, bytes of the tensors themselves).

    Storage is what is allocated: it includes FSDP2's padding and counts a shared buffer
    (a tied weight, FSDP's flat gradient buffer) once."""
    seen, stored, logical = set(), 0, 0
    for t in tensors:
        for local in _plain(t):
            logical += local.numel() * local.element_size()
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                stored += storage.nbytes()
    return stored, logical


def measure_state_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict:
    """Bytes this rank stores for parameters, gradients and optimizer state, read off its tensors.

    DTensors count their local shard; storage is counted, so FSDP2's padding is included
    (`padding` says how much of the total it is). For a ZeroRedundancyOptimizer only this
    rank's partition has state. AdamW's per-tensor `step` counters (scalars) are left out of
    "optimizer" and reported as `optimizer_steps`. Not counted: activations, DDP's gradient
    buckets (a second gradient-sized buffer unless gradient_as_bucket_view=True), and FSDP's
    temporarily gathered weights (see `unsharded_param_bytes`).
    """
    params = list(model.parameters())
    p_stored, p_logical = _storage_bytes(params)
    g_stored, g_logical = _storage_bytes([p.grad for p in params if p.grad is not None])
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps a local one
    states, steps = [], []
    for state in inner.state.values() if inner is not None else ():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                (steps if key == "step" or value.dim() == 0 else states).append(value)
    o_stored, o_logical = _storage_bytes(states)
    total = p_stored + g_stored + o_stored
    return {
        "params": p_stored,
        "grads": g_stored,
        "optimizer": o_stored,
        "total": total,
        "padding": total - (p_logical + g_logical + o_logical),
        "optimizer_steps": _storage_bytes(steps)[0],
    }


def unsharded_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of full (gathered) parameters alive right now: FSDP2 registers a module's
    unsharded weights as plain tensors while it holds them, and its DTensor shards otherwise.
    Call it between forward and backward to see what reshard_after_forward kept."""
    return _storage_bytes([p for p in model.parameters() if not hasattr(p, "to_local")])[0]


def describe_sharding(model: torch.nn.Module, limit: int = 6) -> str:
    """Each parameter's global shape, local shard shape, placement and dtype: the FSDP2
    example's way of checking what fully_shard did."""
    rows = []
    for name, p in list(model.named_parameters())[:limit]:
        local = p.to_local() if hasattr(p, "to_local") else p
        placement = getattr(p, "placements", ("not sharded",))
        rows.append(
            f"{name:45s} {str(tuple(p.shape)):14s} → local {str(tuple(local.shape)):14s} "
            f"{placement} {p.dtype}"
        )
    return "\n".join(rows)
