"""Which SDPA kernel a causal attention trains through, from the device's facts: what notebook 04's
activation-memory formula and the doctor need to know, testable with any GPU's facts on a CPU.
The core decides the order CUDA tries kernels in and whether GQA repeats k/v (device_policy.py).
"""

from __future__ import annotations

import torch

from ..device_policy import AMPERE, expand_kv_for_sdpa, flash_takes, prefers_cudnn_attention
from ..errors import TitanliteError


def sdpa_kernel_for(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    gqa: bool,
    capability: tuple[int, int] | None = None,
    torch_version: str | None = None,
    expand_kv: bool | None = None,
    deterministic: bool = False,
    cudnn_version: int | None = None,
    cuda_version: str | None = None,
    masked: bool = False,
) -> str:
    """Which SDPA kernel trains a causal attention: "cudnn", "flash", "efficient" or "math".

    expand_kv: did the caller repeat k/v heads (None: what `expand_kv_for_sdpa` decides, i.e.
    what titanlite's attention does). What the kernel keeps for backward differs: cuDNN, flash
    and efficient keep a log-sum-exp per query and head; math keeps the B·H·T² probabilities.
    CPU: torch's CPU flash kernel (GQA included). MPS: the fused Metal kernel is forward-only,
    so training runs math. CUDA: cuDNN first only where torch's own conditions hold for this GPU,
    `cudnn_version` and `cuda_version` (`device_policy.prefers_cudnn_attention`; unknown: they do
    not), then flash, efficient, math, each taking what it can (torch's sdp_utils.cpp).
    `masked`: a boolean mask in place of is_causal (a document mask, notebook 21): flash takes no
    mask (sdp_utils.cpp's check_for_attn_mask), cuDNN and efficient take one, and titanlite
    repeats the k/v heads under a mask on CUDA (models/llama.py's causal_attention)."""
    if device_type == "cpu":
        return "flash"
    if device_type == "mps":
        return "math"
    if device_type != "cuda":
        raise TitanliteError(
            f"no SDPA kernel rule for device type {device_type!r}: use cuda, mps or cpu"
        )
    preferred = prefers_cudnn_attention(capability, cudnn_version, cuda_version)
    if preferred and cudnn_takes(dtype, head_dim, capability, deterministic):
        return "cudnn"
    if not masked and flash_takes(device_type, dtype, head_dim, capability, torch_version):
        return "flash"
    if expand_kv is None:
        expand_kv = masked or expand_kv_for_sdpa(
            device_type, dtype, head_dim, capability, torch_version
        )
    # efficient: fp16/fp32 on any SM 5.0+, bf16 from SM 8.0; head_dim a multiple of 8.
    efficient_dtypes = (torch.float16, torch.float32) + (
        (torch.bfloat16,) if capability and tuple(capability) >= AMPERE else ()
    )
    if (gqa and not expand_kv) or dtype not in efficient_dtypes or head_dim % 8:
        return "math"
    return "efficient"


def cudnn_takes(
    dtype: torch.dtype,
    head_dim: int,
    capability: tuple[int, int] | None,
    deterministic: bool = False,
) -> bool:
    """Would cuDNN's attention take these inputs (GQA included)? fp16/bf16 on SM 8.0 to 12.1, a head
    dimension that is a multiple of 8 and at most 128 (recent cuDNN builds take 256 on SM 9.0/10.x;
    not counted here), and not under torch.use_deterministic_algorithms (cuDNN's is not)."""
    return (
        dtype in (torch.float16, torch.bfloat16)
        and capability is not None
        and AMPERE <= tuple(capability) <= (12, 1)
        and head_dim % 8 == 0
        and head_dim <= 128
        and not deterministic
    )
