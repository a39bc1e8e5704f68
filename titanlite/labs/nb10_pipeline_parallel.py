"""Notebook 10's pipeline lab: the same small model trained in one process and through each
schedule, with every micro-batch timed (pipeline_timeline.TimelineRecorder). Run in every rank
by `launch_function("titanlite.labs.nb10_pipeline_parallel:schedule_lab", nproc=2)`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.pipeline import (
    SCHEDULES,
    TokenLoss,
    available_schedules,
    build_schedule,
    clip_grad_norm_,
    gather_state_dict,
    pipeline_eval,
    pipeline_split,
    pipeline_step,
    split_layers,
)
from ..efficiency.accumulation import count_targets, loss_sum
from ..models.llama import ModelArgs
from ..tools.display.pipeline_timeline import TimelineRecorder, bubble, gather_events
from ..tools.jobs.run_function import report
from ._common import random_tokens, seeded_model, train_adamw


def lab_args(n_layers: int = 4, dim: int = 64, vocab_size: int = 256, seq_len: int = 64):
    """The lab's model: the debug Llama, untied (its embedding and output live on different stages)."""
    return ModelArgs.preset(
        "debug",
        n_layers=n_layers,
        dim=dim,
        vocab_size=vocab_size,
        max_seq_len=seq_len,
        tie_embeddings=False,
    )


def lab_batches(
    vocab_size: int, steps: int, batch_size: int, seq_len: int, seed: int = 0
) -> torch.Tensor:
    """Random token batches [steps, batch, seq_len + 1], the same on every rank."""
    return random_tokens(vocab_size, (steps, batch_size, seq_len + 1), seed)


def train_single(
    args, batches, *, lr: float = 1e-2, grad_clip: float = 1.0, seed: int = 0, device: str = "cpu"
) -> dict:
    """The reference: the whole model in one process, one AdamW step per batch."""
    model = seeded_model(args, seed, device)  # built on the CPU as every rank does: same weights
    batches = batches.to(device)
    out = train_adamw(model, [(b[:, :-1], b[:, 1:]) for b in batches], lr=lr, grad_clip=grad_clip)
    x, y = batches[0, :, :-1], batches[0, :, 1:]
    with torch.no_grad():
        out["eval_loss"] = (loss_sum(model(x), y) / count_targets(y)).item()
    out["state_dict"] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return out


def train_pipeline(
    schedule: str,
    args,
    batches,
    *,
    n_microbatches: int,
    lr: float = 1e-2,
    grad_clip: float = 1.0,
    seed: int = 0,
    stages_per_rank: int | None = None,
    on_step=None,
) -> dict:
    """The same training, pipelined over all ranks with `schedule`, every step's timeline
    recorded. Returns losses, gradient norms, every step's events (all ranks) and the layers
    of each stage; `on_step(step, loss, events)` is called on every rank after each step."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    # every rank builds the same weights, then keeps its part
    model = seeded_model(args, seed, device)
    stages, parts = pipeline_split(
        model, dist.group.WORLD, schedule=schedule, stages_per_rank=stages_per_rank
    )
    del model
    loss_fn = TokenLoss()
    sched = build_schedule(schedule, stages, n_microbatches, loss_fn, batch_size=batches.shape[1])
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=lr)
    recorder = TimelineRecorder(stages)
    out = {
        "losses": [],
        "grad_norms": [],
        "events": [],
        "layers": [list(r) for r in split_layers(args.n_layers, stages[0].num_stages)],
    }
    for step, b in enumerate(batches.to(device)):
        dist.barrier()  # every rank starts the step together: the span measures the pipeline
        with recorder:
            loss = pipeline_step(sched, stages, b[:, :-1], b[:, 1:], loss_fn=loss_fn)
        out["grad_norms"].append(clip_grad_norm_(params, grad_clip).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        out["events"].append(gather_events(recorder.events))
        if on_step is not None:
            on_step(step + 1, loss.item(), out["events"][-1])
    b = batches[0].to(device)  # after training: a forward-only pass, and the whole model's weights
    out["eval_loss"] = (
        None
        if SCHEDULES[schedule][1] == "v"
        # see pipeline_eval
        else pipeline_eval(sched, stages, b[:, :-1], b[:, 1:], loss_fn=loss_fn).item()
    )
    out["state_dict"] = gather_state_dict(parts)
    return out


def schedule_lab(
    schedules=("gpipe", "1f1b", "interleaved_1f1b"),
    *,
    n_layers: int = 4,
    dim: int = 64,
    vocab_size: int = 256,
    seq_len: int = 64,
    batch_size: int = 8,
    n_microbatches: int = 4,
    steps: int = 4,
    lr: float = 1e-2,
    grad_clip: float = 1.0,
    seed: int = 0,
    microbatch_sweep=(),
) -> dict:
    """Train the same model with each schedule over all ranks (run it with `launch_function`);
    progress goes to the notebook's live plot. `microbatch_sweep`: extra 1F1B runs with other
    numbers of micro-batches. Returns {run name: train_pipeline's dict}."""
    args = lab_args(n_layers, dim, vocab_size, seq_len)
    batches = lab_batches(vocab_size, steps, batch_size, seq_len, seed)
    runs = [(name, name, n_microbatches) for name in schedules if name in available_schedules()]
    runs += [(f"1f1b m={m}", "1f1b", m) for m in microbatch_sweep]
    results = {}
    for label, name, m in runs:

        def on_step(step, loss, events, label=label):
            if dist.get_rank() == 0:
                report(
                    {
                        "kind": "train",
                        "run": label,
                        "step": step,
                        "loss": loss,
                        "bubble": sum(bubble(events).values()) / len(bubble(events)),
                    }
                )

        results[label] = dict(
            train_pipeline(
                name,
                args,
                batches,
                n_microbatches=m,
                lr=lr,
                grad_clip=grad_clip,
                seed=seed,
                on_step=on_step,
            ),
            schedule=name,
            n_microbatches=m,
        )
    return results
