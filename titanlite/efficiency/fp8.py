"""FP8 training: swap the big nn.Linear layers for torchao's Float8Linear.

    model = apply_fp8(model, recipe="tensorwise", min_dim=64)   # in place, before AC/compile
    model.fp8_info   # {"recipe", "emulated", "why", "converted": [...], "skipped": {name: reason}}

Weights stay in high precision; matmuls scale operands into FP8 by fp8_max / amax. tensorwise: one scale per
tensor, e4m3 forward, e5m2 gradients, the fastest (cuBLAS) kernel; rowwise: e4m3, a power-of-two scale per
row (an outlier row no longer squeezes the others): more accurate, CUTLASS. Below SM 8.9 torchao emulates FP8."""

import dataclasses
import functools

import torch
from torch import nn
from torchao.float8 import (
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)

from .._compat.torchao_internals import is_float8_linear
from ..errors import TitanliteError, closest

RECIPES = ("tensorwise", "rowwise")  # torchao recipe names (Float8LinearRecipeName)
FP8_GEMM_MULTIPLE = 16  # torch._scaled_mm needs both matrix sides divisible by 16


@dataclasses.dataclass
class FP8Support:
    device: str
    real: bool  # FP8 tensor cores run the matmuls
    available: bool  # FP8 training can run at all here (real or emulated)
    why: str


def apply_fp8(
    model: nn.Module,
    recipe: str = "tensorwise",
    device=None,
    min_dim: int = 64,
    emulate: bool | None = None,
    fsdp_all_gather: bool = False,
) -> nn.Module:
    """Swap qualifying nn.Linear layers for Float8Linear in place (`model.fp8_info` says how); emulate=None:
    real FP8 if possible. fsdp_all_gather: FSDP gathers in FP8 (half the bytes); see precompute_fp8_scales."""
    _check_recipe(recipe)
    if fsdp_all_gather and recipe != "tensorwise":
        raise TitanliteError(
            f"FP8 all-gather needs one scale per weight tensor, i.e. the tensorwise "
            f"recipe, not '{recipe}': use --float8.recipe tensorwise or turn off "
            f"--float8.fsdp_all_gather"
        )
    if min_dim < 1:
        raise TitanliteError(f"float8.min_dim must be positive, got {min_dim}: e.g. 64")
    if any(is_float8_linear(m) for m in model.modules()):
        raise TitanliteError(
            "this model is already converted to FP8: call apply_fp8 once, on a freshly built model"
        )
    device = torch.device(device) if device is not None else next(model.parameters()).device
    support = fp8_support(device, recipe)
    if not support.available:
        raise TitanliteError(support.why)
    if emulate is False and not support.real:
        raise TitanliteError(
            f"real FP8 is not available here ({support.why.split(':')[0]}): "
            f"it needs a CUDA GPU with SM >= 8.9 (H100, L4, L40S, RTX 4090); "
            f"use float8.emulate auto (emulates here) or true"
        )
    emulated = not support.real if emulate is None else emulate
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    skipped = {
        n: reason for n, m in linears.items() if (reason := skip_reason(n, m, min_dim)) is not None
    }
    if len(skipped) == len(linears):
        sizes = sorted({(m.in_features, m.out_features) for m in linears.values()})
        raise TitanliteError(
            f"no Linear layer qualifies for FP8 (sizes in→out: "
            f"{', '.join(f'{i}→{o}' for i, o in sizes)}): FP8 needs in/out features >= "
            f"min_dim={min_dim} and divisible by {FP8_GEMM_MULTIPLE}; use a larger model "
            f"preset or lower float8.min_dim"
        )
    convert_to_float8_training(
        model,
        config=_config(recipe, emulated, fsdp_all_gather),
        module_filter_fn=lambda m, fqn: fqn not in skipped,
    )
    model.fp8_info = {
        "recipe": recipe,
        "emulated": emulated,
        "device": device.type,
        "why": (
            "emulation requested (float8.emulate true) although this GPU has FP8 tensor cores"
            if emulated and support.real
            else support.why
        ),
        "label": f"FP8 {recipe} ({'emulated' if emulated else 'real'})",
        "fsdp_all_gather": fsdp_all_gather,
        "converted": [n for n, m in model.named_modules() if is_float8_linear(m)],
        "skipped": skipped,
    }
    if fsdp_all_gather:  # build_optimizer calls it after every step: the new weights' scales
        model.after_optimizer_step = functools.partial(precompute_fp8_scales, model)
    return model


def skip_reason(name: str, linear: nn.Linear, min_dim: int) -> str | None:
    """Why this Linear stays in high precision, or None if it converts to FP8."""
    # as torchtitan; with tied embeddings its weight is the embedding table too
    if name.split(".")[-1] == "output":
        return (
            "output projection (logits): kept in high precision, as torchtitan does - "
            "its error goes straight into the loss"
        )
    out_f, in_f = linear.weight.shape
    if in_f % FP8_GEMM_MULTIPLE or out_f % FP8_GEMM_MULTIPLE:
        return f"{in_f}→{out_f} features not divisible by {FP8_GEMM_MULTIPLE} (FP8 matmul kernels need it)"
    if min(in_f, out_f) < min_dim:
        return (
            f"{in_f}→{out_f} features below min_dim={min_dim}: the casts would cost more "
            f"than the faster matmul saves"
        )
    return None


def fp8_support(device: torch.device | str, recipe: str = "tensorwise") -> FP8Support:
    """Can this device train in FP8, for real or emulated, and why?"""
    device = torch.device(device)
    _check_recipe(recipe)
    if not _fp8_linear_works(device, recipe, emulate=True):
        return FP8Support(
            device.type,
            False,
            False,
            f"torchao's FP8 '{recipe}' recipe cannot run on {device.type} "
            f"with torch {torch.__version__} (a tiny emulated Float8Linear forward/backward "
            f"failed: float8 dtypes or the float64 scale math are missing there): train FP8 "
            f"on a CUDA GPU or the CPU (--training.device cpu, emulated), or disable float8",
        )
    # torch's CPU _scaled_mm is for correctness only: no CPU has FP8 units to gain
    if device.type != "cuda":
        return FP8Support(
            device.type,
            False,
            True,
            f"{device.type} has no FP8 matrix units: torchao emulates FP8 "
            f"(quantise, then multiply in fp32) - same numerics, and the casts are extra work",
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return FP8Support(
            device.type,
            False,
            True,
            f"SM {major}.{minor} has no FP8 tensor cores "
            f"(they start at SM 8.9): torchao emulates FP8 in high precision",
        )
    if not _fp8_linear_works(device, recipe, emulate=False):
        return FP8Support(
            device.type,
            False,
            True,
            f"this torch has no real '{recipe}' FP8 kernel "
            f"for SM {major}.{minor}: torchao emulates it",
        )
    return FP8Support(device.type, True, True, f"FP8 tensor cores on SM {major}.{minor}")


def _fp8_linear_works(device: torch.device, recipe: str, emulate: bool) -> bool:
    """One tiny Float8Linear forward/backward: probing beats version checks (scale math, kernels)."""
    dtype = torch.float32 if emulate else torch.bfloat16
    with torch.random.fork_rng(
        devices=[device] if device.type == "cuda" else []
    ):  # the run's RNG stays
        try:
            lin = nn.Sequential(nn.Linear(32, 32, bias=False)).to(device, dtype)
            convert_to_float8_training(lin, config=_config(recipe, emulate=emulate))
            x = torch.randn(16, 32, device=device, dtype=dtype, requires_grad=True)
            lin(x).float().sum().backward()
            return bool(torch.isfinite(x.grad).all() and torch.isfinite(lin[0].weight.grad).all())
        except (RuntimeError, ValueError, TypeError, NotImplementedError, AssertionError):
            return False


def set_precision_casts_for(recipe: str, compiled: bool) -> bool:
    """Turn Inductor's `emulate_precision_casts` on where needed (never off); returns whether it is on."""
    import torch._inductor.config as inductor_config  # Inductor: compiled FP8 runs only

    # Compiled rowwise FP8 rounds its scales unlike eager unless Inductor emulates eager's casts.
    if compiled and recipe == "rowwise":
        inductor_config.emulate_precision_casts = True
    return bool(inductor_config.emulate_precision_casts)


def _config(recipe: str, emulate: bool, fsdp_all_gather: bool = False) -> Float8LinearConfig:
    return dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe),
        emulate=emulate,
        enable_fsdp_float8_all_gather=fsdp_all_gather,
    )


def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise TitanliteError(
            f"unknown FP8 recipe '{recipe}'{closest(recipe, RECIPES)}; "
            f"choose one of {', '.join(RECIPES)} (float8.recipe)"
        )


def precompute_fp8_scales(model: nn.Module) -> None:
    """FP8 all-gather: every weight's FP8 scale, after each optimizer step, from one all-reduce of amaxes."""
    if (getattr(model, "fp8_info", None) or {}).get("fsdp_all_gather"):
        precompute_float8_dynamic_scale_for_fsdp(model)
