"""Device-dependent choices, each a small function of the device's *facts* (type, compute capability,
dtype, torch version), so every branch can be tested on a laptop CPU with another machine's facts:
`default_mixed_precision("cuda", capability=(7, 5))` is a T4's. CUDA's `device_defaults` are torchtitan's:

    mixed precision    bf16 autocast on SM 8.0+ (fp16 + GradScaler before); under FSDP no autocast:
                       FSDP gathers bf16 weights and reduces gradients in fp32
    compile            on (the trial falls back to eager where it cannot run); FP8 only compiled
    optimizer          fused AdamW          logging   every 10 steps: an unlogged step never syncs
    attention          SDPA tries cuDNN, flash, memory-efficient, math, in that order
    allocator          expandable segments, unless PYTORCH_CUDA_ALLOC_CONF says otherwise
CPU and MPS keep fp32, eager, per-step logs. Also: TF32, whether GQA repeats k/v, the dtype MFU
divides by, the process-group backend and which GPU a rank takes."""

import os

import torch
from torch.nn.attention import SDPBackend
from torch.torch_version import TorchVersion

from .errors import TitanliteError

AMPERE = (8, 0)  # bf16 + TF32 tensor cores, FlashAttention-2
ADA = (8, 9)  # FP8 tensor cores


# ---- mixed precision ------------------------------------------------------------------------
def default_mixed_precision(
    device_type: str, capability: tuple[int, int] | None = None, scaler_ok: bool = True
) -> str:
    """What training.mixed_precision="auto" means here. CUDA: bf16 autocast (tensor cores, no loss
    scaling); before Ampere fp16 + GradScaler, unless each rank sees only its shard's overflow
    (`scaler_ok=False`: FSDP, TP, PP), then fp32. CPU, MPS: fp32 (16-bit is emulated on most CPUs)."""
    if device_type != "cuda":
        return "fp32"
    if capability is None:
        raise TitanliteError(
            "default_mixed_precision('cuda') needs the GPU's compute capability, "
            "e.g. torch.cuda.get_device_capability()"
        )
    return "bf16" if tuple(capability) >= AMPERE else ("fp16" if scaler_ok else "fp32")


def resolve_mixed_precision(mode: str, device, scaler_ok: bool = True) -> str:
    """ "auto" resolved for this torch.device (asks CUDA for its capability); others unchanged."""
    if mode != "auto":
        return mode
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return default_mixed_precision(device.type, capability, scaler_ok)


def tf32_default(device_type: str, capability: tuple[int, int] | None = None) -> bool:
    """TF32 for fp32 matmuls (10-bit mantissa products, fp32 sums) on CUDA SM 8.0+, as torchtitan and
    nanoGPT do; never on CPU, where the switch would change oneDNN's fp32 matmuls."""
    return device_type == "cuda" and capability is not None and tuple(capability) >= AMPERE


def enable_tf32() -> None:
    """TF32 for fp32 CUDA matmuls and cuDNN convolutions: only the CUDA switches (set_float32_matmul_precision
    flips oneDNN's CPU matmuls too), and the legacy `allow_tf32` ones: once torch 2.9's `fp32_precision`
    is set, the legacy getters Inductor still calls raise, while the new getters read these fine."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


# ---- attention ------------------------------------------------------------------------------
def flash_takes(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    capability: tuple[int, int] | None = None,
    torch_version: str | None = None,
) -> bool:
    """Would CUDA's FlashAttention-2 kernel accept these inputs (GQA included)? It needs fp16 or
    bf16, SM 8.0+, head_dim <= 256 and a multiple of 8; `enable_gqa` reached it in torch 2.5."""
    return (
        device_type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and capability is not None
        and tuple(capability) >= AMPERE
        and head_dim <= 256
        and head_dim % 8 == 0
        # compares with a tuple as a version ("2.13.0+cu130" >= (2, 5))
        and TorchVersion(torch_version or torch.__version__) >= (2, 5)
    )


def expand_kv_for_sdpa(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    capability: tuple[int, int] | None = None,
    torch_version: str | None = None,
) -> bool:
    """Should grouped-query attention repeat its k/v heads before SDPA? On CUDA only flash takes
    `enable_gqa`: elsewhere GQA falls to the *math* kernel, which stores B·H·T² scores, while
    repeated k/v (B·H·T·d) reach the efficient kernel. CPU's flash kernel takes GQA; MPS trains
    through math either way."""
    return device_type == "cuda" and not flash_takes(
        device_type, dtype, head_dim, capability, torch_version
    )


# ---- what the matmuls compute in (the MFU denominator) -------------------------------------
def matmul_dtype(
    param_dtype: torch.dtype,
    autocast_dtype: torch.dtype | None = None,
    fsdp_param_dtype: torch.dtype | str | None = None,
    fp8: dict | bool | None = None,
) -> torch.dtype:
    """The dtype whose peak MFU divides by: autocast's, else FSDP's `param_dtype`, else bf16 under real FP8
    (its Linears multiply in e4m3, attention and the output layer do not; torchtitan divides by bf16 too),
    else the parameters'. fp8: a model's `fp8_info` dict (emulated: not real), True (real) or None (off)."""
    if isinstance(fsdp_param_dtype, str):  # "float32", "bfloat16", as parallel.param_dtype says
        fsdp_param_dtype = getattr(torch, fsdp_param_dtype)
    real_fp8 = fp8 is True or (isinstance(fp8, dict) and not fp8.get("emulated", True))
    return autocast_dtype or fsdp_param_dtype or (torch.bfloat16 if real_fp8 else param_dtype)


# ---- CUDA's defaults (torchtitan's floor) --------------------------------------------------
def device_defaults(cfg, device_type: str, capability: tuple[int, int] | None, fsdp: bool) -> dict:
    """The config values "auto" (or None) resolve to on this device, as overrides. Under FSDP with
    bf16 weights, autocast would also cast the gathered weights and keep those casts for backward,
    which FSDP cannot free: a whole extra bf16 copy of the model per GPU."""
    cuda = device_type == "cuda"
    bf16_fsdp = fsdp and cuda and capability is not None and tuple(capability) >= AMPERE
    out = {}
    if cfg.parallel.param_dtype == "auto":
        out["parallel.param_dtype"] = "bfloat16" if bf16_fsdp else "float32"
    if cfg.training.mixed_precision == "auto" and out.get("parallel.param_dtype") == "bfloat16":
        out["training.mixed_precision"] = "fp32"  # FSDP's bf16 all-gather is the mixed precision
    if cfg.model.attention == "auto":  # FlexAttention trains on CUDA (torch 2.13): masks only
        out["model.attention"] = "flex" if cuda and cfg.data.document_mask else "sdpa"
    if cfg.compile.enable is None:
        out["compile.enable"] = cuda
    if cfg.metrics.log_every is None:
        # a logged step waits for the GPU to read the loss
        out["metrics.log_every"] = 10 if cuda else 1
    return out


def resolve_for_device(cfg, device: torch.device, fsdp: bool):
    """A copy of `cfg` with its "auto"s decided for `device` (`device_defaults`), checked."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    cfg = cfg.with_overrides(device_defaults(cfg, device.type, capability, fsdp), "device defaults")
    check_fp8_compiled(
        device.type, capability, cfg.float8.enable, cfg.float8.emulate, cfg.compile.enable
    )
    if cfg.model.attention == "flex":  # asked where torch may have no backward: asked of torch
        from .models.flex import attention_for

        attention_for("flex", device.type)
    return cfg


def check_fp8_compiled(
    device_type: str, capability: tuple[int, int] | None, fp8: bool, emulate: str, compiled: bool
) -> None:
    """Real FP8 without torch.compile casts every operand in separate, unfused kernels: slower and
    larger than bf16 on the GPUs that have FP8 units. torchtitan requires compile; so do we."""
    real = device_type == "cuda" and capability is not None and tuple(capability) >= ADA
    if fp8 and real and emulate != "true" and not compiled:
        raise TitanliteError(
            "float8.enable on a GPU with FP8 tensor cores needs torch.compile (eager FP8 "
            "casts every operand unfused: slower and larger than bf16): set "
            "--compile.enable true, or train in bf16"
        )


def capability_of(t: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of t's GPU, None off CUDA (its properties: compile folds them)."""
    if t.device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(t.device)
    return (props.major, props.minor)


def use_fused_adamw(device_type: str) -> bool:
    """AdamW's step as one fused kernel over all parameters: CUDA only (torchtitan's default)."""
    return device_type == "cuda"


def prefers_cudnn_attention(
    capability: tuple[int, int] | None,
    cudnn_version: int | None,
    cuda_version: str | None,
    deprioritized: bool = False,
) -> bool:
    """torch's own gate for putting cuDNN's fused attention first (aten's sdp_utils.cpp,
    check_prefer_cudnn_attention, torch 2.13): a cuDNN newer than 9.15.0 (9.15.1 fixed sequence
    lengths not divisible by 128, pytorch#169849) on an SM 9.x or 10.x GPU; with a CUDA 12 build
    only x.0 and x.3; never with TORCH_CUDNN_SDPA_DEPRIORITIZED set (`deprioritized`)."""
    if deprioritized or capability is None or cudnn_version is None:
        return False
    major, minor = capability
    cuda_major = int(str(cuda_version or "0").split(".")[0])
    return cudnn_version > 91500 and major in (9, 10) and (cuda_major >= 13 or minor in (0, 3))


def sdpa_priority(device_type: str, capability: tuple[int, int] | None = None) -> list | None:
    """The order SDPA tries its CUDA kernels in: cuDNN, flash, memory-efficient, math where torch's
    own conditions for cuDNN hold (`prefers_cudnn_attention`, this GPU's capability and this
    build's cuDNN and CUDA): where they do not (an A100, an RTX 4090, a CUDA 12 wheel's older cuDNN),
    None, torch's own order, so nothing torch turned off is forced back on; None off CUDA too."""
    cudnn = cudnn_runtime_version() if device_type == "cuda" else None
    if not prefers_cudnn_attention(capability, cudnn, torch.version.cuda, _DEPRIORITIZED):
        return None
    return [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]


# torch reads this once, at its first attention call; so do we (set later, both ignore it)
_DEPRIORITIZED = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").lower() in ("1", "true", "on")
_CUDNN: list = []  # the runtime cuDNN version, read once (a library call compiled code need not trace)


def cudnn_runtime_version() -> int | None:
    """This process's cuDNN (e.g. 91501 for 9.15.1), or None without one."""
    if not _CUDNN:
        _CUDNN.append(torch.backends.cudnn.version())  # None in a build without cuDNN
    return _CUDNN[0]


def allocator_settings(device_type: str, env=os.environ) -> str | None:
    """The CUDA caching allocator's settings to use: expandable segments (fewer fragmented,
    unusable blocks as activation sizes vary), unless the user set PYTORCH_CUDA_ALLOC_CONF."""
    return (
        None
        if device_type != "cuda" or "PYTORCH_CUDA_ALLOC_CONF" in env
        else "expandable_segments:True"
    )


# ---- processes, backends, devices -----------------------------------------------------------
def backend_and_device_for(
    device_type: str, world_size: int, backend: str = "auto", explicit: bool = False
) -> tuple[str | None, str, str | None]:
    """(process-group backend or None, device type each rank trains on, note or None). nccl moves
    CUDA tensors, gloo CPU ones; nothing moves MPS tensors between processes, so ranks on a Mac
    train on the CPU (said in the note), or the job is refused if mps was named (`explicit`)."""
    if world_size <= 1:
        return None, device_type, None
    if device_type == "mps":
        if explicit or backend == "nccl":
            raise TitanliteError(
                f"--training.device mps with {world_size} processes: no "
                "process-group backend moves MPS tensors (gloo is CPU-only, nccl "
                "CUDA-only): use --training.device cpu, or run a single process"
            )
        return (
            "gloo",
            "cpu",
            (
                f"{world_size} ranks on a Mac: gloo cannot move MPS tensors, so "
                "each rank trains on the CPU"
            ),
        )
    if backend == "auto":
        return ("nccl" if device_type == "cuda" else "gloo"), device_type, None
    if backend == "nccl" and device_type != "cuda":
        raise TitanliteError(
            f"parallel.backend=nccl only moves CUDA tensors, but training.device "
            f"is {device_type}: use --parallel.backend gloo or --training.device cuda"
        )
    return backend, device_type, None


def cuda_index_for(
    requested_index: int | None, local_rank: int, local_world_size: int, device_count: int
) -> int:
    """Which GPU this process takes: alone, `cuda:N` as named (bare `cuda`: 0); under torchrun with
    several local ranks, cuda:local_rank (one named index would put every rank on one GPU: refused;
    CUDA_VISIBLE_DEVICES chooses which GPUs a job uses)."""
    if requested_index is not None and local_world_size > 1:
        raise TitanliteError(
            f"--training.device cuda:{requested_index} names one GPU, but torchrun "
            f"started {local_world_size} processes on this machine and each needs "
            f"its own: use --training.device cuda (rank r takes cuda:r), and "
            f"CUDA_VISIBLE_DEVICES to choose which GPUs"
        )
    # from here on, several local ranks means no index was named
    if local_world_size > 1 and device_count == 1:
        return 0  # one GPU visible per process (SLURM --gpus-per-task=1, Kubernetes): it is ours
    index = local_rank if local_world_size > 1 else (requested_index or 0)
    if index >= device_count:
        if local_world_size > 1:
            raise TitanliteError(
                f"local rank {local_rank} has no GPU: this machine has {device_count}; "
                f"start at most {device_count} processes per node "
                f"(--nproc-per-node {device_count})"
            )
        raise TitanliteError(
            f"cuda:{index} requested but torch sees {device_count} CUDA GPU(s): "
            f"use cuda:0..cuda:{device_count - 1} or auto"
        )
    return index
