"""Notebook 18's experts lab: the load each expert gets, what a hot expert costs the rank that holds
it, an expert-parallel layer checked against the whole one with the bytes of its all-to-alls
counted against their formula, and the memory each rank holds under EP
(`launch_function("titanlite.labs.nb18_mixture_of_experts:ep_layer", nproc=2)`; the tests run
them too).

The technique itself lives in models/moe.py and distributed/expert_parallel.py; this measures it.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.expert_parallel import apply_ep
from ..models.moe import MoE, MoEArgs, sort_by_expert
from ..tools.measure.comm import CommCounter

# ----- the load on each expert ------------------------------------------------------------------


def routers(model: nn.Module) -> list:
    return [m.router for m in model.modules() if isinstance(m, MoE)]


def expert_loads(model: nn.Module) -> torch.Tensor:
    """[MoE blocks, experts]: the token choices each expert got in the last optimizer step (all
    its micro-batches), as the routers counted them for aux_free's bias update."""
    return torch.stack([r.load.float().cpu() for r in routers(model)])


def imbalance(loads: torch.Tensor) -> float:
    """The hottest expert's load over the mean load, averaged over the MoE blocks: 1 is perfectly
    balanced; E/k means every token went to the same k experts. Under expert parallelism the
    step waits for the busiest expert: this is the slowdown it causes, at most."""
    return (loads.max(-1).values / loads.mean(-1).clamp(min=1e-9)).mean().item()


# ----- what a hot expert costs -------------------------------------------------------------------


def experts_seconds(counts: list[int], dim=64, hidden=256, repeats=7, seed=0) -> list[float]:
    """Seconds of one rank's experts forward and backward on `counts[e]` tokens for expert e (the
    loop the CPU runs), `repeats` times: one rank's share of an MoE layer."""
    g = torch.Generator().manual_seed(seed)
    moe = MoE(dim, MoEArgs(n_experts=len(counts)), hidden)
    moe.init_weights(0.02, 0.02)
    x = torch.randn(sum(counts), dim, generator=g, requires_grad=True)
    counts_t = torch.tensor(counts)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        moe.experts(x, counts_t).sum().backward()
        times.append(time.perf_counter() - start)
    return times


def hot_expert_cost(tokens=4096, n_experts=8, k=2, ep=4, dim=64, hidden=256, repeats=7):
    """One rank of `ep` holds E/ep experts. Balanced routing sends it tokens·k/ep choices; with one
    expert taking every token once (a hot expert, the others sharing the rest) the rank holding it
    gets more. Counted (choices per rank) and timed (median, and the spread of the repeats)."""
    local = n_experts // ep
    balanced = [tokens * k // n_experts] * local
    # The hot expert takes one choice of every token; the other k-1 choices spread evenly.
    hot = [tokens] + [tokens * (k - 1) // (n_experts - 1)] * (local - 1)
    out = {}
    for name, counts in (("balanced", balanced), ("hot", hot)):
        t = experts_seconds(counts, dim, hidden, repeats)
        out[name] = {
            "choices": sum(counts),
            "median_s": statistics.median(t),
            "spread_s": max(t) - min(t),
        }
    return out


# ----- an expert-parallel layer, launched: equal to the whole layer, its bytes counted -----------


def a2a_bytes(n_experts: int, tokens: int, k: int, received: int, dim: int, dtype_bytes=4) -> int:
    """Bytes one rank's all-to-alls carry in an MoE layer's forward and backward, as CommCounter
    counts them (the whole input of each): the split sizes (E int64 counts), the N·k token choices
    sent out and the R rows received sent back, then the same two again for the gradients."""
    return n_experts * 8 + 2 * (tokens * k + received) * dim * dtype_bytes


def ep_layer(n_experts=4, k=2, dim=32, hidden=64, tokens=64, seed=0):
    """Each rank: its own tokens through an MoE layer split over all ranks by `apply_ep`, against
    the same layer whole (one seed: every rank builds the same weights); the split sizes it sent
    and the bytes its all-to-alls moved."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    whole = MoE(dim, MoEArgs(n_experts=n_experts, experts_per_token=k, balance="none"), hidden)
    whole.init_weights(0.5, 0.5)
    split = nn.Sequential(MoE(dim, whole.args, hidden))
    split[0].load_state_dict(whole.state_dict())
    apply_ep(split, _ep_mesh(size))
    g = torch.Generator().manual_seed(seed + 1 + rank)  # each rank reads its own tokens
    x = torch.randn(tokens, dim, generator=g)
    x_whole, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = whole(x_whole)
    want.sum().backward()
    _, chosen, _ = whole.router(x)
    with CommCounter() as counter:
        got = split(x_split)
        got.sum().backward()
    sent = sort_by_expert(chosen, n_experts)[1].view(size, -1).sum(1).tolist()
    # The rows this rank received: every rank's choices of this rank's experts.
    table = [torch.zeros(size, dtype=torch.long) for _ in range(size)]
    dist.all_gather(table, torch.tensor(sent))
    received = int(sum(row[rank] for row in table))
    return {
        "rank": rank,
        "out_diff": (got - want).abs().max().item(),
        "grad_diff": (x_split.grad - x_whole.grad).abs().max().item(),
        "sent": sent,
        "received": received,
        "a2a": counter.summary().get("all_to_all", {}),
        "formula": a2a_bytes(n_experts, tokens, k, received, dim),
    }


def _ep_mesh(size: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (size,), mesh_dim_names=("ep",))


# ----- memory per rank under EP -----------------------------------------------------------------


def param_bytes(overrides: dict) -> dict:
    """Each rank: the bytes of the parameters it holds, experts and the rest, in a trainer built
    with `overrides` (expert parallel with FSDP: the experts split by ep, the rest sharded)."""
    from ..config import load_config
    from ..train import Trainer

    trainer = Trainer(load_config(None, overrides))
    experts = rest = 0
    for name, p in (x for part in trainer.model_parts for x in part.named_parameters()):
        local = p.to_local() if hasattr(p, "to_local") else p
        nbytes = local.numel() * local.element_size()
        if ".experts." in name:
            experts += nbytes
        else:
            rest += nbytes
    rank = dist.get_rank()
    trainer.close()
    return {"rank": rank, "experts": experts, "rest": rest}
