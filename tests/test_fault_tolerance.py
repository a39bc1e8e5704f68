"""Fault tolerance per step (torchft): replica groups equal DDP without faults, and a killed group
heals from a live peer bit for bit, no checkpoint read, while the other kept stepping.

Real processes, on the launcher's warm path (each group's ranks forked from the server, a dead one
forked again by the launcher as torchrun's agent would restart it): seconds, not a torchrun start
each. Notebook 22 runs the same drill under torchrun itself."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_overrides

from titanlite import TitanliteError
from titanlite.config import load_config
from titanlite.distributed.mesh import ParallelDims
from titanlite.preflight import preflight
from titanlite.tools.jobs.launcher import launch
from titanlite.tools.jobs.replica_groups import Lighthouse, launch_replica_groups

pytest.importorskip("torchft")  # the `ft` extra: make test installs it (it is skipped nowhere then)

STEPS = 6
LONG = 120  # the drill's steps: 12 s at least (0.1 s a step), several restarts long


def _cfg(data_dir, tmp_path, **extra):
    o = tiny_overrides(
        data_dir,
        tmp_path,
        **{"training.steps": STEPS, "eval.every": 0, "training.deterministic": True, **extra},
    )
    return load_config(None, o)


def _final_states(groups):
    """Each group's one committed checkpoint: (its folder's name, the whole state it holds)."""
    from titanlite._compat.torch_tools import load_whole_dcp_state
    from titanlite.resilience.checkpoint_files import RawReader, committed

    paths = [committed(g.run_dir / "checkpoints") for g in groups]
    assert [len(p) for p in paths] == [1] * len(groups)
    return [(p.name, load_whole_dcp_state(RawReader(p))) for (p,) in paths]


def test_each_replica_group_reads_its_own_slice_of_the_data():
    """Replica groups are one more data-parallel axis: group g's ranks read slices g·dp .. g·dp+dp-1
    of the g·dp data slices, the global batch of each group staying the group's own."""
    dims = ParallelDims(2, 2, 4, replica_groups=3, replica_group=2)
    assert dims.data_slices == 12 and dims.batch_ranks == 4
    assert [dims.dp_rank(r) for r in range(4)] == [8, 9, 10, 11]
    assert ParallelDims(1, 1, 1).data_slices == 1


def test_two_replica_groups_train_as_two_rank_ddp(data_dir, tmp_path):
    """Without faults, 2 groups of one process each give the losses and gradient norms of plain
    DDP over 2 ranks with the same per-rank batch (deterministic fp32): group g reads DDP rank g's
    slice, and the groups' gradients are averaged as DDP's are."""
    ddp = launch(
        _cfg(data_dir, tmp_path, **{"metrics.run_name": "ddp"}),
        nproc=2,
        overrides={"parallel.dp_replicate": 2, "parallel.dp_shard": 1},
        timeout_s=300,
    ).train
    with Lighthouse() as lighthouse:
        groups = launch_replica_groups(
            _cfg(data_dir, tmp_path, **{"metrics.run_name": "ft"}), 2, lighthouse=lighthouse
        )
    ft = [[r for r in g.records if r.get("kind") == "train"] for g in groups]
    assert [r["step"] for r in ddp] == [r["step"] for r in ft[0]] == list(range(1, STEPS + 1))
    for d, a, b in zip(ddp, *ft):
        # each group logs its own half of the batch: their mean is DDP's loss
        assert (a["loss"] + b["loss"]) / 2 == pytest.approx(d["loss"], abs=1e-5)
        assert a["grad_norm"] == b["grad_norm"] == pytest.approx(d["grad_norm"], abs=1e-5)
        assert a["quorum"] == b["quorum"] == 2 and a["committed"] and b["committed"]
        assert a["reduced_bytes"] == b["reduced_bytes"] > 0  # every gradient, every step


def test_diloco_meets_every_h_steps_and_leaves_the_groups_equal(data_dir, tmp_path):
    """DiLoCo with H = 3 over 6 steps: the groups step alone in between (each on its own data, so
    their losses differ), all-reduce only at steps 3 and 6 - one pseudo-gradient, every parameter's
    bytes, each time (1/H of every-step's) - and after the last outer step hold the same weights."""
    H = 3
    cfg = _cfg(
        data_dir,
        tmp_path,
        **{
            "metrics.run_name": "diloco",
            "checkpoint.enable": True,
            "fault_tolerance.semi_sync_method": "diloco",
            "fault_tolerance.sync_steps": H,
        },
    )
    with Lighthouse() as lighthouse:
        groups = launch_replica_groups(cfg, 2, lighthouse=lighthouse, timeout_s=300)
    (_, a), (_, b) = _final_states(groups)
    # every parameter's bytes: as many as AdamW's first moments (the rotary tables are buffers)
    weights = sum(
        v.numel() * v.element_size() for k, v in a["optimizer"].items() if k.endswith(".exp_avg")
    )
    for g in groups:
        sent = [r["reduced_bytes"] for r in g.records if r.get("kind") == "train"]
        assert sent == [0, 0, weights] * (STEPS // H), sent
        # both groups in every quorum: the first waits for all, the lighthouse then for both
        assert {r["quorum"] for r in g.records if r.get("kind") == "train"} == {2}
    ra, rb = ([r["loss"] for r in g.records if r.get("kind") == "train"] for g in groups)
    assert all(x != y for x, y in zip(ra, rb))  # two data slices, two runs between meetings
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_a_killed_group_heals_from_a_live_peer_bit_for_bit(data_dir, tmp_path):
    """Group 1's worker is SIGKILLed as step 4 begins, after that step's quorum: group 0's step 4
    is not committed, it steps on alone (quorum 1), the launcher restarts group 1 (as torchrun's
    agent would), which joins the quorum and copies group 0's state: no checkpoint is read, its
    first step is the peer's next, and at the end both groups' whole training state (weights,
    AdamW moments, schedule, data position) is bit for bit the same."""
    cfg = _cfg(
        data_dir,
        tmp_path,
        **{"training.steps": LONG, "metrics.run_name": "drill", "checkpoint.enable": True},
    )
    # Group 0 sleeps 0.1 s a step (a "slow" fault) so that the drill outlasts group 1's restart.
    slow = {"fault.kind": "slow", "fault.slow_s": 0.1, "fault.step": 1}
    with Lighthouse(heartbeat_timeout_ms=1000) as lighthouse:
        survivor, healed = launch_replica_groups(
            cfg,
            2,
            lighthouse=lighthouse,
            per_group={0: slow, 1: {"fault.kind": "kill", "fault.step": 4}},
            max_restarts=1,
            restart_delay_s=2.0,  # a replacement's boot: the survivor steps alone meanwhile
            timeout_s=300,
        )
    kept = [r for r in survivor.records if r.get("kind") == "train"]
    assert [r["step"] for r in kept] == list(range(1, LONG + 1))
    assert kept[3]["committed"] is False and kept[3]["grad_norm"] == 0.0  # the dead group's step
    alone = [r["step"] for r in kept if r["quorum"] == 1]
    assert len(alone) >= 3 and all(r["committed"] for r in kept[4:])
    back = [r for r in healed.records if r.get("kind") == "train" and r.get("attempt") == 1]
    assert back[0]["healed_from_step"] == back[0]["step"] - 1 >= max(alone)  # the peer's step
    assert [r["step"] for r in back] == list(range(back[0]["step"], LONG + 1))
    # No checkpoint was read: no restore in its goodput timeline, none committed before the end.
    events = [json.loads(x) for x in (healed.run_dir / "goodput.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "restore"]
    (name_a, a), (name_b, b) = _final_states([survivor, healed])
    assert name_a == name_b == f"step-{LONG:08d}"
    assert a.keys() == b.keys() and a["model"].keys() == b["model"].keys()
    for part in ("model", "optimizer"):
        for key, value in a[part].items():
            other = b[part][key]
            same = torch.equal(value, other) if torch.is_tensor(value) else value == other
            assert same, f"{part} {key} differs"
    assert a["data"] == b["data"] and a["scheduler"] == b["scheduler"] and a["step"] == b["step"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"fault_tolerance.group_size": 2, "fault_tolerance.replica_id": 2}, "replica_id=2"),
        (
            {"fault_tolerance.min_replica_size": 3, "fault_tolerance.group_size": 2},
            "min_replica_size",
        ),
        ({"model.n_experts": 4}, "aux_free"),
    ],
    ids=["replica-id-outside", "min-replicas-beyond", "moe-aux-free"],
)
def test_preflight_refuses_what_cannot_be_replicated(data_dir, tmp_path, overrides, message):
    cfg = _cfg(data_dir, tmp_path, **{"fault_tolerance.enable": True, **overrides})
    with pytest.raises(TitanliteError, match=message):
        preflight(cfg, 1, cfg.data.vocab_size)
