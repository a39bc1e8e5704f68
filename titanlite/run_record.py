"""run.json: what a run is, and what it built, read back from the objects it built.

A policy says what *should* happen on a device (device_policy.py); this records what the trainer
*did*: each rank's device, the dtype its weights are in, what FSDP gathers and reduces in, whether
autocast wraps the step, the optimizer and whether it is fused, which blocks are compiled, FP8,
the attention kernels' order, TF32 and the allocator's settings, each read off the model, the
optimizer or torch at the end of set-up. A wiring mistake between the two (a policy decided and
then not applied) shows here, and the tests on faked GPUs read it (tests/test_virtual_gpu.py)."""

import dataclasses
import os

import torch

from . import hardware
from ._compat.torch_internals import fsdp_mixed_precision, is_compiled_in_place
from .device_policy import sdpa_priority
from .distributed.ddp import unwrap


def built(trainer) -> dict:
    """This rank's settings in force, read back from what `trainer` built."""
    model = unwrap(trainer.model)
    blocks = list(getattr(model, "layers", {}).values())
    kernels = sdpa_priority(
        trainer.device.type,
        # on CUDA, attention asks for this GPU's capability's order
        torch.cuda.get_device_capability(trainer.device) if trainer.device.type == "cuda" else None,
    )
    return {
        "rank": trainer.dist.rank,
        "device": str(trainer.device),
        "device_name": hardware.device_name(trainer.device),
        # a DTensor, if sharded, has its local shard's dtype
        "weights_dtype": str(next(model.parameters()).dtype),
        "fsdp": fsdp_mixed_precision(trainer.model),  # None: not sharded by FSDP
        "autocast": str(trainer.precision.dtype) if trainer.precision.dtype else None,
        "grad_scaler": trainer.precision.scaler.is_enabled(),
        "optimizer": type(trainer.optimizer).__name__,
        "fused": bool(trainer.optimizer.defaults.get("fused")),
        "compiled_blocks": [is_compiled_in_place(b) for b in blocks],
        "compiled_model": is_compiled_in_place(model)
        and not any(map(is_compiled_in_place, blocks)),
        "float8": getattr(model, "fp8_info", None),
        "sdpa_order": [k.name for k in kernels] if kernels else None,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "context_parallel": _context_parallel(model),
        "experts": _experts(trainer),
    }


def _context_parallel(model) -> dict | None:
    """The kernel every block of context-parallel attention runs (decided once, by apply_cp)."""
    cp = getattr(model, "context_parallel", None)
    return cp and {"kernel": cp.kernel, "layout": cp.layout, "method": cp.method}


def _experts(trainer) -> dict | None:
    """The experts' kernel and host waits a layer (models/moe.py), for a mixture only."""
    if trainer.model_args.moe is None:
        return None
    from .models.moe import experts_record  # a mixture only: a dense run never imports it

    return experts_record(
        trainer.model_args, trainer.device, trainer.compute_dtype, trainer.dims.ep
    )


def run_record(trainer, per_rank: list[dict] | None = None) -> dict:
    """run.json: the config, the shapes and batch the run was planned with, its MFU peak, and
    `per_rank` (each rank's `built`)."""
    # a torchrun job's attempts share its run id, and their agent
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    return {
        "job": job and f"{job}:{os.getppid()}",
        "config": dataclasses.asdict(trainer.cfg),
        "model_args": trainer.model_args.to_dict(),
        "num_params": trainer.num_params,
        "micro_batch": trainer.micro_batch,
        "grad_accum_steps": trainer.grad_accum_steps,
        "global_batch": trainer.global_batch,
        "flops_per_token": trainer.flops_per_token,
        "device": hardware.device_name(trainer.device),
        "dtype": str(trainer.dtype),
        "compute_dtype": str(trainer.compute_dtype),
        "peak_flops": trainer.peak.flops if trainer.peak else None,
        "peak_label": trainer.peak.label if trainer.peak else None,
        "world_size": trainer.dist.world_size,
        "parallel": trainer.dims.strategy,
        "tp": trainer.dims.tp,
        "pp": trainer.dims.pp,
        "layout": trainer.dims.describe(),
        "dp_replicate": trainer.dims.dp_replicate,
        "dp_shard": trainer.dims.dp_shard,
        "float8": getattr(unwrap(trainer.model), "fp8_info", None),
        "torch": torch.__version__,
        "built": per_rank,
    }
