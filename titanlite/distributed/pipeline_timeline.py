"""What a pipeline schedule really did: per-rank timelines, the bubble, activations in flight.

    recorder = TimelineRecorder(stages)          # wraps each stage's F / B / I / W calls
    with recorder:
        pipeline_step(schedule, stages, x, y, loss_fn=loss_fn)
    events = gather_events(recorder.events)      # every rank's ops, on every rank
    bubble(events)                               # idle / busy per rank, vs (p-1)/m
    plot_timeline(events)                        # the Gantt chart

Ops: F forward, B full backward, I backward to the input only and W backward to the weights
(zero-bubble schedules split B into I, on the critical path, and W, which can wait).

The bubble, precisely. A step lasts from the first op's start on any rank to the last op's end
on any rank (the optimizer step after it needs every rank done). A rank is *busy* while it runs
one of its ops and *idle* the rest of that span: waiting for a neighbour, communicating, or
running Python between ops. We report idle / busy, which for the textbook schedules with equal
stage times and free communication is exactly (p−1)/m (GPipe, 1F1B) and (p−1)/(v·m)
(interleaved): the formulas count idle time in units of useful work. `simulate` replays a
schedule's op order with given op times and free communication, which separates what the
schedule costs from what the communication and the machine cost.

Clocks: all ranks read time.perf_counter(), one clock for every process of a machine (Linux
CLOCK_MONOTONIC), so single-machine timelines line up exactly. On CUDA each op is bracketed
by a device synchronize: the timeline then shows when the GPU worked, at the price of a little
overlap between communication and compute.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

COLORS = {"F": "#1f77b4", "B": "#2ca02c", "I": "#98df8a", "W": "#ff7f0e"}


@dataclass
class Event:
    rank: int
    stage: int
    microbatch: int
    kind: str           # F, B, I or W
    start: float        # seconds (perf_counter)
    end: float
    live_bytes: int = 0  # bytes autograd had saved on this rank, still alive when the op ended


class TimelineRecorder:
    """Times every forward / backward a schedule runs on this rank's stages, by wrapping the
    three methods torch's schedules call on a stage (names checked in torch 2.11 and 2.13):
    forward_one_chunk, backward_one_chunk (full or input-only) and backward_weight_one_chunk.

    Inside `with recorder:` every tensor autograd saves is also noted (a saved_tensors_hooks
    pack hook, parameters and buffers excluded), so each event carries the activation bytes
    still alive after it: memory a schedule holds between ops, measured, not modelled."""

    def __init__(self, stages: list):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = stages[0].device
        self.events: list[Event] = []
        self._saved: dict[int, tuple[StorageWeakRef, int]] = {}
        self._owned = {StorageWeakRef(t.untyped_storage()).cdata for s in stages
                       for t in [*s.submod.parameters(), *s.submod.buffers()]}
        for stage in stages:
            self._wrap(stage, "forward_one_chunk", lambda a: "F")
            self._wrap(stage, "backward_one_chunk", lambda a: "B" if a.get("full_backward", True) else "I")
            self._wrap(stage, "backward_weight_one_chunk", lambda a: "W")

    def _wrap(self, stage, name: str, kind_of) -> None:
        original = getattr(stage, name)
        signature = inspect.signature(original)

        def timed(*args, **kwargs):
            call = signature.bind(*args, **kwargs).arguments
            self._sync()
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self._sync()
            end = time.perf_counter()
            chunk = next(iter(call.values()))  # fwd_chunk_id / bwd_chunk_id, the first argument
            self.events.append(Event(self.rank, stage.stage_index, int(chunk), kind_of(call),
                                     start, end, self.live_bytes()))
            return out

        setattr(stage, name, timed)  # the instance attribute shadows the class's method

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref.cdata not in self._owned:
            old = self._saved.get(ref.cdata)
            if old is None or old[0].expired():  # a freed storage's address can come back
                self._saved[ref.cdata] = (ref, t.untyped_storage().nbytes())
        return t

    def live_bytes(self) -> int:
        """Saved-activation bytes alive now (each storage once; dead ones forgotten)."""
        self._saved = {k: v for k, v in self._saved.items() if not v[0].expired()}
        return sum(n for _, n in self._saved.values())

    def __enter__(self):
        self.events.clear()
        self._saved = {}  # count only what this step saves
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def gather_events(events: list[Event], group=None) -> list[Event]:
    """Every rank's events, on every rank (a collective: all ranks call it)."""
    if not dist.is_initialized():
        return list(events)
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, [asdict(e) for e in events], group=group)
    return [Event(**e) for rank_events in out for e in rank_events]


# ----- what the timeline says -----------------------------------------------------------------

def bubble(events: list[Event]) -> dict[int, float]:
    """idle / busy for each rank over the step's span (see the module docstring)."""
    span = max(e.end for e in events) - min(e.start for e in events)
    busy: dict[int, float] = {}
    for e in events:
        busy[e.rank] = busy.get(e.rank, 0.0) + (e.end - e.start)
    return {r: (span - b) / b for r, b in sorted(busy.items())}


def bubble_budget(steps: list[list[Event]], formula: float) -> dict:
    """The measured bubble next to the formula, and what the formula leaves out, each measured
    on the same steps (values are idle/busy ratios, averaged over ranks):

      formula    equal stages, instant communication, no time between ops
      ideal      `simulate` the executed op order with each op's median duration: adds the
                 stages' imbalance (e.g. the last stage also runs the output layer and loss)
      predicted  also pay, per op, the median gap before ops whose inputs were already there
                 (posting sends and receives, the schedule's Python) and, per input from
                 another rank, the median delay between its producer's end and this op's start
      measured   the least-disturbed step (other processes on the machine mostly add idle time)
      spread     max − min of the steps: how well this machine lets one number be known

    `agrees`: |measured − formula| <= |predicted − formula| + spread."""
    import statistics
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    per_step = [mean(bubble(ev)) for ev in steps]
    durations: dict[tuple, list[float]] = {}
    gaps, delays = [], []
    for ev in steps:
        last_stage, done = max(e.stage for e in ev), _finished(ev)
        owner = {(e.kind, e.stage, e.microbatch): e.rank for e in ev}
        owner.update({("BI",) + k[1:]: r for k, r in owner.items() if k[0] in "BI"})
        for e in ev:
            durations.setdefault((e.rank, e.kind, e.stage), []).append(e.end - e.start)
        for r in {e.rank for e in ev}:
            mine = sorted((e for e in ev if e.rank == r), key=lambda e: e.start)
            for prev, e in zip(mine, mine[1:]):
                inputs = _inputs(e.kind, e.stage, e.microbatch, last_stage)
                remote = [done[d] for d in inputs if owner[d] != r]
                if all(done[d] <= prev.end for d in inputs):
                    gaps.append(e.start - prev.end)
                elif remote and max(remote) > prev.end:
                    delays.append(e.start - max(remote))
    median = {k: statistics.median(v) for k, v in durations.items()}
    gap = statistics.median(gaps) if gaps else 0.0
    delay = statistics.median(delays) if delays else 0.0
    ev = steps[-1]
    orders = {r: order(ev, r) for r in sorted({e.rank for e in ev})}
    ideal = simulate(orders, lambda r, k, s, i: median[(r, k, s)])
    predicted = simulate(orders, lambda r, k, s, i: median[(r, k, s)] + gap, latency=delay)
    out = {"formula": formula, "ideal": mean(bubble(ideal)), "predicted": mean(bubble(predicted)),
           "measured": min(per_step), "spread": max(per_step) - min(per_step), "per_step": per_step,
           "gap_ms": gap * 1e3, "delay_ms": delay * 1e3}
    out["agrees"] = abs(out["measured"] - formula) <= abs(out["predicted"] - formula) + out["spread"]
    return out


def formula_bubble(schedule: str, p: int, m: int, v: int = 1) -> float | None:
    """The textbook idle/busy ratio: GPipe (Huang et al. 2019), 1F1B (PipeDream-Flush /
    Megatron-LM) (p−1)/m; interleaved 1F1B (Narayanan et al. 2021) (p−1)/(v·m). Zero-bubble
    schedules have none in closed form that holds without their equal-F/I/W assumption."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m)
    return None


def order(events: list[Event], rank: int) -> list[tuple[str, int, int]]:
    """The ops rank `rank` ran, in the order it ran them: (kind, stage, micro-batch)."""
    mine = sorted((e for e in events if e.rank == rank), key=lambda e: e.start)
    return [(e.kind, e.stage, e.microbatch) for e in mine]


def peak_live_microbatches(events: list[Event], rank: int) -> int:
    """Most (stage, micro-batch) activations rank `rank` held at once: alive from the end of
    its F until its B (or, when backward is split, its W) ends."""
    live = peak = 0
    for kind, _, _ in order(events, rank):
        live += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        peak = max(peak, live)
    return peak


def _inputs(kind: str, s: int, i: int, last_stage: int) -> list[tuple]:
    """The ops whose results op (kind, s, i) needs: F(s,i) needs F(s−1,i); a backward B or I
    of (s,i) needs F(s,i) and the next stage's backward of i ("BI": B or I); W(s,i) needs I(s,i)."""
    if kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    if kind == "W":
        return [("I", s, i)]
    return [("F", s, i)] + ([("BI", s + 1, i)] if s < last_stage else [])


def _finished(events: list[Event]) -> dict[tuple, float]:
    done = {}
    for e in events:
        done[(e.kind, e.stage, e.microbatch)] = e.end
        if e.kind in ("B", "I"):
            done[("BI", e.stage, e.microbatch)] = e.end
    return done


def simulate(orders: dict[int, list[tuple[str, int, int]]], duration, latency: float = 0.0) -> list[Event]:
    """Replay each rank's op order: an op starts as soon as its rank is free and its inputs
    (`_inputs`) exist, `latency` seconds after their end when they were computed on another
    rank (0: free communication). `duration(rank, kind, stage, mb)`: seconds."""
    last_stage = max(s for ops in orders.values() for _, s, _ in ops)
    home = {s: r for r, ops in orders.items() for _, s, _ in ops}  # stage -> its rank
    done: dict[tuple, float] = {}
    free = {r: 0.0 for r in orders}
    nxt = {r: 0 for r in orders}
    events: list[Event] = []
    while any(nxt[r] < len(orders[r]) for r in orders):
        progressed = False
        for r, ops in orders.items():
            while nxt[r] < len(ops):
                kind, s, i = ops[nxt[r]]
                deps = _inputs(kind, s, i, last_stage)
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] + latency * (home[d[1]] != r) for d in deps])
                events.append(Event(r, s, i, kind, start, start + duration(r, kind, s, i)))
                done.update(_finished(events[-1:]))
                free[r] = events[-1].end
                nxt[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlocks: next ops {[orders[r][nxt[r]] for r in orders if nxt[r] < len(orders[r])]}")
    return events


# ----- the same orders, from scratch (picotron's two schedules, side by side) -----------------

def afab_order(rank: int, p: int, m: int) -> list[tuple[str, int]]:
    """GPipe, all-forward-all-backward: every micro-batch forward, then every one backward.
    Simple, but a rank keeps all m micro-batches' activations until the backwards start."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_order(rank: int, p: int, m: int) -> list[tuple[str, int]]:
    """1F1B: the same ops, reordered so that backwards start as early as possible."""
    warmup = min(p - rank - 1, m)  # warm-up: the forwards needed before the first backward
    #                                returns here (rank r is p−1−r hops from the last stage)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward; activations stay ≤ p
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", i) for i in range(m - warmup, m)]  # cool-down: drain the remaining backwards
    return ops


# ----- the experiment notebook 10 and the tests run in every rank -------------------------------

def lab_batches(vocab_size: int, steps: int, batch_size: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """Random token batches [steps, batch, seq_len + 1], the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (steps, batch_size, seq_len + 1), generator=g)


def train_single(args, batches, *, lr: float = 1e-2, grad_clip: float = 1.0, seed: int = 0) -> dict:
    """The reference: the whole model in one process, one AdamW step per batch."""
    from ..efficiency.accumulation import count_targets, loss_sum
    from ..models.llama import build_model
    torch.manual_seed(seed)
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = {"losses": [], "grad_norms": []}
    for b in batches:
        x, y = b[:, :-1], b[:, 1:]
        loss = loss_sum(model(x), y) / count_targets(y)
        loss.backward()
        out["grad_norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
    return out


def train_pipeline(schedule: str, args, batches, *, n_microbatches: int, lr: float = 1e-2,
                   grad_clip: float = 1.0, seed: int = 0, stages_per_rank: int | None = None,
                   on_step=None) -> dict:
    """The same training, pipelined over all ranks with `schedule`, every step's timeline
    recorded. Returns losses, gradient norms, every step's events (all ranks) and the layers
    of each stage; `on_step(step, loss, events)` is called on every rank after each step."""
    from ..models.llama import build_model
    from .pipeline import TokenLoss, build_schedule, clip_grad_norm_, pipeline_split, split_layers
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    torch.manual_seed(seed)
    model = build_model(args).to(device)  # every rank builds the same weights, then keeps its part
    stages, parts = pipeline_split(model, dist.group.WORLD, schedule=schedule,
                                   stages_per_rank=stages_per_rank)
    del model
    loss_fn = TokenLoss()
    sched = build_schedule(schedule, stages, n_microbatches, loss_fn, batch_size=batches.shape[1])
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=lr)
    recorder = TimelineRecorder(stages)
    from .pipeline import pipeline_step
    out = {"losses": [], "grad_norms": [], "events": [],
           "layers": [list(r) for r in split_layers(args.n_layers, stages[0].num_stages)]}
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
    return out


def schedule_lab(schedules=("gpipe", "1f1b", "interleaved_1f1b"), *, n_layers: int = 4, dim: int = 64,
                 vocab_size: int = 256, seq_len: int = 64, batch_size: int = 8, n_microbatches: int = 4,
                 steps: int = 4, lr: float = 1e-2, grad_clip: float = 1.0, seed: int = 0,
                 microbatch_sweep=()) -> dict:
    """Train the same model with each schedule over all ranks (run it with `launch_function`);
    progress goes to the notebook's live plot. `microbatch_sweep`: extra 1F1B runs with other
    numbers of micro-batches. Returns {run name: train_pipeline's dict}."""
    from ..models.llama import ModelArgs
    from .pipeline import available_schedules
    from .run_function import report
    args = ModelArgs.preset("debug", n_layers=n_layers, dim=dim, vocab_size=vocab_size,
                            max_seq_len=seq_len, tie_embeddings=False)
    batches = lab_batches(vocab_size, steps, batch_size, seq_len, seed)
    runs = [(name, name, n_microbatches) for name in schedules if name in available_schedules()]
    runs += [(f"1f1b m={m}", "1f1b", m) for m in microbatch_sweep]
    results = {}
    for label, name, m in runs:
        def on_step(step, loss, events, label=label):
            if dist.get_rank() == 0:
                report({"kind": "train", "run": label, "step": step, "loss": loss,
                        "bubble": sum(bubble(events).values()) / len(bubble(events))})
        results[label] = dict(train_pipeline(name, args, batches, n_microbatches=m, lr=lr,
                                             grad_clip=grad_clip, seed=seed, on_step=on_step),
                              schedule=name, n_microbatches=m)
    return results


# ----- the picture ------------------------------------------------------------------------------

def plot_timeline(events: list[Event], ax=None, title: str = "", t0: float | None = None):
    """A Gantt chart: one row per rank, one box per op (colour: F/B/I/W; text: micro-batch,
    and the stage when a rank holds several). Returns the matplotlib Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if ax is None:
        fig = Figure(figsize=(10, 0.5 + 0.45 * len({e.rank for e in events})), dpi=90)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
    t0 = min(e.start for e in events) if t0 is None else t0
    scale = 1e3  # milliseconds
    several = len({e.stage for e in events}) > len({e.rank for e in events})
    for e in events:
        x, w = (e.start - t0) * scale, (e.end - e.start) * scale
        ax.barh(e.rank, w, left=x, height=0.8, color=COLORS[e.kind], edgecolor="black", linewidth=0.4)
        label = f"{e.microbatch}" + (f"s{e.stage}" if several else "")
        ax.text(x + w / 2, e.rank, label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(sorted({e.rank for e in events}))
    ax.set_yticklabels([f"rank {r}" for r in sorted({e.rank for e in events})])
    ax.invert_yaxis()
    ax.set_xlabel("time in the step (ms)")
    kinds = sorted({e.kind for e in events}, key="FBIW".index)
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], loc="lower right",
              bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=len(kinds), frameon=False)
    ax.set_title(title, fontsize=9, loc="left")
    return ax.figure
