"""Notebook 22's helpers: a fault-tolerant job's records read back as the story of a failure.

    plot = DrillPlot(LivePlot(metrics=("loss", "quorum")))  # a line per group, kill and heal marked
    facts = drill_facts(results, victim=1)           # kill step, steps alone, kill -> rejoin, ...
    same, checked = same_final_state(a.run_dir, b.run_dir)   # two groups' last checkpoints, bit for bit

Every group writes its own records (tools/jobs/replica_groups.py labels them "replica_group");
the fault-tolerance fields come from resilience/fault_tolerance.py's watcher: the step's quorum
size, whether it committed, the seconds its quorum took, the step a heal copied, the bytes
all-reduced across the groups, and a wall clock (`unix_time`) the groups' processes share.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from ..errors import TitanliteError
from ..tools.predict import goodput_model


def train_records(result, attempt: int | None = None) -> list[dict]:
    """A group's train records in arrival order (`attempt`: only that attempt's; 0 is the first)."""
    return [
        r
        for r in result.records
        if r.get("kind") == "train"
        and r.get("rank", 0) == 0
        and (attempt is None or r.get("attempt", 0) == attempt)
    ]


class DrillPlot:
    """A LivePlot fed by every group's records: a line per group (and per attempt: a restarted
    group is a new process, a new line), and the failure and the heal marked where they happen -
    at the survivors' step that did not commit, and at the healed group's first step."""

    def __init__(self, plot):
        self.plot, self.marked = plot, set()

    def __call__(self, record: dict) -> None:
        if record.get("kind") != "train":
            return
        g, attempt = record.get("replica_group", 0), record.get("attempt", 0)
        run = f"group {g}" + (f", restarted ×{attempt}" if attempt else "")
        self.plot({**record, "run": run})
        if record.get("committed") is False and "failure" not in self.marked:
            self.marked.add("failure")
            self.plot({"kind": "event", "step": record["step"], "event": "a group died"})
        if record.get("healed_from_step") is not None and ("heal", g) not in self.marked:
            self.marked.add(("heal", g))
            self.plot({"kind": "event", "step": record["step"], "event": f"group {g} healed"})

    def on_train_end(self) -> None:
        self.plot.on_train_end()


def drill_facts(results: list, victim: int) -> dict:
    """What the drill's records say: the step the victim died in (the survivors' uncommitted
    step), the steps they then took alone (quorum below the group count), the victim's heal
    (the step it copied, its first step after), the seconds from the kill to the heal, the
    survivors' wait to drop the dead group (detection), and the mean step time."""
    groups = len(results)
    survivor = results[(victim + 1) % groups]
    kept = train_records(survivor)
    failed = next(r for r in kept if r.get("committed") is False)
    alone = [r["step"] for r in kept if r["quorum"] < groups and r["step"] > failed["step"]]
    first_run = train_records(results[victim], attempt=0)
    back = train_records(results[victim], attempt=1)
    if not back or back[0].get("healed_from_step") is None:
        raise TitanliteError(
            f"group {victim} did not rejoin before the others finished their {kept[-1]['step']} "
            f"steps (its restart took longer than their run on this machine, now): run the drill "
            f"again with more steps"
        )
    healed = back[0]
    # The kill came as its step began, just after that step's quorum: within milliseconds of the
    # end of its last step. The heal ends the restarted worker's first quorum.
    killed_at = first_run[-1]["unix_time"]
    healed_at = healed["unix_time"] - healed["step_time_s"] + healed["quorum_s"]
    after = next(r for r in kept if r["step"] == failed["step"] + 1)
    # A step's cost: the mean of the steps that were only steps (not the first, which waited for
    # every group to start; not the one that waited to drop the dead group; not the heal's).
    odd = (failed["step"] + 1, healed["step"])
    steady = [r["step_time_s"] for r in kept[1:] if r["step"] not in odd]
    return {
        "groups": groups,
        "steps": kept[-1]["step"],
        "failed_step": failed["step"],
        "steps_alone": len(alone),
        "alone": alone,
        "victim_last_step": first_run[-1]["step"],
        "healed_from_step": healed["healed_from_step"],
        "healed_step": healed["step"],
        "rejoin_s": healed_at - killed_at,
        "detect_s": after["quorum_s"],
        "step_s": statistics.mean(steady),
        # From the end of step 1 (its quorum waited for every group to start) to the end.
        "window_steps": kept[-1]["step"] - 1,
        "committed_group_steps": sum(
            sum(1 for r in train_records(res) if r.get("committed") and r["step"] > 1)
            for res in results
        ),
        "wall_s": kept[-1]["unix_time"] - kept[0]["unix_time"],
    }


def measured_goodput(facts: dict) -> float:
    """The drill's goodput, as `goodput_model.replay_ft_run` counts it: the group-steps that
    committed after step 1, at the mean step time, over every group's wall time from the end of
    step 1 to the end of the run."""
    return facts["committed_group_steps"] * facts["step_s"] / (facts["groups"] * facts["wall_s"])


def predicted(facts: dict, checkpoint_every: int, checkpoint_s: float) -> dict:
    """The same run and failure in the two models, from the drill's measured costs: per-step
    fault tolerance (`replay_ft_run`) and notebook 13's restart-everyone (`replay_run`: every
    group restarts after the same start-up the victim's restart took, and goes back to a
    checkpoint taken every `checkpoint_every` steps at `checkpoint_s` each)."""
    t, steps = facts["step_s"], facts["window_steps"]
    ft = goodput_model.replay_ft_run(
        steps, t, facts["groups"], facts["detect_s"], facts["rejoin_s"]
    )
    everyone = goodput_model.replay_run(
        steps * t,
        checkpoint_every * t,
        checkpoint_s,
        facts["rejoin_s"],
        [(facts["failed_step"] - 2) * t + 1e-9],  # as its step began, counted from step 2
    )
    return {"per_step_ft": ft, "restart_everyone": everyone}


def same_final_state(run_a: Path, run_b: Path) -> tuple[list[str], int]:
    """The two groups' newest committed checkpoints compared entry by entry, bit for bit:
    (the entries that differ, how many were compared) - weights, AdamW's moments and steps, the
    schedule, the data position and the step."""
    from .._compat.torch_tools import load_whole_dcp_state
    from ..resilience.checkpoint_files import RawReader, committed

    a, b = (
        load_whole_dcp_state(RawReader(committed(Path(r) / "checkpoints")[-1]))
        for r in (run_a, run_b)
    )

    def flat(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    fa, fb = (
        dict(flat({k: a[k] for k in ("model", "optimizer", "scheduler", "data", "step")})),
        dict(flat({k: b[k] for k in ("model", "optimizer", "scheduler", "data", "step")})),
    )
    differ = sorted(set(fa) ^ set(fb))
    for key in fa.keys() & fb.keys():
        x, y = fa[key], fb[key]
        same = torch.equal(x, y) if torch.is_tensor(x) and torch.is_tensor(y) else x == y
        if not same:
            differ.append(key)
    return differ, len(fa)


def quorum_gradient(grads, in_quorum) -> torch.Tensor:
    """What every group in the quorum steps with (float64): the sum of the quorum's gradients over
    their count, as torchft's Manager.allreduce computes it (a SUM over the quorum's process group,
    then ÷ num_participants; resilience/fault_tolerance.py, average_gradients)."""
    live = [g.double() for g, alive in zip(grads, in_quorum) if alive]
    return torch.stack(live).sum(0) / len(live)


def bytes_sent_per_step(n_params: int, bytes_per_param: int, groups: int, sync_steps: int) -> float:
    """Bytes one replica group sends per training step, on average, in a ring all-reduce (S bytes
    cost each member 2·(G-1)/G·S on the wire: a reduce-scatter, then an all-gather) of every
    gradient each step (sync_steps 1), or of DiLoCo's pseudo-gradient every H steps."""
    return 2 * (groups - 1) / groups * n_params * bytes_per_param / sync_steps


def checkpoint_reads(run_dir: Path) -> int:
    """How many times the run loaded a checkpoint: its goodput timeline's restore events."""
    path = Path(run_dir) / "goodput.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return sum(1 for e in events if e.get("event") == "restore")


def reduced_bytes_per_step(result) -> float:
    """What the group all-reduced across the groups, counted by fault_tolerance.py, per step."""
    records = train_records(result)
    return sum(r["reduced_bytes"] for r in records) / len(records)
