"""Checkpoints and recovery: bit-exact resume, atomic commits, damaged checkpoints refused,
resharding on load, export, goodput accounting, straggler detection."""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest
import torch
from conftest import run_torchrun, tiny_overrides

from titanlite import TitanliteError
from titanlite.config import load_config
from titanlite.resilience.checkpoint import Checkpointer
from titanlite.resilience.checkpoint_files import committed, verify
from titanlite.resilience.faults import InjectedFailure
from titanlite.tools.formats.export import export_hf, export_torch, load_model
from titanlite.tools.jobs.launcher import launch
from titanlite.tools.measure.goodput import Goodput, summarize
from titanlite.tools.measure.stragglers import StragglerDetector, detect_stragglers
from titanlite.train import Trainer

STEPS = 8
BASE = {"training.steps": STEPS, "eval.every": 0, "training.deterministic": True}


def _overrides(data_dir, tmp_path, name, **extra):
    o = tiny_overrides(data_dir, tmp_path, **{**BASE, **extra})
    o["metrics.run_name"] = name
    return o


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> list[float]:
    """One uninterrupted single-process run: the losses every resumed run must reproduce."""
    tmp = tmp_path_factory.mktemp("ref")
    return Trainer(load_config(None, _overrides(data_dir, tmp, "ref"))).fit().losses


# ----- resume, in one process --------------------------------------------------------------
@pytest.mark.parametrize("fail_at, every", [(2, 1), (6, 3), (8, 3)])
def test_resume_after_a_failure_is_bit_identical(
    data_dir, tmp_path, monkeypatch, reference, fail_at, every
):
    o = _overrides(
        data_dir,
        tmp_path,
        "ft",
        **{
            "checkpoint.enable": True,
            "checkpoint.every": every,
            "fault.kind": "exception",
            "fault.step": fail_at,
        },
    )
    with pytest.raises(InjectedFailure):
        Trainer(load_config(None, o)).fit(watchers=[Goodput])  # goodput: a tool, handed in
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # what torchrun sets on a restart
    history = Trainer(load_config(None, o)).fit(watchers=[Goodput])
    saved = (fail_at - 1) // every * every  # the newest checkpoint before the failure
    assert [r["step"] for r in history.train] == list(range(saved + 1, STEPS + 1))
    assert history.losses == reference[saved:]  # ==, not approximately
    assert all(r["attempt"] == 1 for r in history.train)
    g = summarize(history.run_dir)
    assert g["failures"] == 1 and g["steps"] == STEPS and g["finished"]
    # Steps done after the last checkpoint and before the failure were computed twice.
    assert (g["lost_s"] > 0) == (fail_at - 1 > saved)
    assert 0 < g["goodput"] < 1


def test_keep_latest_k_and_a_leftover_partial_save_is_ignored(data_dir, tmp_path):
    o = _overrides(
        data_dir,
        tmp_path,
        "k",
        **{"checkpoint.enable": True, "checkpoint.every": 2, "checkpoint.keep_latest_k": 2},
    )
    history = Trainer(load_config(None, o)).fit()
    folder = history.run_dir / "checkpoints"
    assert [p.name for p in committed(folder)] == ["step-00000006", "step-00000008"]
    assert len(history.checkpoints) == 4 and all(c["blocked_s"] > 0 for c in history.checkpoints)
    # A save that died half-way: data files but no commit record. Never picked up.
    partial = folder / "step-00000010.partial"
    shutil.copytree(folder / "step-00000008", partial)
    (partial / "titanlite.json").unlink()
    assert Checkpointer(folder).latest().name == "step-00000008"
    with pytest.raises(TitanliteError, match="not a committed checkpoint .* never finished"):
        verify(partial)


# ----- damaged or mismatched checkpoints: one clear line, nothing overwritten -----------------
@pytest.fixture
def saved(data_dir, tmp_path):
    o = _overrides(data_dir, tmp_path, "s", **{"training.steps": 2, "checkpoint.enable": True})
    history = Trainer(load_config(None, o)).fit()
    return o, committed(history.run_dir / "checkpoints")[-1]


def _load_into_fresh(o, path):
    trainer = Trainer(load_config(None, {**o, "checkpoint.enable": False}))
    return Checkpointer(path.parent).load(trainer.train_state(), path)


def test_damaged_checkpoints_are_refused(saved):
    o, path = saved
    shard = path / "__0_0.distcp"
    data = shard.read_bytes()
    with pytest.raises(TitanliteError, match="does not exist"):
        _load_into_fresh(o, path.with_name("step-99999999"))
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        TitanliteError, match=r"__0_0.distcp has \d+ bytes, \d+ were written \(truncated"
    ):
        _load_into_fresh(o, path)
    shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    with pytest.raises(TitanliteError, match="__0_0.distcp is corrupt"):
        _load_into_fresh(o, path)
    shard.unlink()
    with pytest.raises(TitanliteError, match="is missing __0_0.distcp"):
        _load_into_fresh(o, path)


def test_a_checkpoint_of_another_model_is_refused_and_left_alone(saved):
    o, path = saved
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    with pytest.raises(TitanliteError, match=r"different model \(.*n_layers: 2 there vs 3 here"):
        _load_into_fresh({**o, "model.n_layers": 3}, path)
    with pytest.raises(TitanliteError, match="different model"):  # also through the trainer
        Trainer(
            load_config(
                None,
                {
                    **o,
                    "model.n_layers": 3,
                    "checkpoint.load": str(path),
                    "checkpoint.enable": False,
                    "metrics.run_name": "bigger",
                },
            )
        ).fit()
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before


def test_an_injection_beyond_the_run_is_refused(data_dir, tmp_path):
    o = _overrides(
        data_dir,
        tmp_path,
        "f",
        **{"fault.kind": "kill", "fault.step": 3, "fault.attempts": 3, "fault.step_gap": 4},
    )
    with pytest.raises(
        TitanliteError, match=r"last injected failure \(step 3 \+ 2 x 4 = 11\) is outside"
    ):
        Trainer(load_config(None, o))


def test_export_to_one_file_and_to_hugging_face(saved, tmp_path):
    from transformers import LlamaForCausalLM

    o, path = saved
    model = load_model(path)
    weights = torch.load(export_torch(path, tmp_path / "model.pt"), weights_only=True)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    full = torch.load(export_torch(path, tmp_path / "state.pt", full=True), weights_only=False)
    assert full["step"] == 2 and set(full) == {
        "model",
        "optimizer",
        "scheduler",
        "data",
        "rng",
        "step",
    }
    hf = LlamaForCausalLM.from_pretrained(export_hf(path, tmp_path / "hf"))
    x = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        assert torch.equal(hf(x).logits, model(x))


# ----- several processes: torchrun restarts, resharding ---------------------------------------
FSDP = {"parallel.dp_shard": 2}
# Two pipeline stages per rank: this rank's model is several parts, whose names are merged.
INTERLEAVED_PP = {
    "parallel.dp_shard": 1,
    "parallel.pp": 2,
    "model.tie_embeddings": False,
    "model.n_layers": 4,
    "parallel.pp_schedule": "interleaved_1f1b",
    "parallel.pp_stages_per_rank": 2,
    "parallel.pp_microbatches": 2,
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, mode, during, fail_at",
    [(FSDP, "sync", "step", 5), (FSDP, "async", "save", 6), (INTERLEAVED_PP, "sync", "step", 4)],
    ids=["fsdp-kill-between-steps", "fsdp-kill-during-async-save", "interleaved-pp"],
)
def test_torchrun_restart_resumes_bit_identically(
    data_dir, tmp_path, layout, mode, during, fail_at
):
    """2 processes, a rank SIGKILLed (between steps, or while a checkpoint is being
    written), torchrun --max-restarts 1 restarts the job, which resumes from the newest
    committed checkpoint and reproduces the uninterrupted run's losses bit for bit."""
    ref = launch(load_config(None, _overrides(data_dir, tmp_path, "ref", **layout)), nproc=2)
    o = _overrides(
        data_dir,
        tmp_path,
        "ft",
        **layout,
        **{
            "checkpoint.enable": True,
            "checkpoint.every": 3,
            "checkpoint.mode": mode,
            "fault.kind": "kill",
            "fault.rank": 1,
            "fault.step": fail_at,
            "fault.during": during,
        },
    )
    result = launch(load_config(None, o), nproc=2, max_restarts=1)
    attempts = {r.get("attempt", 0) for r in result.train}
    assert attempts == {0, 1}
    assert result.attempts == 2 and result.losses == ref.losses  # the kept loss of each step
    g = summarize(result.run_dir)
    assert g["failures"] == 1 and g["finished"] and g["steps"] == STEPS
    # The kill during the save of step 6 left it uncommitted: every restart began after step 3.
    resumed = min(r["step"] for r in result.train if r.get("attempt") == 1)
    assert resumed == 4


RESHARD_WORKER = textwrap.dedent("""
    import json, sys
    import torch
    from titanlite.config import load_config
    from titanlite.resilience.checkpoint import Checkpointer
    from titanlite.resilience.train_state import TrainState
    from titanlite.train import Trainer
    from titanlite.weights import full_state_dict
    from titanlite.distributed.env import exit_worker
    overrides, path, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    trainer = Trainer(load_config(None, overrides))
    step = Checkpointer(path).load(trainer.train_state(), path + "/step-00000003")
    state = full_state_dict(trainer.model)
    exp_avg = {n: trainer.optimizer.state[p]["exp_avg"].full_tensor()  # a collective: all ranks
               for n, p in trainer.model.named_parameters()}
    if trainer.dist.is_main:
        torch.save({"step": step, "model": state, "lr": trainer.scheduler.get_last_lr(),
                    "exp_avg": exp_avg,
                    "data": trainer.data.train.sampler.state_dict()}, out)
    trainer.close(barrier=True)
    exit_worker(0)
""")


@pytest.mark.slow
def test_save_on_two_fsdp_ranks_load_on_one_and_on_tensor_parallel(data_dir, tmp_path):
    o = _overrides(
        data_dir,
        tmp_path,
        "fsdp",
        **{"training.steps": 3, "parallel.dp_shard": 2, "checkpoint.enable": True},
    )
    result = launch(load_config(None, o), nproc=2)
    folder = result.run_dir / "checkpoints"
    path = committed(folder)[-1]
    # Each rank writes its own file; .metadata says what lies where.
    assert sorted(f.name for f in path.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "titanlite.json",
    ]
    whole = load_model(path).state_dict()
    full = torch.load(export_torch(path, tmp_path / "state.pt", full=True), weights_only=False)

    # 1 process: the FSDP shards become whole tensors, optimizer moments included.
    # The global batch stays 8 (the data position must mean the same samples): 1 rank x 8.
    trainer = Trainer(
        load_config(
            None,
            {**o, "parallel.dp_shard": -1, "training.batch_size": 8, "checkpoint.enable": False},
        )
    )
    assert Checkpointer(folder).load(trainer.train_state(), path) == 3
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in whole.items())
    for p_name, p in trainer.model.named_parameters():
        moments = trainer.optimizer.state[p]
        assert torch.equal(moments["exp_avg"], full["optimizer"][f"state.{p_name}.exp_avg"])
        assert torch.equal(moments["exp_avg_sq"], full["optimizer"][f"state.{p_name}.exp_avg_sq"])
    trainer.close()

    # 2 processes with tensor parallelism instead of FSDP: a different cut of the same tensors.
    script, out = tmp_path / "reshard.py", tmp_path / "tp.pt"
    script.write_text(RESHARD_WORKER)
    tp = {
        **o,
        "parallel.dp_shard": 1,
        "parallel.tp": 2,
        "training.batch_size": 8,
        "checkpoint.enable": False,
    }
    run_torchrun(script, json.dumps(tp), folder, out, nproc=2, timeout=240)
    got = torch.load(out, weights_only=False)
    assert got["step"] == 3 and got["lr"] == pytest.approx(trainer.scheduler.get_last_lr())
    assert set(got["model"]) == set(whole)
    assert all(torch.equal(got["model"][k], v) for k, v in whole.items())
    assert all(
        torch.equal(m, full["optimizer"][f"state.{n}.exp_avg"]) for n, m in got["exp_avg"].items()
    )


# ----- goodput and stragglers ------------------------------------------------------------------
@pytest.mark.parametrize(
    "devices, pinned",
    [({"cuda"}, True), ({"cpu"}, False), ({"cpu", "cuda"}, True), ({"mps"}, False), (set(), False)],
)
def test_staging_is_decided_by_where_the_tensors_are(devices, pinned):
    # Not by torch.cuda.is_available(): a CPU rank on a GPU host must not create a CUDA context.
    from titanlite.resilience.staging import staging_options

    assert staging_options(devices) == {
        "use_pinned_memory": pinned,
        "use_non_blocking_copy": pinned,
        "use_staging_stream": pinned,
    }


def test_host_staging_copies_in_the_background_and_the_save_closes_its_stager(tmp_path):
    import threading

    from titanlite.resilience.staging import (
        HostStager,
        make_stager,
        staging_options,
        tensor_device_types,
    )

    state = {"model": {"w": torch.randn(64, 64)}, "optim": [{"m": torch.zeros(3)}], "step": 3}
    assert tensor_device_types(state) == {"cpu"}
    stager = make_stager(staging_options(tensor_device_types(state)))
    assert isinstance(stager, HostStager)
    staged = stager.stage(state).result()  # a future: the copy ran on the stager's thread
    assert torch.equal(staged["model"]["w"], state["model"]["w"])
    assert (
        staged["model"]["w"].untyped_storage().data_ptr()
        != state["model"]["w"].untyped_storage().data_ptr()
    )
    stager.close()
    ckpt = Checkpointer(tmp_path / "ck", mode="async")
    ckpt.save(state, 1)
    ckpt.wait()
    ckpt.close()
    assert (tmp_path / "ck" / "step-00000001").is_dir()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("titanlite-staging")]
    assert alive == [], f"the stager's copy thread outlived the save: {alive}"


def test_goodput_counts_a_recomputed_step_once(tmp_path):
    events = [
        {"event": "start", "attempt": 0, "t": 1.0, "process_start": 0.0},
        {"event": "step", "attempt": 0, "t": 2.0, "step": 1, "seconds": 1.0},
        {"event": "checkpoint", "attempt": 0, "t": 2.5, "step": 1, "seconds": 0.5},
        {"event": "step", "attempt": 0, "t": 3.5, "step": 2, "seconds": 1.0},  # lost in the crash
        {"event": "start", "attempt": 1, "t": 6.0, "process_start": 5.0},
        {"event": "restore", "attempt": 1, "t": 6.5, "step": 1, "seconds": 0.5},
        {"event": "step", "attempt": 1, "t": 7.5, "step": 2, "seconds": 1.0},
        {"event": "end", "attempt": 1, "t": 8.0},
    ]
    (tmp_path / "goodput.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    g = summarize(tmp_path)
    assert g == {
        "wall_s": 8.0,
        "productive_s": 2.0,
        "lost_s": 1.0,
        "checkpoint_s": 0.5,
        "restore_s": 0.5,
        "other_s": 4.0,
        "goodput": 0.25,
        "attempts": 2,
        "failures": 1,
        "steps": 2,
        "finished": True,
    }


def test_straggler_detector():
    d = StragglerDetector(window=3, ratio=2.0, min_gap_s=0.05)
    assert d.update([0.01, 0.01, 0.30, 0.01]) == []  # window not full yet
    d.update([0.01, 0.02, 0.31, 0.01])
    assert d.update([0.02, 0.01, 0.29, 0.01]) == [2]
    quiet = StragglerDetector(window=2)
    quiet.update([0.010, 0.030])  # 3x slower but only 20 ms: noise, not a straggler
    assert quiet.update([0.010, 0.031]) == []
    records = [
        {"kind": "train", "step": s, "rank": r, "ready_s": 0.4 if r == 1 else 0.01}
        for s in range(1, 6)
        for r in range(2)
    ] + [{"kind": "train", "step": s, "rank": 2, "ready_s": 0.01} for s in range(1, 6)]
    assert detect_stragglers(records) == [1]


@pytest.mark.slow
def test_a_slow_rank_is_flagged_as_a_straggler(data_dir, tmp_path):
    o = _overrides(
        data_dir,
        tmp_path,
        "slow",
        **{
            "parallel.dp_shard": 2,
            "fault.kind": "slow",
            "fault.rank": 1,
            "fault.step": 2,
            "fault.slow_s": 0.3,
        },
    )
    result = launch(load_config(None, o), nproc=2)
    last = result.train[-1]
    assert last["stragglers"] == [1]
    assert last["ready_s_by_rank"][1] >= 0.3 > last["ready_s_by_rank"][0]
    assert detect_stragglers(result.records) == [1]


def _tree(folder) -> dict[str, str]:
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _damage(run_dir):
    shard = committed(run_dir / "checkpoints")[-1] / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])


@pytest.mark.parametrize(
    "change, damage, message",
    [
        ({"model.n_layers": 3}, None, r"different model \(.*n_layers: 2 there vs 3 here"),
        ({}, _damage, "is corrupt"),
        ({"training.batch_size": 8}, None, "global"),
    ],
)
def test_a_refused_start_changes_nothing_in_the_run_folder(
    data_dir, tmp_path, change, damage, message
):
    """Issue 13: a refused resume used to rewrite run.json with the refused settings."""
    o = _overrides(data_dir, tmp_path, "r", **{"training.steps": 2, "checkpoint.enable": True})
    run_dir = Trainer(load_config(None, o)).fit(watchers=[Goodput]).run_dir
    if damage:
        damage(run_dir)
    before = _tree(run_dir)
    assert {"run.json", "metrics.jsonl", "goodput.jsonl"} <= set(before)
    with pytest.raises(TitanliteError, match=message):
        Trainer(load_config(None, {**o, **change, "training.steps": 4})).fit(watchers=[Goodput])
    assert _tree(run_dir) == before


def test_kept_stagers_serve_every_async_save_and_their_buffers_carry_each_new_state(
    tmp_path, monkeypatch
):
    """torch's stager keeps its (pinned) copy of the state and refreshes it in place: one per run (two
    when a save comes while the previous one still writes), not a fresh full-size copy per save; each
    checkpoint still holds its own step's values."""
    from titanlite.resilience import async_saves

    made, make_stager = [], async_saves.make_stager
    monkeypatch.setattr(
        async_saves, "make_stager", lambda *a, **kw: made.append(make_stager(*a, **kw)) or made[-1]
    )
    ckpt = Checkpointer(tmp_path / "ck", mode="async", keep_latest_k=0)
    state = {"w": torch.zeros(256)}
    for step in (1, 2, 3):
        state["w"].fill_(step)
        ckpt.save(state, step)
        ckpt.wait_for_staging()
        state["w"].fill_(-1)  # the next "optimizer step": must not reach the checkpoint just staged
    ckpt.close()
    assert 1 <= len(made) <= 2
    for step in (1, 2, 3):
        loaded = {"w": torch.empty(256)}
        assert ckpt.load(loaded, tmp_path / "ck" / f"step-{step:08d}") == step
        assert torch.equal(loaded["w"], torch.full((256,), float(step))), step
