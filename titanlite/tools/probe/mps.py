"""Apple Silicon (MPS): what titanlite can use there, probed when an MPS device is present and
otherwise given as documented rows that say "not measured here".

    for row in mps_support(): print(row.feature, row.value, row.source)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NOT_HERE = "documented, not measured here"


@dataclass(frozen=True)
class Row:
    feature: str
    value: str
    source: str  # "measured here" or NOT_HERE


# (feature, what the documentation and release notes say): torch >= 2.11 on macOS 14+.
_DOCUMENTED = (
    ("bf16 autocast", "works on macOS 14+ (M1 and later); fp16 autocast works everywhere"),
    ("FP8 matmuls", "no: torch._scaled_mm and float8 tensors are CUDA (SM >= 8.9) only"),
    (
        "collectives backend",
        "gloo only: nccl is CUDA-only, so several processes on one Mac use gloo",
    ),
    (
        "torch.compile",
        "Inductor generates Metal shaders for MPS (early support): a trial compile decides",
    ),
    (
        "memory",
        "unified: the GPU shares the Mac's RAM; recommended_max_memory is the Metal working-set limit",
    ),
)


def mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def mps_support() -> list[Row]:
    """One row per feature: probed on an MPS device when there is one, documented otherwise."""
    if not mps_available():
        return [Row(feature, value, NOT_HERE) for feature, value in _DOCUMENTED]
    from ...distributed.env import pick_backend
    from ...efficiency.compile import compile_support
    from .precision_support import support

    device = torch.device("mps")
    bf16 = support("bf16", device)
    try:
        torch.zeros(2, device=device).to(torch.float8_e4m3fn)
        fp8 = "float8 tensors can be created, but there is no FP8 matmul (torch._scaled_mm is CUDA-only)"
    except (RuntimeError, TypeError) as e:
        fp8 = f"no: {str(e).splitlines()[0][:90]}"
    compiled = compile_support(device)
    gib = 2**30
    return [
        Row(
            "bf16 autocast",
            ("works" if bf16.works else "does not work") + f": {bf16.why}",
            "measured here",
        ),
        Row("FP8 matmuls", fp8, "measured here"),
        Row(
            "collectives backend",
            f"{pick_backend('auto', 'mps')} (nccl available in this build: "
            f"{torch.distributed.is_nccl_available()})",
            "measured here",
        ),
        Row(
            "torch.compile",
            ("works" if compiled.works else "does not work") + f": {compiled.why}",
            "measured here",
        ),
        Row(
            "memory",
            f"unified; Metal limit {torch.mps.recommended_max_memory() / gib:.1f} GiB, "
            f"held by this process now {torch.mps.driver_allocated_memory() / gib:.2f} GiB",
            "measured here",
        ),
    ]
