"""The torchao internals only titanlite's tools touch (the core's are in torchao_internals.py), checked
in torchao 0.14-0.18: the cast a Float8Linear makes, which notebook 06's FP8 numerics show."""

import torch

from ..errors import TitanliteError
from .torchao_internals import ROLES, _moved


def quantize_dequantize(
    x: torch.Tensor, cast_config, role: str, round_scales_to_power_of_2: bool
) -> torch.Tensor:
    """`x` cast to FP8 and back exactly as a Float8Linear casts its `role` operand under `cast_config`
    (a torchao CastConfig), by the function its forward calls: the error shown is the one training sees."""
    try:
        from torchao.float8.float8_scaling_utils import (
            get_maybe_axiswise_dim,
            hp_tensor_to_float8_dynamic,
        )
        from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig
    except ImportError as e:
        raise _moved("float8 scaling functions (hp_tensor_to_float8_dynamic)", e) from e
    if role not in ROLES:
        raise TitanliteError(f"unknown operand role '{role}'; choose one of {', '.join(ROLES)}")
    return hp_tensor_to_float8_dynamic(
        x,
        cast_config.target_dtype,
        LinearMMConfig(),
        gemm_input_role=getattr(GemmInputRole, role.upper()),
        scaling_granularity=cast_config.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(-1, cast_config.scaling_granularity),
        round_scales_to_power_of_2=round_scales_to_power_of_2,
    ).to_original_precision()
