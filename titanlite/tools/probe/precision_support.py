"""The mixed-precision support matrix: which mode trains, and is fast, on which device - a row
per (device type, mode), probed on this machine for the device types it has, documented (from
public docs and release notes, marked "not this machine") for the others. Notebook 03 shows it;
the trainer itself only asks `probe` (titanlite/efficiency/mixed_precision.py).

    for row in support_matrix(): print(row.device, row.mode, row.works, row.fast, row.why)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ...efficiency.mixed_precision import MODES, _present, check_mode, probe
from ...errors import TitanliteError, closest

DEVICE_TYPES = ("cuda", "mps", "cpu")
# x86 CPU flags (as /proc/cpuinfo spells them) of units that make a 16-bit matmul fast.
FAST_CPU_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}


@dataclass(frozen=True)
class Support:
    device: str  # "cuda", "mps" or "cpu"
    mode: str  # "fp32", "bf16" or "fp16"
    works: bool | None  # None: depends on the exact hardware (documented rows only)
    why: str
    fast: bool | None = None  # hardware units for this format? None: unknown, measure it
    here: bool = True  # False: documented knowledge about a device type this machine lacks

    @property
    def source(self) -> str:
        return "probed on this machine" if self.here else "documented, not this machine"


def support(mode: str, device) -> Support:
    """Can `mode` train on `device`, and why (not)? Probed here; documented if the device
    type is absent from this machine."""
    check_mode(mode)
    device = torch.device(device)
    if device.type not in DEVICE_TYPES:
        raise TitanliteError(
            f"no mixed-precision support table for device type '{device.type}'"
            f"{closest(device.type, DEVICE_TYPES)}: use cuda, mps or cpu"
        )
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
    probes = {
        "avx2": "_is_avx2_supported",
        "avx512f": "_is_avx512_supported",
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_bf16": "_is_amx_tile_supported",
        "amx_fp16": "_is_amx_fp16_supported",
    }
    found = {flag for flag, name in probes.items() if getattr(torch.cpu, name, lambda: False)()}
    return found or None


@functools.cache
def _probed(mode: str, device_str: str) -> Support:
    device = torch.device(device_str)
    fast, units = _hardware_note(mode, device)
    failure = probe(mode, device_str)
    if failure is None:
        return Support(
            device.type,
            mode,
            True,
            f"probe step ran on torch {torch.__version__.split('+')[0]}; {units}",
            fast=fast,
        )
    return Support(
        device.type,
        mode,
        False,
        failure,
        fast=False if failure.startswith("bf16 needs an Ampere") else fast,
    )


def _hardware_note(mode: str, device: torch.device) -> tuple[bool | None, str]:
    """(has units that make `mode` fast?, why) from what torch and the OS report."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if mode == "fp32":
            return major >= 8, "TF32 tensor cores (if allowed)" if major >= 8 else "CUDA cores"
        if mode == "bf16":
            return True, f"bf16 tensor cores (SM {major}.{minor})"
        return (
            major >= 7,
            f"fp16 tensor cores (SM {major}.{minor})"
            if major >= 7
            else f"no tensor cores before SM 7.0 (this is SM {major}.{minor})",
        )
    if device.type == "mps":
        return {
            "fp32": (True, "Apple GPU"),
            "bf16": (None, "bf16 on Metal needs macOS 14+; MPS bf16 autocast since torch 2.6"),
            "fp16": (True, "GradScaler('mps') since torch 2.8 (pytorch#150255)"),
        }[mode]
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
    return False, (
        f"no {' / '.join(FAST_CPU_FLAGS[mode])} in the CPU flags (ISA {isa}): {mode} "
        f"matmuls are emulated, expect them slower than fp32{scaler}"
    )


_DOCUMENTED = {  # (device type, mode) -> (works, fast, why): public docs and release notes
    ("cuda", "fp32"): (True, True, "always; TF32 tensor cores on SM 8.0+ when allowed"),
    ("cuda", "bf16"): (None, None, "needs SM 8.0+ (A100, RTX 30xx, H100, ...); no scaler needed"),
    ("cuda", "fp16"): (True, None, "every CUDA GPU, with GradScaler; tensor cores from SM 7.0"),
    ("mps", "fp32"): (True, True, "always (Apple Silicon, macOS 12.3+)"),
    ("mps", "bf16"): (None, None, "needs macOS 14+; bf16 autocast on MPS since torch 2.6"),
    ("mps", "fp16"): (True, True, "autocast since torch 2.5; GradScaler('mps') since torch 2.8"),
    ("cpu", "fp32"): (True, True, "always"),
    ("cpu", "bf16"): (True, None, "autocast always works; fast only with AVX512-BF16 or AMX"),
    ("cpu", "fp16"): (
        True,
        None,
        "GradScaler('cpu') since torch 2.3; fast only with AVX512-FP16 or AMX-FP16",
    ),
}


def _documented(mode: str, kind: str) -> Support:
    works, fast, why = _DOCUMENTED[(kind, mode)]
    return Support(kind, mode, works, why, fast=fast, here=False)
