"""Every torch internal titanlite touches, in one place, each with why and what if it moves.

torch keeps some things we need behind underscores: the dispatch-mode base class, the
activation-checkpoint wrapper torchtitan uses, the slot `nn.Module.compile()` fills, DCP's
writer process, the PipelineStage methods a schedule calls. Nothing else in titanlite imports
`torch._*` / `torch.*._*` modules or reads those attributes (tests/test_imports.py checks), so a
torch upgrade that moves one breaks here, with a clear message or a fallback, not everywhere.

Names and signatures checked in the sources of torch 2.11.0, 2.12.0 and 2.13.0 ("2.11-2.13"
below); the tests run it on the installed torch.
Documented torch toggles that merely live under an underscore (`torch._dynamo.explain`,
`torch._inductor.config.patch`, the `torch._dynamo` logger) stay where they are used.
"""
from __future__ import annotations

import contextlib
import importlib.util

from torch import nn

from ..errors import TitanliteError

# TorchDispatchMode: the documented way to see every operator call (`__torch_dispatch__`); torch
# has only ever exported it from this module. comm.CommCounter counts collectives with it and
# checkpointing measures the activations a forward keeps alive. If it moves, importing titanlite's
# comm / checkpointing fails here with torch's ImportError naming this file.
# is_traceable_wrapper_subclass: is this a tensor subclass wrapping inner tensors (DTensor,
# torchao's FP8 weights)? zero.py counts the bytes of what such a subclass wraps.
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass  # noqa: E402,F401

# tree_leaves: the tensors inside a nested output (tuples, dicts). torch has no public pytree
# module up to 2.13; the private one has been stable for years and torch.compile relies on it.
from torch.utils._pytree import tree_leaves  # noqa: E402,F401

# FakeTensor: comm.CommCounter skips collectives traced on fake tensors (a compile's tracing
# pass), which would otherwise be counted twice.
from torch._subclasses.fake_tensor import FakeTensor  # noqa: E402,F401

# checkpoint_wrapper: the activation-checkpoint wrapper torchtitan uses (state-dict keys keep
# their names, unlike wrapping by hand). Only reachable from this private module in 2.11-2.13.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: E402,F401
    CheckpointWrapper, checkpoint_wrapper)


def is_checkpoint_wrapped(model: nn.Module) -> bool:
    """True if any submodule of `model` was wrapped by `checkpoint_wrapper`."""
    return any(isinstance(m, CheckpointWrapper) for m in model.modules())


def process_group_named(name: str):
    """The ProcessGroup a functional collective names by string (its `group_name` argument).
    torch resolves those names with the private `_resolve_process_group` (re-exported by
    distributed_c10d from torch._C in 2.11-2.13); if it moves, one line says what broke."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
    except ImportError as e:
        import torch
        raise TitanliteError(f"this torch ({torch.__version__}) cannot resolve process group "
                             f"names ({e}): CommCounter was written for torch 2.11-2.13") from e
    return _resolve_process_group(name)


# ----- nn.Module.compile() -------------------------------------------------------------------
# `module.compile()` compiles in place by filling the instance attribute `_compiled_call_impl`,
# which `__call__` uses when set (torch 2.11-2.13). There is no public "is this compiled?" or
# "run uncompiled for a moment". If torch renames the slot, `getattr(..., None)` reads None:
# is_compiled_in_place then says False (apply_tp's order check stops guarding) and
# explain() traces the compiled module — both degrade, neither crashes.

_COMPILED_SLOT = "_compiled_call_impl"


def compiled_call(module: nn.Module):
    """The compiled callable `module.compile()` installed, or None."""
    return getattr(module, _COMPILED_SLOT, None)


def set_compiled_call(module: nn.Module, impl) -> None:
    """Install (or with None, hide) the callable `module.compile()` installed."""
    setattr(module, _COMPILED_SLOT, impl)


def is_compiled_in_place(module: nn.Module) -> bool:
    """True if `module` or any submodule was compiled in place with nn.Module.compile()."""
    return any(compiled_call(m) is not None for m in module.modules())


# ----- can Inductor build kernels here? -----------------------------------------------------

def cpp_compiler_error() -> Exception | None:
    """Why Inductor on CPU has no C++ compiler (the exception it raises), or None if it has one.
    torch._inductor.cpp_builder.get_cpp_compiler is what Inductor itself calls (2.11-2.13). If
    it moves, we return None and the trial compile that follows gives the verdict."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:
        return None
    try:
        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - InvalidCxxCompiler and friends
        return e
    return None


def has_triton() -> bool:
    """Whether Inductor can generate Triton kernels. torch.utils._triton.has_triton also checks
    the installed Triton works with this device (2.11-2.13); if it moves, fall back to "is the
    triton package installed"."""
    try:
        from torch.utils._triton import has_triton as torch_has_triton
    except ImportError:
        return importlib.util.find_spec("triton") is not None
    return torch_has_triton()


# ----- DCP's background writer process ------------------------------------------------------

def stop_dcp_writer_process() -> None:
    """End the writer process DCP's `async_process` saves spawned. torch keeps one per Python
    process in the module global `_CHECKPOINT_PROCESS`, bound to the process group of its first
    save, and has no public way to stop it: left alone it outlives the run, and the next run's
    saves (on a new group) fail with "background process is dead". Its `__del__` sends
    TERMINATE, joins for 5 s and SIGTERMs if it lingers (2.11-2.13). If the module or global
    moves, this does nothing: the process is then torch's to manage again."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor
    except ImportError:
        return
    proc = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if proc is not None:
        executor._CHECKPOINT_PROCESS = None
        with contextlib.suppress(Exception):
            proc.__del__()
        # __del__ runs again when `proc` is garbage-collected; if the writer is still dying
        # from the SIGTERM above (a busy machine), that second call writes TERMINATE into a
        # closed pipe and prints a BrokenPipeError. Wait for it (and SIGKILL a straggler)
        # so the second call finds it dead and does nothing.
        writer = getattr(proc, "_save_process", None)
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.join(timeout=10)
                if writer.is_alive():
                    writer.kill()
                    writer.join(timeout=5)


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
        raise TitanliteError(f"this torch ({torch.__version__}) PipelineStage has no {name}(): the "
                             f"pipeline timeline was written for torch 2.11-2.13; use one of those")
    setattr(stage, name, make_replacement(original))


# ----- Inductor's cache folder ---------------------------------------------------------------
# compile_trial remembers the trials that worked beside Inductor's compiled kernels, so that
# clearing one clears both. torch computes the folder in a private module (2.11-2.13:
# TORCHINDUCTOR_CACHE_DIR, else a per-user folder in the temp dir); if it moves, the same rule.

def inductor_cache_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return cache_dir()
    except (ImportError, AttributeError, OSError):
        import getpass
        import os
        import tempfile
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = "unknown"
        return os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                               or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"))
