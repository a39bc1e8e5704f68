"""Vendor datasheet peaks for common GPUs, looked up by the name torch reports.

These are *upper bounds* printed by vendors (dense, i.e. without 2:4 structured sparsity, which
datasheets quote at 2x). Real kernels fall short of them, so titanlite
divides by a measured peak by default and shows these only labelled "datasheet".
The lookup takes a name, not a device, so it can be tested on a machine without the GPU.
"""
from __future__ import annotations

import re

import torch

# Dense TFLOP/s per format. Regexes are tried in order on torch.cuda.get_device_name(), so the
# more specific name comes first (H100 NVL before H100, L40S before L40, A10G before A10).
_HOPPER_SXM = dict(fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, fp8=1979)
_HOPPER_NVL = dict(fp32=60, tf32=417.5, bf16=835.5, fp16=835.5, fp8=1670.5)
_DATASHEET = [
    (r"GH200", "NVIDIA GH200", _HOPPER_SXM, ""),
    (r"H200.*NVL", "NVIDIA H200 NVL", _HOPPER_NVL, ""),
    (r"H200", "NVIDIA H200 SXM", _HOPPER_SXM, ""),
    (r"H100.*NVL", "NVIDIA H100 NVL", _HOPPER_NVL, ""),
    (r"H100.*PCIe", "NVIDIA H100 PCIe", dict(fp32=51, tf32=378, bf16=756, fp16=756, fp8=1513), ""),
    (r"H100", "NVIDIA H100 SXM", _HOPPER_SXM, ""),
    (r"A100", "NVIDIA A100", dict(fp32=19.5, tf32=156, bf16=312, fp16=312), ""),
    (r"L40S", "NVIDIA L40S", dict(fp32=91.6, tf32=183, bf16=362.05, fp16=362.05, fp8=733), ""),
    (r"L40\b", "NVIDIA L40", dict(fp32=90.5, tf32=90.5, bf16=181.05, fp16=181.05, fp8=362), ""),
    (r"\bL4\b", "NVIDIA L4", dict(fp32=30.3, tf32=60, bf16=121, fp16=121, fp8=242.5), ""),
    (r"A10G", "NVIDIA A10G", dict(fp32=31.52, tf32=35, bf16=70, fp16=70),
     " (AWS-only part: AWS/third-party spec, no public NVIDIA datasheet)"),
    (r"\bA10\b", "NVIDIA A10", dict(fp32=31.2, tf32=62.5, bf16=125, fp16=125), ""),
    (r"RTX 4090", "NVIDIA GeForce RTX 4090", dict(fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2,
                                                  fp8=330.3), " (FP32 accumulate, as torch uses)"),
    (r"V100.*PCIE", "NVIDIA V100 PCIe", dict(fp32=14, fp16=112), ""),
    (r"V100", "NVIDIA V100 SXM2", dict(fp32=15.7, fp16=125), ""),
    (r"\bT4\b", "NVIDIA T4", dict(fp32=8.1, fp16=65), ""),
    (r"MI300X", "AMD Instinct MI300X", dict(fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4,
                                            fp8=2614.9), ""),
]


def _format_key(dtype: torch.dtype, tf32: bool, table: dict) -> str | None:
    if dtype == torch.float32:  # TF32 only counts when torch is allowed to use it
        return "tf32" if tf32 and "tf32" in table else "fp32"
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)


def lookup(gpu_name: str, dtype: torch.dtype, tf32: bool = False) -> tuple[float, str] | None:
    """(FLOP/s, label) for a GPU name and dtype, or None when the GPU or format is not listed."""
    for pattern, product, table, note in _DATASHEET:
        if re.search(pattern, gpu_name, flags=re.IGNORECASE):
            fmt = _format_key(dtype, tf32, table)
            if fmt not in table:
                return None  # e.g. bf16 on a V100: the hardware has no such format
            return table[fmt] * 1e12, f"datasheet: {product} dense {fmt} {table[fmt]:g} TFLOP/s{note}"
    return None
