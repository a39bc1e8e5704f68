"""Joining the process group: which rank am I, which device is mine, which backend talks.

    dist_env = init_distributed("auto")     # no torchrun variables: a world of one, no group

Every process runs the same script; torchrun tells each one who it is: RANK (across all machines),
LOCAL_RANK (on this machine), WORLD_SIZE, MASTER_ADDR/MASTER_PORT (where rank 0 listens)."""

import contextlib
import ctypes
import datetime
import os
import signal
import socket
import sys
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..device_policy import backend_and_device_for, cuda_index_for
from ..errors import TitanliteError
from ..hardware import detect_device


@dataclass
class DistEnv:
    """Who this process is in the job torchrun started (a world of one when alone) and, once it
    joined the process group (`init_distributed`), the backend it talks through and its device."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None  # None: no process group (a single process, or not joined yet)
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


ONE_PROCESS = DistEnv()


LAUNCH_HINT = (
    "launch with torchrun (torchrun --nproc-per-node N -m titanlite train ...) or, under SLURM, "
    "with configs/multinode/train.sbatch"
)


def torchrun_env(env=os.environ) -> DistEnv | None:
    """Who this process is (a `DistEnv` with no backend yet) when started by torchrun, else None.
    The variables are read once and checked as a whole, before any process group starts: a
    hand-written job script that sets some of them, or sets one wrong, gets one line saying which
    and how to launch instead."""
    present = sorted({"RANK", "WORLD_SIZE", "LOCAL_RANK"} & env.keys())
    if not present:
        tasks = env.get("SLURM_NTASKS", "1")
        if "SLURM_PROCID" in env and tasks.isdigit() and int(tasks) > 1:  # srun without torchrun
            raise TitanliteError(
                f"SLURM started {tasks} tasks but set no RANK/WORLD_SIZE, so each would train "
                f"alone: {LAUNCH_HINT}"
            )
        return None
    if missing := [name for name in ("RANK", "WORLD_SIZE") if name not in env]:
        raise TitanliteError(
            f"{' and '.join(missing)} not set while {', '.join(present)} is: a half-set "
            f"distributed environment; {LAUNCH_HINT}"
        )
    world, rank = _count(env, "WORLD_SIZE"), _count(env, "RANK")
    local, local_world = _count(env, "LOCAL_RANK", 0), _count(env, "LOCAL_WORLD_SIZE", world)
    if world < 1 or not 0 <= rank < world or not 0 <= local < max(local_world, 1):
        raise TitanliteError(
            f"RANK={rank}, LOCAL_RANK={local} do not fit WORLD_SIZE={world} (LOCAL_WORLD_SIZE="
            f"{local_world}): ranks count from 0 to WORLD_SIZE-1; {LAUNCH_HINT}"
        )
    unset = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if world > 1 and unset:
        raise TitanliteError(
            f"WORLD_SIZE={world} but {' and '.join(unset)} not set: the ranks find each other "
            f"at rank 0's address and port; {LAUNCH_HINT}"
        )
    if world > 1 and not 0 < _count(env, "MASTER_PORT") < 65536:
        raise TitanliteError(
            f"MASTER_PORT={env['MASTER_PORT']} is not a port (1-65535); {LAUNCH_HINT}"
        )
    return DistEnv(rank, local, world)


def _count(env, name: str, default: int | None = None) -> int:
    """An environment variable that must be a whole number, or one line naming it."""
    text = env.get(name, "").strip()
    if not text and default is not None:
        return default
    if not text.lstrip("-").isdigit():
        raise TitanliteError(f"{name}={env.get(name)!r} is not a whole number; {LAUNCH_HINT}")
    return int(text)


def pick_backend(requested: str, device_type: str) -> str:
    """nccl for CUDA (GPU-to-GPU over NVLink/InfiniBand), gloo for everything else (CPU)."""
    if requested == "nccl" and not torch.cuda.is_available():
        raise TitanliteError(
            "parallel.backend=nccl needs CUDA GPUs, and none is available here: "
            "use --parallel.backend gloo (or auto)"
        )
    return backend_and_device_for(device_type, 2, requested)[0]


def device_for_rank(requested: str, local_rank: int, local_world_size: int = 1) -> torch.device:
    """One accelerator per process: alone, `cuda:N` is honoured; under torchrun local rank r takes cuda:r."""
    device = detect_device(requested)
    if device.type == "cuda":
        device = torch.device(
            "cuda",
            cuda_index_for(device.index, local_rank, local_world_size, torch.cuda.device_count()),
        )
        torch.cuda.set_device(device)
    return device


def init_distributed(
    device: str = "auto", backend: str = "auto", timeout_s: float = 300
) -> DistEnv:
    """Join the job's process group (if torchrun started us); return who we are."""
    launch = torchrun_env() or ONE_PROCESS
    if launch.world_size == 1 or not dist.is_available():
        return DistEnv(device=device_for_rank(device, 0))
    die_with_parent()
    dev = device_for_rank(
        device, launch.local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", launch.world_size))
    )
    # mps named (`explicit`) is refused here; found by "auto", the ranks train on the CPU instead
    name, dev_type, note = backend_and_device_for(
        dev.type, launch.world_size, backend, explicit=str(device).strip().lower().startswith("mps")
    )
    if dev_type != dev.type:  # MPS under torchrun: no backend moves its tensors
        dev = torch.device(dev_type)
        if launch.rank == 0:
            print(f"[titanlite] {note}", file=sys.stderr, flush=True)
    if not dist.is_initialized():
        # Past the timeout a collective raises instead of hanging: a dead peer becomes an error.
        timeout = datetime.timedelta(seconds=timeout_s)
        # torch's own rendezvous (env://, torchrun's agent store where it has one), first to
        # check that no two ranks of a machine hold the same GPU, where NCCL would fail obscurely
        store, _, _ = next(
            dist.rendezvous("env://", launch.rank, launch.world_size, timeout=timeout)
        )
        if dev.type == "cuda":  # the UUID: the same physical GPU whatever CUDA_VISIBLE_DEVICES says
            gpu = torch.cuda.get_device_properties(dev).uuid
            refuse_shared_gpus(
                store, launch.rank, launch.world_size, f"{socket.gethostname()}/{gpu}"
            )
        dist.init_process_group(
            name,
            store=store,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,
        )
    return replace(launch, backend=name, device=dev)


def die_with_parent() -> None:
    """Linux: have the kernel kill this worker if its torchrun agent (or fork server) dies, even by
    SIGKILL (each worker has a session of its own), so an interrupted notebook leaves no rank."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
            if os.getppid() == 1:  # the parent died before we asked
                os._exit(1)


def refuse_shared_gpus(store, rank: int, world_size: int, gpu: str) -> None:
    """Every rank writes which GPU it took (`gpu`: host and UUID) to the store and reads the others':
    two ranks on one GPU are refused in one line, on every rank, before NCCL starts (one GPU and
    torchrun --nproc-per-node 2 would otherwise meet NCCL's "Duplicate GPU detected")."""
    gpus = dist.PrefixStore("titanlite-gpus", store)
    gpus.set(str(rank), gpu)
    taken = [gpus.get(str(r)).decode() for r in range(world_size)]  # get waits for the key
    if shared := [r for r in range(world_size) if taken.count(taken[r]) > 1]:
        raise TitanliteError(
            f"ranks {', '.join(map(str, shared))} took the same GPU ({taken[shared[0]]}): each "
            f"rank needs its own; start at most {world_size - len(shared) + 1} processes per "
            f"machine here (--nproc-per-node), or give each one a GPU of its own"
        )


def destroy_distributed(barrier: bool = False) -> None:
    """Leave the process group. barrier=True (only after success: a failed rank's peers may be gone)
    first waits for every rank: tearing gloo down while a peer still talks to it can abort."""
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist.destroy_process_group()


def exit_worker(code: int = 0) -> None:
    """Flush, then `os._exit` (last, results saved): at interpreter exit gloo's C++ threads can SIGABRT."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def broadcast_from_rank0(value):
    """Rank 0's value, everywhere (e.g. a run name that contains the time); as is, alone."""
    return gather_from_ranks(value)[0]


def all_reduce_sum(value: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a tensor over the group in place (no-op in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def gather_from_ranks(value, group=None) -> list:
    """Every rank's `value` (a picklable object) in the group (None: all), in rank order; [value]
    alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone
