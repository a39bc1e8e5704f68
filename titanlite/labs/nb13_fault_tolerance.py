"""Notebook 13's helpers: jobs that fail on purpose, and a failed run's goodput against the model.

    err = launch_expecting_failure(cfg, 2, overrides={"fault.kind": "kill", "fault.rank": 1})
    losses = final_losses(result.records)        # one loss per step, the attempt that was kept
    cmp = measured_vs_model(result.run_dir)      # measured goodput vs goodput_model.replay_run

A restarted job logs some steps twice (computed, lost in the failure, computed again after the
resume): the run's losses are the *last* record of each step. `measure_costs` reads what each
part of a run cost from its goodput.jsonl - step time, checkpoint stall, start-up, each restart
(an attempt's last event to the next attempt's first step: detection, new processes, rendezvous,
restore) - and where in the work each failure struck; `measured_vs_model` feeds those to
`goodput_model.replay_run`, the same model the cluster-scale simulations use.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import TitanliteError
from ..tools.measure.goodput import read_events, summarize
from ..tools.predict import goodput_model

# A failure just after a committed checkpoint: a hair past the step boundary, so the replay
# resumes from that checkpoint (exactly on a boundary it strikes before the save).
_AFTER_SAVE = 1e-6


def final_records(records: list[dict], rank: int = 0, kind: str = "train") -> list[dict]:
    """The last record of each step of `rank`, in step order: what the job finally computed."""
    last = {r["step"]: r for r in records if r.get("kind") == kind and r.get("rank", 0) == rank}
    return [last[s] for s in sorted(last)]


def final_losses(records: list[dict], rank: int = 0) -> list[float]:
    return [r["loss"] for r in final_records(records, rank)]


@dataclass
class ExpectedFailure:
    message: str  # the launcher's one-line TitanliteError
    traceback: str  # what it printed about the failing rank (its traceback), if anything
    wall_s: float


def launch_expecting_failure(
    cfg,
    nproc: int,
    *,
    overrides: dict | None = None,
    callbacks=(),
    timeout_s: float = 180,
    max_restarts: int = 0,
) -> ExpectedFailure:
    """Launch a job that its [fault] section breaks; return the error instead of raising it.
    The failing rank's traceback, which the launcher prints to stderr, is captured so a notebook
    can show it as ordinary output."""
    from ..tools.jobs.launcher import launch

    captured, start = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stderr(captured):
        try:
            launch(
                cfg,
                nproc,
                overrides=overrides,
                callbacks=callbacks,
                timeout_s=timeout_s,
                max_restarts=max_restarts,
            )
        except TitanliteError as e:
            return ExpectedFailure(str(e), captured.getvalue(), time.perf_counter() - start)
    raise TitanliteError(
        f"the job finished although it was meant to fail (overrides {overrides}): "
        f"set fault.kind to exception, kill or hang, at a step the job reaches"
    )


# ----- what a run cost, from its goodput.jsonl ------------------------------------------------


def split_attempts(events: list[dict]) -> list[list[dict]]:
    """The log cut into attempts, each from its "start" event: torchrun's restarts, and also a
    job requeued by hand (a new torchrun counts its attempts from 0 again)."""
    attempts: list[list[dict]] = []
    for e in events:
        if e["event"] == "start" or not attempts:
            attempts.append([])
        attempts[-1].append(e)
    return attempts


@dataclass
class RunCosts:
    steps: int  # steps of the whole job
    every: int  # checkpoint interval in steps (0: only after the last step)
    step_s: float  # mean time of a kept step
    ckpt_cost_s: float  # mean stall of a checkpoint taken before the last step
    startup_s: float  # first attempt: process start -> its first step
    # per failure: last event -> next first step
    restarts_s: list[float] = field(default_factory=list)
    tail_s: float = 0.0  # last step -> end (the final save, the final sample)
    failures_at_step: list[float] = field(default_factory=list)  # work done when each failure hit
    restored_from: list[int] = field(default_factory=list)  # the step each restart resumed at
    lost_steps: int = 0  # steps computed and then thrown away

    @property
    def restart_s(self) -> float:
        return sum(self.restarts_s) / len(self.restarts_s) if self.restarts_s else 0.0


def measure_costs(run_dir: str | Path) -> RunCosts:
    """Read a run's costs and failure points from its goodput.jsonl (and run.json's config).
    The replay model knows synchronous saves only: with async ones, the stall is the staging."""
    run_dir = Path(run_dir)
    events = read_events(run_dir)
    cfg = json.loads((run_dir / "run.json").read_text())["config"]
    steps, every = cfg["training"]["steps"], cfg["checkpoint"]["every"]
    by = split_attempts(events)
    step_events = [e for e in events if e["event"] == "step"]
    if not step_events:
        raise TitanliteError(f"{run_dir} logged no training step: nothing to measure")
    kept = {e["step"]: e["seconds"] for e in step_events}  # the last computation of each step

    def first_step_start(a):
        first = next((e for e in by[a] if e["event"] == "step"), None)
        return None if first is None else first["t"] - first["seconds"]

    began = first_step_start(0) if first_step_start(0) is not None else by[0][-1]["t"]
    costs = RunCosts(
        steps=steps,
        every=every,
        step_s=sum(kept.values()) / len(kept),
        ckpt_cost_s=0.0,
        startup_s=began - by[0][0].get("process_start", by[0][0]["t"]),
        lost_steps=len(step_events) - len(kept),
    )
    restored = [next((e["step"] for e in mine if e["event"] == "restore"), 0) for mine in by]
    # Saves before the last step that finished, whichever attempt took them (a lost attempt's
    # count too). A save finished if its attempt logged more after it, or the next attempt
    # resumed from it; the trainer may log a ~0 s staging wait before a save a kill interrupts.
    saves = 0
    for a, mine in enumerate(by):
        ends = {e["step"]: i for i, e in enumerate(mine) if e["event"] == "checkpoint"}
        saves += sum(
            1
            for step, i in ends.items()
            if every
            and step % every == 0
            and step < steps
            and (i < len(mine) - 1 or (a + 1 < len(by) and restored[a + 1] == step))
        )
    stall = sum(e["seconds"] for e in events if e["event"] == "checkpoint" and e["step"] < steps)
    costs.ckpt_cost_s = stall / saves if saves else 0.0
    for a, nxt in zip(range(len(by)), range(1, len(by))):
        last = max((e["step"] for e in by[a] if e["event"] == "step"), default=restored[a])
        after_save = restored[nxt] == last > restored[a]  # died after committing step `last`
        costs.failures_at_step.append(last + (_AFTER_SAVE if after_save else 0.0))
        costs.restored_from.append(restored[nxt])
        # an attempt that died before its first step: its whole life is restart time
        back = first_step_start(nxt) if first_step_start(nxt) is not None else by[nxt][-1]["t"]
        costs.restarts_s.append(back - by[a][-1]["t"])
    if events[-1]["event"] == "end":
        costs.tail_s = events[-1]["t"] - step_events[-1]["t"]
    return costs


def predict(costs: RunCosts) -> dict:
    """goodput_model.replay_run on a run's costs, plus the fixed start-up and tail it does not
    model: the wall time and goodput the model expects for that run."""
    work, tau = costs.steps * costs.step_s, (costs.every or costs.steps) * costs.step_s
    fails = [x * costs.step_s for x in costs.failures_at_step]
    replay = goodput_model.replay_run(work, tau, costs.ckpt_cost_s, costs.restart_s, fails)
    wall = costs.startup_s + replay.wall_s + costs.tail_s
    return {
        "wall_s": wall,
        "goodput": work / wall,
        "lost_steps": replay.lost_work_s / costs.step_s,
        "checkpoints": replay.checkpoints,
        "replay": replay,
    }


def measured_vs_model(run_dir: str | Path, costs_from: str | Path | RunCosts | None = None) -> dict:
    """A run's measured goodput (its goodput.jsonl) next to the model's prediction for it.
    By default the model gets this run's own costs (a check of the bookkeeping: lost work, which
    checkpoint each restart resumed from). With `costs_from` (another run, or RunCosts), step
    time, checkpoint stall, start-up, restart and tail come from there, and only this run's
    shape (steps, interval, failure points) from here: a prediction made before looking."""
    own = measure_costs(run_dir)
    used = own
    if costs_from is not None:
        src = costs_from if isinstance(costs_from, RunCosts) else measure_costs(costs_from)
        if not src.restarts_s and own.failures_at_step:
            raise TitanliteError(
                "costs_from holds no restart to measure its cost: pass a run "
                "that failed and resumed at least once"
            )
        used = replace(
            own,
            step_s=src.step_s,
            ckpt_cost_s=src.ckpt_cost_s,
            startup_s=src.startup_s,
            restarts_s=[src.restart_s] * len(own.failures_at_step),
            tail_s=src.tail_s,
        )
    measured = summarize(run_dir)
    measured["lost_steps"] = own.lost_steps
    return {"measured": measured, "model": predict(used), "costs": own, "costs_used": used}


def model_breakdown(cmp: dict) -> dict:
    """The model's wall time split like goodput.summarize's (restore is part of each restart)."""
    c, m = cmp["costs_used"], cmp["model"]
    work, lost = c.steps * c.step_s, m["replay"].lost_work_s
    ckpt = m["checkpoints"] * c.ckpt_cost_s
    return {
        "wall_s": m["wall_s"],
        "productive_s": work,
        "lost_s": lost,
        "checkpoint_s": ckpt,
        "restore_s": 0.0,
        "other_s": m["wall_s"] - work - lost - ckpt,
        "goodput": m["goodput"],
    }


# ----- pictures -------------------------------------------------------------------------------

PARTS = (
    ("productive_s", "productive", "tab:green"),
    ("lost_s", "lost (redone)", "tab:red"),
    ("checkpoint_s", "checkpoint stall", "tab:blue"),
    ("restore_s", "restore", "tab:purple"),
    ("other_s", "start-up, restarts, other", "tab:gray"),
)


def plot_goodput_breakdown(breakdowns: dict[str, dict], title: str = ""):
    """Stacked horizontal bars of wall time per run (goodput.summarize-shaped dicts)."""
    height = 1.3 + 0.6 * len(breakdowns)
    fig, ax = goodput_model._figure((9, height))
    labels = list(breakdowns)
    for i, label in enumerate(labels):
        left = 0.0
        for key, name, color in PARTS:
            v = max(breakdowns[label][key], 0.0)
            ax.barh(i, v, left=left, color=color, label=name if i == 0 else None)
            left += v
        ax.text(left, i, f"  goodput {breakdowns[label]['goodput']:.0%}", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("wall time (s)")
    ax.set_xlim(0, 1.2 * max(b["wall_s"] for b in breakdowns.values()))
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, ncol=len(PARTS), loc="lower center")
    ax.set_title(title or "where the wall time went", fontsize=9)
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))  # room for the legend below
    return fig


def plot_timeline(run_dir: str | Path, title: str = ""):
    """Training progress (step) against wall time, one colour per attempt: restarts are the flat
    gaps, lost work the steps an attempt reached and the next one had to redo."""
    events = read_events(run_dir)
    t0 = min(e["process_start"] for e in events if e["event"] == "start")
    fig, ax = goodput_model._figure((8, 3.6))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    for a, mine in enumerate(split_attempts(events)):
        start = mine[0].get("process_start", mine[0]["t"])
        steps = [e for e in mine if e["event"] == "step"]
        restored = next((e["step"] for e in mine if e["event"] == "restore"), 0)
        xs = [steps[0]["t"] - steps[0]["seconds"] - t0] if steps else []
        color = colors[a % len(colors)]
        ax.plot(
            xs + [e["t"] - t0 for e in steps],
            [restored] * bool(xs) + [e["step"] for e in steps],
            ".-",
            color=color,
            label=f"attempt {a}" + (f" (resumed at step {restored})" if restored else ""),
        )
        ax.axvspan(start - t0, xs[0] if xs else mine[-1]["t"] - t0, color=color, alpha=0.12)
        if mine[-1]["event"] != "end":  # this attempt died: mark where its log stops
            ax.plot(
                mine[-1]["t"] - t0,
                steps[-1]["step"] if steps else restored,
                "x",
                color="black",
                markersize=9,
                label=None if a else "failure",
            )
    ax.set(xlabel="wall time since the first process started (s)", ylabel="step completed")
    ax.set_title(
        title or "progress against wall time (shaded: start-up of each attempt)", fontsize=9
    )
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig
