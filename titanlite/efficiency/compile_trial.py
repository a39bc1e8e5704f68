"""Can torch.compile run here? Checked before step 1, so a machine that cannot compile trains
eagerly with one line saying why (`apply_compile`'s fallback) instead of failing mid-run.

    support = compile_support("cpu", block=model.layers["0"], args=model.args, example_shape=(8, 256))
    support.works, support.why        # True, "a trial compile of block 0 on a 8x256 batch ... worked"

Static checks first, because they give the clearest fix (Dynamo supports this Python; Inductor
finds a C++ compiler on CPU, Triton on CUDA); then a trial compile, forward and backward, of a
copy of a real transformer block on a batch of the run's shape (a toy that compiles proves
little about a block's attention kernel or dtypes).

A trial that worked is remembered twice: in this process (`_TRIALS`), and in a small file next
to Inductor's own cache (`_REMEMBERED`), keyed by everything the trial depends on (torch
version, device, block, shapes, dtypes, compile arguments). A new process, say each rank of
every torchrun job, then skips a trial that already worked on this machine: seconds per start,
and under FSDP the trial's graph is not the one training traces anyway. Clearing Inductor's
cache clears the memo with it; a failure is never remembered, so it is tried again.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .._compat.torch_internals import cpp_compiler_error, has_triton, inductor_cache_dir
from ..hardware import synchronize


@dataclass
class CompileSupport:
    device: str
    backend: str
    works: bool
    why: str  # what works or failed
    fix: str = ""  # how to make it work, when it does not
    error: BaseException | None = None  # the trial's exception, chained into TitanliteError


def compile_support(device: torch.device | str, block: nn.Module | None = None, args=None,
                    example_shape: tuple[int, int] | None = None,
                    autocast_dtype: torch.dtype | None = None, **compile_kwargs) -> CompileSupport:
    """Can torch.compile (with these kwargs) run on `device`? Static checks first, because
    they give the clearest fix, then a trial compile, remembered (see above): of a copy of
    `block` (a transformer block of a model with ModelArgs `args`) on a (batch, seq_len)
    `example_shape` batch under the run's autocast (`autocast_dtype`), or of a tiny matmul
    without one."""
    import torch._dynamo  # noqa: F401  (heavy: imported only when compiling)
    device = torch.device(device)
    backend = compile_kwargs.get("backend", "inductor")
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
    problem = _static_problem(device, backend)
    if problem:
        return CompileSupport(device.type, name, False, *problem)
    what = "a tiny matmul"
    key = (str(device), repr(sorted(compile_kwargs.items(), key=lambda kv: kv[0])))
    real_block = block is not None and args is not None and example_shape is not None
    if real_block:
        what = f"block 0 on a {example_shape[0]}x{example_shape[1]} batch" + \
               (f" under {str(autocast_dtype)[6:]} autocast" if autocast_dtype is not None else "")
        # repr: the block's module tree (FP8 Linears, a checkpoint wrapper): each kind is tried
        key += (repr(block), tuple(example_shape), str(next(block.parameters()).dtype),
                repr(args), str(autocast_dtype))
    before = False
    if key not in _TRIALS:
        # On disk only for a named backend: a function's repr (its address) differs every process.
        digest = _digest(key, device) if real_block and isinstance(backend, str) else None
        before = digest is not None and _worked_before(digest)
        if before:
            _TRIALS[key] = None
        else:
            _TRIALS[key] = (_trial_compile_block(block, args, example_shape, device, compile_kwargs, autocast_dtype)
                            if real_block else _trial_compile(device, compile_kwargs))
            if _TRIALS[key] is None and digest is not None:
                _remember(digest)
    error = _TRIALS[key]
    if error is None:
        when = " on this machine before (remembered beside Inductor's cache)" if before else ""
        return CompileSupport(device.type, name, True,
                              f"a trial compile of {what} (backend={name}) worked{when}")
    return CompileSupport(device.type, name, False,
                          f"a trial compile of {what} (backend={name}) on {device.type} failed "
                          f"with {_describe(error)}",
                          "check the compile arguments (backend, mode) and this torch install",
                          error)


_TRIALS: dict[tuple, BaseException | None] = {}  # (device, kwargs[, block, shape]) -> error or None


_REMEMBERED = "titanlite-compile-trials.json"  # in Inductor's cache folder: digests of trials that worked


def _memo_path() -> Path:
    return Path(inductor_cache_dir()) / _REMEMBERED


def _digest(key: tuple, device: torch.device) -> str:
    from ..hardware import device_name
    return hashlib.sha256(repr((key, torch.__version__, device_name(device))).encode()).hexdigest()[:32]


def _worked_before(digest: str) -> bool:
    try:
        return digest in json.loads(_memo_path().read_text())
    except (OSError, ValueError, TypeError):  # none yet, or damaged: try again
        return False


def _remember(digest: str) -> None:
    """Add a trial that worked; best effort (a read-only cache only costs the next trial)."""
    path = _memo_path()
    try:
        try:
            known = set(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            known = set()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(sorted(known | {digest})))
        os.replace(tmp, path)  # whole or not at all: ranks writing at once never leave half a file
    except OSError:
        pass


def _static_problem(device: torch.device, backend) -> tuple[str, str] | None:
    """(what is missing, how to fix it), or None if nothing is known to be missing."""
    check = getattr(getattr(torch._dynamo, "eval_frame", None), "check_if_dynamo_supported", None)
    try:
        if check is not None:
            check()  # raises with the reason (e.g. this Python is newer than Dynamo supports)
        elif not torch._dynamo.is_dynamo_supported():
            raise RuntimeError("Dynamo is not supported on this platform")
    except Exception as e:  # noqa: BLE001 - the reason is in the message
        return (f"TorchDynamo is unavailable with Python {sys.version.split()[0]} and torch "
                f"{torch.__version__} ({first_line(e)})",
                "use a Python version this torch release supports for torch.compile")
    if backend != "inductor":
        return None  # e.g. "aot_eager" or "eager" need neither a compiler nor Triton
    if device.type == "cpu":
        e = cpp_compiler_error()  # None also when torch moved the probe: the trial compile tells
        if e is not None:
            fix = {"win32": "install Visual Studio Build Tools (MSVC) and start Python from a "
                            "Developer Command Prompt",
                   "darwin": "run `xcode-select --install`"}.get(
                sys.platform, "install one (e.g. `apt install g++`) or point CXX at it")
            return f"Inductor on CPU needs a C++ compiler and found none ({first_line(e)})", fix
    if device.type == "cuda":
        if not has_triton():
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (7, 0):
                return (f"Inductor's Triton kernels need a GPU of compute capability 7.0+, this "
                        f"is {major}.{minor}", "pass backend='aot_eager', or train eagerly")
            return "Inductor on CUDA needs Triton, which is not installed", "`pip install triton`"
    # MPS: Inductor's Metal backend is young and depends on the torch and macOS versions;
    # the trial compile is the only honest test.
    return None


def _trial_compile(device: torch.device, compile_kwargs: dict) -> BaseException | None:
    """Compile a tiny matmul + pointwise + reduction, forward and backward; None if it works."""
    def tiny(x, w):
        return F.silu(x @ w).pow(2).mean()

    try:
        x = torch.randn(8, 8, device=device, requires_grad=True)
        w = torch.randn(8, 8, device=device)
        loss = torch.compile(tiny, **compile_kwargs)(x, w)
        loss.backward()  # AOTAutograd compiles the backward graph lazily, here
        synchronize(device)
    except Exception as e:  # noqa: BLE001 - any failure means "not here"
        return e
    return None


def _trial_compile_block(block: nn.Module, args, shape: tuple[int, int], device: torch.device,
                         compile_kwargs: dict, autocast_dtype: torch.dtype | None = None
                         ) -> BaseException | None:
    """Compile a copy of a real transformer block and run forward + backward on a batch of
    the run's shape; None if it works. The copy keeps the real block uncompiled and its
    gradients untouched; a block still on the meta device gets small random weights.

    The trial feeds the block what the model will (hidden states in the weights' dtype, rotary
    tables sliced and cast as `Transformer.forward` does) under the run's autocast, so it traces
    the very graph training will: a bf16 graph can fail where an fp32 one compiles, and the
    same graph is then found in Inductor's cache at step 1 instead of being compiled twice."""
    from ..models.llama import rope_cache

    batch, seq_len = shape
    # fork_rng: the trial's random numbers must not shift the run's random streams.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            trial = copy.deepcopy(block)
            if any(p.device.type == "meta" for p in trial.parameters()):
                trial = trial.to_empty(device=device)
                with torch.no_grad():
                    for p in trial.parameters():
                        p.normal_(std=0.02)
            dtype = next(trial.parameters()).dtype
            x = torch.randn(batch, seq_len, args.dim, device=device, dtype=dtype, requires_grad=True)
            cos, sin = (t[:seq_len].to(dtype) for t in rope_cache(args, device=device))
            autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                        else contextlib.nullcontext())
            with autocast:
                out = torch.compile(trial, **compile_kwargs)(x, cos, sin)
            out.float().pow(2).mean().backward()
            synchronize(device)
        except Exception as e:  # noqa: BLE001 - any failure means "not here"
            return e
    return None


def _describe(e: BaseException) -> str:
    # Dynamo wraps a backend's own exception (BackendCompilerFailed.inner_exception).
    inner = getattr(e, "inner_exception", None) or e
    return f"{type(inner).__name__}: {first_line(inner)}"


def first_line(e: BaseException, limit: int = 160) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
