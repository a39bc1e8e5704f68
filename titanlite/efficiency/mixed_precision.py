"""Mixed precision: compute in 16 bits where it is safe, keep the weights and optimizer in fp32.

    precision = Precision("bf16", device)
    with precision.autocast():
        loss = model(x)...
    precision.backward(loss)
    grad_norm, skipped = precision.step(optimizer, params, grad_clip=1.0)

bf16 keeps fp32's exponent range: gradients do not underflow, no scaler needed. fp16 has 3 more mantissa
bits but 5 exponent bits: small gradients flush to zero, so `torch.amp.GradScaler` scales the loss up before
backward and the gradients back down before the step, skipping the step and halving the scale on overflow."""

import contextlib
import functools
import math
import warnings

import torch

from .._compat.torch_internals import scaler_scale
from ..device_policy import enable_tf32, resolve_mixed_precision, tf32_default
from ..errors import TitanliteError, closest

MODES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
CHOICES = ("auto", *MODES)  # auto: resolved per device (device_policy.default_mixed_precision)


class Precision:
    """Autocast + (for fp16) loss scaling, behind the three calls the training step makes. "auto": bf16
    on CUDA SM 8.0+, fp16 on older GPUs, fp32 on CPU/MPS. tf32 None: TF32 for fp32 CUDA matmuls on SM 8.0+."""

    def __init__(
        self,
        mode: str,
        device,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        tf32: bool | None = None,
        scaler_ok: bool = True,
        param_dtype: torch.dtype | None = None,
    ):
        check_mode(mode, allow_auto=True)
        device = torch.device(device)
        if not _present(device.type):
            raise TitanliteError(
                f"mixed precision '{mode}' was asked for on {device.type}, which "
                f"this machine does not have: use --training.device auto"
            )
        mode = resolve_mixed_precision(mode, device, scaler_ok)
        if param_dtype is not None:  # known now (the trainer): refuse before any step runs
            check_param_dtype(mode, param_dtype)
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if tf32 or (
            tf32 is None and tf32_default(device.type, capability)
        ):  # None: the device's default
            enable_tf32()  # fp32 matmuls that remain (and fp32 runs) on TF32 tensor cores
        if (failure := probe(mode, str(device))) is not None:
            raise TitanliteError(
                f"mixed precision '{mode}' is not available on {device.type}: {failure}"
            )
        self.mode, self.device, self.dtype = mode, device, MODES[mode]
        self.scaler = torch.amp.GradScaler(
            device.type,
            init_scale=init_scale,  # fp16 only (off: a no-op)
            growth_interval=growth_interval,
            enabled=(mode == "fp16"),
        )
        self.skipped_steps = 0  # a device tensor once fp16 steps have run: read when logging

    def autocast(self):
        return (
            torch.autocast(self.device.type, dtype=self.dtype)
            if self.dtype
            else contextlib.nullcontext()
        )

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def step(self, optimizer, params, grad_clip: float, clip=None) -> tuple[torch.Tensor, bool]:
        """Unscale, clip, step (unless the gradients overflowed); returns (grad_norm, skipped).
        `clip(params, max_norm)`: clips by a norm computed elsewhere (a pipeline's, over all its
        stages); default torch's clip_grad_norm_ (0: measure the norm, clip nothing)."""
        params = [p for p in params if p.grad is not None]
        if self.scaler.is_enabled():  # before unscale_, whose own error names no fix
            for dtype in {p.dtype for p in params}:
                check_param_dtype(self.mode, dtype)
        self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        norm = (clip or clip_grad_norm)(params, grad_clip or float("inf"))
        # The scale stays on the device: reading it (get_scale) would wait for the GPU twice a
        # step. Compared there, a skip is a device bool, read only when the step is logged.
        scale_before = scaler_scale(self.scaler).clone() if self.scaler.is_enabled() else None
        # A disabled scaler (bf16, fp32) just calls optimizer.step(), and its update does nothing.
        self.scaler.step(optimizer)  # skips optimizer.step() if any gradient is inf/nan
        self.scaler.update()  # ... and then halves the scale: that is how we see a skip
        skipped = scale_before is not None and scaler_scale(self.scaler) < scale_before
        self.skipped_steps = self.skipped_steps + skipped  # unchanged (+ False) without a scaler
        if hasattr(norm, "full_tensor"):  # FSDP: the norm is a DTensor, already summed over ranks
            norm = norm.full_tensor()
        # the norm (and an fp16 skip) stay on the device: read them when logging (that waits)
        return norm.detach(), skipped

    def advance(self, scheduler) -> None:
        """`scheduler.step()`. A step the fp16 scaler skipped still advances the schedule
        (torchtitan does the same); torch then warns, once, that the schedule moved before the
        optimizer did, which here is no mistake."""
        if not self.scaler.is_enabled():  # only a scaler skips a step: no warning to expect
            return scheduler.step()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            scheduler.step()


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ (max_norm inf: the norm only), over parameters that may be sharded
    on different meshes (expert parallel: the experts over ep, the rest over dp_shard × ep): each
    mesh's part of the norm summed over its own ranks, then the parts added."""
    by_mesh = {}
    for p in params:
        by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
    if len(by_mesh) <= 1:  # none: a step fault tolerance did not commit dropped every gradient
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    parts = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in by_mesh.values()]
    # the parts' own 2-norm, as torch's get_total_norm combines per-tensor norms
    norm = torch.linalg.vector_norm(
        torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in parts])
    )
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def check_mode(mode: str, allow_auto: bool = False) -> None:
    choices = CHOICES if allow_auto else tuple(MODES)
    if mode not in choices:
        raise TitanliteError(
            f"training.mixed_precision='{mode}' is not one of "
            f"{', '.join(choices)}{closest(str(mode), choices)}"
        )


def check_param_dtype(mode: str, param_dtype: torch.dtype) -> None:
    """fp16 autocast needs fp32 master weights: GradScaler will not unscale fp16 gradients in place."""
    if mode == "fp16" and param_dtype == torch.float16:
        raise TitanliteError(
            "training.dtype float16 with training.mixed_precision fp16: GradScaler "
            "needs fp32 weights to unscale into: use --training.dtype float32 "
            "(fp16 autocast still runs the matmuls in fp16)"
        )


def _present(kind: str) -> bool:
    return (
        torch.cuda.is_available()
        if kind == "cuda"
        else kind != "mps" or torch.backends.mps.is_available()
    )


@functools.cache
def probe(mode: str, device_str: str) -> str | None:
    """None if `mode` trains on this device, else why not and the fix (cached per process)."""
    device = torch.device(device_str)
    # Older GPUs can emulate bf16, slowly; refuse it (as hardware.resolve_dtype does) and say why.
    if (
        device.type == "cuda"
        and mode == "bf16"
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        major, minor = torch.cuda.get_device_capability(device)
        return (
            f"bf16 needs an Ampere or newer GPU (SM 8.0+), this is SM {major}.{minor}: "
            f"use fp16 (with the scaler) or fp32"
        )
    if (failure := _probe_step(mode, device)) is None:
        return None
    fix = {
        "fp32": "report this as a bug",
        "bf16": (
            f"bf16 on MPS needs macOS 14+ (this is "
            f"{'' if torch.backends.mps.is_macos_or_newer(14, 0) else 'not '}14+): use fp32"
            if device.type == "mps"
            else "use fp32"
        ),
        "fp16": "use bf16 (no scaler needed) or fp32",  # GradScaler runs on MPS since torch 2.8
    }[mode]
    return f"the probe step failed ({failure}): {fix}"


def _probe_step(mode: str, device: torch.device) -> str | None:
    """One training step of a 16x16 matmul in `mode`, then one with an injected inf gradient; None if
    both behaved. No randomness: the model's initialisation must not depend on which mode was probed."""
    dtype = MODES[mode]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # autocast *warns* and disables itself on bad dtypes
            w = torch.linspace(-1, 1, 256, device=device).view(16, 16).requires_grad_()
            x = torch.linspace(-1, 1, 64, device=device).view(4, 16)
            opt = torch.optim.SGD([w], lr=0.1)
            scaler = torch.amp.GradScaler(device.type, enabled=(mode == "fp16"))
            for inject_inf in (False, True):
                with (
                    torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
                ):
                    out = x @ w
                if dtype is not None and out.dtype != dtype:
                    notes = "; ".join(str(c.message).splitlines()[0] for c in caught)
                    return f"autocast did not run the matmul in {mode} ({notes or out.dtype})"
                scaler.scale(out.float().square().mean()).backward()
                if inject_inf:
                    w.grad[0, 0] = math.inf
                before, scale = w.detach().clone(), scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                changed = not torch.equal(before, w.detach())  # .equal syncs the device
                if not inject_inf and not (changed and torch.isfinite(w).all()):
                    return "a normal step did not update the weights correctly"
                if inject_inf and mode == "fp16" and (changed or scaler.get_scale() >= scale):
                    return "GradScaler did not skip an overflowing step and halve its scale"
                opt.zero_grad()
    except Exception as e:  # any failure means "does not work here"; say which
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None
