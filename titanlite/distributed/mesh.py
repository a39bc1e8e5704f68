"""The parallel layout: how the world's ranks split into groups, one idea in one grid.

As in picotron, the ranks 0..world-1 form a grid (pp, dp_replicate, dp_shard, ep, cp, tp); each line
along one axis is a process group. tp (innermost) talks in every layer: the fastest links (one node); cp
passes keys and values in every attention layer; ep sends tokens to their experts and back in every MoE
layer; dp_shard is FSDP, dp_replicate DDP (HSDP: both); pp (outermost) passes activations once per
micro-batch: the slowest links. Ranks differing in dp_replicate, dp_shard or ep read different data.
FSDP shards the weights over dp_shard × ep × cp (as torchtitan does): those ranks hold the same weights,
so they can share them out - all but the experts, which ep splits and FSDP shards over dp_shard."""

from dataclasses import dataclass

import torch

from ..errors import TitanliteError

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @classmethod
    def resolve(
        cls,
        dp_replicate: int,
        dp_shard: int,
        world_size: int,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
    ) -> "ParallelDims":
        """Fill in dp_shard=-1 ("every rank not used otherwise") and check the product."""
        for name, value in dict(dp_replicate=dp_replicate, tp=tp, pp=pp, cp=cp, ep=ep).items():
            if value < 1:
                raise TitanliteError(f"parallel.{name} must be at least 1, got {value}")
        if dp_shard == 0 or dp_shard < -1:
            raise TitanliteError(
                f"parallel.dp_shard must be positive or -1 (all ranks left over), got {dp_shard}"
            )
        others = dp_replicate * ep * cp * tp * pp
        if dp_shard == -1 and world_size % others:
            raise TitanliteError(
                f"dp_replicate × ep × cp × tp × pp = {dp_replicate} × {ep} × {cp} × {tp} × {pp} = {others} "
                f"does not divide the {world_size} processes: choose degrees "
                f"whose product divides {world_size}"
            )
        dp_shard = world_size // others if dp_shard == -1 else dp_shard
        if others * dp_shard != world_size:
            raise TitanliteError(
                f"pp × dp_replicate × dp_shard × ep × cp × tp = {pp} × {dp_replicate} × "
                f"{dp_shard} × {ep} × {cp} × {tp} = {others * dp_shard}, but {world_size} processes "
                f"were started: make the product equal the number of processes"
            )
        return cls(dp_replicate, dp_shard, world_size, tp, pp, cp, ep)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.ep, self.cp, self.tp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def batch_ranks(self) -> int:
        """How many slices each global batch is cut into: one per data-parallel or ep rank."""
        return self.dp * self.ep

    @property
    def strategy(self) -> str:
        """The data-parallel wrapper: none, ddp, fsdp (over dp_shard × ep × cp) or hsdp (both)."""
        if self.dp_shard * self.ep * self.cp == 1:  # nothing to shard over: replicas only, if any
            return "ddp" if self.dp_replicate > 1 else "none"
        return "hsdp" if self.dp_replicate > 1 else "fsdp"

    @property
    def sharded(self) -> bool:
        """Whether FSDP shards the weights (fsdp or hsdp)."""
        return self.strategy in ("fsdp", "hsdp")

    def describe(self) -> str:
        return (
            " × ".join(f"{n}={d}" for n, d in zip(DIM_NAMES, self.shape) if d > 1) or "one process"
        )

    def layout(self) -> torch.Tensor:
        """The rank grid itself: layout()[p, r, s, e, c, t] is the rank at those coordinates."""
        return torch.arange(self.world_size).view(self.shape)

    def coordinates(self, rank: int) -> dict[str, int]:
        return dict(zip(DIM_NAMES, (self.layout() == rank).nonzero()[0].tolist()))

    def dp_rank(self, rank: int) -> int:
        """Which of the `batch_ranks` slices of each global batch this rank reads (ranks differing
        only in cp, tp or pp share one: cp ranks then each keep their part of its sequences)."""
        c = self.coordinates(rank)
        return (c["dp_replicate"] * self.dp_shard + c["dp_shard"]) * self.ep + c["ep"]

    def sequence_part(self, rank: int, layout: str):
        """What a rank keeps of each sequence it reads: under context parallelism its chunks
        (distributed/context_parallel.py), else None: all of it."""
        if self.cp == 1:
            return None
        from .context_parallel import shard_sequence  # cp > 1 only

        cp_rank = self.coordinates(rank)["cp"]
        return lambda t: shard_sequence(t, cp_rank, self.cp, layout)

    def build_mesh(self, device_type: str):
        """A DeviceMesh with the six named dims; None for one process."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh  # multi-rank runs only

        return init_device_mesh(device_type, self.shape, mesh_dim_names=DIM_NAMES)

    def fsdp_mesh(self, mesh, experts: bool = False):
        """The mesh FSDP shards over: dp_shard, with ep and cp folded in where they are used (one
        dim, e.g. "dp_shard_ep_cp"), and dp_replicate beside it for HSDP. `experts=True`: where it
        shards the experts, which ep has split already: over dp_shard alone (and dp_replicate for
        HSDP); None where no rank holds the same experts."""
        if experts and self.dp_shard * self.dp_replicate == 1:
            return None
        replicate = "dp_replicate" if self.strategy == "hsdp" else None
        folded = ["dp_shard"] + [d for d in ("ep", "cp") if getattr(self, d) > 1 and not experts]
        if len(folded) == 1:
            return mesh[replicate, "dp_shard"] if replicate else mesh["dp_shard"]
        from .._compat.torch_internals import flatten_mesh  # private DeviceMesh methods

        return flatten_mesh(mesh, tuple(folded), "_".join(folded), beside=replicate)

    def groups(self, dim: str) -> list[list[int]]:
        """The process groups along one dim, e.g. groups("tp") → [[0, 1], [2, 3], ...]."""
        axis = DIM_NAMES.index(dim)
        return self.layout().movedim(axis, -1).reshape(-1, self.shape[axis]).tolist()
