"""The torch internals only titanlite's tools touch (the core's are in torch_internals.py),
each with why and what if it moves: the dispatch-mode base class (collectives counted, activation
memory measured), pytree, fake tensors, process-group names, the PipelineStage methods the
pipeline timeline shadows, where a DTensor's shard lies. Names and signatures checked in torch
2.11-2.13.
"""

# FakeTensor: comm.CommCounter skips collectives traced on fake tensors (a compile's tracing
# pass), which would otherwise be counted twice.
from torch._subclasses.fake_tensor import FakeTensor  # noqa: F401

# TorchDispatchMode: the documented way to see every operator call (`__torch_dispatch__`); torch
# has only ever exported it from this module. comm.CommCounter counts collectives with it and
# checkpointing measures the activations a forward keeps alive. If it moves, importing titanlite's
# comm / checkpointing fails here with torch's ImportError naming this file.
# is_traceable_wrapper_subclass: is this a tensor subclass wrapping inner tensors (DTensor,
# torchao's FP8 weights)? zero.py counts the bytes of what such a subclass wraps.
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass  # noqa: F401

# tree_leaves: the tensors inside a nested output (tuples, dicts). torch has no public pytree
# module up to 2.13; the private one has been stable for years and torch.compile relies on it.
from torch.utils._pytree import tree_leaves  # noqa: F401

from ..errors import TitanliteError


def process_group_named(name: str):
    """The ProcessGroup a functional collective names by string (its `group_name` argument).
    torch resolves those names with the private `_resolve_process_group` (re-exported by
    distributed_c10d from torch._C in 2.11-2.13); if it moves, one line says what broke."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
    except ImportError as e:
        import torch

        raise TitanliteError(
            f"this torch ({torch.__version__}) cannot resolve process group "
            f"names ({e}): CommCounter was written for torch 2.11-2.13"
        ) from e
    return _resolve_process_group(name)


# ----- PipelineStage methods the schedules call ---------------------------------------------
# pipeline_timeline records when each stage runs a chunk by shadowing, on the stage instance,
# the three methods every torch schedule calls (2.11-2.13): forward_one_chunk(fwd_chunk_id, ...),
# backward_one_chunk(bwd_chunk_id, ..., full_backward=True) and
# backward_weight_one_chunk(bwd_chunk_id, ...). torch has no per-op hook for schedules.

STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def replace_stage_method(stage, name: str, make_replacement) -> None:
    """Shadow `stage.<name>` with `make_replacement(original)` on this instance only (the
    class's method, and every other stage, are untouched). If this torch's PipelineStage lacks
    the method, say so in one line rather than record a timeline with holes."""
    original = getattr(stage, name, None)
    if name not in STAGE_METHODS or not callable(original):
        import torch

        raise TitanliteError(
            f"this torch ({torch.__version__}) PipelineStage has no {name}(): the "
            f"pipeline timeline was written for torch 2.11-2.13; use one of those"
        )
    setattr(stage, name, make_replacement(original))


# ----- a process group that moves no data ---------------------------------------------------
# predict_memory.py wraps a preset in FSDP2 on N ranks that do not exist: torch's "fake" backend
# (its collectives return at once, untouched) is registered by importing its test module, and its
# FakeStore is the rendezvous it needs. FakeTensorMode: tensors with shapes and dtypes, no bytes.
# Both have lived at these paths since torch 2.2; if they move, the import fails here.
def fake_process_group(world_size: int) -> None:
    """Make this process rank 0 of `world_size` fake ranks (the default group)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402,F401


def load_whole_dcp_state(storage_reader) -> dict:
    """Every entry of a DCP checkpoint, in one process, as torch's dcp_to_torch_save loads it (2.11-2.13:
    a private loader and planner), but through `storage_reader`: titanlite's stores tensors as bytes."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(
        state, storage_reader=storage_reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    return state


def local_piece(t) -> tuple:
    """(this rank's part of `t`, where it starts in the whole tensor, its size per dim). A DTensor
    (FSDP, TP, EP) says where its shard lies through `__create_chunk_list__`, the protocol DCP asks
    every tensor it saves (2.11-2.13; torch has no public spelling): one chunk for a DTensor. A
    plain tensor is whole. hf_moe reads a Mixtral's experts by it, each rank only its slices."""
    if not hasattr(t, "to_local"):
        return t, (0,) * t.dim(), tuple(t.shape)
    (chunk,) = t.__create_chunk_list__()
    return t.to_local(), tuple(chunk.offsets), tuple(chunk.sizes)
