"""The parallel layout: how the world's ranks split into data-parallel groups.

Like picotron's process-group manager, the whole layout is one tensor: arrange the ranks
0..world-1 as a grid of shape (dp_replicate, dp_shard); every row/column is one process
group. `init_device_mesh` builds exactly that grid and its groups for us.

- dp_replicate: full model copies that all-reduce gradients (DDP; across nodes in HSDP).
- dp_shard: ranks that split parameters, gradients and optimizer state (FSDP / ZeRO-3).
Their product is the data-parallel degree: how many different batches are processed at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TitanliteError


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, world_size: int) -> "ParallelDims":
        """Fill in dp_shard=-1 ("every rank not used otherwise") and check the product."""
        if dp_replicate < 1 or dp_shard == 0 or dp_shard < -1:
            raise TitanliteError(f"parallel degrees must be positive (dp_shard may be -1 = the rest), "
                                 f"got dp_replicate={dp_replicate}, dp_shard={dp_shard}")
        if dp_shard == -1:
            if world_size % dp_replicate:
                raise TitanliteError(f"parallel.dp_replicate={dp_replicate} does not divide the "
                                     f"{world_size} processes: choose a divisor of {world_size}")
            dp_shard = world_size // dp_replicate
        if dp_replicate * dp_shard != world_size:
            raise TitanliteError(f"dp_replicate × dp_shard = {dp_replicate} × {dp_shard} = "
                                 f"{dp_replicate * dp_shard}, but {world_size} processes were started: "
                                 f"make the product equal the number of processes")
        return cls(dp_replicate, dp_shard, world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def strategy(self) -> str:
        """What the data-parallel wrapper will be: none, ddp, fsdp or hsdp (both)."""
        if self.world_size == 1:
            return "none"
        if self.dp_shard == 1:
            return "ddp"
        return "hsdp" if self.dp_replicate > 1 else "fsdp"

    def build_mesh(self, device_type: str):
        """A DeviceMesh with named dims ("dp_replicate", "dp_shard"); None for one process."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))

    def layout(self) -> torch.Tensor:
        """The rank grid itself: layout()[i, j] is the rank with replica i, shard j."""
        return torch.arange(self.world_size).view(self.dp_replicate, self.dp_shard)

    def dp_rank(self, rank: int) -> int:
        """Which slice of each global batch this rank reads (row-major over the grid)."""
        return rank  # data parallel is the only dimension yet: every rank reads its own slice
