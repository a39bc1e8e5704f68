"""Pipeline parallelism: each rank holds a slice of the layers, and micro-batches flow through.

    stages, parts = pipeline_split(model, pp_group, schedule="1f1b")
    loss_fn = TokenLoss()
    schedule = build_schedule("1f1b", stages, n_microbatches=4, loss_fn=loss_fn)
    loss = pipeline_step(schedule, stages, x, y, loss_fn=loss_fn)   # forward + backward
    clip_grad_norm_([p for m in parts for p in m.parameters()], 1.0, pp_group)

A stage is the `Transformer` minus the parts other stages own (layer names survive: the stages' state
dicts together are the plain model's). Rank r starts micro-batch i once rank r−1 sent it, so ranks idle
at each step's start and end: the bubble, (p−1)/m of the time with m micro-batches, GPipe and 1F1B
alike; 1F1B starts backwards early, holding at most p micro-batches' activations, not m. Interleaving v
stages per rank cuts it to (p−1)/(v·m); zero-bubble schedules fill it with weight gradients split off."""

import copy
import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import nn

from ..efficiency.accumulation import count_targets, loss_sum
from ..errors import TitanliteError
from .env import all_reduce_sum, gather_from_ranks

# build_schedule and microbatches too are imported from here by notebooks, tools and tests
from .pipeline_schedules import (
    SCHEDULES,
    build_schedule,
    check_pipeline,
    microbatches,
    stage_ids,
)

# Re-exported: notebooks, tools and tests import it from here, beside pipeline_split.
from .pipeline_schedules import available_schedules as available_schedules


def _group(pp_group):  # a process group (None: the default one) or a 1-D DeviceMesh
    return pp_group.get_group() if hasattr(pp_group, "get_group") else pp_group


def pipeline_split(
    model: nn.Module,
    pp_group,
    *,
    schedule: str = "1f1b",
    stages_per_rank: int | None = None,
    device: torch.device | None = None,
    first_stage_weight: float = 0.0,
    last_stage_weight: float = 0.0,
):
    """This rank's stages (torch `PipelineStage`s) and their modules; every rank passes the same full model
    (`pp_group`: group or 1-D mesh). Parallelize each part afterwards, then set its stage's `submod`.
    The stage weights: the embedding's and the output's work in layers (`split_layers`)."""
    group = _group(pp_group)
    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    v = check_pipeline(
        pp=pp,
        schedule=schedule,
        n_layers=model.args.n_layers,
        stages_per_rank=stages_per_rank,
        tie_embeddings=model.args.tie_embeddings,
    )
    n_stages = pp * v
    layers = split_layers(model.args.n_layers, n_stages, first_stage_weight, last_stage_weight)
    device = device or next(model.parameters()).device
    stages = []
    for s in stage_ids(rank, pp, v, SCHEDULES[schedule][1]):
        part = copy.deepcopy(model)
        for i in [i for i in part.layers if int(i) not in layers[s]]:
            del part.layers[i]
        if s != 0:
            part.tok_embeddings = None
        if s != n_stages - 1:
            part.norm = part.output = None
        stages.append(pipelining.PipelineStage(part, s, n_stages, device, group=group))
    return stages, [stage.submod for stage in stages]  # torch keeps each part as its submod


def split_layers(
    n_layers: int, n_stages: int, first_stage_weight: float = 0.0, last_stage_weight: float = 0.0
) -> list[range]:
    """Which layers each stage runs: equal *work*, counting the embedding as `first_stage_weight` layers
    and output + loss as `last_stage_weight` (Llama 3 405B took a layer off its first and last stages)."""
    work = n_layers + first_stage_weight + last_stage_weight
    cuts = (
        [0]
        + [
            min(n_layers, max(0, math.floor(k * work / n_stages - first_stage_weight + 0.5)))
            for k in range(1, n_stages)
        ]
        + [n_layers]
    )
    ranges = [range(a, b) for a, b in zip(cuts, cuts[1:])]
    if empty := [s for s, r in enumerate(ranges) if len(r) == 0]:
        raise TitanliteError(
            f"stage {empty[0]} of {n_stages} would run no layer ({n_layers} layers, "
            f"first/last stage weights {first_stage_weight}/{last_stage_weight}): "
            f"lower the weights or use fewer stages"
        )
    return ranges


class TokenLoss:
    """The schedule's loss_fn: a micro-batch's *summed* token loss over the whole batch's target tokens
    (`num_tokens`, set each step): with scale_grads=False the gradients add up to the batch mean's."""

    def __init__(self, num_tokens: float = 1.0):
        self.num_tokens = num_tokens

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_sum(logits, targets) / self.num_tokens


def pipeline_step(
    schedule,
    stages: list,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    loss_fn: TokenLoss,
    num_tokens: float | None = None,
    pp_group=None,
    forward_only: bool = False,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward + backward of the batch (grads accumulate into the stages); the loss on every pp rank.
    `num_tokens`: the TokenLoss divisor (default: this batch's; under DP the global batch's count / dp).
    `forward_only`: torch's `schedule.eval` instead of its step (`pipeline_eval`). `documents`: a
    document mask's, handed to every stage (each cut into the schedule's micro-batches)."""
    # `is not None`, not `or`: the divisor may be a device tensor, whose truth value waits for it
    loss_fn.num_tokens = num_tokens if num_tokens is not None else max(1, count_targets(y))
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    losses = [] if last else None
    # A step without return_outputs would keep every micro-batch's logits alive
    run = schedule.eval if forward_only else partial(schedule.step, return_outputs=False)
    masks = {} if documents is None else {"documents": documents}
    run(*((x,) if first else ()), target=y if last else None, losses=losses, **masks)
    total = (
        torch.stack(losses).sum().detach().float()
        if last
        else torch.zeros((), device=stages[0].device)
    )
    # only the last stage knows the loss: tell the others
    return all_reduce_sum(total, _group(pp_group))


@torch.no_grad()
def pipeline_eval(
    schedule, stages: list, x, y, documents=None, *, loss_fn: TokenLoss, pp_group=None
) -> torch.Tensor:
    """The batch's mean token loss on every pipeline rank, forward only (no gradients or activations kept)."""
    if type(schedule) in {cls for cls, style in SCHEDULES.values() if style == "v"}:
        # Its stages that share a rank hand gradients over locally, even in eval (torch 2.13).
        raise TitanliteError(
            f"torch's {type(schedule).__name__} cannot run forward-only: evaluate "
            f"the gathered model (gather_state_dict), or train with interleaved_zb"
        )
    return pipeline_step(
        schedule,
        stages,
        x,
        y,
        loss_fn=loss_fn,
        pp_group=pp_group,
        forward_only=True,
        documents=documents,
    )


def gather_state_dict(parts: list, pp_group=None) -> dict[str, torch.Tensor]:
    """The plain model's state dict (CPU tensors) on every pipeline rank, for sampling, export and checks;
    FSDP-sharded parts are gathered over their data-parallel ranks first (all of them must call this)."""
    local = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
        for part in parts
        for k, v in part.state_dict().items()
    }
    return {k: v for d in gather_from_ranks(local, _group(pp_group)) for k, v in d.items()}


def clip_grad_norm_(
    parameters, max_norm: float, pp_group=None, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip by the *whole* model's gradient norm: ‖g‖² is a sum over parameters, so ranks add their local
    sums (max for inf) over `pp_group` first (None: the default group; with DP too, pass mesh["pp"])."""
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    if hasattr(norm, "full_tensor"):  # FSDP × PP: a DTensor norm of this rank's shards
        norm = norm.full_tensor()
    if not math.isinf(norm_type):  # ‖g‖ᵖ adds up over the ranks' parameters
        norm = all_reduce_sum(norm**norm_type, _group(pp_group)) ** (1.0 / norm_type)
    elif dist.is_initialized():  # inf: the largest entry of any rank's
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=_group(pp_group))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


@dataclass
class Pipeline:
    """This rank's pipeline stages and torch's schedule over them, for the trainer: `parallel` is the
    config's [parallel] section, `micro_batch` the sequences of each batch the schedule cuts up."""

    stages: list
    pp_mesh: object
    parallel: object
    micro_batch: int
    loss_fn: TokenLoss = field(default_factory=TokenLoss)

    def __post_init__(self) -> None:  # torch's schedule over the stages, as parallelized
        self.schedule = build_schedule(
            self.parallel.pp_schedule,
            self.stages,
            microbatches(self.parallel, self.micro_batch, self.pp_mesh.size()),
            self.loss_fn,
            batch_size=self.micro_batch,
        )

    def step(self, x, y, documents=None, num_tokens=None) -> torch.Tensor:
        return pipeline_step(
            self.schedule,
            self.stages,
            x,
            y,
            loss_fn=self.loss_fn,
            num_tokens=num_tokens,
            pp_group=self.pp_mesh,
            documents=documents,
        )

    def eval_loss(self, x, y, documents=None) -> float:
        return pipeline_eval(
            self.schedule, self.stages, x, y, documents, loss_fn=self.loss_fn, pp_group=self.pp_mesh
        ).item()

    def clip_grad_norm_(self, params, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(params, max_norm, pp_group=self.pp_mesh)

    def whole_model(self, parts, args, dtype, is_main: bool):
        """The whole model, its stages' weights gathered (every rank takes part), on rank 0 alone
        (None elsewhere): generating a token at a time through every stage would be slow."""
        state = gather_state_dict(parts, self.pp_mesh)
        if not is_main:
            return None
        from ..models.llama import build_model

        model = build_model(args, "cpu").to(dtype)
        model.load_state_dict(state)
        return model
