"""Profiler traces and memory records the trainer writes for `--profile.steps`, and reading them back."""

import json

import pytest
import torch
from conftest import tiny_overrides

from titanlite import TitanliteError
from titanlite.config import load_config
from titanlite.tools.measure.profiling import (
    StepProfiler,
    memory_record_kind,
    memory_timeline,
    phase_seconds,
    trace_phases,
)
from titanlite.train import Trainer


def test_a_profiled_run_writes_a_trace_with_its_phases_and_a_memory_timeline(data_dir, tmp_path):
    cfg = load_config(
        None,
        tiny_overrides(
            data_dir, tmp_path, **{"training.steps": 4, "eval.every": 0, "profile.steps": "2-3"}
        ),
    )
    Trainer(cfg).fit(watchers=[StepProfiler])  # a tool, handed to the loop
    trace_dir = tmp_path / "runs" / "t" / "trace"
    assert sorted(p.name for p in trace_dir.iterdir()) == [
        "rank0.memory.json",
        "rank0.pt.trace.json",
    ]
    trace = json.loads((trace_dir / "rank0.pt.trace.json").read_text())  # valid Chrome trace JSON
    assert trace["traceEvents"]
    phases = trace_phases(trace_dir)
    assert list(phases) == [0]
    per_step = phase_seconds(phases)[0]
    # Exactly the two profiled steps, each with its forward, backward and optimizer inside it.
    assert len(per_step["step"]) == 2
    for phase in ("forward", "backward", "optimizer"):
        assert len(per_step[phase]) == 2 and all(s > 0 for s in per_step[phase]), phase
        assert all(p < s for p, s in zip(per_step[phase], per_step["step"]))
    assert "collective" not in per_step  # one process talks to no one
    steps = [s for s in phases[0] if s.phase == "step"]
    assert steps[0].start_s == 0 and steps[0].end_s <= steps[1].start_s
    # The memory timeline: the trainer's file and the trace agree, and the steps allocated something.
    t_s, allocated = memory_timeline(trace_dir / "rank0.memory.json")
    assert (t_s, allocated) == memory_timeline(trace_dir, device="cpu")
    assert len(t_s) > 10 and t_s == sorted(t_s) and max(allocated) > 0
    # Activations are freed by the backward: the timeline comes back down from its peak.
    assert allocated[-1] < max(allocated)


def test_profiling_off_writes_nothing(data_dir, tmp_path, capsys):
    cfg = load_config(
        None, tiny_overrides(data_dir, tmp_path, **{"training.steps": 2, "eval.every": 0})
    )
    Trainer(cfg).fit(watchers=[StepProfiler])  # handed in, but [profile] steps is empty
    assert not (tmp_path / "runs" / "t" / "trace").exists()
    # Asked for in the config but not handed in: nothing is traced, and one line says why.
    cfg = load_config(
        None,
        tiny_overrides(
            data_dir, tmp_path / "b", **{"training.steps": 2, "eval.every": 0, "profile.steps": "2"}
        ),
    )
    Trainer(cfg).fit()
    assert not (tmp_path / "b" / "runs" / "t" / "trace").exists()
    notes = [ln for ln in capsys.readouterr().out.splitlines() if "profile.steps" in ln]
    assert notes == [
        "profile.steps is set, but profiling is a tool: hand it to the loop with "
        "fit(watchers=[StepProfiler]) (titanlite.tools.measure.profiling); `titanlite train` does"
    ]


def test_memory_off_writes_only_the_trace(data_dir, tmp_path):
    cfg = load_config(
        None,
        tiny_overrides(
            data_dir,
            tmp_path,
            **{
                "training.steps": 2,
                "eval.every": 0,
                "profile.steps": "2",
                "profile.memory": False,
                "profile.trace_dir": str(tmp_path / "elsewhere"),
            },
        ),
    )
    Trainer(cfg).fit(watchers=[StepProfiler])
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["rank0.pt.trace.json"]


def test_two_ranks_write_two_traces_with_their_collectives(data_dir, tmp_path):
    from titanlite.tools.jobs.launcher import launch

    cfg = load_config(
        None,
        tiny_overrides(
            data_dir, tmp_path, **{"training.steps": 3, "eval.every": 0, "profile.steps": "2-3"}
        ),
    )
    result = launch(cfg, nproc=2, overrides={"parallel.dp_shard": 2}, timeout_s=240)
    trace_dir = result.run_dir / "trace"
    assert sorted(p.name for p in trace_dir.glob("*.pt.trace.json")) == [
        "rank0.pt.trace.json",
        "rank1.pt.trace.json",
    ]
    phases = trace_phases(trace_dir)
    assert list(phases) == [0, 1]
    for rank, per_step in phase_seconds(phases).items():
        # FSDP all-gathers and reduce-scatters every step: both ranks spent time in collectives.
        assert len(per_step["step"]) == 2 and all(s > 0 for s in per_step["collective"]), rank
        assert all(s > 0 for s in per_step["backward"]), rank
    assert max(memory_timeline(trace_dir, rank=1)[1]) > 0


@pytest.mark.parametrize("steps", ["0-2", "3-2", "2-99", "five", "2-3-4"])
def test_the_config_refuses_bad_profile_ranges(steps):
    with pytest.raises(
        TitanliteError,
        match=r"profile.steps must (look like|be a step range like) 5-8 within training.steps.*e.g. --profile.steps",
    ):
        load_config(None, {"training.steps": 10, "profile.steps": steps})


def test_good_profile_ranges_load():
    assert (
        load_config(None, ["--training.steps", "10", "--profile.steps", "5-8"]).profile.steps
        == "5-8"
    )
    assert load_config(None, {"training.steps": 10, "profile.steps": "10"}).profile.steps == "10"


def test_the_memory_record_is_a_function_of_the_device():
    assert memory_record_kind("cuda") == "snapshot"  # a GPU's facts, on a CPU machine
    assert memory_record_kind("cuda", has_history_api=False) == "timeline"
    assert memory_record_kind("cpu") == "timeline"
    assert memory_record_kind("mps") == "timeline"
    here = memory_record_kind(
        torch.device("cpu").type, hasattr(torch.cuda.memory, "_record_memory_history")
    )
    assert here == "timeline"
