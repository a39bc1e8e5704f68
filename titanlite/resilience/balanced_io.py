"""ByteCheckpoint's balanced I/O: a save's bytes spread evenly over the ranks; a load that reads each
replicated byte from storage once per job.

Save: DCP writes each item several ranks hold alike (DDP's weights and moments, HSDP's replicated
shards) on one of its holders, picked in the items' order, so a few large items can pile onto one
rank; `BalancedSavePlanner` picks largest first, each for the holder with the fewest bytes so far.
Load: DCP has every rank read every replicated byte (N ranks, N times the checkpoint). Here each such
entry is read by one rank - tensors spread by bytes, small pickled values by rank 0 - and broadcast;
DTensor shards (FSDP, TP) are read by their owners, as before."""

import dataclasses
import io

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType


class BalancedSavePlanner(DefaultSavePlanner):
    """DCP's save plan, with each replicated item written by the holder with the fewest bytes so
    far, largest items first (then DCP's own dedup finds nothing left to do)."""

    def create_global_plan(self, all_plans):
        holders, size = {}, {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                holders.setdefault(item.index, []).append(rank)
                # A pickled value's size is unknown until written: ~1 KB, so thousands of them (the
                # flattened optimizer settings) are spread too rather than all given to one rank.
                size[item.index] = item.tensor_storage_size() or 1024
        load, keep = [0] * len(all_plans), [set() for _ in all_plans]
        for index in sorted(holders, key=lambda i: -size[i]):
            rank = min(holders[index], key=load.__getitem__)
            load[rank] += size[index]
            keep[rank].add(index)
        return super().create_global_plan(
            [
                dataclasses.replace(plan, items=[i for i in plan.items if i.index in mine])
                for plan, mine in zip(all_plans, keep)
            ]
        )

    def transform_object(self, write_item, object):
        """A small value (~600 optimizer settings) as torch's plain pickle, not a zip each: 3x less CPU."""
        if write_item.type != WriteItemType.BYTE_IO:
            return super().transform_object(write_item, object)
        torch.save(object, out := io.BytesIO(), _use_new_zipfile_serialization=False)
        return out


def leaves(sd: dict, prefix: str = "") -> dict[str, tuple[dict, str]]:
    """{name DCP gives it ("model.w"): (the dict holding it, its key)} for every non-dict value."""
    out = {}
    for key, value in sd.items():
        out.update(
            leaves(value, f"{prefix}{key}.")
            if isinstance(value, dict)
            else {f"{prefix}{key}": (sd, key)}
        )
    return out


def _signature(value):  # what must match on every rank for a value to be one replicated entry
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return tuple(value.shape), str(value.dtype)
    # a DTensor is a shard: never shared
    return None if isinstance(value, torch.Tensor) else "object"


def read_owners(sd: dict) -> dict[str, int]:
    """The rank that reads each entry all ranks hold alike: tensors largest first, each to the rank
    with the fewest bytes so far; other values to rank 0. Collective; the same answer everywhere."""
    values = {name: box[key] for name, (box, key) in leaves(sd).items()}
    mine = {name: sig for name, value in values.items() if (sig := _signature(value)) is not None}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    common = [
        name for name in sorted(mine) if all(other.get(name) == mine[name] for other in every)
    ]
    nbytes = {
        n: values[n].numel() * values[n].element_size() for n in common if mine[n] != "object"
    }
    owners, load = {n: 0 for n in common if n not in nbytes}, [0] * len(every)
    for name in sorted(nbytes, key=lambda n: -nbytes[n]):
        owners[name] = min(range(len(load)), key=load.__getitem__)
        load[owners[name]] += nbytes[name]
    return owners


class ReadOncePlanner(DefaultLoadPlanner):
    """DCP's load plan without the reads another rank makes for everyone."""

    def __init__(self, owners: dict[str, int], rank: int):
        super().__init__()
        self.owners, self.rank = owners, rank

    def create_local_plan(self):
        plan = super().create_local_plan()
        return dataclasses.replace(
            plan,
            items=[
                i for i in plan.items if self.owners.get(i.dest_index.fqn, self.rank) == self.rank
            ],
        )


def share_read_entries(sd: dict, owners: dict[str, int]) -> None:
    """Each entry from the rank that read it to all the others (tensors in place). Collective."""
    where = leaves(sd)
    values = {name: box[key] for name, (box, key) in where.items() if name in owners}
    objects = [
        {name: value for name, value in values.items() if not isinstance(value, torch.Tensor)}
    ]
    dist.broadcast_object_list(objects, src=0)
    for name, value in objects[0].items():
        box, key = where[name]
        box[key] = value
    for name in sorted(n for n in owners if n not in objects[0]):
        dist.broadcast(values[name].data, src=owners[name])
