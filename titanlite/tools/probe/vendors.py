"""Which accelerator this is beyond "cuda": NVIDIA or AMD, Intel's XPU, and how the GPUs are wired,
said in one line each for the doctor's report (and notebook 19).

A ROCm build of torch drives AMD GPUs through the same `torch.cuda` API (HIP underneath,
`torch.version.hip` set, RCCL behind the "nccl" backend), so titanlite's CUDA paths run there
unchanged; what differs is named here: FP8 is the "fnuz" variant on the MI300 series, cuDNN's
attention does not exist, and none of it has run on AMD hardware in this project's tests (only
the facts below, on faked devices). Intel GPUs are `torch.xpu`: titanlite recognises one and says
that it trains on the CPU instead.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import torch

from .datasheet import fp8_dtypes_for


def gpu_stack() -> dict:
    """The GPU software stack torch was built for: vendor, runtime and collective library."""
    if getattr(torch.version, "hip", None):
        return {
            "vendor": "AMD",
            "runtime": f"ROCm (HIP {torch.version.hip})",
            "collectives": "RCCL",
        }
    if getattr(torch.version, "cuda", None):
        return {"vendor": "NVIDIA", "runtime": f"CUDA {torch.version.cuda}", "collectives": "NCCL"}
    return {"vendor": None, "runtime": "none (a CPU build)", "collectives": "gloo"}


def gpu_line(gpu_name: str) -> str:
    """One line on a visible `torch.cuda` GPU: whose, through what, and what is and is not tested."""
    stack = gpu_stack()
    e4m3, _ = fp8_dtypes_for(gpu_name)
    fp8 = str(e4m3).replace("torch.", "")
    if stack["vendor"] == "AMD":
        return (
            f"AMD GPU {gpu_name} through {stack['runtime']}: titanlite's CUDA paths run via HIP, "
            f"collectives on {stack['collectives']}, FP8 in {fp8}, no cuDNN attention (torch's "
            f"own SDPA order); untested on AMD hardware here"
        )
    return (
        f"NVIDIA GPU {gpu_name} through {stack['runtime']}: collectives on "
        f"{stack['collectives']}, FP8 in {fp8}"
    )


def xpu_line() -> str | None:
    """One line when torch sees Intel GPUs (torch.xpu); None when it does not."""
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        return None
    name = xpu.get_device_name(0)
    return (
        f"Intel GPU {name} ({xpu.device_count()} visible, torch.xpu): titanlite does not train "
        f"on XPUs yet, so runs here use the CPU; untested on Intel hardware"
    )


def topology(which=shutil.which, run=subprocess.run) -> str | None:
    """How the GPUs are wired, as their vendor's tool prints it (`nvidia-smi topo -m`, or
    `rocm-smi --showtopo` on AMD), or None where there is no such tool."""
    vendor = gpu_stack()["vendor"]
    command = ["rocm-smi", "--showtopo"] if vendor == "AMD" else ["nvidia-smi", "topo", "-m"]
    if vendor is None or which(command[0]) is None:
        return None
    try:
        done = run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def links_summary(matrix: str) -> str:
    """One line from `nvidia-smi topo -m`: the kinds of link between GPU pairs, counted
    (NV# = NVLink with # links; PIX/PXB/PHB = PCIe through one/several switches/the host bridge;
    NODE/SYS = across the CPU's NUMA node / sockets)."""
    # A GPU row has its own column marked X (the header row, GPU0 GPU1 ..., does not).
    rows = [
        row
        for row in (line.split() for line in matrix.splitlines())
        if row and re.fullmatch(r"GPU\d+", row[0]) and row[1 + int(row[0][3:]) :][:1] == ["X"]
    ]
    gpus = [row[0] for row in rows]
    counts: dict[str, int] = {}
    for i, row in enumerate(rows):
        for j in range(i + 1, len(gpus)):
            counts[row[1 + j]] = counts.get(row[1 + j], 0) + 1
    pairs = ", ".join(f"{kind} × {n}" for kind, n in sorted(counts.items()))
    return f"{len(gpus)} GPUs; GPU pairs by link: {pairs}" if gpus else "no GPU rows"
