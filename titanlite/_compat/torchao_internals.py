"""The torchao internals titanlite touches, in one place, each with why and what if it moves.

torchao's public FP8 API (`torchao.float8`: Float8LinearConfig, convert_to_float8_training,
precompute_float8_dynamic_scale_for_fsdp) converts and trains a model. Two things notebook 06
teaches need more: recognising a converted layer (the Float8Linear class is not exported) and
quantising one tensor exactly as a Float8Linear casts it (`fp8_roundtrip`, to show the error).
Those live in torchao's float8_linear / float8_scaling_utils / float8_training_tensor modules.

Names and signatures checked in the sources of torchao 0.14, 0.15, 0.16, 0.17 and 0.18 (the
same in all); the tests run it on the installed torchao.
Imports happen on first use, so a torchao that moved them fails with one TitanliteError naming
the fix when FP8 is used, and never breaks `import titanlite`.
"""
from __future__ import annotations

import torch

from ..errors import TitanliteError

CHECKED = "0.14-0.18"


def _moved(what: str, error: ImportError) -> TitanliteError:
    import torchao
    return TitanliteError(f"this torchao ({getattr(torchao, '__version__', '?')}) has no {what} "
                          f"({error}); titanlite's FP8 was checked with torchao {CHECKED}: "
                          f"pip install 'torchao>=0.14,<0.19'")


def float8_linear_class() -> type:
    """torchao's Float8Linear (the layer convert_to_float8_training swaps in), to recognise
    converted layers: torchao.float8 does not export it."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        raise _moved("torchao.float8.float8_linear.Float8Linear", e) from e
    return Float8Linear


def is_float8_linear(module) -> bool:
    return isinstance(module, float8_linear_class())


# The operands a Linear's matmuls cast; upper-cased, each names a torchao GemmInputRole.
ROLES = ("input", "weight", "grad_output")


def quantize_dequantize(x: torch.Tensor, cast_config, role: str,
                        round_scales_to_power_of_2: bool) -> torch.Tensor:
    """`x` cast to FP8 and back exactly as a Float8Linear casts its `role` operand under
    `cast_config` (a torchao CastConfig: target dtype + tensorwise/rowwise granularity). Uses
    the same function Float8Linear's forward calls (hp_tensor_to_float8_dynamic), so the error
    shown is the error training sees, not a re-implementation of it."""
    try:
        from torchao.float8.float8_scaling_utils import (get_maybe_axiswise_dim,
                                                         hp_tensor_to_float8_dynamic)
        from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig
    except ImportError as e:
        raise _moved("float8 scaling functions (hp_tensor_to_float8_dynamic)", e) from e
    if role not in ROLES:
        raise TitanliteError(f"unknown operand role '{role}'; choose one of {', '.join(ROLES)}")
    fp8 = hp_tensor_to_float8_dynamic(
        x, cast_config.target_dtype, LinearMMConfig(),
        gemm_input_role=getattr(GemmInputRole, role.upper()),
        scaling_granularity=cast_config.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(-1, cast_config.scaling_granularity),
        round_scales_to_power_of_2=round_scales_to_power_of_2)
    return fp8.to_original_precision()
