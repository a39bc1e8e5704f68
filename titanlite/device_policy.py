"""Device-dependent choices, each a small function of the device's *facts* (type, compute
capability, dtype, torch version) - so every branch can be called, and tested, on a laptop CPU
with another machine's facts: `default_mixed_precision("cuda", capability=(7, 5))` is what a T4
would get.

    mixed precision    cuda: bf16 on SM 8.0+, else fp16 + GradScaler; cpu/mps: fp32 (unchanged)
    TF32               on for fp32 CUDA matmuls on SM 8.0+ (several times the fp32 rate)
    attention kernel   which SDPA kernel runs, and whether GQA must expand k/v to reach it
    matmul dtype       what the matmuls really compute in: the MFU denominator's dtype
    backend + device   nccl for CUDA, gloo for CPU; MPS under torchrun falls back to CPU
    CUDA index         cuda:N honoured alone; under torchrun each local rank takes its own
"""
from __future__ import annotations

import torch

from .errors import TitanliteError

AMPERE = (8, 0)  # bf16 + TF32 tensor cores, FlashAttention-2


def _version(text: str | None = None) -> tuple[int, int]:
    major, minor = (text or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int(minor)


# ---- mixed precision ------------------------------------------------------------------------
def default_mixed_precision(device_type: str, capability: tuple[int, int] | None = None,
                            scaler_ok: bool = True) -> str:
    """What training.mixed_precision="auto" means on this device.

    A CUDA GPU left in fp32 runs its matmuls on CUDA cores (or TF32) and its attention on the
    slowest SDPA kernel; bf16 autocast reaches the tensor cores with no loss scaling. Before
    Ampere there is no bf16 hardware, so fp16 + GradScaler. CPU and MPS keep fp32: a CPU
    without AVX512-BF16/AMX emulates 16-bit matmuls (slower), and MPS's 16-bit support
    depends on the macOS and torch versions - notebook 03 measures both instead.
    scaler_ok=False (FSDP, TP or PP: the ranks would each see only their shard's overflow)
    keeps a pre-Ampere GPU in fp32 rather than choosing fp16 + GradScaler for the user."""
    if device_type != "cuda":
        return "fp32"
    if capability is None:
        raise TitanliteError("default_mixed_precision('cuda') needs the GPU's compute capability, "
                             "e.g. torch.cuda.get_device_capability()")
    if tuple(capability) >= AMPERE:
        return "bf16"
    return "fp16" if scaler_ok else "fp32"


def resolve_mixed_precision(mode: str, device, scaler_ok: bool = True) -> str:
    """"auto" resolved for this torch.device (asks CUDA for its capability); others unchanged."""
    if mode != "auto":
        return mode
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return default_mixed_precision(device.type, capability, scaler_ok)


def tf32_default(device_type: str, capability: tuple[int, int] | None = None) -> bool:
    """Allow TF32 for fp32 matmuls? On CUDA SM 8.0+ yes: 10-bit mantissa products with fp32
    accumulation, what torchtitan and nanoGPT turn on; before Ampere there are no TF32 units.
    Never on CPU: the switch would also change oneDNN's fp32 matmuls there."""
    return device_type == "cuda" and capability is not None and tuple(capability) >= AMPERE


def enable_tf32() -> None:
    """Let fp32 CUDA matmuls and cuDNN convolutions use TF32 tensor cores. Only the CUDA
    switches, not torch.set_float32_matmul_precision, which would also flip oneDNN's CPU
    matmuls. torch >= 2.9 has a per-backend `fp32_precision`; mixing it with the legacy
    `allow_tf32` flags raises, so use the new one where it exists."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32"
        cudnn.fp32_precision = "tf32"
    else:  # pragma: no cover - torch < 2.9
        matmul.allow_tf32 = True
        cudnn.allow_tf32 = True


# ---- attention ------------------------------------------------------------------------------
def flash_takes(device_type: str, dtype: torch.dtype, head_dim: int,
                capability: tuple[int, int] | None = None, torch_version: str | None = None) -> bool:
    """Would CUDA's FlashAttention-2 kernel accept these inputs (GQA included)? It needs fp16 or
    bf16, SM 8.0+, head_dim <= 256 and a multiple of 8; `enable_gqa` reached it in torch 2.5."""
    return (device_type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and capability is not None and tuple(capability) >= AMPERE
            and head_dim <= 256 and head_dim % 8 == 0 and _version(torch_version) >= (2, 5))


def expand_kv_for_sdpa(device_type: str, dtype: torch.dtype, head_dim: int,
                       capability: tuple[int, int] | None = None,
                       torch_version: str | None = None) -> bool:
    """Should grouped-query attention repeat its k/v heads itself before SDPA?

    On CUDA only FlashAttention takes `enable_gqa`: the memory-efficient (cutlass) kernel
    refuses different head counts (native GQA for it is pytorch#191085, newer than our torch
    floor), so fp32 or a pre-Ampere GPU with `enable_gqa` falls to the *math* kernel, which
    stores B·H·T² scores. Repeating k/v (B·H·T·d, what `enable_gqa` does inside math anyway)
    reaches the efficient kernel instead. CPU and MPS keep `enable_gqa`: CPU's flash kernel
    takes GQA, and MPS trains through math either way."""
    return device_type == "cuda" and not flash_takes(device_type, dtype, head_dim, capability,
                                                     torch_version)


def sdpa_kernel_for(device_type: str, dtype: torch.dtype, head_dim: int, gqa: bool,
                    capability: tuple[int, int] | None = None, torch_version: str | None = None,
                    expand_kv: bool | None = None) -> str:
    """Which SDPA kernel trains a causal, unmasked attention: "flash", "efficient" or "math".

    expand_kv: did the caller repeat k/v heads (None: what `expand_kv_for_sdpa` decides, i.e.
    what titanlite's attention does). What the kernel keeps for backward differs: flash and
    efficient keep a log-sum-exp per query and head; math keeps the B·H·T² probabilities.
    CPU: torch's CPU flash kernel (GQA included). MPS: the fused Metal kernel is forward-only,
    so training runs math. CUDA: flash if it takes the inputs, else efficient (cuDNN attention,
    preferred on some Hopper/Blackwell builds, keeps a log-sum-exp too)."""
    if device_type == "cpu":
        return "flash"
    if device_type == "mps":
        return "math"
    if device_type != "cuda":
        raise TitanliteError(f"no SDPA kernel rule for device type {device_type!r}: use cuda, mps or cpu")
    if flash_takes(device_type, dtype, head_dim, capability, torch_version):
        return "flash"
    if expand_kv is None:
        expand_kv = expand_kv_for_sdpa(device_type, dtype, head_dim, capability, torch_version)
    # efficient: fp16/fp32 on any SM 5.0+, bf16 from SM 8.0; head_dim a multiple of 8.
    efficient_dtypes = (torch.float16, torch.float32) + \
        ((torch.bfloat16,) if capability and tuple(capability) >= AMPERE else ())
    if (gqa and not expand_kv) or dtype not in efficient_dtypes or head_dim % 8:
        return "math"
    return "efficient"


# ---- what the matmuls compute in (the MFU denominator) -------------------------------------
def matmul_dtype(param_dtype: torch.dtype, autocast_dtype: torch.dtype | None = None,
                 fsdp_param_dtype: torch.dtype | str | None = None,
                 fp8: dict | bool | None = None) -> torch.dtype:
    """The dtype the model's matmuls really run in, so MFU divides by that dtype's peak.

    Real FP8 Linear layers multiply in FP8 (e4m3). Otherwise autocast casts matmul inputs to
    its dtype; without autocast FSDP's `param_dtype` is what the weights are all-gathered and
    computed in; else the parameters' own dtype. Emulated FP8 quantises and then multiplies in
    the high-precision dtype, so it counts as that dtype.
    fp8: a model's `fp8_info` dict ({"emulated": bool, ...}), True (real), or None/False (off)."""
    if isinstance(fsdp_param_dtype, str):
        fsdp_param_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                            "float16": torch.float16}[fsdp_param_dtype]
    real_fp8 = fp8 is True or (isinstance(fp8, dict) and not fp8.get("emulated", True))
    if real_fp8:
        return torch.float8_e4m3fn
    return autocast_dtype or fsdp_param_dtype or param_dtype


# ---- processes, backends, devices -----------------------------------------------------------
def backend_and_device_for(device_type: str, world_size: int, backend: str = "auto",
                           explicit: bool = False) -> tuple[str | None, str, str | None]:
    """(process-group backend or None, device type each rank trains on, note or None).

    nccl moves CUDA tensors, gloo CPU tensors; nothing moves MPS tensors between processes
    (gloo has no MPS backend), so a job of several ranks on a Mac would fail at its first
    all-reduce. Instead each rank trains on the CPU - said in the note - or, if the user
    asked for mps by name (`explicit`), the job is refused before it starts."""
    if world_size <= 1:
        return None, device_type, None
    if device_type == "mps":
        if explicit or backend == "nccl":
            raise TitanliteError(f"--training.device mps with {world_size} processes: no "
                                 "process-group backend moves MPS tensors (gloo is CPU-only, nccl "
                                 "CUDA-only): use --training.device cpu, or run a single process")
        return "gloo", "cpu", (f"{world_size} ranks on a Mac: gloo cannot move MPS tensors, so "
                               "each rank trains on the CPU")
    if backend == "auto":
        return ("nccl" if device_type == "cuda" else "gloo"), device_type, None
    if backend == "nccl" and device_type != "cuda":
        raise TitanliteError(f"parallel.backend=nccl only moves CUDA tensors, but training.device "
                             f"is {device_type}: use --parallel.backend gloo or --training.device cuda")
    return backend, device_type, None


def cuda_index_for(requested_index: int | None, local_rank: int, local_world_size: int,
                   device_count: int) -> int:
    """Which GPU this process takes.

    Alone (one process on this machine): `cuda:N` is honoured, bare `cuda` means cuda:0.
    Under torchrun with several local ranks each takes cuda:local_rank; naming one index
    there would put every rank on the same GPU, so it is refused (CUDA_VISIBLE_DEVICES is the
    way to choose which GPUs a multi-process job uses)."""
    if requested_index is not None and local_world_size > 1:
        raise TitanliteError(f"--training.device cuda:{requested_index} names one GPU, but torchrun "
                             f"started {local_world_size} processes on this machine and each needs "
                             f"its own: use --training.device cuda (rank r takes cuda:r), and "
                             f"CUDA_VISIBLE_DEVICES to choose which GPUs")
    index = local_rank if requested_index is None and local_world_size > 1 else (requested_index or 0)
    if index >= device_count:
        if local_world_size > 1:
            raise TitanliteError(f"local rank {local_rank} has no GPU: this machine has {device_count}; "
                                 f"start at most {device_count} processes per node "
                                 f"(--nproc-per-node {device_count})")
        raise TitanliteError(f"cuda:{index} requested but torch sees {device_count} CUDA GPU(s): "
                             f"use cuda:0..cuda:{device_count - 1} or auto")
    return index
