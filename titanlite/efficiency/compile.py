"""torch.compile, applied the way torchtitan does it: one transformer block at a time.

    model = apply_compile(model, scope="regional")   # in place; state-dict names unchanged

Regional: every block runs the same code on same-shaped tensors and Dynamo guards on the block's
type, so block 0's compiled graph serves every later block: compile time is one block's, however
deep the model. Compile is lazy, so a failure would surface mid-run: a trial compile comes first."""

import warnings

import torch
from torch import nn

from .._compat.torch_internals import is_compiled_in_place as is_compiled  # noqa: F401  (this API)
from ..errors import TitanliteError, closest
from .compile_trial import CompileSupport, compile_support, first_line  # noqa: F401  (this API)

SCOPES = ("regional", "model")


class CompileFallbackWarning(UserWarning):
    """torch.compile cannot run here; the model was left eager."""


def apply_compile(
    model: nn.Module,
    scope: str = "regional",
    fallback: bool = True,
    device: torch.device | str | None = None,
    example_shape: tuple[int, int] | None = None,
    autocast_dtype: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
    **compile_kwargs,
) -> nn.Module:
    """Compile `model` in place ("regional": each block, "model": all of it) and return it. `device`:
    where it will run (default: its parameters'; pass it for a meta-device model); the trial compiles
    block 0 on an `example_shape` (batch, seq_len) batch under the run's `autocast_dtype`, with its
    weights in `param_dtype` where they compute in another dtype than they are kept in (FSDP)."""
    if scope not in SCOPES:
        raise TitanliteError(
            f"compile scope '{scope}' is not one of {', '.join(SCOPES)}"
            f"{closest(scope, SCOPES)}: regional compiles each transformer "
            f"block, model compiles the whole model"
        )
    layers = getattr(model, "layers", None)  # the transformer blocks
    blocks = list(layers.children()) if isinstance(layers, (nn.ModuleDict, nn.ModuleList)) else None
    if scope == "regional" and blocks is None:
        raise TitanliteError(
            f"regional compile needs model.layers (the transformer blocks), which "
            f"{type(model).__name__} does not have: use scope='model'"
        )
    # The trial compiles a copy of block 0 if it can run alone. Tensor-parallel blocks (DTensor
    # weights) expect sharded inputs and collectives on every rank: those get the tiny trial instead.
    sharded = blocks and any(hasattr(p, "placements") for p in blocks[0].parameters())
    support = compile_support(
        # where it will run: the parameters' device unless told (a meta-device model is told)
        device if device is not None else next((p.device for p in model.parameters()), "cpu"),
        block=blocks[0] if blocks and not sharded else None,
        args=getattr(model, "args", None),  # a Transformer's ModelArgs: the block's shapes
        example_shape=example_shape,
        autocast_dtype=autocast_dtype,
        param_dtype=param_dtype,
        **compile_kwargs,
    )
    if not support.works:
        if not fallback:
            raise TitanliteError(
                f"torch.compile cannot run here: {support.why}. Fix: {support.fix}, "
                f"or set [compile] fallback=true to train eagerly"
            ) from support.error
        more = " ([compile] fallback=false raises with the full traceback)" if support.error else ""
        warnings.warn(
            f"torch.compile cannot run here, so training continues eagerly (same "
            f"results, slower): {support.why}. Fix: {support.fix}{more}, or set "
            f"[compile] enable=false to skip compiling",
            CompileFallbackWarning,
            stacklevel=2,
        )
        return model
    for module in blocks if scope == "regional" else [model]:
        module.compile(**compile_kwargs)
    return model
