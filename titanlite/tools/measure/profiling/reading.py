"""Reading a trace back: which phase ran when on each rank, and the bytes allocated over time.

    phases = trace_phases("runs/x/trace")      {rank: [Span("forward", start_s, end_s), ...]}
    per_step = phase_seconds(phases)           {rank: {"backward": [s per profiled step], ...}}
    t_s, allocated = memory_timeline("runs/x/trace")

The phases are the labels the trainer puts around its work (torch.profiler.record_function in
Trainer.forward_backward and Trainer.train_step) plus the process-group's collective operators:
the only names in a trace that mean the same thing on every device and torch version. On a GPU
the labelled spans are the host's (when the work was issued; the kernels run later, and appear
beside them in Perfetto), and the collectives include NCCL's kernels on the device.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

PHASES = ("forward", "backward", "forward_backward", "optimizer")  # the trainer's labels
# c10d's operators (DDP's and FSDP's all-reduce/all-gather/reduce-scatter, and the functional
# ones with their waits), the backend's own spans (gloo:, nccl:), and NCCL's GPU kernels.
COLLECTIVE = re.compile(
    r"^(c10d::|_c10d_functional::|c10d_functional::|gloo:|nccl:|ncclKernel|ncclDevKernel)"
)
STEP = re.compile(r"^ProfilerStep#(\d+)$")


class Span(NamedTuple):
    phase: str  # forward, backward, forward_backward (pipeline), optimizer, collective, step
    start_s: float  # from the earliest profiled step's start, over all ranks
    end_s: float


def _load(source) -> dict:
    return source if isinstance(source, dict) else json.loads(Path(source).read_text())


def _trace_paths(source) -> list:
    if isinstance(source, (str, Path)) and Path(source).is_dir():
        paths = sorted(Path(source).glob("*.pt.trace.json"))
        if not paths:
            from ....errors import TitanliteError

            raise TitanliteError(
                f"no *.pt.trace.json in {source}: train with --profile.steps 2-3 first"
            )
        return paths
    return [source]


def _rank(trace: dict, source) -> int:
    info = trace.get("distributedInfo") or {}
    if "rank" in info:
        return int(info["rank"])
    m = re.search(r"rank(\d+)", str(source)) if not isinstance(source, dict) else None
    return int(m[1]) if m else 0


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Nested and overlapping intervals as one (c10d::allreduce_ holds gloo:all_reduce)."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def trace_phases(source) -> dict[int, list[Span]]:
    """Per rank, the spans of forward, backward, optimizer, collective and step, in seconds from
    the first profiled step. `source`: a trace file, its loaded dict, or a folder of rank traces."""
    raw: dict[int, dict[str, list]] = {}
    for src in _trace_paths(source):
        trace = _load(src)
        spans = raw.setdefault(_rank(trace, src), {})
        for ev in trace.get("traceEvents", []):
            if ev.get("ph") != "X" or "dur" not in ev:
                continue
            name, host_label = ev.get("name", ""), ev.get("cat") == "user_annotation"
            # (On CUDA the labels appear a second time, as gpu_user_annotation: the host's are the ones.)
            phase = (
                name
                if name in PHASES and host_label
                else "step"
                if host_label and STEP.match(name)
                else "collective"
                if COLLECTIVE.match(name)
                else None
            )
            if phase:
                spans.setdefault(phase, []).append((ev["ts"] / 1e6, (ev["ts"] + ev["dur"]) / 1e6))
    starts = [a for spans in raw.values() for a, _ in spans.get("step", [])]
    if not starts:
        from ....errors import TitanliteError

        raise TitanliteError(
            "the trace has no ProfilerStep# spans: write it with --profile.steps "
            "(the trainer labels its steps), not a bare torch.profiler run"
        )
    t0 = min(starts)
    return {
        rank: sorted(
            (
                Span(phase, a - t0, b - t0)
                for phase, intervals in spans.items()
                for a, b in (_merged(intervals) if phase == "collective" else intervals)
            ),
            key=lambda s: s.start_s,
        )
        for rank, spans in sorted(raw.items())
    }


def phase_seconds(phases: dict[int, list[Span]]) -> dict[int, dict[str, list[float]]]:
    """Per rank and phase, the seconds spent in it during each profiled step (micro-batches add up)."""
    out = {}
    for rank, spans in phases.items():
        steps = [s for s in spans if s.phase == "step"]
        out[rank] = {
            phase: [
                sum(
                    s.end_s - s.start_s
                    for s in spans
                    if s.phase == phase and step.start_s <= s.start_s < step.end_s
                )
                for step in steps
            ]
            for phase in sorted({s.phase for s in spans})
        }
    return out


def phase_at(spans: list[Span], t_s: float) -> str | None:
    """The trainer's phase (forward, backward, optimizer, ...) one rank was in at time t_s."""
    inside = [s for s in spans if s.phase in PHASES and s.start_s <= t_s <= s.end_s]
    return inside[0].phase if inside else None


def memory_timeline(
    source, device: str | None = None, rank: int = 0
) -> tuple[list[float], list[int]]:
    """(seconds since the first profiled step, bytes allocated) from the profiler's memory events.

    `source`: a trace file or dict, a folder (this rank's trace in it), or the rank<r>.memory.json
    the trainer writes. `device`: "cpu" or "cuda" (None: cuda if the trace has it). On CPU the
    profiler counts only what was allocated while it ran: the weights and optimizer state made
    before are not in it, the activations, gradients and temporaries of the steps are. On CUDA
    it is the caching allocator's whole total."""
    if isinstance(source, (str, Path)) and Path(source).is_dir():
        source = Path(source) / f"rank{rank}.pt.trace.json"
    data = _load(source)
    if "bytes_allocated" in data:  # the trainer's memory.json
        return data["t_s"], data["bytes_allocated"]
    events = [ev for ev in data.get("traceEvents", []) if ev.get("name") == "[memory]"]
    types = {ev["args"].get("Device Type") for ev in events}
    # c10::DeviceType
    wanted = {"cpu": 0, "cuda": 1}[device] if device else (1 if 1 in types else 0)
    events = sorted(
        (ev for ev in events if ev["args"].get("Device Type") == wanted), key=lambda ev: ev["ts"]
    )
    if not events:
        return [], []
    # The same origin as trace_phases: this trace's first profiled step, so the two line up.
    steps = [
        ev["ts"]
        for ev in data["traceEvents"]
        if ev.get("ph") == "X" and STEP.match(ev.get("name", ""))
    ]
    t0 = min(steps) if steps else events[0]["ts"]
    return [(ev["ts"] - t0) / 1e6 for ev in events], [
        int(ev["args"]["Total Allocated"]) for ev in events
    ]


# ----- pictures for the notebooks --------------------------------------------------------------

COLORS = {
    "forward": "tab:blue",
    "backward": "tab:orange",
    "forward_backward": "tab:purple",
    "optimizer": "tab:green",
    "collective": "tab:red",
}


def plot_phases(ax, phases: dict[int, list[Span]], title: str = "one row per rank"):
    """A timeline: per rank, a band of forward/backward/optimizer and one of collectives below it."""
    rows = []
    for rank, spans in phases.items():
        for row, kinds in (("compute", set(PHASES)), ("collectives", {"collective"})):
            bars = [s for s in spans if s.phase in kinds]
            if row == "collectives" and not bars:
                continue
            y = len(rows)
            rows.append(f"rank {rank} {row}")
            for s in bars:
                ax.broken_barh(
                    [(s.start_s * 1e3, (s.end_s - s.start_s) * 1e3)],
                    (y - 0.4, 0.8),
                    color=COLORS[s.phase],
                )
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first profiled step")
    ax.set_title(title)
    seen = sorted({s.phase for spans in phases.values() for s in spans} & set(COLORS))
    from matplotlib.patches import Patch

    ax.legend(
        handles=[Patch(color=COLORS[p], label=p) for p in seen], loc="upper right", fontsize=8
    )
    return ax


def plot_memory(ax, t_s, allocated, label: str = None):
    """Bytes allocated over time, in MiB, with the peak marked; the x axis matches plot_phases."""
    ms, mib = [t * 1e3 for t in t_s], [b / 2**20 for b in allocated]
    (line,) = ax.step(ms, mib, where="post", label=label)
    if mib:
        i = max(range(len(mib)), key=mib.__getitem__)
        ax.plot([ms[i]], [mib[i]], "o", color=line.get_color())
    ax.set_xlabel("ms since the first profiled step")
    ax.set_ylabel("MiB allocated")
    return ax
