"""torch.compile, applied the way torchtitan does it: one transformer block at a time.

    model = apply_compile(model, scope="regional")   # in place; state-dict names unchanged
    graph_break_report(model, tokens)                # {"graphs": 1, "graph_breaks": 0, ...}

Why compile helps: Dynamo captures the Python forward as a graph, AOTAutograd derives the
backward graph, and Inductor fuses the many small element-wise ops (RMSNorm, rotary, SwiGLU,
residual adds) into a few generated kernels: fewer round trips through memory, less Python
and dispatcher overhead per op. The matmuls stay library calls; the win is everything around them.

Why regional: every block runs the same code on same-shaped tensors, and Dynamo guards on
the block's *type*, not its identity, so block 0's compiled graph is reused by every later
block. Compile time stays that of one block however deep the model is; whole-model compile
traces and optimises all of them. `nn.Module.compile()` compiles in place (no `_orig_mod.`
wrapper), so checkpoints and the Hugging Face export see the plain model's names.

Compile is lazy: nothing is compiled until the first call, which is where failures would
surface. `apply_compile` therefore checks up front (Dynamo supports this Python, a C++
compiler for Inductor on CPU, Triton on CUDA) and runs a trial compile, forward and backward,
on the model's device: of a copy of the model's first block on a batch of the run's shape
when it knows the shape (`example_shape`, as the trainer passes it), else of a tiny matmul. A
toy that compiles proves little about a real block (its attention kernel, its dtypes). If
the trial fails it warns once and leaves the model eager (`fallback=True`) or raises a
one-line TitanliteError (`fallback=False`).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._compat.torch_internals import (compiled_call, cpp_compiler_error, has_triton,
                                       is_compiled_in_place, set_compiled_call)
from ..errors import TitanliteError, closest
from ..hardware import synchronize

SCOPES = ("regional", "model")


class CompileFallbackWarning(UserWarning):
    """torch.compile cannot run here; the model was left eager."""


@dataclass
class CompileSupport:
    device: str
    backend: str
    works: bool
    why: str  # what works or failed
    fix: str = ""  # how to make it work, when it does not
    error: BaseException | None = None  # the trial's exception, chained into TitanliteError


def apply_compile(model: nn.Module, scope: str = "regional", fallback: bool = True,
                  device: torch.device | str | None = None,
                  example_shape: tuple[int, int] | None = None,
                  autocast_dtype: torch.dtype | None = None, **compile_kwargs) -> nn.Module:
    """Compile `model` in place (`scope`: "regional" = each block, "model" = all of it) and
    return it. `compile_kwargs` go to torch.compile (backend, mode, dynamic, fullgraph...).
    `device`: where it will run (default: where its parameters are; pass it for a model
    still on the meta device, as FSDP's meta-device init builds it).
    `example_shape`: (batch, seq_len) of the run: the trial compiles block 0 on it.
    `autocast_dtype`: the run's autocast (mixed precision), which the trial runs under too."""
    if scope not in SCOPES:
        raise TitanliteError(f"compile scope '{scope}' is not one of {', '.join(SCOPES)}"
                             f"{closest(scope, SCOPES)}: regional compiles each transformer "
                             f"block, model compiles the whole model")
    if scope == "regional" and not isinstance(getattr(model, "layers", None), (nn.ModuleDict, nn.ModuleList)):
        raise TitanliteError(f"regional compile needs model.layers (the transformer blocks), which "
                             f"{type(model).__name__} does not have: use scope='model'")
    device = torch.device(device) if device is not None else _device_of(model)
    args = getattr(model, "args", None)  # a Transformer's ModelArgs: the block's shapes
    block = _trial_block(model) if example_shape is not None and args is not None else None
    support = compile_support(device, block=block, args=args, example_shape=example_shape,
                              autocast_dtype=autocast_dtype, **compile_kwargs)
    if not support.works:
        if not fallback:
            raise TitanliteError(f"torch.compile cannot run here: {support.why}. Fix: {support.fix}, "
                                 f"or set [compile] fallback=true to train eagerly") from support.error
        more = " ([compile] fallback=false raises with the full traceback)" if support.error else ""
        warnings.warn(f"torch.compile cannot run here, so training continues eagerly (same "
                      f"results, slower): {support.why}. Fix: {support.fix}{more}, or set "
                      f"[compile] enable=false to skip compiling", CompileFallbackWarning, stacklevel=2)
        return model
    if scope == "regional":
        # In place: the block's _compiled_call_impl is set, its parameters are untouched.
        for block in _blocks(model):
            block.compile(**compile_kwargs)
    else:
        model.compile(**compile_kwargs)
    return model


def is_compiled(module: nn.Module) -> bool:
    """True if `module` or any submodule was compiled in place with nn.Module.compile()."""
    return is_compiled_in_place(module)


# ----- can it compile here? ------------------------------------------------------------------

def compile_support(device: torch.device | str, block: nn.Module | None = None, args=None,
                    example_shape: tuple[int, int] | None = None,
                    autocast_dtype: torch.dtype | None = None, **compile_kwargs) -> CompileSupport:
    """Can torch.compile (with these kwargs) run on `device`? Static checks first, because
    they give the clearest fix, then a trial compile, remembered per process: of a copy of
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
    if key not in _TRIALS:
        _TRIALS[key] = (_trial_compile_block(block, args, example_shape, device, compile_kwargs,
                                             autocast_dtype)
                        if real_block else _trial_compile(device, compile_kwargs))
    error = _TRIALS[key]
    if error is None:
        return CompileSupport(device.type, name, True, f"a trial compile of {what} (backend={name}) worked")
    return CompileSupport(device.type, name, False,
                          f"a trial compile of {what} (backend={name}) on {device.type} failed "
                          f"with {_describe(error)}",
                          "check the compile arguments (backend, mode) and this torch install",
                          error)


_TRIALS: dict[tuple, BaseException | None] = {}  # (device, kwargs[, block, shape]) -> error or None


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
                f"{torch.__version__} ({_first_line(e)})",
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
            return f"Inductor on CPU needs a C++ compiler and found none ({_first_line(e)})", fix
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


def _trial_block(model: nn.Module) -> nn.Module | None:
    """Block 0, if a copy of it can run alone. Tensor-parallel blocks (DTensor weights) expect
    sharded inputs and collectives on every rank: those get the tiny trial instead."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)) or len(layers) == 0:
        return None
    block = _blocks(model)[0]
    if any(hasattr(p, "placements") for p in block.parameters()):
        return None
    return block


def _describe(e: BaseException) -> str:
    # Dynamo wraps a backend's own exception (BackendCompilerFailed.inner_exception).
    inner = getattr(e, "inner_exception", None) or e
    return f"{type(inner).__name__}: {_first_line(inner)}"


def _first_line(e: BaseException, limit: int = 160) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ----- what did it capture? ------------------------------------------------------------------

def graph_break_report(fn, *example_args, **example_kwargs) -> dict:
    """Trace `fn(*example_args)` with torch._dynamo.explain and say how it splits into graphs.

    Returns {"graphs", "graph_breaks", "ops" (FX nodes in all graphs), "ops_per_graph",
    "break_reasons": [{"reason", "where"}]}. A compiled model is explained as its eager self.
    Note: explain() resets Dynamo, so compiled models re-trace on their next call (Inductor's
    cache makes that quick)."""
    import torch._dynamo
    with _uncompiled(fn), _quiet_dynamo():
        out = torch._dynamo.explain(fn)(*example_args, **example_kwargs)
    reasons = []
    for r in out.break_reasons:
        frame = r.user_stack[-1] if r.user_stack else None
        where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {(frame.line or '').strip()}" if frame else "?"
        reasons.append({"reason": _first_line(Exception(r.reason), limit=200), "where": where})
    return {"graphs": out.graph_count, "graph_breaks": max(0, out.graph_break_count),
            "ops": out.op_count, "ops_per_graph": [len(ops) for ops in out.ops_per_graph],
            "break_reasons": reasons}


@contextlib.contextmanager
def _uncompiled(fn):
    """Temporarily hide in-place compilation, so explain() traces the Python code itself."""
    modules = list(fn.modules()) if isinstance(fn, nn.Module) else []
    saved = [(m, compiled_call(m)) for m in modules if compiled_call(m) is not None]
    for m, _ in saved:
        set_compiled_call(m, None)
    try:
        yield
    finally:
        for m, impl in saved:
            set_compiled_call(m, impl)


@contextlib.contextmanager
def _quiet_dynamo():
    # Dynamo also logs each break as a multi-line warning; the report already carries it.
    logger = logging.getLogger("torch._dynamo")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# ----- what does it cost, what does it buy? --------------------------------------------------

def forward_backward(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """Forward, cross-entropy, backward (no optimizer): what compile changes in a step."""
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()  # waits for the device


def time_first_call(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                    steps: int = 5, cold: bool = True) -> dict:
    """Seconds for the first training step (compile + run) and the median of the next
    `steps` (steady state); compile_s is the difference. cold=True bypasses Inductor's
    on-disk caches: what a first-ever run pays. Dynamo keeps compiled code per Python
    function, so only the first model of its kind (and shapes) compiles here; later ones reuse it."""
    patch = contextlib.nullcontext()
    if cold:
        import torch._inductor.config
        patch = torch._inductor.config.patch(force_disable_caches=True)
    with patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "dynamo_pgo force disabled by ..." says what we asked
        start = time.perf_counter()
        forward_backward(model, tokens, targets)
        first = time.perf_counter() - start
    steady = statistics.median(_timed(model, tokens, targets) for _ in range(max(1, steps)))
    return {"first_call_s": first, "steady_s": steady, "compile_s": max(0.0, first - steady)}


def steady_step_times(models: dict[str, nn.Module], tokens: torch.Tensor, targets: torch.Tensor,
                      rounds: int = 10, warmup: int = 2) -> dict[str, float]:
    """Median seconds per training step of each model, measured in interleaved rounds (a
    burst of load on a shared machine then hits every model alike, not just one)."""
    for _ in range(warmup):
        for model in models.values():
            forward_backward(model, tokens, targets)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            times[name].append(_timed(model, tokens, targets))
    return {name: statistics.median(t) for name, t in times.items()}


def _timed(model, tokens, targets) -> float:
    synchronize(tokens.device)
    start = time.perf_counter()
    forward_backward(model, tokens, targets)
    return time.perf_counter() - start


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = model.layers
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
