"""Context parallelism (CP): each rank holds a slice of every sequence; attention is computed across them.

Everything in the model except attention works token by token, so with each sequence cut into
`cp` slices the embedding, norms, MLPs and loss run on a rank's slice exactly as on the whole.
Attention needs every earlier token: each rank keeps its queries, and the keys and values travel.

- ring (default, picotron's and the Ultra-Scale Playbook's): K/V blocks go round the ring of cp
  ranks; each step's send overlaps the compute of the block in hand, and the partial results merge
  by their log-sum-exp (online softmax). One extra K/V block in flight per rank.
- allgather (torchtitan's newer layout): every rank gathers all the K/V at once. Same bytes, one
  collective instead of cp − 1 steps, but the whole sequence's K/V sits on every rank.

Causal attention makes contiguous slices unbalanced: the last rank's queries see every token, the
first rank's only its own. "zigzag" cuts the sequence into 2·cp chunks and gives rank r chunks r
and 2·cp−1−r, so every rank does the same work (Ultra-Scale Playbook; torchtitan's load balancer).

The backward is written by hand, as flash attention's is: each block's gradients are recomputed
from the saved merged output and log-sum-exp, and the K/V gradients travel round the ring with
their K/V until they are home. A block is computed by torch's fused kernel that returns the
log-sum-exp where there is one, called as torch's own ring attention calls it, else in plain torch
ops (`math`): attention_block.py, which `block_kernel` chooses in."""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..device_policy import capability_of
from .attention_block import block_backward, block_forward, block_kernel, native_gqa

LAYOUTS = ("zigzag", "contiguous")
METHODS = ("ring", "allgather")


def apply_cp(
    model: torch.nn.Module, cp_mesh, layout="zigzag", method="ring", device=None, dtype=None
):
    """Give the model's rotary tables and every attention layer the cp group (models/llama.py
    reads `context_parallel`): RoPE then takes this rank's real positions, attention runs across
    the ranks. The batches arrive cut already: the data loader keeps each rank's part of every
    sequence (`ParallelDims.sequence_part`, `shard_sequence`). `device` and `dtype`: where and in
    what attention runs; each block's kernel is decided from them here, once (`block_kernel`), and
    kept (run.json's `built` shows it); without them, from each call's tensors."""
    kernel = None
    if device is not None:
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        rocm = torch.version.hip is not None
        kernel = block_kernel(device.type, dtype, capability, model.args.head_dim, rocm)
    cp = ContextParallel(
        cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank(), layout, method, kernel
    )
    for module in model.modules():
        if hasattr(type(module), "context_parallel"):
            module.context_parallel = cp
    return cp


def chunks_of(rank: int, cp: int, layout: str = "zigzag") -> tuple[int, ...]:
    """Which chunks of the sequence a rank holds: of 2·cp under zigzag, of cp when contiguous."""
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (rank,)


def positions_of(rank: int, cp: int, local_len: int, layout: str = "zigzag") -> torch.Tensor:
    """The sequence positions of a rank's `local_len` tokens, in the order it holds them."""
    ids = chunks_of(rank, cp, layout)
    size = local_len // len(ids)
    return torch.cat([torch.arange(i * size, (i + 1) * size) for i in ids])


def shard_sequence(t: torch.Tensor, rank: int, cp: int, layout: str = "zigzag", dim: int = 1):
    """A rank's slice of `t` along its sequence dim: its chunks, concatenated."""
    ids = chunks_of(rank, cp, layout)
    pieces = t.chunk(len(ids) * cp, dim=dim)
    return torch.cat([pieces[i] for i in ids], dim=dim)


def blocks(q_rank: int, kv_rank: int, cp: int, local_len: int, layout: str):
    """The (query rows, key rows, causal) blocks of attention between one rank's queries and
    another's K/V: chunk i sees chunk j whole when i > j, causally when i == j, not at all when
    i < j (it lies in the future)."""
    q_ids, kv_ids = chunks_of(q_rank, cp, layout), chunks_of(kv_rank, cp, layout)
    size = local_len // len(q_ids)
    for a, i in enumerate(q_ids):
        for b, j in enumerate(kv_ids):
            if i >= j:
                yield slice(a * size, (a + 1) * size), slice(b * size, (b + 1) * size), i == j


def merge(out, lse, block_out, block_lse):
    """Fold one block's (output, log-sum-exp) into the running ones (online softmax): each is
    weighted by its share exp(lse_part − lse_total) of the total."""
    total = torch.logaddexp(lse, block_lse)
    return (
        out * (lse - total).exp()[..., None]
        + block_out.float() * (block_lse - total).exp()[..., None]
    ), total


@dataclass
class ContextParallel:
    """What each attention layer of a CP model holds: its group and how the sequence is cut."""

    group: object  # the cp process group
    size: int
    rank: int  # within the group
    layout: str = "zigzag"
    method: str = "ring"
    kernel: str | None = None  # None: block_kernel decides from the device's facts

    def __deepcopy__(self, memo):  # a copied model shares the process group, never copies it
        return self

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        return positions_of(self.rank, self.size, local_len, self.layout).to(device)

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return shard_sequence(t, self.rank, self.size, self.layout, dim)

    def attention(self, q, k, v) -> torch.Tensor:
        """Causal attention of this rank's queries over every rank's keys and values."""
        # Dynamo cannot trace the sends and receives: compiled blocks call attention eagerly.
        return torch._dynamo.disable(ContextAttention.apply, recursive=True)(q, k, v, self)

    def ring_pass(self, t: torch.Tensor):
        """Start sending `t` to the next rank while receiving the previous rank's; returns the
        buffer it arrives in and a wait(): compute meanwhile, wait before using it."""
        incoming = torch.empty_like(t)
        after, before = (self.rank + 1) % self.size, (self.rank - 1) % self.size  # in the group
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, t.contiguous(), group=self.group, group_peer=after),
                dist.P2POp(dist.irecv, incoming, group=self.group, group_peer=before),
            ]
        )
        return incoming, lambda: [w.wait() for w in works]

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t`, stacked in rank order (the allgather method)."""
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))  # concatenated along dim 0
        dist.all_gather_into_tensor(out, t.contiguous(), group=self.group)
        return out.view(self.size, *t.shape)

    def key_positions(self, local_len: int, device=None) -> torch.Tensor:
        """Every rank's positions, in rank order: where `gather_sequence`'s rows sit in the sequence."""
        ranks = range(self.size)
        return torch.cat([positions_of(r, self.size, local_len, self.layout) for r in ranks]).to(
            device
        )

    def gather_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's part of `t` [..., T, D], concatenated along T in rank order: a masked
        attention's keys (models/masked_attention.py). Its backward hands each rank the gradients of
        its own part, summed over the ranks (a reduce-scatter)."""
        # Dynamo cannot trace the collectives: compiled blocks call it eagerly.
        return torch._dynamo.disable(GatherSequence.apply, recursive=True)(t, self)

    def visits(self, kv: torch.Tensor):
        """(source rank, its stacked K/V) for every rank of the group, this rank's own first."""
        if self.method == "allgather":
            every = self.gather(kv)
            for step in range(self.size):
                yield (self.rank - step) % self.size, every[(self.rank - step) % self.size]
            return
        for step in range(self.size - 1):
            incoming, wait = self.ring_pass(kv)  # the next block travels while this one computes
            yield (self.rank - step) % self.size, kv
            wait()
            kv = incoming
        yield (self.rank + 1) % self.size, kv  # the last block (the next rank's): nothing to send


def kv_block(kv: torch.Tensor, cols: slice, groups: int):
    """One block's K and V ([2, B, H_kv, T, D] stacked), contiguous as torch's ring hands its
    kernels K/V; each K/V head repeated for its `groups` query heads where the kernel needs it."""
    k, v = kv[..., cols, :].contiguous()
    return (
        (k, v) if groups == 1 else (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))
    )


class ContextAttention(torch.autograd.Function):
    """Causal attention over the whole sequence from this rank's slice of q, k and v [B, H, T, D]."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel):
        B, H, T, D = q.shape  # T: this rank's part of the sequence
        rocm = torch.version.hip is not None
        kind = cp.kernel or block_kernel(q.device.type, q.dtype, capability_of(q), D, rocm)
        groups = 1 if native_gqa(kind) else H // k.shape[1]
        # Laid out [B, T, H, D] as SDPA's output is: the caller's transpose(1, 2) is then free.
        out = torch.zeros(B, T, H, D, dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        extra = []  # what the kernel's backward takes from its forward (the same for every block)
        for source, kv_in in cp.visits(torch.stack([k, v])):
            for rows, cols, causal in blocks(cp.rank, source, cp.size, T, cp.layout):
                k_block, v_block = kv_block(kv_in, cols, groups)
                part, part_lse = block_forward(
                    kind, q[:, :, rows], k_block, v_block, causal, keep=extra
                )
                out[:, :, rows], lse[:, :, rows] = merge(
                    out[:, :, rows], lse[:, :, rows], part, part_lse
                )
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.kind, ctx.groups, ctx.extra = cp, kind, groups, extra
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, kind, groups, local_len = ctx.cp, ctx.kind, ctx.groups, q.shape[2]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

        def add_block_grads(source, kv_in, dkv):
            for rows, cols, causal in blocks(cp.rank, source, cp.size, local_len, cp.layout):
                k_block, v_block = kv_block(kv_in, cols, groups)
                # this rank's rows of each
                dout_, q_, out_, lse_ = (t[:, :, rows] for t in (dout, q, out, lse))
                dq_, dk, dv = block_backward(
                    kind, dout_, q_, k_block, v_block, out_, lse_, causal, ctx.extra
                )
                dq[:, :, rows] += dq_
                # A repeat's gradient: the query heads' shares summed back onto their K/V head.
                dkv[..., cols, :] += (
                    torch.stack([dk, dv]).float().unflatten(-3, (-1, groups)).sum(-3)
                )

        kv = torch.stack([k, v])
        # allgather: gather again (not kept from the forward: memory), then scatter back
        if cp.method == "allgather":
            dkv_every = torch.zeros((cp.size, *kv.shape), dtype=torch.float32, device=q.device)
            for source, kv_in in enumerate(cp.gather(kv)):
                add_block_grads(source, kv_in, dkv_every[source])
            dkv = torch.empty(kv.shape, dtype=torch.float32, device=q.device)
            dist.reduce_scatter_tensor(dkv, dkv_every.flatten(0, 1), group=cp.group)
        else:
            # The K/V go round the ring as in the forward (`visits`: the next block travels while
            # this one computes), and their gradients travel with them: after cp passes they are home.
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            for source, kv_in in cp.visits(kv):
                add_block_grads(source, kv_in, dkv)
                if cp.size > 1:
                    dkv_next, dkv_wait = cp.ring_pass(dkv)
                    dkv_wait()
                    dkv = dkv_next
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim −2), differentiable: the all-gather form of CP's keys."""

    @staticmethod
    def forward(ctx, t, cp: ContextParallel):
        ctx.cp = cp
        return cp.gather(t).movedim(0, -3).flatten(-3, -2)  # [size, ..., T, D] -> [..., size·T, D]

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        parts = grad.unflatten(-2, (cp.size, -1)).movedim(-3, 0).contiguous()
        mine = parts.new_empty(parts.shape[1:])
        dist.reduce_scatter_tensor(mine, parts.flatten(0, 1), group=cp.group)
        return mine, None
