"""FP8 training: swap the big nn.Linear layers for torchao's Float8Linear.

    model = apply_fp8(model, recipe="tensorwise", min_dim=64)   # in place, before AC/compile
    model.fp8_info   # {"recipe", "emulated", "why", "converted": [...], "skipped": {name: reason}}

A Float8Linear keeps its weight in high precision (fp32/bf16; the optimizer never sees FP8).
Each forward/backward it scales input, weight and output-gradient into FP8's narrow range,
multiplies in FP8 and returns a high-precision result:

    scale = fp8_max / amax(x)        (one per tensor: "tensorwise"; one per row: "rowwise")
    x_fp8 = cast(clamp(x · scale))   ...   y = (x_fp8 @ w_fp8) / (scale_x · scale_w)

tensorwise: e4m3 (3 mantissa bits) for input and weight, e5m2 (wider range, 2 bits) for
gradients; the fastest cuBLAS kernel. rowwise: e4m3 everywhere with a power-of-two scale per
row, so one outlier row no longer squeezes the others; more accurate, needs CUTLASS kernels.

Real FP8 matmuls need FP8 tensor cores: CUDA SM >= 8.9 (L4, L40S, RTX 4090, H100, ...).
Elsewhere torchao *emulates*: the same quantisation, then dequantise and multiply in fp32. The
numerics (what this module teaches) are identical; the speed is not - emulation is slower than
plain fp32, so an emulated run is labelled as such and never reported as an FP8 speed-up.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from .._compat.torchao_internals import ROLES, is_float8_linear, quantize_dequantize
from ..errors import TitanliteError, closest

RECIPES = ("tensorwise", "rowwise")  # torchao recipe names (Float8LinearRecipeName)
FP8_GEMM_MULTIPLE = 16  # torch._scaled_mm needs both matrix sides divisible by 16
# torchtitan keeps the vocabulary projection in high precision; with tied embeddings its
# weight is the embedding table too.
SKIP_NAMES = ("output",)


@dataclass
class FP8Support:
    device: str
    real: bool       # FP8 tensor cores run the matmuls
    available: bool  # FP8 training can run at all here (real or emulated)
    why: str


def _fp8_linear_works(device: torch.device, recipe: str, emulate: bool) -> bool:
    """One tiny Float8Linear forward/backward on `device`. Probing beats version checks, and
    casting a tensor to float8 is not enough: torchao computes scales from amaxes (in float64
    on some paths, which MPS lacks), clamps, casts, and for real FP8 calls `_scaled_mm`, whose
    kernels differ per recipe (rowwise came to SM 8.9 later than to SM 9.0)."""
    dtype = torch.float32 if emulate else torch.bfloat16
    # fork_rng: the probe's random init must not shift the training run's random streams.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            lin = nn.Sequential(nn.Linear(32, 32, bias=False)).to(device, dtype)
            convert_to_float8_training(lin, config=_config(recipe, emulate=emulate))
            x = torch.randn(16, 32, device=device, dtype=dtype, requires_grad=True)
            lin(x).float().sum().backward()
            return bool(torch.isfinite(x.grad).all() and torch.isfinite(lin[0].weight.grad).all())
        except (RuntimeError, ValueError, TypeError, NotImplementedError, AssertionError):
            return False


def fp8_support(device: torch.device | str, recipe: str = "tensorwise") -> FP8Support:
    """Can this device train in FP8, for real or emulated, and why?"""
    device = torch.device(device)
    kind = device.type
    _check_recipe(recipe)
    if not _fp8_linear_works(device, recipe, emulate=True):
        return FP8Support(kind, False, False, f"torchao's FP8 '{recipe}' recipe cannot run on "
                          f"{kind} with torch {torch.__version__} (a tiny emulated Float8Linear "
                          f"forward/backward failed: float8 dtypes or the float64 scale math are "
                          f"missing there): train FP8 on a CUDA GPU or the CPU "
                          f"(--training.device cpu, emulated), or disable float8")
    if kind == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return FP8Support(kind, False, True, f"SM {major}.{minor} has no FP8 tensor cores "
                              f"(they start at SM 8.9): torchao emulates FP8 in high precision")
        if not _fp8_linear_works(device, recipe, emulate=False):
            return FP8Support(kind, False, True, f"this torch has no real '{recipe}' FP8 kernel "
                              f"for SM {major}.{minor}: torchao emulates it")
        return FP8Support(kind, True, True, f"FP8 tensor cores on SM {major}.{minor}")
    # torch ships a CPU _scaled_mm for correctness, but no CPU here has FP8 matrix units:
    # it is no faster than emulation, so "real" FP8 is reserved for hardware that gains.
    return FP8Support(kind, False, True, f"{kind} has no FP8 matrix units: torchao emulates FP8 "
                      f"(quantise, then multiply in fp32) - same numerics, slower than fp32")


def needs_emulate_precision_casts(recipe: str, compiled: bool) -> bool:
    """Should Inductor emulate eager's precision casts? Compiled rowwise FP8 rounds its
    power-of-two scales differently from eager unless it does (torchtitan sets
    `torch._inductor.config.emulate_precision_casts = True` for rowwise + compile)."""
    return compiled and recipe == "rowwise"


def set_precision_casts_for(recipe: str, compiled: bool) -> bool:
    """Turn Inductor's `emulate_precision_casts` on where `needs_emulate_precision_casts`
    says so (never off: other code may rely on it). Returns whether it is on now."""
    import torch._inductor.config as inductor_config
    if needs_emulate_precision_casts(recipe, compiled):
        inductor_config.emulate_precision_casts = True
    return bool(inductor_config.emulate_precision_casts)


def _config(recipe: str, emulate: bool, fsdp_all_gather: bool = False) -> Float8LinearConfig:
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_all_gather)


def skip_reason(name: str, linear: nn.Linear, min_dim: int) -> str | None:
    """Why this Linear stays in high precision, or None if it converts to FP8."""
    if name.split(".")[-1] in SKIP_NAMES:
        return ("output projection (logits): kept in high precision, as torchtitan does - "
                "its error goes straight into the loss")
    out_f, in_f = linear.weight.shape
    if in_f % FP8_GEMM_MULTIPLE or out_f % FP8_GEMM_MULTIPLE:
        return (f"{in_f}→{out_f} features not divisible by {FP8_GEMM_MULTIPLE} "
                f"(FP8 matmul kernels need it)")
    if min(in_f, out_f) < min_dim:
        return (f"{in_f}→{out_f} features below min_dim={min_dim}: the casts would cost more "
                f"than the faster matmul saves")
    return None


def apply_fp8(model: nn.Module, recipe: str = "tensorwise", device=None, min_dim: int = 64,
              emulate: bool | None = None, fsdp_all_gather: bool = False) -> nn.Module:
    """Swap qualifying nn.Linear layers for Float8Linear in place; returns the model with
    `model.fp8_info` describing the run. emulate=None: real FP8 where the hardware has it.
    fsdp_all_gather: FSDP gathers these weights in FP8 (half of bf16's bytes), which needs
    `precompute_fp8_scales(model)` after every optimizer step (titanlite.distributed.fsdp)."""
    _check_recipe(recipe)
    if fsdp_all_gather and recipe != "tensorwise":
        raise TitanliteError(f"FP8 all-gather needs one scale per weight tensor, i.e. the tensorwise "
                             f"recipe, not '{recipe}': use --float8.recipe tensorwise or turn off "
                             f"--float8.fsdp_all_gather")
    if min_dim < 1:
        raise TitanliteError(f"float8.min_dim must be positive, got {min_dim}: e.g. 64")
    if any(is_float8_linear(m) for m in model.modules()):
        raise TitanliteError("this model is already converted to FP8: call apply_fp8 once, on a "
                             "freshly built model")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    support = fp8_support(device, recipe)
    if not support.available:
        raise TitanliteError(support.why)
    if emulate is False and not support.real:
        raise TitanliteError(f"real FP8 is not available here ({support.why.split(':')[0]}): "
                             f"it needs a CUDA GPU with SM >= 8.9 (H100, L4, L40S, RTX 4090); "
                             f"use float8.emulate auto (emulates here) or true")
    emulated = not support.real if emulate is None else emulate

    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    skipped = {name: reason for name, m in linears.items()
               if (reason := skip_reason(name, m, min_dim)) is not None}
    if len(skipped) == len(linears):
        sizes = sorted({(m.in_features, m.out_features) for m in linears.values()})
        raise TitanliteError(
            f"no Linear layer qualifies for FP8 (sizes in→out: "
            f"{', '.join(f'{i}→{o}' for i, o in sizes)}): FP8 needs in/out features >= min_dim="
            f"{min_dim} and divisible by {FP8_GEMM_MULTIPLE}; use a larger model preset or "
            f"lower float8.min_dim")

    convert_to_float8_training(model, config=_config(recipe, emulated, fsdp_all_gather),
                               module_filter_fn=lambda m, fqn: fqn not in skipped)
    converted = [n for n, m in model.named_modules() if is_float8_linear(m)]
    why = support.why
    if emulated and support.real:
        why = "emulation requested (float8.emulate true) although this GPU has FP8 tensor cores"
    model.fp8_info = {"recipe": recipe, "emulated": emulated, "device": device.type, "why": why,
                      "label": f"FP8 {recipe} ({'emulated' if emulated else 'real'})",
                      "fsdp_all_gather": fsdp_all_gather,
                      "converted": converted, "skipped": skipped}
    return model


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
        raise TitanliteError(f"unknown operand role '{role}'{closest(role, _CAST_CONFIGS)}; "
                             f"choose one of {', '.join(_CAST_CONFIGS)}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    return config, getattr(config, _CAST_CONFIGS[role])


def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise TitanliteError(f"unknown FP8 recipe '{recipe}'{closest(recipe, RECIPES)}; "
                             f"choose one of {', '.join(RECIPES)} (float8.recipe)")
