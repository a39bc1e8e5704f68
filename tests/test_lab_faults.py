"""Notebook 13's helpers (no processes launched): losses of restarted jobs, costs read from a
goodput log, and the replay model fed with them."""

import json

import pytest

from titanlite.errors import TitanliteError
from titanlite.labs import nb13_fault_tolerance as lab
from titanlite.tools.measure import goodput


def test_final_losses_keep_the_last_attempt_of_each_step_in_step_order():
    records = [{"kind": "train", "step": s, "loss": float(s)} for s in (1, 2, 3, 4)]
    records += [{"kind": "checkpoint", "step": 2}, {"kind": "val", "step": 4, "val_loss": 9.0}]
    records += [{"kind": "train", "step": s, "loss": s + 0.5, "attempt": 1} for s in (3, 4, 5)]
    records += [{"kind": "train", "step": s, "loss": -1.0, "rank": 1} for s in (1, 2, 3, 4, 5)]
    assert lab.final_losses(records) == [1.0, 2.0, 3.5, 4.5, 5.5]
    assert lab.final_losses(records, rank=1) == [-1.0] * 5
    assert [r["step"] for r in lab.final_records(list(reversed(records)))] == [1, 2, 3, 4, 5]


def write_run(
    run_dir,
    *,
    steps=8,
    every=2,
    step_s=1.0,
    ckpt_s=0.5,
    startup_s=3.0,
    restart_s=4.0,
    tail_s=0.25,
    failures=(),
    requeued=False,
):
    """A goodput.jsonl as the trainer writes it, with exact costs. failures[a] = (step, phase):
    attempt a dies as `step` begins ("step") or while saving after it ("save"). requeued: every
    attempt is a new torchrun, so all log "attempt": 0."""
    events, a, committed, process_start = [], 0, 0, 100.0
    t = process_start + startup_s
    while True:
        events.append(
            {"t": process_start + 1, "attempt": a, "event": "start", "process_start": process_start}
        )
        if committed:
            events.append(
                {
                    "t": process_start + 2,
                    "attempt": a,
                    "event": "restore",
                    "step": committed,
                    "seconds": 0.3,
                }
            )
        step, dead = committed, False
        while step < steps and not dead:
            step += 1
            if a < len(failures) and failures[a] == (step, "step"):
                dead = True
                break
            t += step_s
            events.append({"t": t, "attempt": a, "event": "step", "step": step, "seconds": step_s})
            # with checkpointing on, the trainer logs its (here ~0 s) wait for async staging
            events.append(
                {"t": t, "attempt": a, "event": "checkpoint", "step": step, "seconds": 0.0}
            )
            if step % every == 0 and step < steps:
                if a < len(failures) and failures[a] == (step, "save"):
                    dead = True
                    break
                t += ckpt_s
                events.append(
                    {"t": t, "attempt": a, "event": "checkpoint", "step": step, "seconds": ckpt_s}
                )
                committed = step
        if not dead:
            break
        a, process_start, t = a + 1, t + 1.0, t + restart_s
    if requeued:
        events = [{**e, "attempt": 0} for e in events]
    t += tail_s
    events += [
        {"t": t, "attempt": a, "event": "checkpoint", "step": steps, "seconds": tail_s},
        {"t": t, "attempt": a, "event": "end"},
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "goodput.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "run.json").write_text(
        json.dumps({"config": {"training": {"steps": steps}, "checkpoint": {"every": every}}})
    )
    return run_dir


@pytest.mark.parametrize(
    "failures, restored, lost, at",
    [
        ((), [], 0, []),
        (((6, "step"),), [4], 1, [5.0]),  # steps 1-5 done, resumes at 4: step 5 redone
        (((5, "step"),), [4], 0, [4 + lab._AFTER_SAVE]),  # died right after committing 4
        (
            ((4, "save"), (6, "save")),
            [2, 4],
            4,
            [4.0, 6.0],
        ),  # each save-kill falls back one checkpoint
    ],
)
def test_costs_are_read_back_and_the_model_reproduces_the_wall_time(
    tmp_path, failures, restored, lost, at
):
    run = write_run(tmp_path / "run", failures=failures)
    c = lab.measure_costs(run)
    assert (c.steps, c.every, c.restored_from, c.lost_steps, c.failures_at_step) == (
        8,
        2,
        restored,
        lost,
        at,
    )
    assert (
        c.step_s == 1.0 and c.ckpt_cost_s == pytest.approx(0.5) and c.tail_s == pytest.approx(0.25)
    )
    assert c.startup_s == pytest.approx(3.0) and c.restarts_s == pytest.approx(
        [4.0] * len(failures)
    )
    cmp = lab.measured_vs_model(run)
    measured = goodput.summarize(run)
    # constant costs: the replay model accounts for every second and every lost step
    # (to the hair _AFTER_SAVE: a failure right after a save is placed 1e-6 steps past it)
    assert cmp["model"]["wall_s"] == pytest.approx(measured["wall_s"], rel=1e-6)
    assert cmp["model"]["goodput"] == pytest.approx(measured["goodput"], rel=1e-6)
    assert round(cmp["model"]["lost_steps"]) == cmp["measured"]["lost_steps"] == lost
    saves = [json.loads(line) for line in (run / "goodput.jsonl").read_text().splitlines()]
    saves = [e for e in saves if e["event"] == "checkpoint" and e["seconds"] and e["step"] < 8]
    assert cmp["model"]["checkpoints"] == len(saves)
    b = lab.model_breakdown(cmp)
    assert sum(
        b[k] for k in ("productive_s", "lost_s", "checkpoint_s", "restore_s", "other_s")
    ) == pytest.approx(b["wall_s"])


def test_costs_from_another_run_change_only_the_costs(tmp_path):
    shape = {"failures": ((4, "save"), (6, "save"))}
    slow = write_run(tmp_path / "slow", restart_s=6.0, startup_s=5.0, **shape)
    fast = write_run(tmp_path / "fast", failures=((3, "step"),))  # restart 4 s, start-up 3 s
    cross = lab.measured_vs_model(slow, costs_from=fast)
    assert cross["costs_used"].failures_at_step == [4.0, 6.0]  # this run's shape
    assert cross["costs_used"].restarts_s == [4.0, 4.0]  # the other run's costs
    assert cross["model"]["wall_s"] == pytest.approx(cross["measured"]["wall_s"] - 2 * 2.0 - 2.0)
    with pytest.raises(TitanliteError, match="no restart"):
        lab.measured_vs_model(slow, costs_from=write_run(tmp_path / "clean"))


def test_a_job_requeued_by_hand_is_cut_at_each_start(tmp_path):
    shape = {"failures": ((4, "save"), (7, "step"))}
    torchrun, requeued = (
        write_run(tmp_path / n, requeued=r, **shape) for n, r in (("a", False), ("b", True))
    )
    assert lab.measure_costs(requeued) == lab.measure_costs(torchrun)
    assert lab.measure_costs(requeued).restored_from == [2, 6]


def test_an_attempt_that_dies_before_its_first_step_is_all_restart(tmp_path):
    run = write_run(tmp_path / "run", failures=((3, "step"), (3, "step")))  # attempt 1 dies at once
    c = lab.measure_costs(run)
    assert c.failures_at_step == [2 + lab._AFTER_SAVE, 2.0] and c.restored_from == [2, 2]
    # attempt 1's short life (start, restore) counts as restart time, up to attempt 2's first step
    assert c.restarts_s == pytest.approx([3.0, 5.0]) and c.lost_steps == 0
    assert lab.predict(c)["wall_s"] == pytest.approx(goodput.summarize(run)["wall_s"], rel=1e-6)


def test_missing_log_or_no_steps_is_one_clear_line(tmp_path):
    with pytest.raises(TitanliteError, match="does not exist") as e:
        lab.measure_costs(tmp_path)
    assert "\n" not in str(e.value)
    run = write_run(tmp_path / "run")
    lines = [ln for ln in (run / "goodput.jsonl").read_text().splitlines() if '"step"' not in ln]
    (run / "goodput.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(TitanliteError, match="no training step"):
        lab.measure_costs(run)


def test_launch_expecting_failure_returns_the_error_and_captures_the_traceback(monkeypatch):
    import sys

    from titanlite.tools.jobs import launcher

    def failing(*args, **kwargs):
        print(
            "--- rank 1 failed; its traceback: ---\nTraceback (most recent call last): ...",
            file=sys.stderr,
        )
        raise TitanliteError("rank 1 failed: InjectedFailure: boom")

    monkeypatch.setattr(launcher, "launch", failing)
    got = lab.launch_expecting_failure(None, 2, overrides={"fault.kind": "exception"})
    assert got.message == "rank 1 failed: InjectedFailure: boom"
    assert "Traceback" in got.traceback and got.wall_s >= 0
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: None)
    with pytest.raises(TitanliteError, match="meant to fail"):
        lab.launch_expecting_failure(None, 2, overrides={"fault.kind": "none"})


def test_plots_return_labelled_figures(tmp_path):
    run = write_run(tmp_path / "run", failures=((4, "save"),))
    fig = lab.plot_timeline(run)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert labels == ["attempt 0", "failure", "attempt 1 (resumed at step 2)"]
    fig = lab.plot_goodput_breakdown(
        {
            "measured": goodput.summarize(run),
            "model": lab.model_breakdown(lab.measured_vs_model(run)),
        }
    )
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["measured", "model"]
