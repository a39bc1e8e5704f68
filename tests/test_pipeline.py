"""Pipeline parallelism: PP=2 and PP=4 train exactly like one process under every schedule,
torch runs the orders we derive from scratch, 1F1B holds at most p micro-batches, bad input
is refused in one line, and the timeline arithmetic is exact on a hand-made timeline."""

from __future__ import annotations

import pytest
import torch

from titanlite import TitanliteError
from titanlite.distributed import pipeline as pp_mod
from titanlite.distributed.pipeline import available_schedules, check_pipeline, split_layers
from titanlite.labs.nb10_pipeline_parallel import lab_args, lab_batches, train_single
from titanlite.models.llama import ModelArgs, build_model
from titanlite.tools.display.pipeline_timeline import (
    Event,
    afab_order,
    bubble,
    bubble_budget,
    causality_margin,
    formula_bubble,
    one_f_one_b_order,
    order,
    peak_live_bytes,
    peak_live_microbatches,
    simulate,
)
from titanlite.tools.jobs.launcher import launch_function

LAB = "titanlite.labs.nb10_pipeline_parallel:schedule_lab"
# fp32 losses of ~5 carry ~5e-7 of rounding (1 ulp); PP sums the same per-micro-batch
# gradients in another grouping than one whole-batch backward, so a few ulps of difference
# may grow through 3 AdamW steps. 1e-5 leaves 20× room for that and is 1000× below what a
# wrong normalisation (a loss or gradient off by the m = 4 micro-batches) would show.
TOL = 1e-5
# Gradient norms, relative: Adam's first step divides each gradient entry by its own size, so
# entries near eps (1e-8) turn last-bit differences into visibly different updates, and the
# next step's gradients differ by a few 1e-5 (measured up to 3.7e-5 with PP=4). A wrong scaling
# (÷m) or a norm not summed over the stages would be off by 4× or more.
NORM_RTOL = 2e-4


def _reference(kw: dict, n_layers: int) -> dict:
    torch.set_num_threads(1)  # like the ranks (OMP_NUM_THREADS=1): the same summation order
    args = lab_args(n_layers, kw["dim"], kw["vocab_size"], kw["seq_len"])
    batches = lab_batches(kw["vocab_size"], kw["steps"], kw["batch_size"], kw["seq_len"])
    return train_single(args, batches, lr=1e-2, grad_clip=kw["grad_clip"])


def _check_parity(results: dict, ref: dict) -> None:
    for name, r in results.items():
        loss_diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        norm_diff = max(abs(a - b) / b for a, b in zip(r["grad_norms"], ref["grad_norms"]))
        assert loss_diff < TOL and norm_diff < NORM_RTOL, (
            name,
            r["losses"],
            ref["losses"],
            r["grad_norms"],
            ref["grad_norms"],
        )
        assert min(r["grad_norms"]) > KW2["grad_clip"], (
            "clipping must act for the norm to be tested"
        )
        # After training: the forward-only pass and the gathered weights are the single process's.
        if r["schedule"] != "zbv":  # torch's V schedule cannot run forward-only (pipeline_eval)
            assert abs(r["eval_loss"] - ref["eval_loss"]) < TOL, name
        assert r["state_dict"].keys() == ref["state_dict"].keys()
        # Whole tensors, relative: AdamW divides each gradient entry by its own running size, so
        # last-bit differences of small entries become visible in the weights: measured up to
        # 1.7e-4 after 2 steps with PP=4. A missing or misplaced stage would be off by O(1).
        worst = max(
            ((r["state_dict"][k] - v).norm() / v.norm()).item()
            for k, v in ref["state_dict"].items()
        )
        assert worst < 1e-3, (name, worst)


KW2 = dict(
    dim=64, vocab_size=128, seq_len=32, batch_size=8, n_microbatches=4, steps=3, grad_clip=0.5
)


@pytest.fixture(scope="module")
def pp2():
    schedules = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"]
    out = launch_function(LAB, nproc=2, timeout_s=180, schedules=schedules, n_layers=4, **KW2)
    return out[0]


def test_pp2_trains_like_one_process(pp2):
    assert {"gpipe", "1f1b", "interleaved_1f1b"} <= set(pp2)
    assert set(pp2) == {
        s
        for s in ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"]
        if s in available_schedules()
    }
    _check_parity(pp2, _reference(KW2, n_layers=4))


def test_pp2_runs_the_orders_derived_from_scratch(pp2):
    for name, scratch in (("gpipe", afab_order), ("1f1b", one_f_one_b_order)):
        for step in pp2[name]["events"]:
            for rank in (0, 1):
                ran = [(kind, mb) for kind, _, mb in order(step, rank)]
                assert ran == scratch(rank, 2, 4), (name, rank, ran)
    # The recorded orders, replayed with equal stage times, give exactly the textbook bubble.
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        ev = pp2[name]["events"][-1]
        ideal = simulate({r: order(ev, r) for r in (0, 1)}, lambda r, k, s, i: {"F": 1, "B": 2}[k])
        assert bubble(ideal) == {0: formula_bubble(name, 2, 4, v), 1: formula_bubble(name, 2, 4, v)}


def test_pp2_activation_memory_gpipe_vs_1f1b(pp2):
    p, m = 2, 4
    for rank in range(p):
        gpipe, ofob = (pp2[n]["events"][-1] for n in ("gpipe", "1f1b"))
        assert peak_live_microbatches(gpipe, rank) == m
        assert peak_live_microbatches(ofob, rank) == p - rank  # the warm-up depth
        # One micro-batch's saved tensors, measured: what grew between the starts of the 2nd
        # and 3rd forwards (by then the previous forward, and on the last stage its loss, are
        # done). `shared`: saved once for all (the token ids are views of the whole batch).
        f1, f2 = [e.live_before for e in gpipe if e.rank == rank and e.kind == "F"][1:3]
        one, shared = f2 - f1, 2 * f1 - f2
        assert one > 0 and 0 <= shared < 0.02 * one
        # GPipe holds all m micro-batches' at once, 1F1B at most p: to the byte.
        assert peak_live_bytes(gpipe, rank) == shared + m * one
        assert peak_live_bytes(ofob, rank) == shared + (p - rank) * one


@pytest.mark.filterwarnings("ignore:4 processes on")  # 4 ranks share 2 cores: slow, still exact
def test_pp4_trains_like_one_process():
    kw = dict(KW2, n_microbatches=4, steps=2)
    out = launch_function(
        LAB,
        nproc=4,
        timeout_s=240,
        schedules=["gpipe", "1f1b", "interleaved_1f1b"],
        n_layers=8,
        **kw,
    )
    assert [len(ls) for ls in out[0]["interleaved_1f1b"]["layers"]] == [1] * 8  # 4 ranks × 2 stages
    _check_parity(out[0], _reference(kw, n_layers=8))


# ----- bad input: one clear line each ----------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pp=2, schedule="1f1bb", n_microbatches=4), "did you mean: 1f1b"),
        (dict(pp=4, schedule="1f1b", n_layers=2), "4 pipeline stages, but the model has 2 layers"),
        (dict(pp=2, schedule="interleaved_1f1b", n_layers=3), "at most 3 stages"),
        (dict(pp=4, schedule="1f1b", n_microbatches=2), "n_microbatches=2 < pp=4"),
        (dict(pp=2, schedule="interleaved_1f1b", n_microbatches=5), "multiple of 2"),
        (dict(pp=2, schedule="gpipe", n_microbatches=3, batch_size=8), "does not split into 3"),
        (dict(pp=2, schedule="1f1b", tie_embeddings=True), "model.tie_embeddings=false"),
        (dict(pp=2, schedule="gpipe", stages_per_rank=2), "one stage per rank"),
        (dict(pp=2, schedule="gpipe", n_microbatches=0), "at least 1"),
    ],
)
def test_bad_pipelines_are_refused(kwargs, message):
    with pytest.raises(TitanliteError, match=message) as e:
        check_pipeline(**kwargs)
    assert "\n" not in str(e.value)


def test_gpipe_accepts_fewer_microbatches_than_stages():
    assert check_pipeline(pp=4, schedule="gpipe", n_layers=4, n_microbatches=2, batch_size=8) == 1
    assert check_pipeline(pp=2, schedule="interleaved_1f1b", n_microbatches=6) == 2


def test_pipeline_split_refuses_tied_embeddings(monkeypatch):
    # pipeline_split asks the group for its size and rank first: pretend to be rank 0 of 2.
    monkeypatch.setattr(pp_mod.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(pp_mod.dist, "get_rank", lambda group=None: 0)
    tied = build_model(ModelArgs.preset("debug", vocab_size=64, n_layers=2))
    with pytest.raises(TitanliteError, match="tie_embeddings"):
        pp_mod.pipeline_split(tied, None)
    with pytest.raises(TitanliteError, match="unknown pipeline schedule"):
        pp_mod.build_schedule("looped", [type("S", (), {"group_size": 2})()], 4, None)


def test_split_layers_balances_work():
    assert [list(r) for r in split_layers(8, 4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # The embedding and the output layer each weigh one layer: the ends get one layer fewer.
    assert [len(r) for r in split_layers(10, 4, 1, 1)] == [2, 3, 3, 2]
    assert [len(r) for r in split_layers(5, 2)] in ([2, 3], [3, 2])
    with pytest.raises(TitanliteError, match="would run no layer"):
        split_layers(4, 4, first_stage_weight=2)


# ----- the timeline arithmetic, on a timeline made by hand ----------------------------------------


def _timeline(schedule, p: int, m: int, f: float = 1.0, b: float = 2.0) -> list[Event]:
    """Equal stages, free communication: what the textbook draws."""
    orders = {r: [(k, r, i) for k, i in schedule(r, p, m)] for r in range(p)}
    return simulate(orders, lambda r, k, s, i: f if k == "F" else b)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (3, 3)])
def test_synthetic_timelines_give_the_formula_exactly(p, m):
    for schedule in (afab_order, one_f_one_b_order):
        ev = _timeline(schedule, p, m)
        assert bubble(ev) == {r: (p - 1) / m for r in range(p)}
        # makespan (m + p − 1)(f + b): the textbook picture
        assert max(e.end for e in ev) == (m + p - 1) * 3.0
    for r in range(p):
        assert peak_live_microbatches(_timeline(afab_order, p, m), r) == m
        assert peak_live_microbatches(_timeline(one_f_one_b_order, p, m), r) == min(p - r, m)


def test_bubble_budget_on_a_known_timeline():
    # Three identical steps; the last stage's ops take 50% longer (it also runs the output layer).
    p, m = 2, 4
    orders = {r: [(k, r, i) for k, i in one_f_one_b_order(r, p, m)] for r in range(p)}
    slow = lambda r, k, s, i: (1.0 if k == "F" else 2.0) * (1.5 if s == 1 else 1.0)  # noqa: E731
    steps = [simulate(orders, slow) for _ in range(3)]
    out = bubble_budget(steps, formula_bubble("1f1b", p, m))
    assert out["sigma"] == 0 and out["overhead"] == 0 and causality_margin(steps[0]) >= 0
    assert out["measured"] == out["wall"] == pytest.approx(out["expected"], abs=1e-12)
    assert out["measured"] > out["formula"] == 0.25  # the slow last stage widens the bubble
    assert out["agrees"]
    # A 0.5-unit message delay on every hop: on the clock, not in the schedule's own bubble.
    late = [simulate(orders, slow, latency=0.5) for _ in range(2)]
    out = bubble_budget(late, 0.25)
    assert causality_margin(late[0]) == 0.5
    assert out["measured"] == bubble_budget(steps, 0.25)["measured"] and out["overhead"] > 0
    # Equal stages, no delay: exactly the formula, every way of looking at it.
    equal = [_timeline(one_f_one_b_order, p, m)]
    assert bubble_budget(equal, 0.25)["measured"] == bubble_budget(equal, 0.25)["wall"] == 0.25


@pytest.mark.parametrize(
    "policy, pp, expected",
    [
        ("default", 1, [True, True, True, False]),  # the last block's backward follows at once
        ("default", 2, [False] * 4),  # a stage runs forward per micro-batch: keep
        ("always", 2, [True] * 4),
        ("never", 1, [False] * 4),
    ],
)
def test_fsdp_keeps_gathered_weights_under_pipeline_parallelism(policy, pp, expected):
    from titanlite.distributed.fsdp import reshard_flags

    assert reshard_flags(policy, 4, pp=pp) == expected


def test_an_unknown_reshard_policy_is_one_line():
    from titanlite.distributed.fsdp import reshard_flags

    with pytest.raises(TitanliteError, match="'sometimes' is not one of default, always, never"):
        reshard_flags("sometimes", 4)
