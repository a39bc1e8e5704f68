"""The trainer: it learns, logs honest metrics, is deterministic, and refuses bad input."""

import json
import statistics
import warnings

import pytest
import torch
from conftest import tiny_overrides

from titanlite import TitanliteError
from titanlite.config import load_config
from titanlite.optimizer import lr_lambda
from titanlite.tools.probe.matmul_peak import MatmulPeaks, mfu_within_noise
from titanlite.train import Trainer
from titanlite.weights import load_weights, save_weights

REQUIRED = {"step", "loss", "tokens_per_sec", "mfu", "peak_memory_bytes", "lr", "elapsed_s"}


def run(data_dir, tmp_path, **extra):
    cfg = load_config(None, tiny_overrides(data_dir, tmp_path, **extra))
    trainer = Trainer(cfg)
    return trainer, trainer.fit()


def test_loss_falls_and_metrics_are_logged(data_dir, tmp_path, monkeypatch):
    from titanlite import peaks

    monkeypatch.setattr(peaks, "_WARNED", set())  # an earlier test's warning must not hide ours
    seen = []
    cfg = load_config(None, tiny_overrides(data_dir, tmp_path, **{"training.steps": 40}))
    trainer = Trainer(cfg, peaks=MatmulPeaks())  # the peak finder `titanlite train` hands in
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = trainer.fit(callbacks=[seen.append])
    assert sum(history.losses[-5:]) / 5 < sum(history.losses[:5]) / 5 - 0.5
    records = [
        json.loads(line) for line in (history.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 40 and REQUIRED <= set(train[0])
    assert [r["step"] for r in records if r["kind"] == "val"] == [6, 12, 18, 24, 30, 36, 40]
    assert all(r["mfu"] > 0 and r["tokens_per_sec"] > 0 for r in train)
    # MFU is a fraction of the peak measured on this machine. A step can still beat a peak that
    # was measured while the machine was busier (the load here comes and goes): the typical step
    # does not, against a peak measured again with its noise, and a step that does is never silent.
    mfu, noise, _ = mfu_within_noise(
        statistics.median(r["tokens_per_sec"] for r in train) * trainer.flops_per_token,
        trainer.peak,
        trainer.device,
        trainer.compute_dtype,
    )
    assert 0 < mfu <= 1 + noise
    if any(r["mfu"] >= 1 for r in train):
        assert any("peak is too low" in str(w.message) for w in caught), "MFU > 1 said so"
    assert seen == records  # callbacks see exactly what is logged
    info = json.loads((history.run_dir / "run.json").read_text())
    assert info["flops_per_token"] == trainer.model.flops_per_token(32)
    assert info["peak_label"].startswith(("measured", "datasheet"))
    assert history.samples[0] != history.samples[40]


def test_deterministic_runs_are_bit_identical(data_dir, tmp_path):
    _, a = run(data_dir, tmp_path / "a", **{"training.deterministic": True, "training.seed": 3})
    _, b = run(data_dir, tmp_path / "b", **{"training.deterministic": True, "training.seed": 3})
    _, c = run(data_dir, tmp_path / "c", **{"training.deterministic": True, "training.seed": 4})
    torch.use_deterministic_algorithms(False)
    assert a.losses == b.losses
    assert a.losses != c.losses


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = load_config(
        None, {"training.steps": 100, "scheduler.warmup_steps": 10, "scheduler.min_lr_ratio": 0.1}
    )
    f = lr_lambda(cfg.scheduler, cfg.training.steps)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.55)
    assert f(100) == pytest.approx(0.1)
    assert all(f(i) >= f(i + 1) for i in range(10, 100))


def test_weights_round_trip_and_tensorboard(data_dir, tmp_path):
    trainer, history = run(data_dir, tmp_path, **{"metrics.tensorboard": True, "training.steps": 3})
    save_weights(
        trainer.model_parts,
        trainer.model_args,
        trainer.dtype,
        trainer.tokenizer,
        history.run_dir,
        pp=trainer.dims.pp,
        is_main=trainer.dist.is_main,
    )
    model, tok = load_weights(history.run_dir)
    for (k, v), (k2, v2) in zip(trainer.model.state_dict().items(), model.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    assert len(tok) == trainer.data.vocab_size
    assert list((history.run_dir / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"model.vocab_size": 100}, r"tokenizer has 512 tokens but the model's vocab_size is 100"),
        ({"training.seq_len": 1000}, r"training.seq_len=1000 exceeds the model's maximum \(256"),
        (
            {"training.device": "cuda"}
            if not torch.cuda.is_available()
            else {"training.device": "cuda:99"},
            r"cuda",
        ),
        ({"data.dataset": "file", "data.path": "/no/such/file.txt"}, r"/no/such/file.txt"),
        ({"model.preset": "tiny"}, r"model.preset='tiny' is not one of debug, small"),
    ],
)
def test_bad_input_is_one_clear_line(data_dir, tmp_path, extra, message):
    with pytest.raises(TitanliteError, match=message) as e:
        run(data_dir, tmp_path, **extra)
    assert "\n" not in str(e.value)


def test_diverging_loss_stops_with_advice(data_dir, tmp_path):
    with pytest.raises(TitanliteError, match="lower --optimizer.lr"):
        run(
            data_dir,
            tmp_path,
            **{
                "optimizer.lr": 1e6,
                "training.grad_clip": 0.0,
                "training.steps": 30,
                "scheduler.warmup_steps": 0,
            },
        )


# ----- the loop's device decisions (issue 10) --------------------------------------------------
def test_only_cuda_copies_batches_non_blocking():
    """A non-blocking copy from memory freed before it runs corrupts batches on MPS
    (pytorch#189690): pinned + non-blocking on CUDA only, a blocking copy everywhere else."""
    from titanlite.data.transfer import should_pin, to_device

    assert (
        should_pin(torch.device("cuda"))
        and should_pin(torch.device("cuda", 3))
        and should_pin("cuda")
    )
    assert not should_pin(torch.device("mps")) and not should_pin(torch.device("cpu"))
    x, y = torch.arange(6).view(2, 3), torch.arange(1, 7).view(2, 3)
    x2, y2 = to_device((x, y), torch.device("cpu"))
    assert torch.equal(x2, x) and torch.equal(y2, y)


def test_unlogged_steps_leave_the_loss_unread_and_logged_losses_do_not_change(data_dir, tmp_path):
    """Issue 10.11: the target count comes from the labels' host copy and the loss is read
    only on logged steps; what is logged is exactly what logging every step gives."""
    from titanlite.efficiency.accumulation import (
        IGNORE_INDEX,
        count_targets,
        global_tokens_per_rank,
    )

    extra = {"training.deterministic": True, "training.steps": 9, "eval.every": 0}
    trainer, every = run(data_dir, tmp_path / "every", **extra)
    batches = trainer.next_micro_batches()
    assert batches.num_targets == sum(count_targets(y) for _, y in batches) > 0
    out = trainer.train_step(batches, read=False)
    assert out["loss"] is None and out["grad_norm"] is None
    out = trainer.train_step(trainer.next_micro_batches())
    assert isinstance(out["loss"], float) and isinstance(out["grad_norm"], float)
    # Padding targets count neither in the loss nor in the divisor, counted on the host.
    x, y = batches[0]
    y = y.clone()
    y[:, ::2] = IGNORE_INDEX
    assert (
        global_tokens_per_rank([(x, y)], trainer.dims, trainer.device, False)
        == count_targets(y)
        < y.numel()
    )

    _, sparse = run(data_dir, tmp_path / "sparse", **extra, **{"metrics.log_every": 4})
    assert [r["step"] for r in sparse.train] == [4, 8, 9]  # every 4th, and the last
    assert sparse.losses == [every.losses[s - 1] for s in (4, 8, 9)]  # ==, bit for bit
    assert [r["grad_norm"] for r in sparse.train] == [
        every.train[s - 1]["grad_norm"] for s in (4, 8, 9)
    ]


VAL_SCRIPT = """
import json, sys
import torch
from titanlite.config import load_config
from titanlite.train import Trainer
from titanlite.efficiency.accumulation import count_targets

trainer = Trainer(load_config(None, json.loads(sys.argv[1])))
# This rank's shard alone, as evaluate() measured it before issue 10.12.
sums = [(trainer.loss_on(x, y).item() * count_targets(y), count_targets(y))
        for x, y in trainer.data.val.eval_batches(trainer.cfg.eval.batches)]
mine = [sum(s for s, _ in sums), sum(n for _, n in sums)]
everyone = [None] * trainer.dist.world_size
torch.distributed.all_gather_object(everyone, mine)
result = {"rank": trainer.dist.rank, "evaluate": trainer.evaluate(), "shards": everyone}
with open(sys.argv[2] + f"/val.rank{trainer.dist.rank}.json", "w") as f:
    json.dump(result, f)
trainer.close(barrier=True)
"""


def test_validation_loss_is_the_mean_over_every_data_parallel_rank(data_dir, tmp_path):
    """Issue 10.12: evaluate() used to return rank 0's shard only."""
    from conftest import run_torchrun

    script = tmp_path / "val.py"
    script.write_text(VAL_SCRIPT)
    o = tiny_overrides(
        data_dir,
        tmp_path,
        **{"parallel.dp_replicate": 2, "parallel.dp_shard": 1, "eval.batches": 2},
    )
    run_torchrun(script, json.dumps(o), tmp_path, nproc=2, timeout=300)
    results = [json.loads((tmp_path / f"val.rank{r}.json").read_text()) for r in (0, 1)]
    shards = results[0]["shards"]
    local_means = [s / n for s, n in shards]
    assert local_means[0] != local_means[1], "the ranks hold different validation shards"
    overall = sum(s for s, _ in shards) / sum(n for _, n in shards)
    assert results[0]["evaluate"] == results[1]["evaluate"]  # one answer everywhere
    assert results[0]["evaluate"] == pytest.approx(overall, rel=1e-12)
