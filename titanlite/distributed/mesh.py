"""The parallel layout: how the world's ranks split into groups, one idea in one grid.

Like picotron's process-group manager, the whole layout is one tensor: arrange the ranks
0..world-1 as a grid of shape (pp, dp_replicate, dp_shard, tp); every line of the grid along
one axis is one process group. `init_device_mesh` builds exactly that grid and its groups.

- tp (innermost): ranks that split every matmul; they talk in every layer, so they get the
  fastest links (neighbouring ranks = the same node, NVLink).
- dp_shard: ranks that split parameters, gradients and optimizer state (FSDP / ZeRO-3).
- dp_replicate: full model copies that all-reduce gradients (DDP; across nodes in HSDP).
- pp (outermost): pipeline stages; they only pass activations to a neighbour once per
  micro-batch, so they tolerate the slowest links (across nodes).
dp = dp_replicate × dp_shard is how many different batches are processed at once.
"""
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
    def resolve(cls, dp_replicate: int, dp_shard: int, world_size: int, tp: int = 1,
                pp: int = 1) -> "ParallelDims":
        """Fill in dp_shard=-1 ("every rank not used otherwise") and check the product."""
        for name, value in (("dp_replicate", dp_replicate), ("tp", tp), ("pp", pp)):
            if value < 1:
                raise TitanliteError(f"parallel.{name} must be at least 1, got {value}")
        if dp_shard == 0 or dp_shard < -1:
            raise TitanliteError(f"parallel.dp_shard must be positive or -1 (all ranks left over), "
                                 f"got {dp_shard}")
        others = dp_replicate * tp * pp
        if dp_shard == -1:
            if world_size % others:
                raise TitanliteError(f"dp_replicate × tp × pp = {dp_replicate} × {tp} × {pp} = {others} "
                                     f"does not divide the {world_size} processes: choose degrees "
                                     f"whose product divides {world_size}")
            dp_shard = world_size // others
        if others * dp_shard != world_size:
            raise TitanliteError(f"pp × dp_replicate × dp_shard × tp = {pp} × {dp_replicate} × "
                                 f"{dp_shard} × {tp} = {others * dp_shard}, but {world_size} processes "
                                 f"were started: make the product equal the number of processes")
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
        if self.dp_shard == 1:
            return "ddp"
        return "hsdp" if self.dp_replicate > 1 else "fsdp"

    def describe(self) -> str:
        used = [f"{n}={d}" for n, d in zip(DIM_NAMES, self.shape) if d > 1]
        return " × ".join(used) or "one process"

    def layout(self) -> torch.Tensor:
        """The rank grid itself: layout()[p, r, s, t] is the rank at those coordinates."""
        return torch.arange(self.world_size).view(self.shape)

    def coordinates(self, rank: int) -> dict[str, int]:
        where = (self.layout() == rank).nonzero()[0].tolist()
        return dict(zip(DIM_NAMES, where))

    def dp_rank(self, rank: int) -> int:
        """Which slice of each global batch this rank reads: ranks that differ only in tp or
        pp read the same batch (they work on the same samples together)."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def build_mesh(self, device_type: str):
        """A DeviceMesh with the four named dims; None for one process."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh(device_type, self.shape, mesh_dim_names=DIM_NAMES)

    def groups(self, dim: str) -> list[list[int]]:
        """The process groups along one dim, e.g. groups("tp") → [[0, 1], [2, 3], ...]."""
        axis = DIM_NAMES.index(dim)
        grid = self.layout().movedim(axis, -1)
        return grid.reshape(-1, self.shape[axis]).tolist()
