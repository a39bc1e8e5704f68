"""titanlite.device_policy: every device-dependent choice, called with other machines' facts."""

from __future__ import annotations

import pytest
import torch

from titanlite import TitanliteError
from titanlite.device_policy import (
    backend_and_device_for,
    cuda_index_for,
    default_mixed_precision,
    expand_kv_for_sdpa,
    flash_takes,
    matmul_dtype,
    resolve_mixed_precision,
    tf32_default,
)
from titanlite.labs.nb04_sdpa_kernels import sdpa_kernel_for

T4, V100, A100, H100 = (7, 5), (7, 0), (8, 0), (9, 0)


# ---- mixed precision and TF32 ---------------------------------------------------------------
@pytest.mark.parametrize(
    "device_type, capability, mode",
    [
        ("cuda", H100, "bf16"),
        ("cuda", A100, "bf16"),
        ("cuda", (8, 6), "bf16"),
        ("cuda", T4, "fp16"),
        ("cuda", V100, "fp16"),  # no bf16 units before Ampere
        ("cpu", None, "fp32"),
        ("mps", None, "fp32"),  # CPU and MPS stay as they were
    ],
)
def test_auto_mixed_precision_per_device(device_type, capability, mode):
    assert default_mixed_precision(device_type, capability) == mode


def test_auto_on_this_cpu_is_fp32_and_explicit_modes_pass_through():
    assert resolve_mixed_precision("auto", "cpu") == "fp32"
    assert resolve_mixed_precision("bf16", "cpu") == "bf16"
    with pytest.raises(TitanliteError, match="compute capability"):
        default_mixed_precision("cuda")


def test_tf32_only_on_ampere_or_newer_cuda():
    assert tf32_default("cuda", A100) and tf32_default("cuda", H100)
    assert not tf32_default("cuda", T4)
    assert not tf32_default("cpu") and not tf32_default("mps")


# ---- attention kernels ----------------------------------------------------------------------
def test_flash_takes_16_bit_on_ampere_only():
    assert flash_takes("cuda", torch.bfloat16, 64, H100)
    assert flash_takes("cuda", torch.float16, 128, A100)
    assert not flash_takes("cuda", torch.float32, 64, H100)  # flash has no fp32 kernel
    assert not flash_takes("cuda", torch.float16, 64, T4)  # FlashAttention-2 needs SM 8.0
    assert not flash_takes("cuda", torch.bfloat16, 512, H100)  # head_dim above 256
    # no enable_gqa yet
    assert not flash_takes("cuda", torch.bfloat16, 64, H100, torch_version="2.4.1")


@pytest.mark.parametrize(
    "device_type, dtype, capability, expand, kernel",
    [
        ("cuda", torch.float16, A100, False, "flash"),  # torch does not put cuDNN first on SM 8.x
        ("cuda", torch.bfloat16, H100, False, "flash"),  # nor with an unknown (older) cuDNN
        ("cuda", torch.float32, H100, True, "efficient"),  # fp32 GQA: repeat k/v to reach cutlass
        ("cuda", torch.float16, T4, True, "efficient"),  # pre-Ampere fp16: no flash either
        ("cuda", torch.bfloat16, T4, True, "math"),  # bf16 on SM 7.5: only math computes it
        ("cpu", torch.float32, None, False, "flash"),  # CPU flash kernel takes GQA: unchanged
        ("mps", torch.float32, None, False, "math"),  # Metal's fused kernel is forward-only
    ],
)
def test_sdpa_kernel_and_kv_expansion(device_type, dtype, capability, expand, kernel):
    assert expand_kv_for_sdpa(device_type, dtype, 64, capability) is expand
    assert sdpa_kernel_for(device_type, dtype, 64, gqa=True, capability=capability) == kernel


def test_cudnn_steps_aside_where_it_cannot_run():
    # where torch would put cuDNN first (a new cuDNN on Hopper), flash still takes what cuDNN does
    # not: deterministic runs, head_dim 256 (flash's limit)
    new = {"cudnn_version": 91501, "cuda_version": "12.8"}
    assert sdpa_kernel_for("cuda", torch.bfloat16, 64, gqa=True, capability=H100, **new) == "cudnn"
    assert (
        sdpa_kernel_for(
            "cuda", torch.bfloat16, 64, gqa=True, capability=H100, deterministic=True, **new
        )
        == "flash"
    )
    assert sdpa_kernel_for("cuda", torch.bfloat16, 256, gqa=True, capability=H100, **new) == "flash"
    assert (
        sdpa_kernel_for("cuda", torch.bfloat16, 64, gqa=True, capability=(12, 1), **new) == "flash"
    )
    assert (
        sdpa_kernel_for("cuda", torch.bfloat16, 64, gqa=True, capability=(10, 0), **new) == "cudnn"
    )


@pytest.mark.parametrize(
    "gpu, capability, cudnn, cuda, first",
    [
        ("H100, CUDA 12.8 wheel, cuDNN 9.15.1", (9, 0), 91501, "12.8", True),
        ("H100, CUDA 12 wheel, cuDNN 9.10", (9, 0), 91002, "12.6", False),
        ("H100, cuDNN 9.15.0 exactly", (9, 0), 91500, "13.0", False),
        ("B200, CUDA 13", (10, 0), 91600, "13.0", True),
        ("GB300-class SM 10.3, CUDA 12", (10, 3), 91600, "12.9", True),
        ("SM 10.1, CUDA 12", (10, 1), 91600, "12.9", False),
        ("SM 10.1, CUDA 13", (10, 1), 91600, "13.0", True),
        ("A100", (8, 0), 91600, "13.0", False),
        ("RTX 4090", (8, 9), 91600, "13.0", False),
        ("RTX 5090 (SM 12.0)", (12, 0), 91600, "13.0", False),
        ("no cuDNN", (9, 0), None, "13.0", False),
    ],
)
def test_cudnn_attention_comes_first_only_where_torchs_own_gate_puts_it(
    gpu, capability, cudnn, cuda, first, monkeypatch
):
    """torch's check_prefer_cudnn_attention (sdp_utils.cpp, 2.13), as facts: cuDNN > 9.15.0 on
    SM 9.x/10.x (x.0 and x.3 only with CUDA 12), never when TORCH_CUDNN_SDPA_DEPRIORITIZED is set.
    Elsewhere titanlite leaves torch's own order in force instead of forcing cuDNN back on."""
    from torch.nn.attention import SDPBackend

    from titanlite import device_policy

    assert device_policy.prefers_cudnn_attention(capability, cudnn, cuda) is first, gpu
    assert not device_policy.prefers_cudnn_attention(capability, cudnn, cuda, deprioritized=True)
    monkeypatch.setattr(device_policy, "_CUDNN", [cudnn])
    monkeypatch.setattr(torch.version, "cuda", cuda)
    order = device_policy.sdpa_priority("cuda", capability)
    assert (order is not None and order[0] == SDPBackend.CUDNN_ATTENTION) is first, gpu
    assert order is None or order[1:] == [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    assert device_policy.sdpa_priority("cpu") is None


def test_without_expansion_gqa_on_cuda_falls_to_math():
    # The bug this policy fixes: fp32 + enable_gqa on CUDA stores B·H·T² scores.
    assert (
        sdpa_kernel_for("cuda", torch.float32, 64, gqa=True, capability=H100, expand_kv=False)
        == "math"
    )
    assert sdpa_kernel_for("cuda", torch.float32, 64, gqa=False, capability=H100) == "efficient"


def test_cpu_reports_the_kernel_torch_actually_picks():
    # On this machine torch can tell us: _fused_sdp_choice is SDPA's own dispatcher decision.
    from torch.nn.attention import SDPBackend

    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
    choice = SDPBackend(torch._fused_sdp_choice(q, k, k, None, 0.0, True, enable_gqa=True))
    names = {
        SDPBackend.FLASH_ATTENTION: "flash",
        SDPBackend.EFFICIENT_ATTENTION: "efficient",
        SDPBackend.MATH: "math",
    }
    assert names[choice] == sdpa_kernel_for("cpu", torch.float32, 8, gqa=True)


# ---- the MFU dtype --------------------------------------------------------------------------
def test_matmul_dtype_follows_what_the_matmuls_compute_in():
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert matmul_dtype(f32) == f32
    assert matmul_dtype(f32, autocast_dtype=bf16) == bf16
    assert matmul_dtype(f32, fsdp_param_dtype="bfloat16") == bf16  # FSDP casts the weights
    # autocast wins
    assert matmul_dtype(f32, autocast_dtype=f16, fsdp_param_dtype="bfloat16") == f16
    assert matmul_dtype(f32, fsdp_param_dtype="float32") == f32
    # Real FP8 still divides by the bf16 peak: attention and the output layer never run in FP8,
    # and torchtitan's MFU does the same (before: the FP8 peak, twice as high).
    assert matmul_dtype(f32, bf16, fp8={"emulated": False}) == bf16
    assert matmul_dtype(f32, fp8=True) == bf16
    assert matmul_dtype(f32, bf16, fp8={"emulated": True}) == bf16  # emulation multiplies in bf16
    assert matmul_dtype(f32, fp8={"emulated": True}) == f32
    assert matmul_dtype(bf16, fp8=None) == bf16


# ---- process groups -------------------------------------------------------------------------
def test_backend_and_device_per_device_type():
    assert backend_and_device_for("cuda", 4) == ("nccl", "cuda", None)
    assert backend_and_device_for("cpu", 4) == ("gloo", "cpu", None)
    assert backend_and_device_for("mps", 1) == (None, "mps", None)  # alone: MPS is fine
    backend, device, note = backend_and_device_for("mps", 2)
    assert (backend, device) == ("gloo", "cpu") and "gloo cannot move MPS tensors" in note
    assert "\n" not in note


def test_explicit_mps_under_torchrun_is_refused_in_one_line():
    with pytest.raises(TitanliteError) as e:
        backend_and_device_for("mps", 2, explicit=True)
    assert "\n" not in str(e.value) and "--training.device cpu" in str(e.value)
    with pytest.raises(TitanliteError, match="nccl only moves CUDA tensors"):
        backend_and_device_for("cpu", 2, backend="nccl")


def test_cuda_index_alone_is_honoured():
    assert cuda_index_for(1, local_rank=0, local_world_size=1, device_count=2) == 1
    assert cuda_index_for(None, local_rank=0, local_world_size=1, device_count=2) == 0
    with pytest.raises(TitanliteError, match="torch sees 2 CUDA GPU"):
        cuda_index_for(3, local_rank=0, local_world_size=1, device_count=2)


def test_cuda_index_under_torchrun():
    assert cuda_index_for(None, local_rank=3, local_world_size=4, device_count=8) == 3
    with pytest.raises(TitanliteError) as e:  # every rank would share cuda:1
        cuda_index_for(1, local_rank=0, local_world_size=4, device_count=8)
    assert "\n" not in str(e.value) and "CUDA_VISIBLE_DEVICES" in str(e.value)
    with pytest.raises(TitanliteError, match="local rank 4 has no GPU"):
        cuda_index_for(None, local_rank=4, local_world_size=5, device_count=4)
    # One process per node (multi-node, one GPU each): an explicit index is still honoured.
    assert cuda_index_for(1, local_rank=0, local_world_size=1, device_count=2) == 1


@pytest.mark.parametrize(
    "capability, mode", [(T4, "fp32"), (V100, "fp32"), (A100, "bf16"), (H100, "bf16")]
)
def test_auto_never_picks_the_fp16_scaler_for_sharded_runs(capability, mode):
    # FSDP/TP/PP refuse fp16 + GradScaler (each rank sees only its shard's overflow): "auto"
    # must not choose it for the user there; the trainer passes scaler_ok=False.
    assert default_mixed_precision("cuda", capability, scaler_ok=False) == mode
