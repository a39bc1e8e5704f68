"""Vendor datasheet peaks for common GPUs, looked up by the name torch reports: a tool the loop
is handed (`Trainer(cfg, datasheet=datasheet_peak)`, as `titanlite train` does) for MFU against
the datasheet, the figure published MFUs divide by.

These are *upper bounds* printed by vendors (dense, i.e. without 2:4 structured sparsity, which
datasheets quote at 2x). Real kernels fall short of them, so titanlite
divides by a measured peak by default and shows these only labelled "datasheet".
The lookup takes a name, not a device, so it can be tested on a machine without the GPU.
Also here: FP8's measured matmul peak (`measure_matmul_peak`), which the core does not need.
"""

from __future__ import annotations

import re

import torch

from ... import hardware
from ...peaks import Peak
from . import matmul_peak

# Dense TFLOP/s per format. Regexes are tried in order on torch.cuda.get_device_name(), so the
# more specific name comes first (H100 NVL before H100, L40S before L40, A10G before A10), and
# variants with other peaks (laptop parts, the China-market "D" cut) are matched *before* the
# desktop part and mapped to None: no figure rather than a silently wrong one.
# Sources: vendor datasheets / architecture whitepapers, dense (datasheets print 2:4-sparse
# tensor figures at 2x: those are halved here). GeForce cards: FP32-accumulate rates, as torch uses.
_HOPPER_SXM = dict(fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, fp8=1979)  # H100 SXM datasheet
_HOPPER_NVL = dict(fp32=60, tf32=417.5, bf16=835.5, fp16=835.5, fp8=1670.5)  # H100 NVL datasheet
_HOPPER_PCIE = dict(fp32=51, tf32=378, bf16=756, fp16=756, fp8=1513)  # H100 PCIe datasheet
_AMPERE_A100 = dict(fp32=19.5, tf32=156, bf16=312, fp16=312)  # A100 datasheet
# MI300X/MI325X datasheets
_CDNA3 = dict(fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4, fp8=2614.9)
_DATASHEET = [
    (r"GH200", "NVIDIA GH200", _HOPPER_SXM, ""),  # GH200 datasheet (= H100 SXM)
    (r"H200.*NVL", "NVIDIA H200 NVL", _HOPPER_NVL, ""),  # H200 datasheet, NVL column
    (r"H200", "NVIDIA H200 SXM", _HOPPER_SXM, ""),  # H200 datasheet, SXM column
    (r"H100.*NVL", "NVIDIA H100 NVL", _HOPPER_NVL, ""),
    (r"H100.*PCIe", "NVIDIA H100 PCIe", _HOPPER_PCIE, ""),
    (r"H100", "NVIDIA H100 SXM", _HOPPER_SXM, ""),
    (r"H800.*PCIe", "NVIDIA H800 PCIe", _HOPPER_PCIE, ""),  # H800: H100 compute, cut NVLink
    (r"H800", "NVIDIA H800 SXM", _HOPPER_SXM, ""),
    (
        r"H20\b",
        "NVIDIA H20",
        dict(fp32=44, tf32=74, bf16=148, fp16=148, fp8=296),
        "",
    ),  # H20 spec sheet
    (
        r"GB200",
        "NVIDIA GB200",
        None,
        "",
    ),  # Grace-Blackwell runs B200 silicon at higher power: other peaks
    # HGX B200 page (nvidia.com/en-us/data-center/hgx), per GPU: its 8-GPU figures ÷ 8, the tensor
    # ones printed with sparsity so halved too (bf16 36 PFLOPS -> 2,250, fp8 72 -> 4,500, TF32 18
    # -> 1,125), FP32 600 TFLOPS -> 75. The totals are rounded (TF32 18 may be 8 x 2.2 sparse).
    (r"B200", "NVIDIA B200", dict(fp32=75, tf32=1125, bf16=2250, fp16=2250, fp8=4500), ""),
    (r"A800", "NVIDIA A800", _AMPERE_A100, ""),  # A800: A100 compute, cut NVLink
    (r"A100", "NVIDIA A100", _AMPERE_A100, ""),
    (r"L40S", "NVIDIA L40S", dict(fp32=91.6, tf32=183, bf16=362.05, fp16=362.05, fp8=733), ""),
    (r"L40\b", "NVIDIA L40", dict(fp32=90.5, tf32=90.5, bf16=181.05, fp16=181.05, fp8=362), ""),
    (r"\bL4\b", "NVIDIA L4", dict(fp32=30.3, tf32=60, bf16=121, fp16=121, fp8=242.5), ""),
    (
        r"A10G",
        "NVIDIA A10G",
        dict(fp32=31.52, tf32=35, bf16=70, fp16=70),
        " (AWS-only part: AWS/third-party spec, no public NVIDIA datasheet)",
    ),
    (r"\bA10\b", "NVIDIA A10", dict(fp32=31.2, tf32=62.5, bf16=125, fp16=125), ""),
    # RTX 6000 Ada datasheet (1457 sparse FP8 -> 728.5 dense); before "RTX A6000" and "RTX 6000".
    (
        r"RTX 6000 Ada",
        "NVIDIA RTX 6000 Ada",
        dict(fp32=91.1, tf32=182.1, bf16=364.2, fp16=364.2, fp8=728.5),
        "",
    ),
    (
        r"RTX A6000",
        "NVIDIA RTX A6000",
        dict(fp32=38.7, tf32=77.4, bf16=154.8, fp16=154.8),
        "",
    ),  # GA102 whitepaper
    # Laptop GPUs share desktop names but run at a fraction of the power, and the 4090 D is a
    # cut-down part: refuse rather than quote the desktop peak.
    (r"Laptop GPU", "laptop GPU", None, ""),
    (r"RTX 4090 D\b", "NVIDIA GeForce RTX 4090 D", None, ""),
    (
        r"RTX 4090$",
        "NVIDIA GeForce RTX 4090",
        dict(fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2, fp8=330.3),
        " (FP32 accumulate, as torch uses)",
    ),  # Ada whitepaper
    (
        r"RTX 5090$",
        "NVIDIA GeForce RTX 5090",
        dict(fp32=104.8, tf32=104.8, bf16=209.5, fp16=209.5, fp8=419),
        " (FP32 accumulate, as torch uses)",
    ),  # RTX Blackwell whitepaper
    (
        r"RTX 3090$",
        "NVIDIA GeForce RTX 3090",
        dict(fp32=35.6, tf32=35.6, bf16=71, fp16=71),
        " (FP32 accumulate, as torch uses)",
    ),  # GA102 whitepaper
    (r"V100.*PCIE", "NVIDIA V100 PCIe", dict(fp32=14, fp16=112), ""),
    (r"V100", "NVIDIA V100 SXM2", dict(fp32=15.7, fp16=125), ""),
    (r"\bT4\b", "NVIDIA T4", dict(fp32=8.1, fp16=65), ""),
    (r"MI325X", "AMD Instinct MI325X", _CDNA3, ""),  # same CDNA3 compute as MI300X
    (r"MI300X", "AMD Instinct MI300X", _CDNA3, ""),
]


def _format_key(dtype: torch.dtype, tf32: bool, table: dict) -> str | None:
    if dtype == torch.float32:  # TF32 only counts when torch is allowed to use it
        return "tf32" if tf32 and "tf32" in table else "fp32"
    if dtype in (
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    ):
        return "fp8"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)


def lookup(gpu_name: str, dtype: torch.dtype, tf32: bool = False) -> tuple[float, str] | None:
    """(FLOP/s, label) for a GPU name and dtype, or None when the GPU or format is not listed."""
    for pattern, product, table, note in _DATASHEET:
        if re.search(pattern, gpu_name.strip(), flags=re.IGNORECASE):
            if table is None:
                return None  # a variant whose peak we will not guess (see the table)
            fmt = _format_key(dtype, tf32, table)
            if fmt not in table:
                return None  # e.g. bf16 on a V100: the hardware has no such format
            return table[
                fmt
            ] * 1e12, f"datasheet: {product} dense {fmt} {table[fmt]:g} TFLOP/s{note}"
    return None


def lookup_datasheet(gpu_name: str, dtype: torch.dtype, tf32: bool = False) -> Peak | None:
    """Datasheet peak for a GPU *name* (testable without the GPU)."""
    hit = lookup(gpu_name, dtype, tf32)
    return Peak(hit[0], "datasheet", hit[1]) if hit else None


def datasheet_peak(device, dtype) -> Peak | None:
    """Vendor peak for this GPU and dtype; None on CPU, MPS or an unlisted GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return lookup_datasheet(hardware.device_name(device), dtype, tf32=matmul_peak._tf32_enabled())


def datasheet_mfu(achieved_flops_per_s: float, device, dtype) -> float | None:
    """MFU against the datasheet peak, as published MFUs (PaLM, torchtitan) divide; None where
    there is none (CPU, MPS, unlisted GPUs)."""
    sheet = datasheet_peak(device, dtype)
    return None if sheet is None else achieved_flops_per_s / sheet.flops


def fp8_dtypes_for(gpu_name: str) -> tuple[torch.dtype, torch.dtype]:
    """(e4m3, e5m2) dtypes a GPU's FP8 units compute in: OCP's on NVIDIA, the earlier "fnuz"
    variants (no negative zero, bias shifted by one) on AMD's CDNA3 (MI300 series, MI325X)."""
    if re.search(r"MI300|MI325", gpu_name, flags=re.IGNORECASE):
        return torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
    return torch.float8_e4m3fn, torch.float8_e5m2


def measure_matmul_peak(device, dtype, budget_s: float = 2.0) -> Peak:
    """`matmul_peak.measure_matmul_peak`, FP8 (e4m3) included: timed through torch._scaled_mm, the kernel
    FP8 Linear layers use (row-major A, column-major B, fp32 scales, bf16 out). The core does not
    measure FP8: MFU of a real FP8 run divides by the bf16 peak (device_policy.matmul_dtype)."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        return matmul_peak.measure_matmul_peak(device, dtype, budget_s)
    device = torch.device(device)  # MI300-class GPUs compute in the fnuz variant
    fp8 = fp8_dtypes_for(hardware.device_name(device))[0] if device.type == "cuda" else dtype

    def scaled_mm(n: int):
        a = torch.randn(n, n, device=device).to(fp8)
        b = torch.randn(n, n, device=device).to(fp8).t()  # column-major, as cuBLASLt wants
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return matmul_peak.measure_matmul_peak(device, dtype, budget_s, matmul=scaled_mm)
