"""The Trainer built on virtual GPUs: what it *built*, read back from the objects (run_record.built),
for six machines a user may have — eight H100s, an A100, an RTX 4090, a T4, one GPU under two
ranks, and SLURM's one GPU per task.

This CPU build of torch cannot allocate a CUDA tensor, so the GPU is made of its facts (torch.cuda's
answers: count, capability, name, UUIDs, memory) and the model's tensors of FakeTensorMode's fake
CUDA tensors (shapes, dtypes and devices, no bytes): `Module.to` and `to_empty` onto a CUDA device
land there. Everything else is the trainer's own code: the device policy, the precision, the
layout, FSDP or DDP on torch's fake process group standing in for NCCL, the optimizer, the compile
decision. What a CPU cannot run is answered as the GPU would answer it: the mixed-precision probe step, the
FP8 probe and the trial compile (each runs kernels) say "works", and the bf16 check says what the
capability says; FSDP wraps the modules under the fake-tensor mode (it allocates on the device)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import join_as_rank, tiny_overrides
from torch import nn

from titanlite import TitanliteError
from titanlite._compat.torch_tools import FakeTensorMode

H100 = ("NVIDIA H100 80GB HBM3", (9, 0))
A100 = ("NVIDIA A100-SXM4-80GB", (8, 0))
RTX4090 = ("NVIDIA GeForce RTX 4090", (8, 9))
T4 = ("Tesla T4", (7, 5))
MI300X = ("AMD Instinct MI300X", (9, 4))  # under ROCm, torch reports gfx942 as 9.4


@pytest.fixture
def virtual_gpus(monkeypatch):
    """`make(gpu, uuids)`: this process sees GPUs of that kind (one per UUID); returns what the
    trial compile was asked (its param_dtype and autocast dtype)."""
    from titanlite.efficiency import compile as compile_module
    from titanlite.efficiency import fp8, mixed_precision
    from titanlite.efficiency.compile_trial import CompileSupport

    def make(gpu, uuids):
        name, capability = gpu
        monkeypatch.setattr(torch.version, "hip", "6.4" if gpu == MI300X else None)
        memory = 80 * 2**30 if capability >= (8, 0) else 16 * 2**30
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: len(uuids))
        monkeypatch.setattr(cuda, "set_device", lambda device: None)
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (memory, memory))
        monkeypatch.setattr(
            cuda, "is_bf16_supported", lambda including_emulation=True: capability >= (8, 0)
        )

        def properties(device=None):
            index = torch.device(device).index or 0 if device is not None else 0
            return SimpleNamespace(
                uuid=uuids[index],
                name=name,
                major=capability[0],
                minor=capability[1],
                total_memory=memory,
            )

        monkeypatch.setattr(cuda, "get_device_properties", properties)
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        # What a CPU cannot run, answered as this GPU would: its probe step trains.
        monkeypatch.setattr(mixed_precision, "_probe_step", lambda mode, device: None)
        trial = {}

        def compile_support(device, block=None, **kwargs):
            trial.update(kwargs, device=str(device))
            return CompileSupport(torch.device(device).type, "inductor", True, "the trial compiled")

        monkeypatch.setattr(compile_module, "compile_support", compile_support)
        monkeypatch.setattr(fp8, "_fp8_linear_works", lambda device, recipe, emulate: True)
        # TF32's switches are the process's: each machine starts from torch's defaults.
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
        _fake_cuda_tensors(monkeypatch)
        return trial

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield make
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _fake_cuda_tensors(monkeypatch):
    """`Module.to(cuda)` and `Module.to_empty(device=cuda)` make fake CUDA tensors."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    to, to_empty = nn.Module.to, nn.Module.to_empty

    def onto(args, kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if target is None or isinstance(target, torch.dtype):
            return None
        return torch.device(target) if torch.device(target).type == "cuda" else None

    def fake_to(self, *args, **kwargs):
        if (device := onto(args, kwargs)) is None:
            return to(self, *args, **kwargs)
        dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))

        def move(t):
            t = t if isinstance(t, torch._subclasses.FakeTensor) else fake.from_tensor(t)
            with fake:
                return t.to(device=device, dtype=dtype if dtype and t.is_floating_point() else None)

        return self._apply(move)

    def fake_to_empty(self, *, device, recurse=True):
        if torch.device(device).type != "cuda":
            return to_empty(self, device=device, recurse=recurse)
        with fake:
            return to_empty(self, device=device, recurse=recurse)

    monkeypatch.setattr(nn.Module, "to", fake_to)
    monkeypatch.setattr(nn.Module, "to_empty", fake_to_empty)
    # FSDP allocates its (empty) buffers on the mesh's device as it wraps each module.
    from titanlite.distributed import fsdp

    def fully_shard(module, **kwargs):
        with fake:
            return shard(module, **kwargs)

    shard = fsdp.fully_shard
    monkeypatch.setattr(fsdp, "fully_shard", fully_shard)

    def shard_and_init(model, weights, mesh, device, **kwargs):
        # FSDP wraps the model as parallelize asks (its kwargs: the dtypes); the shards stay on the
        # meta device, unfilled: filling fake CUDA tensors (copy_, slicing) and broadcasting rank
        # 0's weights need a CUDA build and real ranks, and no dtype or wrapper depends on them.
        model = fsdp.apply_fsdp(model, mesh, **kwargs)
        return model.to_empty(device="meta")

    monkeypatch.setattr(fsdp, "shard_and_init", shard_and_init)


def _build(data_dir, tmp_path, peaks=True, **overrides):
    from titanlite.config import load_config
    from titanlite.run_record import built
    from titanlite.tools.probe.datasheet import datasheet_peak
    from titanlite.tools.probe.matmul_peak import MatmulPeaks
    from titanlite.train import Trainer

    o = tiny_overrides(data_dir, tmp_path, **{"metrics.peak": "datasheet", **overrides})
    tools = {"datasheet": datasheet_peak, "peaks": MatmulPeaks()} if peaks else {}
    trainer = Trainer(load_config(None, o), **tools)
    return trainer, built(trainer)


@pytest.fixture
def no_group_left():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_eight_h100s_rank_5_fsdp_in_bf16_fused_compiled_cudnn_first(
    data_dir, tmp_path, monkeypatch, virtual_gpus, no_group_left
):
    from titanlite import device_policy

    trial = virtual_gpus(H100, [f"GPU-{i}" for i in range(8)])
    monkeypatch.setattr(device_policy, "_CUDNN", [91501])  # a cuDNN where torch puts it first
    started = join_as_rank(
        monkeypatch, 5, 5, 8, 8, {r: f"HOST/GPU-{r}" for r in range(8) if r != 5}, fake_group=True
    )
    trainer, record = _build(data_dir, tmp_path, **{"training.batch_size": 8})
    assert started["backend"] == "nccl" and started["device_id"] == torch.device("cuda", 5)
    assert trainer.dims.strategy == "fsdp" and trainer.dims.dp_shard == 8
    assert record["device"] == "cuda:5" and record["device_name"] == H100[0]
    assert record["fsdp"] == {"param_dtype": "torch.bfloat16", "reduce_dtype": "torch.float32"}
    assert record["weights_dtype"] == "torch.float32"  # the shards AdamW steps
    assert record["autocast"] is None and record["grad_scaler"] is False
    assert record["optimizer"] == "AdamW" and record["fused"] is True
    assert record["compiled_blocks"] == [True, True] and record["compiled_model"] is False
    assert record["sdpa_order"][0] == "CUDNN_ATTENTION"
    assert record["tf32_matmul"] is True and record["allocator"] == "expandable_segments:True"
    # the trial compile ran the graph training runs: bf16 weights, no autocast
    assert trial["param_dtype"] == torch.bfloat16 and trial["autocast_dtype"] is None
    assert trainer.compute_dtype == torch.bfloat16 and trainer.peak.flops == 989.5e12  # bf16


def test_one_a100_autocasts_in_bf16_with_tf32_and_torchs_own_attention_order(
    data_dir, tmp_path, virtual_gpus
):
    trial = virtual_gpus(A100, ["GPU-a100"])
    trainer, record = _build(data_dir, tmp_path)
    assert record["device"] == "cuda:0" and record["fsdp"] is None
    assert record["weights_dtype"] == "torch.float32" and record["autocast"] == "torch.bfloat16"
    assert record["fused"] is True and record["compiled_blocks"] == [True, True]
    assert record["sdpa_order"] is None  # SM 8.0: torch's gate keeps cuDNN out of first place
    assert record["tf32_matmul"] is True and record["allocator"] == "expandable_segments:True"
    assert trial["autocast_dtype"] == torch.bfloat16 and trial["param_dtype"] is None


def test_an_rtx_4090_trains_real_fp8_compiled_and_mfu_divides_by_bf16(
    data_dir, tmp_path, virtual_gpus
):
    virtual_gpus(RTX4090, ["GPU-4090"])
    trainer, record = _build(data_dir, tmp_path, **{"float8.enable": True, "float8.min_dim": 16})
    assert record["float8"]["emulated"] is False and record["float8"]["converted"]
    assert record["compiled_blocks"] == [True, True] and record["fused"] is True
    assert record["autocast"] == "torch.bfloat16"
    assert trainer.compute_dtype == torch.bfloat16


def test_a_t4_autocasts_in_fp16_with_the_scaler_and_no_tf32(data_dir, tmp_path, virtual_gpus):
    virtual_gpus(T4, ["GPU-t4"])
    trainer, record = _build(data_dir, tmp_path)
    assert record["autocast"] == "torch.float16" and record["grad_scaler"] is True
    assert record["tf32_matmul"] is False  # no TF32 units before Ampere
    assert record["fused"] is True and record["device_name"] == T4[0]
    assert trainer.compute_dtype == torch.float16


def test_one_gpu_two_ranks_is_refused_in_one_line_before_nccl(
    data_dir, tmp_path, monkeypatch, virtual_gpus, no_group_left
):
    virtual_gpus(H100, ["GPU-only"])
    started = join_as_rank(monkeypatch, 1, 1, 2, 2, {0: "HOST/GPU-only"}, fake_group=True)
    with pytest.raises(TitanliteError) as e:
        _build(data_dir, tmp_path)
    assert "ranks 0, 1 took the same GPU" in str(e.value) and "\n" not in str(e.value)
    assert started == {}  # NCCL never started


def test_slurm_one_gpu_per_task_each_rank_trains_on_its_own_cuda_0(
    data_dir, tmp_path, monkeypatch, virtual_gpus, no_group_left
):
    virtual_gpus(A100, ["GPU-task1"])  # this task sees one GPU, its own
    started = join_as_rank(monkeypatch, 1, 1, 2, 2, {0: "HOST/GPU-task0"}, fake_group=True)
    trainer, record = _build(data_dir, tmp_path)
    assert started["backend"] == "nccl" and started["device_id"] == torch.device("cuda", 0)
    assert record["rank"] == 1 and record["device"] == "cuda:0"
    assert record["fsdp"] == {"param_dtype": "torch.bfloat16", "reduce_dtype": "torch.float32"}
    assert record["fused"] is True


def test_a_t4_under_fsdp_trains_in_fp32_never_fp16_with_a_scaler(
    data_dir, tmp_path, monkeypatch, virtual_gpus, no_group_left
):
    """ "auto" on a GPU without bf16: fp16 + GradScaler where one process holds the whole model,
    but under FSDP each rank would see only its shard's overflow (the pair preflight refuses when
    asked for by name): fp32 there."""
    virtual_gpus(T4, ["GPU-0", "GPU-1"])
    join_as_rank(monkeypatch, 1, 1, 2, 2, {0: "HOST/GPU-0"}, fake_group=True)
    trainer, record = _build(data_dir, tmp_path, peaks=False)
    assert trainer.dims.strategy == "fsdp"
    assert record["autocast"] is None and record["grad_scaler"] is False


def test_a_t4_in_a_replica_group_trains_in_fp32_never_fp16_with_a_scaler(
    data_dir, tmp_path, monkeypatch, virtual_gpus
):
    """The same "auto" in one process that is a replica group of a fault-tolerant job: a group
    that rejoins would start from a fresh loss scale, not its peers' (the pair preflight refuses
    when fp16 is asked for by name), so fp32 there too. (torchft's Manager is not joined: no
    lighthouse in this test, and the precision is decided before it.)"""
    import titanlite.resilience.fault_tolerance as fault_tolerance

    monkeypatch.setattr(fault_tolerance, "apply_ft", lambda trainer: None)
    virtual_gpus(T4, ["GPU-t4"])
    trainer, record = _build(data_dir, tmp_path, peaks=False, **{"fault_tolerance.enable": True})
    assert trainer.dims.strategy == "none" and trainer.dims.replica_groups == 1
    assert record["autocast"] is None and record["grad_scaler"] is False
    alone, record = _build(data_dir, tmp_path / "alone", peaks=False)  # the same GPU, alone
    assert record["autocast"] == "torch.float16" and record["grad_scaler"] is True


MOE = {"model.n_experts": 4, "model.experts_per_token": 2}
FP32 = {"training.mixed_precision": "fp32", "parallel.param_dtype": "float32"}  # no 16 bits


@pytest.mark.parametrize(
    "gpu, overrides, attention",
    [
        (H100, {}, "cuda_flash"),
        (A100, {}, "cuda_flash"),
        (A100, FP32, "cuda_efficient"),  # flash takes no fp32
        (T4, {}, "cuda_efficient"),  # fp16 autocast; no flash before SM 8.0
        (MI300X, {}, "math"),
    ],
)
def test_context_parallel_records_the_kernel_each_gpu_runs_its_blocks_in(
    data_dir, tmp_path, monkeypatch, virtual_gpus, no_group_left, gpu, overrides, attention
):
    virtual_gpus(gpu, ["GPU-0", "GPU-1"])
    join_as_rank(monkeypatch, 1, 1, 2, 2, {0: "HOST/GPU-0"}, fake_group=True)
    o = {"parallel.cp": 2, "parallel.dp_shard": 1, **overrides}
    trainer, record = _build(data_dir, tmp_path, peaks=False, **o)
    assert record["context_parallel"] == {
        "kernel": attention,
        "layout": "zigzag",
        "method": "ring",
    }


@pytest.mark.parametrize(
    "gpu, kernel, waits",
    [
        (H100, "grouped_mm", 0),  # the grouped GEMM reads its group ends on the GPU
        (A100, "loop", 1),  # torch's grouped GEMM would loop with a host read: ours, once
        (T4, "loop", 1),  # fp16 autocast: no grouped GEMM
        (MI300X, "loop", 1),  # ROCm: the same (its 9.4 is not Hopper)
    ],
)
def test_the_experts_record_their_kernel_and_host_waits_per_layer(
    data_dir, tmp_path, virtual_gpus, gpu, kernel, waits
):
    """One process, bf16 autocast where the GPU has it. Expert parallel adds one read of the
    split sizes a layer and hands them to the loop: one wait, either kernel (models/moe.host_waits;
    counted on a real 2-rank run in tests/test_moe.py)."""
    from titanlite.models.moe import host_waits

    virtual_gpus(gpu, ["GPU-0"])
    trainer, record = _build(data_dir, tmp_path, peaks=False, **MOE)
    assert record["experts"] == {"kernel": kernel, "host_waits_per_layer": waits}
    assert host_waits(kernel, ep=2) == 1


@pytest.mark.parametrize(
    "name, kind",
    [("adamw8bit", "AdamW8bit"), ("adamw4bit", "AdamW4bit"), ("muon", "MuonWithAdamW")],
)
def test_an_h100_steps_each_optimizer_as_the_gpu_would(
    data_dir, tmp_path, virtual_gpus, name, kind
):
    """What the trainer decides on a GPU for an optimizer (optimizer.py, notebook 20's "on a GPU"):
    torchao's step compiled with the blocks (its fused kernels; eager on a CPU), Muon's AdamW part
    fused and its Newton-Schulz in bf16 as torch's Muon computes it (fp32 on a CPU)."""
    virtual_gpus(H100, ["GPU-h100"])
    trainer, record = _build(data_dir, tmp_path, **{"optimizer.name": name})
    assert record["optimizer"] == kind and record["fused"] is True
    assert record["compiled_blocks"] == [True, True]
    if name == "muon":
        assert trainer.optimizer.muon.ns_dtype == torch.bfloat16
        assert trainer.optimizer.adamw.defaults["fused"] is True
    cpu, cpu_record = _cpu_build(data_dir, tmp_path, name)
    assert cpu_record["optimizer"] == kind and cpu_record["fused"] is False
    if name == "muon":
        assert cpu.optimizer.muon.ns_dtype == torch.float32


def _cpu_build(data_dir, tmp_path, name):
    from titanlite.config import load_config
    from titanlite.run_record import built
    from titanlite.train import Trainer

    o = tiny_overrides(data_dir, tmp_path, **{"optimizer.name": name, "training.device": "cpu"})
    trainer = Trainer(load_config(None, o))
    return trainer, built(trainer)
