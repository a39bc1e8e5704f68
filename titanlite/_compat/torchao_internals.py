"""The torchao internals titanlite touches beyond the public `torchao.float8`, checked in torchao
0.14-0.18. Imported on first use: one that moved fails with a TitanliteError naming the fix, never at
`import titanlite`."""
from __future__ import annotations

import torch

from ..errors import TitanliteError

CHECKED = "0.14-0.18"
ROLES = ("input", "weight", "grad_output")  # the operands a Linear casts; upper-cased, GemmInputRoles


def _moved(what: str, error: ImportError) -> TitanliteError:
    import torchao
    return TitanliteError(f"this torchao ({getattr(torchao, '__version__', '?')}) has no {what} "
                          f"({error}); titanlite's FP8 was checked with torchao {CHECKED}: "
                          f"pip install 'torchao>=0.14,<0.19'")


def float8_linear_class() -> type:
    """torchao's Float8Linear: convert_to_float8_training swaps it in, torchao.float8 does not export it."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        raise _moved("torchao.float8.float8_linear.Float8Linear", e) from e
    return Float8Linear


def is_float8_linear(module) -> bool:
    return isinstance(module, float8_linear_class())


def quantize_dequantize(x: torch.Tensor, cast_config, role: str,
                        round_scales_to_power_of_2: bool) -> torch.Tensor:
    """`x` cast to FP8 and back exactly as a Float8Linear casts its `role` operand under `cast_config`
    (a torchao CastConfig), by the function its forward calls: the error shown is the one training sees."""
    try:
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig
    except ImportError as e:
        raise _moved("float8 scaling functions (hp_tensor_to_float8_dynamic)", e) from e
    if role not in ROLES:
        raise TitanliteError(f"unknown operand role '{role}'; choose one of {', '.join(ROLES)}")
    return hp_tensor_to_float8_dynamic(
        x, cast_config.target_dtype, LinearMMConfig(), gemm_input_role=getattr(GemmInputRole, role.upper()),
        scaling_granularity=cast_config.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(-1, cast_config.scaling_granularity),
        round_scales_to_power_of_2=round_scales_to_power_of_2).to_original_precision()
