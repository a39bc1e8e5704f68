"""Expert parallelism (EP): E/ep experts on each of ep ranks; tokens travel to their experts and back.

    apply_ep(model, mesh["ep"])     # the model built whole (same seed everywhere), before FSDP

Each ep rank reads its own slice of the batch, as a data-parallel rank does, and routes its tokens
(models/moe.py). The dispatch then sends every token choice to the rank that holds its expert with
one all-to-all (`all_to_all_single`: each rank sends a different number of rows to each, so the
split sizes are exchanged first - a small all-to-all of counts - and read on the host with this
rank's own, in one copy: the one wait for the device an MoE layer costs under expert parallelism,
as in torchtitan), runs the local experts on what arrived,
and sends the outputs back the same way. The backward of an all-to-all is the reverse all-to-all.

The experts' stacked weights become DTensors sharded over ep (Shard(0): rank r holds experts
[r·E/ep, (r+1)·E/ep)), so a checkpoint holds all E experts and loads into any ep. The other
weights are the same on every ep rank, and FSDP shards them over dp_shard × ep (mesh.py). Each
rank's loss is scaled for the average over the batch's ranks, while an expert's gradient sums
the tokens of all ep ranks: the experts scale their gradient by 1/ep to match (Experts.grad_scale)."""

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from .._compat.torch_internals import all_to_all
from ..models.moe import MoE, combine, sort_by_expert


def apply_ep(model: nn.Module, ep_mesh) -> nn.Module:
    """Keep this rank's experts of every MoE block (as DTensors over `ep_mesh`) and send tokens
    to the others' through `ExpertDispatch`, in place."""
    for module in model.modules():
        if isinstance(module, MoE):
            experts = module.experts
            for name in ("w_gate", "w_up", "w_down"):
                whole = getattr(experts, name).detach()  # the same on every rank: one seed
                setattr(experts, name, nn.Parameter(distribute_tensor(whole, ep_mesh, [Shard(0)])))
            experts.grad_scale = 1.0 / ep_mesh.size()
            module.dispatch = ExpertDispatch(ep_mesh.get_group(), ep_mesh.size())
    return model


class ExpertDispatch:
    """Token choices to the ranks of their experts, the experts' outputs back (see the top)."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def __deepcopy__(self, memo):  # a copied model shares the process group, never copies it
        return self

    def __call__(self, tokens, weights, chosen, experts):
        G, k = self.size, chosen.shape[1]
        local = experts.w_gate.shape[0] // G  # a DTensor's shape is the whole: all E experts
        # counts: on the device (NCCL moves only device tensors), rank g's experts contiguous
        order, counts = sort_by_expert(chosen, G * local)
        # counts_in[g][e]: how many of rank g's choices go to my local expert e.
        counts_in = all_to_all(counts, None, None, self.group).view(G, local)
        # Both tables on the host in one read: the one wait for the device an MoE layer costs
        # (all_to_all_single takes its split sizes as host integers).
        on_host = torch.cat([counts.view(G, local), counts_in]).tolist()
        mine, table = on_host[:G], on_host[G:]  # [rank][local expert]: sent, received
        sent, received = [sum(row) for row in mine], [sum(row) for row in table]
        arrived = all_to_all(tokens[order // k], received, sent, self.group)
        # Arrived by source rank, then expert; the experts want them by expert: a stable sort on
        # each row's expert keeps the source ranks in order within an expert. Worked out on the
        # host (the sizes are there), the index then copied to the device, where it is used.
        rows = torch.tensor(table).flatten()  # output_size: the length is known, not waited for
        expert_of_row = (
            torch.arange(local).repeat(G).repeat_interleave(rows, output_size=sum(received))
        )
        by_expert = expert_of_row.argsort(stable=True).to(tokens.device)
        out = experts(arrived[by_expert], counts_in.sum(0), sizes=[sum(e) for e in zip(*table)])
        # The outputs, in arrival order again, back to the ranks their tokens came from
        back = torch.empty_like(out).index_copy(0, by_expert, out)
        return combine(all_to_all(back, sent, received, self.group), order, weights, chosen, tokens)
