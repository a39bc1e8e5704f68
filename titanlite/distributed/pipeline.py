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

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import nn

from ..efficiency.accumulation import count_targets, loss_sum
from ..errors import TitanliteError, closest

# name -> (torch class, stages of rank r): "single": r; "loop": r, r+p, r+2p, ... (interleaved); "v": r and
# 2p−1−r, so the first and last stage share rank 0 and a micro-batch turns around on the last rank locally.
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
}


def _group(pp_group):  # a process group (None: the default one) or a 1-D DeviceMesh
    return pp_group.get_group() if hasattr(pp_group, "get_group") else pp_group


def pipeline_split(
    model: nn.Module,
    pp_group,
    *,
    schedule: str = "1f1b",
    stages_per_rank: int | None = None,
    first_stage_weight: float = 0.0,
    last_stage_weight: float = 0.0,
    device: torch.device | None = None,
    parallelize_part=None,
):
    """This rank's stages (torch `PipelineStage`s) and their modules; every rank passes the same full model
    (`pp_group`: group or 1-D mesh). `parallelize_part(part)` runs on each part first (AC, compile, DP)."""
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
    stages, parts = [], []
    for s in stage_ids(rank, pp, v, SCHEDULES[schedule][1]):
        part = copy.deepcopy(model)
        for i in [i for i in part.layers if int(i) not in layers[s]]:
            del part.layers[i]
        if s != 0:
            part.tok_embeddings = None
        if s != n_stages - 1:
            part.norm = part.output = None
        if parallelize_part is not None:
            part = parallelize_part(part)
        stages.append(pipelining.PipelineStage(part, s, n_stages, device, group=group))
        parts.append(part)
    return stages, parts


def available_schedules() -> list[str]:
    """The schedule names this torch provides (zero-bubble ones arrived in later releases)."""
    return [name for name, (cls, _) in SCHEDULES.items() if hasattr(pipelining, cls)]


def check_pipeline(
    *,
    pp: int,
    schedule: str,
    n_layers: int | None = None,
    n_microbatches: int | None = None,
    batch_size: int | None = None,
    stages_per_rank: int | None = None,
    tie_embeddings: bool = False,
) -> int:
    """Refuse a pipeline that cannot run, in one line each (None: unchecked); return the stages per rank."""
    if schedule not in SCHEDULES:
        raise TitanliteError(
            f"unknown pipeline schedule '{schedule}'{closest(schedule, SCHEDULES)}: "
            f"choose one of {', '.join(SCHEDULES)}"
        )
    if schedule not in available_schedules():
        raise TitanliteError(
            f"pipeline schedule '{schedule}' needs torch.distributed.pipelining."
            f"{SCHEDULES[schedule][0]}, which torch {torch.__version__} lacks: "
            f"choose one of {', '.join(available_schedules())}"
        )
    style = SCHEDULES[schedule][1]
    v = stages_per_rank or (1 if style == "single" else 2)
    if style == "single" and v != 1:
        raise TitanliteError(
            f"schedule '{schedule}' runs one stage per rank, got stages_per_rank={v}: "
            f"use interleaved_1f1b for several stages per rank"
        )
    if style == "v" and v != 2:
        raise TitanliteError(
            f"schedule 'zbv' runs exactly 2 stages per rank (a V), got stages_per_rank={v}"
        )
    if pp > 1 and tie_embeddings:
        raise TitanliteError(
            "tied embeddings cannot span pipeline stages (the embedding lives on the "
            "first stage, the output projection on the last): set "
            "model.tie_embeddings=false for pipeline parallelism"
        )
    if n_layers is not None and pp * v > n_layers:
        raise TitanliteError(
            f"{pp} ranks × {v} stages per rank = {pp * v} pipeline stages, but the model "
            f"has {n_layers} layers: every stage needs a layer, so use at most "
            f"{n_layers} stages (fewer ranks or stages per rank, or more layers)"
        )
    if n_microbatches is None:
        return v
    if n_microbatches < 1:
        raise TitanliteError(f"n_microbatches must be at least 1, got {n_microbatches}")
    # GPipe runs any m (idling more); the others start backwards with forwards in flight: 1F1B refuses m < p.
    if schedule != "gpipe" and n_microbatches < pp:
        raise TitanliteError(
            f"schedule '{schedule}' needs at least as many micro-batches as pipeline "
            f"ranks: n_microbatches={n_microbatches} < pp={pp}; use n_microbatches >= {pp}"
        )
    rounds = max(1, n_microbatches // pp)  # torch's interleaved schedules run m in rounds of ~p
    if style == "loop" and n_microbatches % rounds:
        raise TitanliteError(
            f"schedule '{schedule}' runs micro-batches in rounds of about pp={pp}: "
            f"n_microbatches={n_microbatches} must be a multiple of {rounds} "
            f"(n_microbatches // pp); e.g. {rounds * pp}"
        )
    if batch_size is not None and batch_size % n_microbatches:
        ok = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise TitanliteError(
            f"a batch of {batch_size} sequences does not split into {n_microbatches} "
            f"micro-batches: choose n_microbatches among {ok}"
        )
    return v


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


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, style: str) -> list[int]:
    """The global stage indices rank `pp_rank` holds."""
    if style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


class TokenLoss:
    """The schedule's loss_fn: a micro-batch's *summed* token loss over the whole batch's target tokens
    (`num_tokens`, set each step): with scale_grads=False the gradients add up to the batch mean's."""

    def __init__(self, num_tokens: float = 1.0):
        self.num_tokens = num_tokens

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_sum(logits, targets) / self.num_tokens


def build_schedule(
    name: str, stages: list, n_microbatches: int, loss_fn, *, batch_size: int | None = None
):
    """torch's schedule `name` over this rank's stages (from `pipeline_split(schedule=name)`)."""
    check_pipeline(
        pp=stages[0].group_size,
        schedule=name,
        n_microbatches=n_microbatches,
        batch_size=batch_size,
        stages_per_rank=len(stages),
    )
    cls = getattr(pipelining, SCHEDULES[name][0])
    stage_arg = stages[0] if SCHEDULES[name][1] == "single" else stages  # multi-stage: the list
    # scale_grads=False (where torch has it): TokenLoss already divides by the batch's token count
    kwargs = (
        {"scale_grads": False}
        if "scale_grads" in inspect.signature(cls.__init__).parameters
        else {}
    )
    return cls(stage_arg, n_microbatches=n_microbatches, loss_fn=loss_fn, **kwargs)


def pipeline_step(
    schedule,
    stages: list,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    loss_fn: TokenLoss,
    num_tokens: float | None = None,
    pp_group=None,
) -> torch.Tensor:
    """Forward + backward of the batch (grads accumulate into the stages); the loss on every pp rank.
    `num_tokens`: the TokenLoss divisor (default: this batch's; under DP the global batch's count / dp)."""
    # `is not None`, not `or`: the divisor may be a device tensor, whose truth value waits for it
    loss_fn.num_tokens = num_tokens if num_tokens is not None else max(1, count_targets(y))
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    losses = [] if last else None
    # return_outputs=False (where torch has it): do not keep every micro-batch's logits alive
    kw = (
        {"return_outputs": False}
        if "return_outputs" in inspect.signature(schedule.step).parameters
        else {}
    )
    schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses, **kw)
    total = (
        torch.stack(losses).sum().detach().float()
        if last
        else torch.zeros((), device=stages[0].device)
    )
    if dist.is_initialized():  # only the last stage knows the loss: tell the others
        dist.all_reduce(total, group=_group(pp_group))
    return total


@torch.no_grad()
def pipeline_eval(
    schedule, stages: list, x: torch.Tensor, y: torch.Tensor, *, loss_fn: TokenLoss, pp_group=None
) -> torch.Tensor:
    """The batch's mean token loss on every pipeline rank, forward only (no gradients or activations kept)."""
    if type(schedule).__name__ in {cls for cls, style in SCHEDULES.values() if style == "v"}:
        # Its stages that share a rank hand gradients over locally, even in eval (torch 2.13).
        raise TitanliteError(
            f"torch's {type(schedule).__name__} cannot run forward-only: evaluate "
            f"the gathered model (gather_state_dict), or train with interleaved_zb"
        )
    loss_fn.num_tokens = max(1, count_targets(y))
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    losses = [] if last else None
    schedule.eval(*((x,) if first else ()), target=y if last else None, losses=losses)
    total = torch.stack(losses).sum().float() if last else torch.zeros((), device=stages[0].device)
    if dist.is_initialized():
        dist.all_reduce(total, group=_group(pp_group))
    return total


def gather_state_dict(parts: list, pp_group=None) -> dict[str, torch.Tensor]:
    """The plain model's state dict (CPU tensors) on every pipeline rank, for sampling, export and checks;
    FSDP-sharded parts are gathered over their data-parallel ranks first (all of them must call this)."""
    local = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
        for part in parts
        for k, v in part.state_dict().items()
    }
    if not dist.is_initialized():
        return local
    group = _group(pp_group)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, local, group=group)
    return {k: v for d in everyone for k, v in d.items()}


def clip_grad_norm_(
    parameters, max_norm: float, pp_group=None, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip by the *whole* model's gradient norm: ‖g‖² is a sum over parameters, so ranks add their local
    sums (max for inf) over `pp_group` first (None: the default group; with DP too, pass mesh["pp"])."""
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    if hasattr(norm, "full_tensor"):  # FSDP × PP: a DTensor norm of this rank's shards
        norm = norm.full_tensor()
    if dist.is_initialized():
        group = _group(pp_group)
        if math.isinf(norm_type):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        else:
            norm = norm**norm_type
            dist.all_reduce(norm, group=group)
            norm = norm ** (1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def microbatches(cfg, dims) -> int:
    """Micro-batches per step: parallel.pp_microbatches, else 2 per stage (at most the batch's sequences)."""
    p = cfg.parallel
    return p.pp_microbatches or min(
        cfg.training.batch_size,
        2
        * dims.pp
        * (1 if SCHEDULES[p.pp_schedule][1] == "single" else (p.pp_stages_per_rank or 2)),
    )


@dataclass
class Pipeline:
    """This rank's pipeline stages and torch's schedule over them, for the trainer."""

    stages: list
    cfg: object
    pp_mesh: object
    schedule: object = None
    loss_fn: TokenLoss = field(default_factory=TokenLoss)

    def build_schedule(self, parts) -> None:
        n = microbatches(self.cfg, SimpleNamespace(pp=self.pp_mesh.size()))
        self.schedule = build_schedule(
            self.cfg.parallel.pp_schedule,
            self.stages,
            n,
            self.loss_fn,
            batch_size=self.cfg.training.batch_size,
        )

    def step(self, x: torch.Tensor, y: torch.Tensor, num_tokens: float) -> torch.Tensor:
        return pipeline_step(
            self.schedule,
            self.stages,
            x,
            y,
            loss_fn=self.loss_fn,
            num_tokens=num_tokens,
            pp_group=self.pp_mesh,
        )

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return pipeline_eval(
            self.schedule, self.stages, x, y, loss_fn=self.loss_fn, pp_group=self.pp_mesh
        ).item()

    def clip_grad_norm_(self, params, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(params, max_norm, pp_group=self.pp_mesh)

    def whole_state_dict(self, parts) -> dict[str, torch.Tensor]:
        return gather_state_dict(parts, self.pp_mesh)
