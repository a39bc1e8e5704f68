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
surface. `apply_compile` therefore asks `compile_support` (compile_trial.py) first: static
checks (Dynamo supports this Python, a C++ compiler for Inductor on CPU, Triton on CUDA), then
a trial compile, forward and backward, of a copy of the model's first block on a batch of the
run's shape when it knows the shape (`example_shape`, as the trainer passes it), else of a tiny
matmul. If the trial fails it warns once and leaves the model eager (`fallback=True`) or raises
a one-line TitanliteError (`fallback=False`).
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .._compat.torch_internals import compiled_call, is_compiled_in_place, set_compiled_call
from ..errors import TitanliteError, closest
from ..hardware import synchronize
from .compile_trial import CompileSupport, compile_support, first_line  # noqa: F401  (this API)

SCOPES = ("regional", "model")


class CompileFallbackWarning(UserWarning):
    """torch.compile cannot run here; the model was left eager."""


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
        reasons.append({"reason": first_line(Exception(r.reason), limit=200), "where": where})
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
