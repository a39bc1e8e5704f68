"""The trainer: it learns, logs honest metrics, is deterministic, and refuses bad input."""
import json

import pytest
import torch

from conftest import tiny_overrides
from titanlite import TitanliteError
from titanlite.config import load_config
from titanlite.train import Trainer, load_weights, lr_lambda

REQUIRED = {"step", "loss", "tokens_per_sec", "mfu", "peak_memory_bytes", "lr", "elapsed_s"}


def run(data_dir, tmp_path, **extra):
    cfg = load_config(None, tiny_overrides(data_dir, tmp_path, **extra))
    trainer = Trainer(cfg)
    return trainer, trainer.fit()


def test_loss_falls_and_metrics_are_logged(data_dir, tmp_path):
    seen = []
    cfg = load_config(None, tiny_overrides(data_dir, tmp_path, **{"training.steps": 40}))
    trainer = Trainer(cfg)
    history = trainer.fit(callbacks=[seen.append])
    assert sum(history.losses[-5:]) / 5 < sum(history.losses[:5]) / 5 - 0.5
    records = [json.loads(l) for l in (history.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 40 and REQUIRED <= set(train[0])
    assert [r["step"] for r in records if r["kind"] == "val"] == [6, 12, 18, 24, 30, 36, 40]
    assert all(0 < r["mfu"] < 1 and r["tokens_per_sec"] > 0 for r in train)
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
    cfg = load_config(None, {"training.steps": 100, "scheduler.warmup_steps": 10,
                             "scheduler.min_lr_ratio": 0.1})
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.55)
    assert f(100) == pytest.approx(0.1)
    assert all(f(i) >= f(i + 1) for i in range(10, 100))


def test_weights_round_trip_and_tensorboard(data_dir, tmp_path):
    trainer, history = run(data_dir, tmp_path, **{"metrics.tensorboard": True, "training.steps": 3})
    trainer.save_weights(history.run_dir)
    model, tok = load_weights(history.run_dir)
    for (k, v), (k2, v2) in zip(trainer.model.state_dict().items(), model.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    assert len(tok) == trainer.data.vocab_size
    assert list((history.run_dir / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("extra, message", [
    ({"model.vocab_size": 100}, r"tokenizer has 512 tokens but the model's vocab_size is 100"),
    ({"training.seq_len": 1000}, r"training.seq_len=1000 exceeds the model's maximum \(256"),
    ({"training.device": "cuda"} if not torch.cuda.is_available() else {"training.device": "cuda:99"},
     r"cuda"),
    ({"data.dataset": "file", "data.path": "/no/such/file.txt"}, r"/no/such/file.txt"),
    ({"model.preset": "tiny"}, r"unknown model preset 'tiny'"),
])
def test_bad_input_is_one_clear_line(data_dir, tmp_path, extra, message):
    with pytest.raises(TitanliteError, match=message) as e:
        run(data_dir, tmp_path, **extra)
    assert "\n" not in str(e.value)


def test_diverging_loss_stops_with_advice(data_dir, tmp_path):
    with pytest.raises(TitanliteError, match="lower --optimizer.lr"):
        run(data_dir, tmp_path, **{"optimizer.lr": 1e6, "training.grad_clip": 0.0,
                                   "training.steps": 30, "scheduler.warmup_steps": 0})
