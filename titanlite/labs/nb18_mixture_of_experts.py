"""Notebook 18's experts lab: the load each expert gets, what a hot expert costs the rank that holds
it, an expert-parallel layer checked against the whole one with the bytes of its all-to-alls
counted against their formula, and the memory each rank holds under EP
(`launch_function("titanlite.labs.nb18_mixture_of_experts:ep_layer", nproc=2)`; the tests run
them too).

The technique itself lives in models/moe.py and distributed/expert_parallel.py; this measures it.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.expert_parallel import apply_ep
from ..errors import TitanliteError
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


def experts_step(counts: list[int], dim=64, hidden=256, seed=0):
    """One rank's experts, forward and backward, on `counts[e]` tokens for expert e (the loop the
    CPU runs): one rank's share of an MoE layer. Returns a function that runs it once and returns
    the CPU seconds of the calling thread, which count the work and not the slices a busy machine
    gives other processes."""
    g = torch.Generator().manual_seed(seed)
    moe = MoE(dim, MoEArgs(n_experts=len(counts)), hidden)
    moe.init_weights(0.02, 0.02)
    x = torch.randn(sum(counts), dim, generator=g, requires_grad=True)
    counts_t = torch.tensor(counts)

    def run() -> float:
        start = time.thread_time()
        moe.experts(x, counts_t).sum().backward()
        return time.thread_time() - start

    return run


def hot_expert_cost(tokens=4096, n_experts=8, k=2, ep=4, dim=64, hidden=256, repeats=7):
    """One rank of `ep` holds E/ep experts. Balanced routing sends it tokens·k/ep choices; with one
    expert taking every token once (a hot expert, the others sharing the rest) the rank holding it
    gets more. Counted (choices per rank) and timed on one thread: an untimed round first (the
    first call allocates), then `repeats` rounds, each timing the balanced and the hot rank once,
    in turn, so that a busy moment hits both: {case: {"choices", "seconds": [one per round]}}."""
    local = n_experts // ep
    balanced = [tokens * k // n_experts] * local
    # The hot expert takes one choice of every token; the other k-1 choices spread evenly.
    hot = [tokens] + [tokens * (k - 1) // (n_experts - 1)] * (local - 1)
    cases = {"balanced": balanced, "hot": hot}
    steps = {name: experts_step(counts, dim, hidden) for name, counts in cases.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the thread's CPU clock then holds all of the work
    try:
        for step in steps.values():
            step()
        rounds = [{name: step() for name, step in steps.items()} for _ in range(repeats)]
    finally:
        torch.set_num_threads(threads)
    return {
        name: {"choices": sum(counts), "seconds": [r[name] for r in rounds]}
        for name, counts in cases.items()
    }


def median_interval(values, confidence=0.95) -> tuple[float, float, float, float]:
    """(low, median, high, coverage): the median of `values`, and the narrowest interval between
    order statistics that holds the true median with probability `coverage` >= `confidence`, for
    any distribution (each value falls below the median with probability 1/2, so the count below
    it is binomial(n, 1/2)). Seven values give their whole range at 98%; fifteen, the 4th to the
    12th at 96%."""
    v, n = sorted(values), len(values)

    def coverage(j):  # of [v[j], v[n-1-j]]: the median is not among the j lowest nor highest
        return 1 - 2 * sum(math.comb(n, i) for i in range(j + 1)) / 2**n

    if coverage(0) < confidence:
        raise TitanliteError(
            f"{n} values cannot bound a median at {confidence:.0%} confidence: time more rounds"
        )
    j = max(j for j in range((n + 1) // 2) if coverage(j) >= confidence)
    return v[j], statistics.median(v), v[n - 1 - j], coverage(j)


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


# ----- what an expert-parallel step costs: exchanges and host waits -----------------------------


def ep_step_costs(overrides: dict) -> dict:
    """One optimizer step of a trainer built with `overrides` (expert parallel), counted on this
    rank: the all-to-alls it issued (forward, any recompute, backward) and the reads that wait for
    the device (tools.measure.host_syncs: on a GPU each would stall the queue), per MoE layer."""
    from ..config import load_config
    from ..tools.measure.host_syncs import HostSyncs
    from ..train import Trainer

    trainer = Trainer(load_config(None, overrides))
    try:
        batches = trainer.next_micro_batches()
        with CommCounter() as counter, HostSyncs() as syncs:
            trainer.train_step(batches, read=False)
        layers = len(routers(trainer.model))
        return {
            "rank": dist.get_rank(),
            "moe_layers": layers,
            "all_to_all": counter.summary().get("all_to_all", {}).get("calls", 0),
            "host_reads": [s for s in syncs.sites if "expert" in s or "moe" in s],
        }
    finally:
        trainer.close()
