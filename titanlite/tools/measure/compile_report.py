"""What torch.compile captured and what it costs: graph breaks, the first call (compiling) vs
the steady steps. Notebook 05 measures both; the core only compiles (efficiency/compile.py).

    graph_break_report(model, tokens)        # {"graphs": 1, "graph_breaks": 0, ...}
    time_first_call(model, tokens, targets)  # {"first_call_s", "steady_s", "compile_s"}
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

from ..._compat.torch_internals import compiled_call, set_compiled_call
from ...efficiency.compile_trial import first_line
from ...hardware import synchronize


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
        where = (
            f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {(frame.line or '').strip()}"
            if frame
            else "?"
        )
        reasons.append({"reason": first_line(Exception(r.reason), limit=200), "where": where})
    return {
        "graphs": out.graph_count,
        "graph_breaks": max(0, out.graph_break_count),
        "ops": out.op_count,
        "ops_per_graph": [len(ops) for ops in out.ops_per_graph],
        "break_reasons": reasons,
    }


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


def time_first_call(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, steps: int = 5, cold: bool = True
) -> dict:
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


def steady_step_times(
    models: dict[str, nn.Module],
    tokens: torch.Tensor,
    targets: torch.Tensor,
    rounds: int = 10,
    warmup: int = 2,
) -> dict[str, float]:
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
