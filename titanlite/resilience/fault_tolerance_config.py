"""[fault_tolerance]: this job as one replica group of a fault-tolerant job (torchft, notebook 22),
with torchtitan's names, and what a replica group cannot be, refused before anything starts.

    --fault_tolerance.enable true --fault_tolerance.group_size 2 --fault_tolerance.replica_id 0

Apart from config.py, as torchtitan keeps its own in components/ft/config: the technique itself,
which imports torchft, is fault_tolerance.py, loaded only by a run that asks for it."""

from dataclasses import dataclass, replace

from ..config_fields import one_of, ranged
from ..errors import refuse_first


@dataclass
class FaultToleranceSection:
    # Replica groups that average each step's gradients and go on without a group that died;
    # their lighthouse (torchft's quorum server) is at $TORCHFT_LIGHTHOUSE.
    enable: bool = False
    replica_id: int = ranged(0, "[0, inf)")  # which replica group this job is: 0..group_size-1
    group_size: int = ranged(1, "[1, 1024]")  # replica groups in all; each reads its own data slice
    # a step commits only with at least this many groups in its quorum
    min_replica_size: int = ranged(1, "[1, 1024]")
    # none: the groups meet every step; diloco or local_sgd: every sync_steps (semi-synchronous)
    semi_sync_method: str = one_of("none", "diloco", "local_sgd")
    sync_steps: int = ranged(5, "[1, inf)")  # H: inner steps between two meetings
    # the process group across the groups; auto: nccl on CUDA, gloo otherwise
    process_group: str = one_of("auto", "gloo", "nccl")
    # a peer silent this long fails the step's exchange (a dead one fails it at once)
    process_group_timeout_ms: int = ranged(10_000, "[1, inf)")


def replica_group(ft: FaultToleranceSection, dims, mixed_precision: str, moe):
    """The rank grid `dims` (a ParallelDims) as replica group `ft.replica_id` of `ft.group_size`,
    after refusing what no replica group can be: outside the groups, waiting for more groups than
    there are, or holding state the groups would not keep equal (`moe`: the model's MoEArgs)."""
    refuse_first(
        (
            ft.replica_id >= ft.group_size,
            f"fault_tolerance.replica_id={ft.replica_id} is outside the {ft.group_size} replica "
            f"group(s) of fault_tolerance.group_size: choose 0..{ft.group_size - 1}, or raise "
            "--fault_tolerance.group_size",
        ),
        (
            ft.min_replica_size > ft.group_size,
            f"fault_tolerance.min_replica_size={ft.min_replica_size} needs more replica groups "
            f"than the {ft.group_size} there are (group_size), so no step could commit: lower it",
        ),
        (
            moe is not None and moe.balance == "aux_free",
            "fault tolerance cannot replicate a mixture of experts balanced aux_free: each replica "
            "group would move its router bias (a buffer, not a gradient) by its own tokens, so "
            "the groups' weights drift apart; use --model.moe_balance aux_loss",
        ),
        (
            mixed_precision == "fp16",
            "fault tolerance with fp16's GradScaler is not supported here: a group that rejoins "
            "would start from a fresh loss scale, not the others' - use "
            "--training.mixed_precision bf16",
        ),
    )
    return replace(dims, replica_groups=ft.group_size, replica_group=ft.replica_id)
