"""What several labs share, once: join the job, a seeded tiny model, random tokens, the
next-token loss, a plain AdamW loop to compare a parallel run against, and progress reports.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed.env import init_distributed, pick_backend, torchrun_env
from ..efficiency.accumulation import count_targets, loss_sum
from ..errors import TitanliteError
from ..models.llama import ModelArgs, build_model
from ..tools.jobs.run_function import report


def group_device() -> str:
    """The device type the running process group moves: nccl CUDA tensors, gloo CPU ones
    (a job launched on CPU ranks stays on the CPU even on a machine with GPUs)."""
    return (
        "cuda"
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
        else "cpu"
    )


def join(
    device: str | None = None,
    *,
    mesh_dim: str | None = None,
    world_of_one: bool = False,
    threads: int | None = None,
    deterministic: bool = False,
):
    """This rank's DistEnv, and a 1-D DeviceMesh named `mesh_dim` over every rank (or None).

    The caller (torchrun, or titanlite's launch_function) started the ranks; this joins their
    process group. With `world_of_one`, a plain process (a notebook kernel) or a one-process job
    still gets a group of its own, because DDP and FSDP need one: torchrun's rendezvous, or an
    in-memory store; `titanlite.distributed.env.destroy_distributed()` ends it.
    `deterministic`: CUDA kernels that give the same bits every run (for "bitwise equal")."""
    env = init_distributed(device or group_device())
    if not dist.is_initialized():
        if not world_of_one:
            raise TitanliteError(
                "this lab needs several processes in a process group: start it with "
                "titanlite's launch_function(..., nproc=2) or torchrun"
            )
        alone = {} if torchrun_env() else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        dist.init_process_group(
            pick_backend("auto", env.device.type),
            device_id=env.device if env.device.type == "cuda" else None,
            **alone,
        )
        env.world_size, env.backend = 1, dist.get_backend()
    if threads:  # several ranks on one machine's cores: each takes its share, not all of them
        torch.set_num_threads(threads)
    if deterministic and env.device.type == "cuda":
        # By default some CUDA backward kernels add with atomics, in an order that changes
        # from run to run.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if mesh_dim is None:
        return env, None
    from torch.distributed.device_mesh import init_device_mesh

    return env, init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=(mesh_dim,))


def seeded_model(args: ModelArgs, seed: int, device="cpu"):
    """The tiny Llama with the weights `seed` gives. Built on the CPU and then moved, so every
    rank and every device starts from the very same numbers."""
    torch.manual_seed(seed)
    return build_model(args, "cpu").to(device)


def random_tokens(vocab_size: int, shape: tuple, seed: int, device="cpu") -> torch.Tensor:
    """Random token ids of `shape` that depend only on `seed` (not on the global RNG)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, shape, generator=g).to(device)


def next_token_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `model(x)` against `y`, in fp32 whatever the logits' dtype."""
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def train_adamw(
    model,
    batches,
    *,
    lr: float,
    grad_clip: float = 1.0,
    loss_sum_fn=loss_sum,
    loss_context=contextlib.nullcontext,
    on_step=None,
) -> dict:
    """The reference loop a parallel run is held against: one AdamW step per (x, y) pair, the
    loss a mean over the targets that count (padding does not), gradients clipped at
    `grad_clip`. `loss_context()` wraps the loss and its backward (loss parallelism needs both
    inside). Returns {"losses", "grad_norms"}; calls on_step(step, loss) after each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    out = {"losses": [], "grad_norms": []}
    for step, (x, y) in enumerate(batches, 1):
        with loss_context():
            loss = loss_sum_fn(model(x), y) / count_targets(y)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        out["grad_norms"].append(
            (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        if on_step is not None:
            on_step(step, loss.item())
    return out


class Progress:
    """Seconds of each finished part of a lab job, each also sent to the launcher's callbacks
    as {"kind": "lab", "done": part, "seconds": ...} (run_function.report): a notebook cell
    shows how far a job of several minutes has got."""

    def __init__(self):
        self.start, self.seconds = time.perf_counter(), {}

    def done(self, part: str) -> None:
        self.seconds[part] = time.perf_counter() - self.start - sum(self.seconds.values())
        report({"kind": "lab", "done": part, "seconds": self.seconds[part]})


def state_against_floor(overrides: dict) -> dict:
    """Each rank of a trainer built with `overrides`, one optimizer step and one more backward in:
    the bytes of the weights, gradients and AdamW moments it holds, read off its tensors
    (tools.predict.zero), and
    preflight's floor for them (`memory_floor`): what notebooks 17 and 18 check the formula by."""
    from ..config import load_config
    from ..preflight import memory_floor
    from ..tools.predict.zero import measure_state_bytes
    from ..train import Trainer

    cfg = load_config(None, overrides)
    trainer = Trainer(cfg)
    try:
        trainer.train_step(trainer.next_micro_batches())  # AdamW's moments exist after a step
        batches = trainer.next_micro_batches()  # and the gradients between backward and step
        trainer.forward_backward(batches, batches.num_targets)
        # the optimizer's moments once (it holds every part's), each part's weights and gradients
        held = [measure_state_bytes(part) for part in trainer.model_parts]
        moments = measure_state_bytes(trainer.model_parts[0], trainer.optimizer)["optimizer"]
        state, per_sequence = memory_floor(trainer.plan, cfg)
        return {
            "rank": dist.get_rank() if dist.is_initialized() else 0,
            "held": moments + sum(h["params"] + h["grads"] for h in held),
            "floor": state,
            "per_sequence": per_sequence,
        }
    finally:
        trainer.close()
