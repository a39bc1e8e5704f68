"""FP8 casts, operand by operand, exactly as torchao's Float8Linear makes them: what notebook 06
checks its from-scratch tensorwise and rowwise scaling against.

    x8 = fp8_roundtrip(x, "rowwise", role="input")   # quantised to FP8 and back
    fp8_dtype_for("tensorwise", "grad_output")       # torch.float8_e5m2
"""

from __future__ import annotations

import torch
from torchao.float8 import Float8LinearConfig

from .._compat.torchao_internals import ROLES
from .._compat.torchao_tools import quantize_dequantize
from ..efficiency.fp8 import _check_recipe
from ..errors import TitanliteError, closest

# Operand roles of a Linear's three matmuls: the cast config of each in a Float8LinearConfig.
_CAST_CONFIGS = {role: f"cast_config_{role}" for role in ROLES}


@torch.no_grad()
def fp8_roundtrip(x: torch.Tensor, recipe: str = "tensorwise", role: str = "input") -> torch.Tensor:
    """x quantised to FP8 and back, exactly as a Float8Linear of `recipe` casts the `role`
    operand (input, weight [out, in] or grad_output) for its forward / grad-input matmul.
    Rowwise scales each row (last dim): per token for activations and gradients, per output
    feature for weights. `x - fp8_roundtrip(x)` is the quantisation error."""
    config, cast = _cast_config(recipe, role)
    return quantize_dequantize(x, cast, role, config.round_scales_to_power_of_2)


def fp8_dtype_for(recipe: str, role: str) -> torch.dtype:
    """The FP8 format `recipe` casts the `role` operand to (e4m3 or e5m2)."""
    return _cast_config(recipe, role)[1].target_dtype


def _cast_config(recipe: str, role: str):
    _check_recipe(recipe)
    if role not in _CAST_CONFIGS:
        raise TitanliteError(
            f"unknown operand role '{role}'{closest(role, _CAST_CONFIGS)}; "
            f"choose one of {', '.join(_CAST_CONFIGS)}"
        )
    config = Float8LinearConfig.from_recipe_name(recipe)
    return config, getattr(config, _CAST_CONFIGS[role])
