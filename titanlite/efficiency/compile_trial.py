"""Can torch.compile run here? Asked before step 1, so `apply_compile` can train eagerly instead of failing.

support = compile_support("cpu", block=model.layers["0"], args=model.args, example_shape=(8, 256))
support.works, support.why        # (True, "a trial compile of block 0 on a 8x256 batch ... worked")"""

import contextlib
import copy
import sys
from dataclasses import dataclass

import torch
from torch import nn

from .._compat.torch_internals import cpp_compiler_error, has_triton
from ..hardware import synchronize
from ..models.rope import rope_cache

_TRIALS: dict[tuple, BaseException | None] = {}  # (device, kwargs[, block, shape]) -> error or None


@dataclass
class CompileSupport:
    device: str
    backend: str
    works: bool
    why: str  # what works or failed
    fix: str = ""  # how to make it work, when it does not
    error: BaseException | None = None  # the trial's exception, chained into TitanliteError


def compile_support(
    device: torch.device | str,
    block: nn.Module | None = None,
    args=None,
    example_shape: tuple[int, int] | None = None,
    autocast_dtype: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
    **compile_kwargs,
) -> CompileSupport:
    """Can torch.compile (with these kwargs) run on `device`? Static checks first (the clearest fix),
    then a trial compile of a copy of `block` on an `example_shape` batch, or else of a tiny matmul.
    `param_dtype`: the dtype the block's weights compute in, when not their own (FSDP gathers
    them in bf16 while they are kept in fp32): the trial runs the graph training will run."""
    import torch._dynamo  # heavy: imported only when compiling

    device = torch.device(device)
    backend = compile_kwargs.get("backend", "inductor")
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
    if problem := _static_problem(device, backend):
        return CompileSupport(device.type, name, False, *problem)
    key = (str(device), repr(sorted(compile_kwargs.items(), key=lambda kv: kv[0])))
    if block is None or args is None or example_shape is None:
        block, what = None, "a tiny matmul"
    else:
        what = f"block 0 on a {example_shape[0]}x{example_shape[1]} batch"
        if autocast_dtype is not None:
            what += f" under {str(autocast_dtype).removeprefix('torch.')} autocast"
        if param_dtype is not None:
            what += f" with {str(param_dtype).removeprefix('torch.')} weights"
        # repr: the block's module tree (FP8 Linears, a checkpoint wrapper): each kind is tried
        key += (
            repr(block),
            tuple(example_shape),
            str(param_dtype or next(block.parameters()).dtype),
            repr(args),
            str(autocast_dtype),
        )
    if key not in _TRIALS:
        _TRIALS[key] = _trial_compile(
            device, compile_kwargs, block, args, example_shape, autocast_dtype, param_dtype
        )
    error, trial = _TRIALS[key], f"a trial compile of {what} (backend={name})"
    if error is None:
        return CompileSupport(device.type, name, True, f"{trial} worked")
    inner = getattr(error, "inner_exception", None) or error  # Dynamo wraps the backend's exception
    return CompileSupport(
        device.type,
        name,
        False,
        f"{trial} on {device.type} failed with {type(inner).__name__}: {first_line(inner)}",
        "check the compile arguments (backend, mode) and this torch install",
        error,
    )


def _static_problem(device: torch.device, backend) -> tuple[str, str] | None:
    """(what is missing, how to fix it), or None if none is known (on MPS only a trial can tell)."""
    try:
        # raises with the reason (e.g. this Python is newer than Dynamo supports)
        torch._dynamo.eval_frame.check_if_dynamo_supported()
    except Exception as e:  # the reason is in the message
        return (
            f"TorchDynamo is unavailable with Python {sys.version.split()[0]} and torch "
            f"{torch.__version__} ({first_line(e)})",
            "use a Python version this torch release supports for torch.compile",
        )
    if backend != "inductor":
        return None  # e.g. "aot_eager" or "eager" need neither a compiler nor Triton
    if device.type == "cpu" and (e := cpp_compiler_error()) is not None:
        fix = {
            "win32": "install Visual Studio Build Tools (MSVC) and start Python from a Developer "
            "Command Prompt",
            "darwin": "run `xcode-select --install`",
        }.get(sys.platform, "install one (e.g. `apt install g++`) or point CXX at it")
        return f"Inductor on CPU needs a C++ compiler and found none ({first_line(e)})", fix
    if device.type == "cuda" and not has_triton():
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (7, 0):
            return (
                f"Inductor's Triton kernels need a GPU of compute capability 7.0+, this "
                f"is {major}.{minor}",
                "pass backend='aot_eager', or train eagerly",
            )
        return "Inductor on CUDA needs Triton, which is not installed", "`pip install triton`"
    return None


def _trial_compile(
    device: torch.device,
    compile_kwargs: dict,
    block: nn.Module | None,
    args,
    shape: tuple[int, int],
    autocast_dtype: torch.dtype | None,
    param_dtype: torch.dtype | None = None,
) -> BaseException | None:
    """Compile and run forward + backward: without `block` a tiny matmul + pointwise + reduction, else
    a copy of it fed as the model feeds it (dtypes, rotary tables, the run's autocast): a bf16 graph can
    fail where fp32 compiles, and step 1 then finds this very graph in Inductor's cache. None: works."""
    try:
        if block is None:
            x = torch.randn(8, 8, device=device, requires_grad=True)
            # AOTAutograd compiles backward here
            torch.compile(lambda x, w: nn.functional.silu(x @ w).pow(2).mean(), **compile_kwargs)(
                x, torch.randn(8, 8, device=device)
            ).backward()
        else:
            # fork_rng: the trial's random numbers must not shift the run's random streams.
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                # the real block stays uncompiled, its gradients untouched
                trial = copy.deepcopy(block)
                if any(p.device.type == "meta" for p in trial.parameters()):
                    trial = trial.to_empty(device=device)
                    for p in trial.parameters():
                        nn.init.normal_(p, std=0.02)
                if param_dtype is not None:
                    trial = trial.to(param_dtype)  # as FSDP gathers them
                dtype = next(
                    trial.parameters()
                ).dtype  # hidden states and rotary tables as the model's
                # shape: (batch, seq_len)
                x = torch.randn(*shape, args.dim, device=device, dtype=dtype, requires_grad=True)
                cos, sin = (t[: shape[1]].to(dtype) for t in rope_cache(args, device=device))
                with (
                    torch.autocast(device.type, dtype=autocast_dtype)
                    if autocast_dtype is not None
                    else contextlib.nullcontext()
                ):
                    out = torch.compile(trial, **compile_kwargs)(x, cos, sin)
                out.float().pow(2).mean().backward()
        synchronize(device)
    except Exception as e:  # any failure means "not here"
        return e
    return None


def first_line(e: BaseException, limit: int = 160) -> str:
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return text if len(text) <= limit else text[: limit - 3] + "..."
