"""Mixed precision: compute in 16 bits where it is safe, keep the weights and optimizer in fp32.

    precision = Precision("bf16", device)
    with precision.autocast():
        loss = model(x)...
    precision.backward(loss)
    grad_norm, skipped = precision.step(optimizer, params, grad_clip=1.0)

bf16 keeps fp32's exponent range, so gradients do not underflow: no scaler needed. fp16 has
3 more mantissa bits but only 5 exponent bits; small gradients flush to zero, so the loss is
multiplied by a large scale before backward and the gradients divided by it before the step
(`torch.amp.GradScaler`). When the scaled gradients overflow to inf/nan the step is skipped
and the scale halved — `skipped` reports it, so a notebook can count it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..errors import TitanliteError, closest

MODES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Support:
    device: str
    mode: str
    works: bool
    why: str


def support(mode: str, device: torch.device) -> Support:
    """Can `mode` train on `device`, and why (not)? Decided from what torch reports here."""
    kind = device.type
    if mode == "fp32":
        return Support(kind, mode, True, "always available")
    if kind == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if mode == "bf16" and not torch.cuda.is_bf16_supported():
            return Support(kind, mode, False, f"bf16 needs an Ampere or newer GPU (SM 8.0+), this is "
                                              f"SM {major}.{minor}: use fp16 (with the scaler) or fp32")
        return Support(kind, mode, True, f"tensor cores on SM {major}.{minor}")
    if kind == "mps":
        if mode == "fp16":
            return Support(kind, mode, False, "MPS autocast supports fp16 but torch's GradScaler does "
                                              "not run on MPS in every release: use bf16 (no scaler "
                                              "needed) or fp32")
        try:
            torch.ones(2, device=device, dtype=torch.bfloat16).sum().item()
        except Exception:  # noqa: BLE001 - any failure means "not on this macOS"
            return Support(kind, mode, False, "this macOS/torch cannot run bf16 on MPS (needs macOS 14+): "
                                              "use fp32")
        return Support(kind, mode, True, "Apple GPU, bf16 via Metal")
    # CPU autocast covers bf16 and fp16; whether it is *fast* depends on AMX/AVX-512-BF16/FP16.
    if mode == "fp16":
        return Support(kind, mode, True, "autocast works; GradScaler on CPU needs torch >= 2.3; "
                                         "fast only with AVX-512-FP16/AMX-FP16")
    return Support(kind, mode, True, "autocast works; fast only with AVX-512-BF16 or AMX")


def support_matrix(device: torch.device) -> list[Support]:
    return [support(m, device) for m in MODES]


class Precision:
    def __init__(self, mode: str, device: torch.device):
        if mode not in MODES:
            raise TitanliteError(f"training.mixed_precision='{mode}' is not one of "
                                 f"{', '.join(MODES)}{closest(mode, MODES)}")
        s = support(mode, device)
        if not s.works:
            raise TitanliteError(f"mixed precision '{mode}' is not available on {device.type}: {s.why}")
        self.mode, self.device, self.dtype = mode, device, MODES[mode]
        # Only fp16 needs loss scaling; a disabled scaler is a no-op with the same interface.
        self.scaler = torch.amp.GradScaler(device.type, enabled=(mode == "fp16"))
        self.skipped_steps = 0

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def step(self, optimizer, params, grad_clip: float) -> tuple[float, bool]:
        """Unscale, clip, step (unless the gradients overflowed); returns (grad_norm, skipped)."""
        params = [p for p in params if p.grad is not None]
        self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        scale_before = self.scale
        self.scaler.step(optimizer)  # skips optimizer.step() if any gradient is inf/nan
        self.scaler.update()
        skipped = self.scaler.is_enabled() and self.scale < scale_before
        self.skipped_steps += int(skipped)
        return norm.item(), skipped
