"""The torch internals the core touches, each with why and what if it moves. Names and signatures
checked in torch 2.11, 2.12 and 2.13 ("2.11-2.13" below); the tools' internals are in torch_tools.py."""

import contextlib
import importlib.util

import torch
from torch import nn

# checkpoint_wrapper: the activation-checkpoint wrapper torchtitan uses (state-dict keys keep
# their names, unlike wrapping by hand). Only reachable from this private module in 2.11-2.13.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: F401
    CheckpointWrapper,
    checkpoint_wrapper,
)

# `module.compile()` compiles in place by setting `_compiled_call_impl`, which `__call__` uses when
# set (2.11-2.13); torch has no public "is this compiled?" nor "run uncompiled for a moment". If the
# slot is renamed, getattr reads None: is_compiled_in_place says False (apply_tp's order check stops
# guarding) and explain() traces the compiled module - both degrade, neither crashes.
_COMPILED_SLOT = "_compiled_call_impl"


def is_checkpoint_wrapped(model: nn.Module) -> bool:
    return any(isinstance(m, CheckpointWrapper) for m in model.modules())


def compiled_call(module: nn.Module):  # the callable `module.compile()` installed, or None
    return getattr(module, _COMPILED_SLOT, None)


def set_compiled_call(module: nn.Module, impl) -> None:
    """Install (or with None, hide) the callable `module.compile()` installed."""
    setattr(module, _COMPILED_SLOT, impl)


def is_compiled_in_place(module: nn.Module) -> bool:
    """True if `module` or any submodule was compiled in place with nn.Module.compile()."""
    return any(compiled_call(m) is not None for m in module.modules())


def cpp_compiler_error() -> Exception | None:
    """Why Inductor on CPU has no C++ compiler (its exception), or None. Inductor itself calls this
    probe (2.11-2.13); if it moves we return None, and the trial compile that follows decides."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler  # compiling on a CPU only
    except ImportError:
        return None
    try:
        get_cpp_compiler()
    except Exception as e:  # InvalidCxxCompiler and friends
        return e
    return None


def has_triton() -> bool:
    """Whether Inductor can generate Triton kernels. torch.utils._triton.has_triton also checks that
    Triton works with this device (2.11-2.13); if it moves: "is the triton package installed"."""
    try:
        from torch.utils._triton import has_triton as torch_has_triton  # compiling on CUDA only
    except ImportError:
        return importlib.util.find_spec("triton") is not None
    return torch_has_triton()


def stop_dcp_writer_process() -> None:
    """End the writer process DCP's `async_process` saves spawn. torch keeps it in the global
    `_CHECKPOINT_PROCESS`, bound to its first save's process group, with no public way to stop it: it
    would fail the next run's saves ("background process is dead"). Its `__del__` sends TERMINATE, joins
    5 s, then SIGTERMs (2.11-2.13). If the module or global moves, this does nothing (torch's again)."""
    try:
        from torch.distributed.checkpoint import (
            _async_process_executor as executor,  # async_process only
        )
    except ImportError:
        return
    if (proc := getattr(executor, "_CHECKPOINT_PROCESS", None)) is not None:
        executor._CHECKPOINT_PROCESS = None
        with contextlib.suppress(Exception):
            proc.__del__()
        # __del__ runs again when `proc` is collected; a writer still dying from the SIGTERM (a busy
        # machine) would then get TERMINATE on a closed pipe (a BrokenPipeError). Wait, or SIGKILL it.
        if (writer := getattr(proc, "_save_process", None)) is not None:
            with contextlib.suppress(Exception):
                writer.join(timeout=10)
                if writer.is_alive():
                    writer.kill()
                    writer.join(timeout=5)


def dcp_storage_info(file: str, offset: int, length: int, tags: list[str] | None):
    """DCP's record of where an entry lies (file, byte range, stream tags), which its file reader reads
    back: a storage writer of our own must make it, and torch keeps it private (`_StorageInfo`, 2.11-2.13)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(file, offset, length, transform_descriptors=tags)


def set_cuda_allocator_settings(settings: str) -> None:
    """Change the CUDA allocator's settings after CUDA started (PYTORCH_CUDA_ALLOC_CONF is read once).
    torch 2.11-2.13 expose only torch._C._accelerator_setAllocatorSettings (torch.cuda.memory's
    _set_allocator_settings wraps it, deprecated); if both move, nothing changes."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(settings)


def fsdp_mixed_precision(model: nn.Module) -> dict | None:
    """What FSDP2 gathers parameters in and reduces gradients in, read from the root module's FSDP
    state (`_get_fsdp_state()._mp_policy`, 2.11-2.13: fully_shard keeps its MixedPrecisionPolicy
    only there); None where `model` is not an FSDP module, or where the state moved (run.json then
    records none: the record degrades, training does not)."""
    get_state = getattr(model, "_get_fsdp_state", None)
    policy = getattr(get_state(), "_mp_policy", None) if get_state is not None else None
    if policy is None:
        return None
    return {
        "param_dtype": str(policy.param_dtype) if policy.param_dtype else None,
        "reduce_dtype": str(policy.reduce_dtype) if policy.reduce_dtype else None,
    }


def scaler_scale(scaler) -> torch.Tensor:
    """GradScaler's current scale as the device tensor it keeps (`_scale`, 2.11-2.13): its public
    `get_scale()` returns a float, which makes the host wait for the GPU. Set by the first
    `scale()`; if renamed, this raises at the first fp16 step rather than mis-detect skips."""
    return scaler._scale


def flatten_mesh(mesh, dims: tuple[str, ...], name: str, beside: str | None = None):
    """Fold `dims` of a DeviceMesh into one dim called `name` (DeviceMesh._flatten, 2.11-2.13, as
    torchtitan does for FSDP over dp_shard × cp) and return that 1-D mesh; `beside`: a dim of
    `mesh` put before it, as a 2-D mesh (HSDP's dp_replicate; DeviceMesh._concatenate, 2.11-2.13).
    Never `mesh[name]`: slicing the root mesh by a flattened name warns in every rank since 2.11
    ("Slicing a flattened dim from root mesh will be deprecated ... bookkeep the flattened mesh
    directly"), so the mesh _flatten returns is the one kept."""
    flat = mesh[dims]._flatten(name)
    # type(flat) is DeviceMesh; _concatenate reuses both meshes' process groups, creates none
    return flat if beside is None else type(flat)._concatenate([mesh[beside], flat])


def in_backward() -> bool:
    """Whether autograd is running a backward now (activation checkpointing recomputes forwards
    there): torch._C._current_graph_task_id() is -1 outside one (2.11-2.13)."""
    return torch._C._current_graph_task_id() != -1


def all_to_all(t: torch.Tensor, out_sizes, in_sizes, group) -> torch.Tensor:
    """Rows of `t` (in_sizes[r] to rank r) exchanged for out_sizes[r] rows from each rank r, with
    an autograd backward (the reverse exchange): torch.distributed._functional_collectives'
    all_to_all_single_autograd (2.11-2.13), as torchtitan's expert parallelism uses it. Sizes None:
    equal parts."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(t, out_sizes, in_sizes, group)


def muon_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """torch.optim.Muon's lr for a matrix of `shape`: "original" lr·√max(1, A/B) (Keller Jordan's),
    "match_rms_adamw" lr·0.2·√max(A, B) (Moonshot's), from torch.optim._muon._adjust_lr (2.13)."""
    from torch.optim._muon import _adjust_lr  # sharded Muon runs only

    return _adjust_lr(lr, adjust_lr_fn, shape)
