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

What works where is decided at run time (`support`, `support_matrix`): one tiny training step
per mode on the device - autocast matmul, backward, GradScaler step, and an injected overflow
that must be skipped - cached per process. Device types this machine lacks get rows from
documented knowledge, marked `here=False`.
"""
from __future__ import annotations

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..device_policy import enable_tf32, resolve_mixed_precision, tf32_default
from ..errors import TitanliteError, closest

MODES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# "auto" is resolved per device by device_policy.default_mixed_precision: bf16 on Ampere+ GPUs,
# fp16 + GradScaler on older ones, fp32 on CPU and MPS.
CHOICES = ("auto", *MODES)
DEVICE_TYPES = ("cuda", "mps", "cpu")
# x86 CPU flags (as /proc/cpuinfo spells them) of units that make a 16-bit matmul fast.
FAST_CPU_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}


@dataclass(frozen=True)
class Support:
    device: str         # "cuda", "mps" or "cpu"
    mode: str           # "fp32", "bf16" or "fp16"
    works: bool | None  # None: depends on the exact hardware (documented rows only)
    why: str
    fast: bool | None = None  # hardware units for this format? None: unknown, measure it
    here: bool = True   # False: documented knowledge about a device type this machine lacks

    @property
    def source(self) -> str:
        return "probed on this machine" if self.here else "documented, not this machine"


def check_mode(mode: str, allow_auto: bool = False) -> str:
    choices = CHOICES if allow_auto else tuple(MODES)
    if mode not in choices:
        raise TitanliteError(f"training.mixed_precision='{mode}' is not one of "
                             f"{', '.join(choices)}{closest(str(mode), choices)}")
    return mode


def check_param_dtype(mode: str, param_dtype: torch.dtype) -> None:
    """fp16 autocast needs fp32 master weights: GradScaler unscales the gradients in place,
    which it refuses for fp16 ones ("Attempting to unscale FP16 gradients") - and an update
    smaller than an fp16 weight's spacing would be lost anyway."""
    if mode == "fp16" and param_dtype == torch.float16:
        raise TitanliteError("training.dtype float16 with training.mixed_precision fp16: GradScaler "
                             "needs fp32 weights to unscale into: use --training.dtype float32 "
                             "(fp16 autocast still runs the matmuls in fp16)")


def support(mode: str, device) -> Support:
    """Can `mode` train on `device`, and why (not)? Probed here; documented if the device
    type is absent from this machine."""
    check_mode(mode)
    device = torch.device(device)
    if device.type not in DEVICE_TYPES:
        raise TitanliteError(f"no mixed-precision support table for device type '{device.type}'"
                             f"{closest(device.type, DEVICE_TYPES)}: use cuda, mps or cpu")
    if not _present(device.type):
        return _documented(mode, device.type)
    return _probed(mode, str(device))


def support_matrix(device=None) -> list[Support]:
    """A row per (device type, mode): probed for the device types present here (on `device`
    for its type), documented and marked "not this machine" for the others."""
    device = None if device is None else torch.device(device)
    rows = []
    for kind in DEVICE_TYPES:
        target = device if device is not None and device.type == kind else torch.device(kind)
        rows += [support(mode, target) for mode in MODES]
    return rows


def _present(kind: str) -> bool:
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        return mps is not None and mps.is_available()
    return True


def cpu_flags() -> set[str] | None:
    """x86 feature flags: /proc/cpuinfo on Linux, else what torch detects; None where neither
    can tell (an ARM CPU such as Apple Silicon: there, measure instead)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    # torch's own CPUID probes (private, hence getattr), named as /proc/cpuinfo names them.
    probes = {"avx2": "_is_avx2_supported", "avx512f": "_is_avx512_supported",
              "avx512_bf16": "_is_avx512_bf16_supported", "amx_bf16": "_is_amx_tile_supported",
              "amx_fp16": "_is_amx_fp16_supported"}
    found = {flag for flag, name in probes.items() if getattr(torch.cpu, name, lambda: False)()}
    return found or None


def _probe(mode: str, device: torch.device) -> str | None:
    """One training step of a 16x16 matmul in `mode`, then one with an injected inf gradient;
    None if both behaved, else what went wrong. No randomness: the caller's RNG stream (and so
    the model's initialisation) must not depend on which mode was probed."""
    dtype = MODES[mode]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # autocast *warns* and disables itself on bad dtypes
            w = torch.linspace(-1, 1, 256, device=device).view(16, 16).requires_grad_()
            x = torch.linspace(-1, 1, 64, device=device).view(4, 16)
            opt = torch.optim.SGD([w], lr=0.1)
            scaler = torch.amp.GradScaler(device.type, enabled=(mode == "fp16"))
            for inject_inf in (False, True):
                autocast = torch.autocast(device.type, dtype=dtype) if dtype else None
                with autocast or contextlib.nullcontext():
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
    except Exception as e:  # noqa: BLE001 - any failure means "does not work here"; say which
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


@functools.lru_cache(maxsize=None)
def _probed(mode: str, device_str: str) -> Support:
    device = torch.device(device_str)
    kind, version = device.type, torch.__version__.split("+")[0]
    # Older GPUs can emulate bf16, slowly; refuse it (as hardware.resolve_dtype does) and say why.
    native_bf16 = kind == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    if kind == "cuda" and mode == "bf16" and not native_bf16:
        major, minor = torch.cuda.get_device_capability(device)
        why = (f"bf16 needs an Ampere or newer GPU (SM 8.0+), this is SM {major}.{minor}: "
               f"use fp16 (with the scaler) or fp32")
        return Support(kind, mode, False, why, fast=False)
    fast, units = _hardware_note(mode, device)
    failure = _probe(mode, device)
    if failure is None:
        return Support(kind, mode, True, f"probe step ran on torch {version}; {units}", fast=fast)
    fix = {"fp32": "report this as a bug", "bf16": "use fp32",
           "fp16": "use bf16 (no scaler needed) or fp32"}[mode]
    if kind == "mps" and mode == "bf16":
        fix = (f"bf16 on MPS needs macOS 14+ (this is "
               f"{'' if torch.backends.mps.is_macos_or_newer(14, 0) else 'not '}14+): use fp32")
    if kind == "mps" and mode == "fp16":
        fix = f"GradScaler('mps') needs torch >= 2.8 (this is {version}): use bf16 or fp32"
    return Support(kind, mode, False, f"the probe step failed ({failure}): {fix}", fast=fast)


def _hardware_note(mode: str, device: torch.device) -> tuple[bool | None, str]:
    """(has units that make `mode` fast?, why) from what torch and the OS report."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if mode == "fp32":
            return major >= 8, "TF32 tensor cores (if allowed)" if major >= 8 else "CUDA cores"
        if mode == "bf16":
            return True, f"bf16 tensor cores (SM {major}.{minor})"
        return major >= 7, f"fp16 tensor cores (SM {major}.{minor})" if major >= 7 else \
            f"no tensor cores before SM 7.0 (this is SM {major}.{minor})"
    if device.type == "mps":
        return {"fp32": (True, "Apple GPU"),
                "bf16": (None, "bf16 on Metal needs macOS 14+; MPS bf16 autocast since torch 2.6"),
                "fp16": (True, "GradScaler('mps') since torch 2.8 (pytorch#150255)")}[mode]
    isa = torch.backends.cpu.get_cpu_capability()
    if mode == "fp32":
        return True, f"vector ISA {isa}"
    flags = cpu_flags()
    scaler = "; GradScaler('cpu') since torch 2.3" if mode == "fp16" else ""
    have = sorted(set(FAST_CPU_FLAGS[mode]) & (flags or set()))
    if have:
        return True, f"has {', '.join(have)}: {mode} matmuls can beat fp32{scaler}"
    if flags is None:
        return None, f"CPU flags unreadable here: measure {mode} vs fp32 matmuls{scaler}"
    return False, (f"no {' / '.join(FAST_CPU_FLAGS[mode])} in the CPU flags (ISA {isa}): {mode} "
                   f"matmuls are emulated, expect them slower than fp32{scaler}")


_DOCUMENTED = {  # (device type, mode) -> (works, fast, why): public docs and release notes
    ("cuda", "fp32"): (True, True, "always; TF32 tensor cores on SM 8.0+ when allowed"),
    ("cuda", "bf16"): (None, None, "needs SM 8.0+ (A100, RTX 30xx, H100, ...); no scaler needed"),
    ("cuda", "fp16"): (True, None, "every CUDA GPU, with GradScaler; tensor cores from SM 7.0"),
    ("mps", "fp32"): (True, True, "always (Apple Silicon, macOS 12.3+)"),
    ("mps", "bf16"): (None, None, "needs macOS 14+; bf16 autocast on MPS since torch 2.6"),
    ("mps", "fp16"): (True, True, "autocast since torch 2.5; GradScaler('mps') since torch 2.8"),
    ("cpu", "fp32"): (True, True, "always"),
    ("cpu", "bf16"): (True, None, "autocast always works; fast only with AVX512-BF16 or AMX"),
    ("cpu", "fp16"): (True, None, "GradScaler('cpu') since torch 2.3; fast only with AVX512-FP16 "
                                  "or AMX-FP16"),
}


def _documented(mode: str, kind: str) -> Support:
    works, fast, why = _DOCUMENTED[(kind, mode)]
    return Support(kind, mode, works, why, fast=fast, here=False)


class Precision:
    """Autocast + (for fp16) loss scaling, behind the three calls the training step makes.

    mode "auto": bf16 on CUDA SM 8.0+, fp16 on older GPUs, fp32 on CPU/MPS (device_policy).
    tf32 None: allow TF32 for fp32 CUDA matmuls on SM 8.0+ (a process-wide torch switch)."""

    def __init__(self, mode: str, device, init_scale: float = 2.0**16, growth_interval: int = 2000,
                 tf32: bool | None = None, scaler_ok: bool = True, param_dtype: torch.dtype | None = None):
        check_mode(mode, allow_auto=True)
        device = torch.device(device)
        if not _present(device.type):
            raise TitanliteError(f"mixed precision '{mode}' was asked for on {device.type}, which "
                                 f"this machine does not have: use --training.device auto")
        mode = resolve_mixed_precision(mode, device, scaler_ok)
        if param_dtype is not None:  # known now (the trainer): refuse before any step runs
            check_param_dtype(mode, param_dtype)
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if tf32 is None:  # fp32 matmuls that remain (and fp32 runs) on TF32 tensor cores
            tf32 = tf32_default(device.type, capability)
        if tf32:
            enable_tf32()
        s = support(mode, device)
        if not s.works:
            raise TitanliteError(f"mixed precision '{mode}' is not available on {device.type}: "
                                 f"{s.why}")
        self.mode, self.device, self.dtype = mode, device, MODES[mode]
        # Only fp16 needs loss scaling; a disabled scaler is a no-op with the same interface.
        # Defaults are GradScaler's: start at 2**16, double after 2000 overflow-free steps.
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale,
                                           growth_interval=growth_interval,
                                           enabled=(mode == "fp16"))
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

    def step(self, optimizer, params, grad_clip: float) -> tuple[torch.Tensor, bool]:
        """Unscale, clip, step (unless the gradients overflowed); returns (grad_norm, skipped),
        the norm a 0-d tensor on the device (float() it when needed: that waits for the device)."""
        params = [p for p in params if p.grad is not None]
        if self.scaler.is_enabled():  # before unscale_, whose own error names no fix
            for dtype in {p.dtype for p in params}:
                check_param_dtype(self.mode, dtype)
        self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        if grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        scale_before = self.scale
        self.scaler.step(optimizer)  # skips optimizer.step() if any gradient is inf/nan
        self.scaler.update()         # ... and then halves the scale: that is how we see a skip
        skipped = self.scaler.is_enabled() and self.scale < scale_before
        self.skipped_steps += int(skipped)
        if hasattr(norm, "full_tensor"):  # FSDP: the norm is a DTensor, already summed over ranks
            norm = norm.full_tensor()
        return norm.detach(), skipped

