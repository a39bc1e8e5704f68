"""A hostile machine: full disks, half-set cluster environments, sizes no memory holds, and an
export aimed at its own run. Each ends in one line on stderr (exit 1 for a failure while running,
2 for bad input), no traceback, and a good run beside it byte for byte as it was; a checkpoint
that met a full disk leaves the previous one loadable and the run resumable once space is freed.

The full disks are real: a small tmpfs mounted for the test (as root; skipped, saying why, where
mounting is not allowed), not a mocked `write`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import tiny_overrides
from test_bad_input import check, flags, snapshot


def run_cli(argv, capfd) -> tuple[int, str]:
    from titanlite.tools.cli.commands import main

    capfd.readouterr()
    code = main([str(a) for a in argv])
    return code, capfd.readouterr().err


@pytest.fixture(scope="module")
def good_run(data_dir, tmp_path_factory):
    """A finished 4-step run with checkpoints, the 'good run beside' every case."""
    from titanlite.tools.cli.commands import main

    home = tmp_path_factory.mktemp("good")
    o = tiny_overrides(
        data_dir,
        home,
        **{"training.steps": 4, "eval.every": 0, "checkpoint.enable": True, "checkpoint.every": 2},
    )
    assert main(["train", *flags(o)]) == 0
    return home / "runs" / "t"


@pytest.fixture
def world(tmp_path, good_run):
    """This case's folder, holding a copy of the good run."""
    w = tmp_path / "world"
    shutil.copytree(good_run, w / "good")
    return w


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or 'not root'})")


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of 32 MiB, unmounted afterwards."""
    mounted = []

    def make(size: str = "32m") -> Path:
        where = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        _mount_tmpfs(where, size)
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(disk: Path, leave: int) -> Path:
    """Fill `disk` but for `leave` bytes; the filler file is returned (delete it to free space)."""
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    filler = disk / "filler.bin"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def _bytes_under(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ----- full disks ---------------------------------------------------------------------------------


def test_a_checkpoint_onto_a_full_disk_is_one_line_and_the_run_resumes_once_space_is_freed(
    world, data_dir, small_disk, capfd
):
    """Saves at steps 2, 4, 6 onto a disk with room for one and a half: the second save fails
    (one line, exit 1), step 2's checkpoint stays loadable, the half-written one is never
    committed; freed, the same command resumes from step 2 and ends with the losses of a run
    that never met a full disk (deterministic mode: bit for bit)."""
    from titanlite.resilience.checkpoint_files import committed, verify

    base = {"training.steps": 6, "eval.every": 0, "training.deterministic": True}
    ckpt = {"checkpoint.enable": True, "checkpoint.every": 2, "checkpoint.keep_latest_k": 2}
    reference = tiny_overrides(data_dir, world / "ref", **base, **ckpt)
    assert run_cli(["train", *flags(reference)], capfd)[0] == 0
    one_save = _bytes_under(world / "ref" / "runs" / "t" / "checkpoints" / "step-00000006")
    disk = small_disk()
    filler = _fill(disk, leave=int(1.5 * one_save) + (256 << 10))  # + the tokenizer copy
    folder = disk / "checkpoints"
    o = tiny_overrides(data_dir, world, **base, **ckpt, **{"checkpoint.folder": str(folder)})
    before = snapshot(world / "good")
    code, err = run_cli(["train", *flags(o)], capfd)
    check(code, err, "no space left on device writing a checkpoint")
    assert code == 1 and str(folder) in err, err
    assert snapshot(world / "good") == before
    assert [p.name for p in committed(folder)] == ["step-00000002"]
    assert verify(folder / "step-00000002")["step"] == 2  # whole, CRC and all
    filler.unlink()  # space freed: the same command picks up where the last good save left off
    code, err = run_cli(["train", *flags(o)], capfd)
    assert code == 0, err
    ran = [json.loads(x) for x in (world / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    ref = (world / "ref" / "runs" / "t" / "metrics.jsonl").read_text().splitlines()
    losses = {r["step"]: r["loss"] for r in ran if r["kind"] == "train"}  # the resumed steps last
    want = {r["step"]: r["loss"] for r in map(json.loads, ref) if r["kind"] == "train"}
    assert losses == want
    assert [p.name for p in committed(folder)] == ["step-00000004", "step-00000006"]


def test_a_run_folder_on_a_full_disk_is_one_line(world, data_dir, small_disk, capfd):
    """The metrics, run.json and final weights go to the run folder: a full disk there is one line
    naming what was being written and where."""
    disk = small_disk()
    _fill(disk, leave=8 << 10)
    o = tiny_overrides(data_dir, disk, **{"training.steps": 3, "eval.every": 0})
    before = snapshot(world / "good")
    code, err = run_cli(["train", *flags(o)], capfd)
    check(code, err, "no space left on device writing")
    assert code == 1 and str(disk) in err, err
    assert snapshot(world / "good") == before


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing_half_written(
    world, small_disk, capfd
):
    disk = small_disk("1m")  # room for the config, not for the weights
    for argv in (
        ["export-hf", world / "good", disk / "hf"],
        ["export-checkpoint", world / "good" / "checkpoints" / "step-00000004", disk / "hf2"],
        [
            "export-checkpoint",
            world / "good" / "checkpoints" / "step-00000004",
            disk / "model.pt",
            "--format",
            "torch",
        ],
    ):
        _fill(disk, leave=64 << 10)
        before = snapshot(world / "good")
        code, err = run_cli(argv, capfd)
        check(code, err, "no space left on device writing")
        assert code == 1, err
        assert snapshot(world / "good") == before
        assert sorted(p.name for p in disk.iterdir()) == ["filler.bin"], "a half export was left"
        (disk / "filler.bin").unlink()


# ----- an output that is the input, a run or a checkpoint ------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        "export-hf-into-its-run",
        "export-hf-into-a-checkpoint",
        "export-hf-into-another-run",
        "export-checkpoint-onto-its-source",
        "export-checkpoint-into-its-run",
        "export-torch-into-its-step",
    ],
)
def test_no_command_writes_into_a_run_a_checkpoint_or_its_own_input(case, world, capfd):
    good = world / "good"
    step = good / "checkpoints" / "step-00000004"
    shutil.copytree(good, world / "other")
    argv = {
        "export-hf-into-its-run": ["export-hf", good, good],
        "export-hf-into-a-checkpoint": ["export-hf", good, step],
        "export-hf-into-another-run": ["export-hf", good, world / "other"],
        "export-checkpoint-onto-its-source": ["export-checkpoint", step, step],
        "export-checkpoint-into-its-run": ["export-checkpoint", step, good],
        "export-torch-into-its-step": [
            "export-checkpoint",
            step,
            step / "model.pt",
            "--format",
            "torch",
        ],
    }[case]
    before = snapshot(world)
    code, err = run_cli(argv, capfd)
    check(code, err)
    assert code == 2, err
    assert snapshot(world) == before
    # and what export-hf RUN RUN did before: the run still exports
    assert run_cli(["export-hf", good, world / "hf"], capfd)[0] == 0


# ----- half-set cluster environments --------------------------------------------------------------


@pytest.mark.parametrize(
    "env, message",
    [
        ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR and MASTER_PORT not set"),
        ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two' is not a whole number"),
        ({"WORLD_SIZE": "2"}, "RANK not set"),
        ({"RANK": "1", "LOCAL_RANK": "1"}, "WORLD_SIZE not set"),
        (
            {"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
            "do not fit WORLD_SIZE=2",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"},
            "not a port",
        ),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "SLURM started 4 tasks"),
    ],
    ids=["no-master", "malformed", "no-rank", "no-world", "rank-too-big", "bad-port", "srun"],
)
def test_a_half_set_distributed_environment_is_one_line(
    env, message, world, data_dir, monkeypatch, capfd
):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    o = tiny_overrides(data_dir, world, **{"training.steps": 2, "eval.every": 0})
    before = snapshot(world)
    code, err = run_cli(["train", *flags(o)], capfd)
    check(code, err, message)
    assert code == 2 and "torchrun" in err, err
    assert snapshot(world) == before


# ----- sizes no memory holds --------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.batch_size", "1000000000"], "training.batch_size must be between 1 and"),
        (["--training.batch_size", "200000"], "needs at least"),
        (
            [
                "--training.seq_len",
                "1048576",
                "--model.max_seq_len",
                "1048576",
                "--training.batch_size",
                "64",
            ],
            "needs at least",
        ),
    ],
    ids=["out-of-range", "batch-beyond-memory", "seq-beyond-memory"],
)
def test_a_size_no_memory_here_holds_is_refused_before_anything_is_allocated(
    argv, message, world, data_dir, capfd
):
    o = tiny_overrides(data_dir, world, **{"training.steps": 2, "eval.every": 0})
    before = snapshot(world)
    code, err = run_cli(["train", *flags(o), *argv], capfd)
    check(code, err, message)
    assert code == 2, err
    assert snapshot(world) == before


def test_the_memory_check_counts_what_a_real_step_holds_at_least():
    """The estimate is a lower bound of one step's real tensors: a step's logits (as autocast
    left them) and their gradient, and the weights, gradients and AdamW moments after a step, summed
    from the tensors themselves, are at least what the check says; and the check refuses exactly
    when its estimate exceeds the limit."""
    import re

    import torch

    from titanlite import TitanliteError
    from titanlite.config import load_config
    from titanlite.preflight import check_memory_fits, preflight
    from titanlite.train import Trainer

    o = {"training.batch_size": 4, "training.seq_len": 32, "data.vocab_size": 512}
    cfg = load_config(None, {**o, "metrics.progress": False})
    plan = preflight(cfg, 1, cfg.data.vocab_size)
    with pytest.raises(TitanliteError) as refused:
        check_memory_fits(plan, cfg, 1, "here")
    need = float(re.search(r"needs at least ([\d.,]+) GiB", str(refused.value))[1].replace(",", ""))
    check_memory_fits(plan, cfg, int((need + 0.01) * 2**30), "here")  # just above: accepted
    trainer = Trainer(cfg)
    seen = []
    trainer.model.output.register_forward_hook(lambda m, i, out: seen.append(out))
    trainer.train_step(trainer.next_micro_batches())
    logits = seen[0].numel() * seen[0].element_size() * 2  # the logits and their gradient
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    moments = sum(
        t.numel() * t.element_size()
        for state in trainer.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    held = logits + 2 * params + moments  # weights, their gradients, AdamW's moments
    assert held >= need * 2**30 - 0.01 * 2**30, (held, need)
