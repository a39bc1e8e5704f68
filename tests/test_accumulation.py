"""Gradient accumulation: k micro-batches give exactly the big batch's gradient."""

import pytest
import torch
from conftest import tiny_overrides

from titanlite import TitanliteError
from titanlite.config import load_config
from titanlite.efficiency.accumulation import IGNORE_INDEX, count_targets, loss_sum, resolve_batch
from titanlite.models.llama import ModelArgs, build_model
from titanlite.train import Trainer


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def accumulated_grads(model, xs, ys):
    model.zero_grad(set_to_none=True)
    total = sum(count_targets(y) for y in ys)
    for x, y in zip(xs, ys):
        (loss_sum(model(x), y) / total).backward()
    return grads(model)


def test_accumulated_gradients_equal_big_batch_gradients():
    torch.manual_seed(0)
    model = build_model(ModelArgs.preset("debug", vocab_size=512, max_seq_len=64)).double()
    x = torch.randint(0, 512, (8, 32))
    y = torch.randint(0, 512, (8, 32))
    big = accumulated_grads(model, [x], [y])
    small = accumulated_grads(model, list(x.chunk(4)), list(y.chunk(4)))
    for a, b in zip(big, small):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_global_token_normalisation_is_unbiased_with_padding():
    """Micro-batches with different numbers of real tokens: dividing by the global token count
    matches the big batch; averaging per-micro-batch means does not."""
    torch.manual_seed(0)
    model = build_model(ModelArgs.preset("debug", vocab_size=512, max_seq_len=64)).double()
    x = torch.randint(0, 512, (4, 32))
    y = torch.randint(0, 512, (4, 32))
    y[0, 4:] = IGNORE_INDEX  # a short sequence, padded
    big = accumulated_grads(model, [x], [y])
    split = accumulated_grads(model, list(x.chunk(2)), list(y.chunk(2)))
    for a, b in zip(big, split):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    model.zero_grad(set_to_none=True)
    for xs, ys in zip(x.chunk(2), y.chunk(2)):  # the naive way: mean of means
        (loss_sum(model(xs), ys) / count_targets(ys) / 2).backward()
    naive = grads(model)
    assert max((a - b).abs().max().item() for a, b in zip(big, naive)) > 1e-6


def test_trainer_accumulation_matches_big_batch(data_dir, tmp_path):
    def losses(**extra):
        cfg = load_config(
            None,
            tiny_overrides(data_dir, tmp_path, **{"training.steps": 4, "eval.every": 0, **extra}),
        )
        trainer = Trainer(cfg)
        return trainer, trainer.fit().losses

    big_trainer, big = losses(**{"training.batch_size": 8, "metrics.run_name": "big"})
    acc_trainer, acc = losses(
        **{
            "training.batch_size": 2,
            "training.global_batch_size": 8,
            "metrics.run_name": "accumulated",
        }
    )
    assert (
        acc_trainer.grad_accum_steps == 4 and acc_trainer.global_batch == big_trainer.global_batch
    )
    assert acc == pytest.approx(big, rel=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        ((4, 1, 10, 1), "not a positive multiple of batch_size × data-parallel degree = 4 × 1 = 4"),
        ((4, 1, 16, 3), "4 × 3 = 12"),
        ((4, 3, 32, 1), "contradicts global_batch_size=32"),
        ((4, 0, None, 1), "must be at least 1"),
    ],
)
def test_invalid_combinations_are_one_line(args, message):
    with pytest.raises(TitanliteError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_batch(*args)


def test_either_way_of_configuring_gives_the_same_batch():
    assert resolve_batch(4, 1, 32, 2) == (4, 4, 32)
    assert resolve_batch(4, 4, None, 2) == (4, 4, 32)
    assert resolve_batch(4, 4, 32, 2) == (4, 4, 32)
