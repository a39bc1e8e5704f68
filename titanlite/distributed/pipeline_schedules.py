"""Pipeline schedules: which stage runs which micro-batch when, and the limits each one has.

    check_pipeline(pp=2, schedule="1f1b", n_layers=4, n_microbatches=4)   # refused in one line, or ok
    schedule = build_schedule("1f1b", stages, n_microbatches=4, loss_fn=TokenLoss())

torch's schedules (torch.distributed.pipelining) run them; this module names them, says how many
stages each puts on a rank (one; several, looping; or two, in a V), checks a layout against them
before any model exists, and builds the one a run asks for (pipeline.py cuts the model)."""

import torch.distributed.pipelining as pipelining

from ..errors import TitanliteError, closest

# name -> (torch class, stages of rank r): "single": r; "loop": r, r+p, r+2p, ... (interleaved); "v": r and
# 2p−1−r, so the first and last stage share rank 0 and a micro-batch turns around on the last rank locally.
SCHEDULES = {
    "gpipe": (pipelining.ScheduleGPipe, "single"),
    "1f1b": (pipelining.Schedule1F1B, "single"),
    "interleaved_1f1b": (pipelining.ScheduleInterleaved1F1B, "loop"),
    "interleaved_zb": (pipelining.ScheduleInterleavedZeroBubble, "loop"),
    "zbv": (pipelining.ScheduleZBVZeroBubble, "v"),
}


def available_schedules() -> list[str]:
    """The schedule names this torch provides: every torch titanlite supports (>= 2.11) has all five."""
    return list(SCHEDULES)


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


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, style: str) -> list[int]:
    """The global stage indices rank `pp_rank` holds."""
    if style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


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
    cls, style = SCHEDULES[name]
    # One stage, or the list of several; scale_grads=False: TokenLoss already divides by the
    # batch's token count
    return cls(
        stages[0] if style == "single" else stages,
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        scale_grads=False,
    )


def microbatches(parallel, micro_batch: int, pp: int) -> int:
    """Micro-batches per step: parallel.pp_microbatches, else 2 per stage (at most the batch's
    sequences)."""
    interleaved = SCHEDULES[parallel.pp_schedule][1] != "single"
    stages = pp * ((parallel.pp_stages_per_rank or 2) if interleaved else 1)
    return parallel.pp_microbatches or min(micro_batch, 2 * stages)
