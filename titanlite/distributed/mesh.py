"""The parallel layout: how the world's ranks split into groups, one idea in one grid.

As in picotron, the ranks 0..world-1 form a grid (pp, dp_replicate, dp_shard, tp); each line along one axis
is a process group. tp (innermost) talks in every layer: the fastest links (one node); dp_shard is FSDP,
dp_replicate DDP (HSDP: both); pp (outermost) passes activations once per micro-batch: the slowest links."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TitanliteError

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int = 1
    pp: int = 1

    @classmethod
    def resolve(
        cls, dp_replicate: int, dp_shard: int, world_size: int, tp: int = 1, pp: int = 1
    ) -> ParallelDims:
        """Fill in dp_shard=-1 ("every rank not used otherwise") and check the product."""
        for name, value in (("dp_replicate", dp_replicate), ("tp", tp), ("pp", pp)):
            if value < 1:
                raise TitanliteError(f"parallel.{name} must be at least 1, got {value}")
        if dp_shard == 0 or dp_shard < -1:
            raise TitanliteError(
                f"parallel.dp_shard must be positive or -1 (all ranks left over), got {dp_shard}"
            )
        others = dp_replicate * tp * pp
        if dp_shard == -1 and world_size % others:
            raise TitanliteError(
                f"dp_replicate × tp × pp = {dp_replicate} × {tp} × {pp} = {others} "
                f"does not divide the {world_size} processes: choose degrees "
                f"whose product divides {world_size}"
            )
        dp_shard = world_size // others if dp_shard == -1 else dp_shard
        if others * dp_shard != world_size:
            raise TitanliteError(
                f"pp × dp_replicate × dp_shard × tp = {pp} × {dp_replicate} × "
                f"{dp_shard} × {tp} = {others * dp_shard}, but {world_size} processes "
                f"were started: make the product equal the number of processes"
            )
        return cls(dp_replicate, dp_shard, world_size, tp, pp)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def strategy(self) -> str:
        """The data-parallel wrapper: none, ddp, fsdp or hsdp (both)."""
        if self.dp == 1:
            return "none"
        return "ddp" if self.dp_shard == 1 else "hsdp" if self.dp_replicate > 1 else "fsdp"

    def describe(self) -> str:
        return (
            " × ".join(f"{n}={d}" for n, d in zip(DIM_NAMES, self.shape) if d > 1) or "one process"
        )

    def layout(self) -> torch.Tensor:
        """The rank grid itself: layout()[p, r, s, t] is the rank at those coordinates."""
        return torch.arange(self.world_size).view(self.shape)

    def coordinates(self, rank: int) -> dict[str, int]:
        return dict(zip(DIM_NAMES, (self.layout() == rank).nonzero()[0].tolist()))

    def dp_rank(self, rank: int) -> int:
        """Which slice of each global batch this rank reads (ranks differing only in tp or pp share one)."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def build_mesh(self, device_type: str):
        """A DeviceMesh with the four named dims; None for one process."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh  # multi-rank runs only

        return init_device_mesh(device_type, self.shape, mesh_dim_names=DIM_NAMES)

    def groups(self, dim: str) -> list[list[int]]:
        """The process groups along one dim, e.g. groups("tp") → [[0, 1], [2, 3], ...]."""
        axis = DIM_NAMES.index(dim)
        return self.layout().movedim(axis, -1).reshape(-1, self.shape[axis]).tolist()
