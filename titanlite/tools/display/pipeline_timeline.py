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
(interleaved): the formulas count idle time in units of useful work. `replay` re-times a
recorded step without communication and without time between ops (each op keeps its measured
duration and starts as soon as its inputs exist): the bubble the schedule itself causes. The
rest of the clock's idle time is communication, Python and the machine (`bubble_budget`).

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

from ..._compat.torch_tools import replace_stage_method

COLORS = {"F": "#1f77b4", "B": "#2ca02c", "I": "#98df8a", "W": "#ff7f0e"}


@dataclass
class Event:
    rank: int
    stage: int
    microbatch: int
    kind: str  # F, B, I or W
    start: float  # seconds (perf_counter)
    end: float
    live_bytes: int = 0  # bytes autograd saved on this rank this step, alive when the op ended
    live_before: int = 0  # ... and when it started (the loss's own saves happen between ops)


class TimelineRecorder:
    """Times every forward / backward a schedule runs on this rank's stages, by wrapping the
    three methods torch's schedules call on a stage (names checked in torch 2.11-2.13;
    titanlite._compat.torch_internals does the wrapping):
    forward_one_chunk, backward_one_chunk (full or input-only) and backward_weight_one_chunk.

    Inside `with recorder:` every tensor autograd saves is also noted (a saved_tensors_hooks
    pack hook; parameters, buffers and storages that outlive a step excluded), so each event
    carries the activation bytes alive before and after it: the memory a schedule holds
    between ops, measured, not modelled. Count from the second step on."""

    def __init__(self, stages: list):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = stages[0].device
        self.events: list[Event] = []
        self._saved: dict[int, tuple[StorageWeakRef, int]] = {}
        self._persistent: set[int] = set()
        self._owned = {
            StorageWeakRef(t.untyped_storage()).cdata
            for s in stages
            for t in [*s.submod.parameters(), *s.submod.buffers()]
        }
        for stage in stages:
            self._wrap(stage, "forward_one_chunk", lambda a: "F")
            self._wrap(
                stage, "backward_one_chunk", lambda a: "B" if a.get("full_backward", True) else "I"
            )
            self._wrap(stage, "backward_weight_one_chunk", lambda a: "W")

    def _wrap(self, stage, name: str, kind_of) -> None:
        def make_timed(original):
            signature = inspect.signature(original)

            def timed(*args, **kwargs):
                call = signature.bind(*args, **kwargs).arguments
                self._sync()
                before = self.live_bytes()
                start = time.perf_counter()
                out = original(*args, **kwargs)
                self._sync()
                end = time.perf_counter()
                chunk = next(iter(call.values()))  # fwd_chunk_id / bwd_chunk_id, the first argument
                self.events.append(
                    Event(
                        self.rank,
                        stage.stage_index,
                        int(chunk),
                        kind_of(call),
                        start,
                        end,
                        self.live_bytes(),
                        before,
                    )
                )
                return out

            return timed

        replace_stage_method(stage, name, make_timed)  # this stage instance only

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref.cdata not in self._owned and ref.cdata not in self._persistent:
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
        # Saved tensors that outlived the last step are not activations: torch's stages keep
        # one receive buffer per micro-batch for the whole run, and the first op of a stage
        # saves its input, which is that buffer. Like the weights, they are not counted.
        self._persistent |= {k for k, (ref, _) in self._saved.items() if not ref.expired()}
        self._saved = {}
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


def replay(events: list[Event]) -> list[Event]:
    """The same ops, in the same order per rank, each with its measured duration, started as
    soon as its inputs exist: the step without communication and without time between ops."""
    orders = {r: order(events, r) for r in sorted({e.rank for e in events})}
    took = {(e.kind, e.stage, e.microbatch): e.end - e.start for e in events}
    return simulate(orders, lambda r, k, s, i: took[(k, s, i)])


def causality_margin(events: list[Event]) -> float:
    """min over ops of (start − end of an input computed on another rank), seconds: >= 0 when
    no op started before what it needs existed there, which checks that the ranks' clocks
    agree; the value is the fastest hand-over between ranks."""
    last_stage, done = max(e.stage for e in events), _finished(events)
    home = {e.stage: e.rank for e in events}
    return min(
        (
            e.start - done[d]
            for e in events
            for d in _inputs(e.kind, e.stage, e.microbatch, last_stage)
            if home[d[1]] != e.rank
        ),
        default=0.0,
    )


def bubble_budget(
    steps: list[list[Event]], formula: float, draws: int = 200, seed: int = 0
) -> dict:
    """Each step's bubble split into what the schedule causes and what the machine adds, and the
    schedule's part checked against the formula (ratios idle / busy, mean over ranks):

      wall       the bubble on the clock
      measured   the bubble of the `replay`: the schedule's own, given the measured op times,
                 without communication and without time between ops (median over steps)
      overhead   wall − measured: communication, the schedule's Python, other processes
      expected   the formula holds for equal, fixed op times. Ours are neither: stages differ
                 (the last also runs the output layer and the loss) and every op's time varies.
                 Replay the order `draws` times with each op's time drawn from the times
                 measured for its stage and kind: the mean bubble, and its spread `sigma`

    `agrees`: |measured − formula| <= |expected − formula| + 3·sigma. The tolerance is what
    the measured imbalance and noise make of the formula; on a quiet machine it is tight."""
    import random
    import statistics

    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    wall = [mean(bubble(ev)) for ev in steps]
    measured = [mean(bubble(replay(ev))) for ev in steps]
    pool: dict[tuple, list[float]] = {}
    for ev in steps:
        for e in ev:
            pool.setdefault((e.stage, e.kind), []).append(e.end - e.start)
    rng = random.Random(seed)
    orders = {r: order(steps[-1], r) for r in sorted({e.rank for e in steps[-1]})}
    sims = [
        mean(bubble(simulate(orders, lambda r, k, s, i: rng.choice(pool[(s, k)]))))
        for _ in range(draws)
    ]
    out = {
        "formula": formula,
        "measured": statistics.median(measured),
        "wall": statistics.median(wall),
        "expected": statistics.fmean(sims),
        "sigma": statistics.pstdev(sims),
        "per_step": measured,
        "per_step_wall": wall,
    }
    out["overhead"] = out["wall"] - out["measured"]
    tolerance = abs(out["expected"] - formula) + 3 * out["sigma"] + 1e-9  # + rounding
    out["agrees"] = abs(out["measured"] - formula) <= tolerance
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


def peak_live_bytes(events: list[Event], rank: int) -> int:
    """The most saved-activation bytes rank `rank` held at an op boundary."""
    return max(max(e.live_bytes, e.live_before) for e in events if e.rank == rank)


def simulate(
    orders: dict[int, list[tuple[str, int, int]]], duration, latency: float = 0.0
) -> list[Event]:
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
            raise RuntimeError(
                f"schedule deadlocks: next ops {[orders[r][nxt[r]] for r in orders if nxt[r] < len(orders[r])]}"
            )
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


# ----- the picture ------------------------------------------------------------------------------


def plot_timeline(events: list[Event], ax=None, title: str = "", unit: str = "ms"):
    """A Gantt chart: one row per rank, one box per op (colour: F/B/I/W; text: micro-batch,
    and the stage when a rank holds several). `unit`: "ms" for recorded seconds, "units" for
    `simulate`'s abstract times. Returns the matplotlib Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if ax is None:
        fig = Figure(figsize=(10, 0.5 + 0.45 * len({e.rank for e in events})), dpi=90)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
    t0 = min(e.start for e in events)
    scale = 1e3 if unit == "ms" else 1.0
    several = len({e.stage for e in events}) > len({e.rank for e in events})
    for e in events:
        x, w = (e.start - t0) * scale, (e.end - e.start) * scale
        ax.barh(
            e.rank, w, left=x, height=0.8, color=COLORS[e.kind], edgecolor="black", linewidth=0.4
        )
        label = f"{e.microbatch}" + (f"s{e.stage}" if several else "")
        ax.text(x + w / 2, e.rank, label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(sorted({e.rank for e in events}))
    ax.set_yticklabels([f"rank {r}" for r in sorted({e.rank for e in events})])
    ax.invert_yaxis()
    ax.set_xlabel(f"time in the step ({unit})")
    kinds = sorted({e.kind for e in events}, key="FBIW".index)
    ax.legend(
        handles=[Patch(color=COLORS[k], label=k) for k in kinds],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        ncol=len(kinds),
        frameon=False,
    )
    ax.set_title(title, fontsize=9, loc="left")
    return ax.figure
