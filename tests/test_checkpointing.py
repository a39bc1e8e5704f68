"""Activation checkpointing: the same math, fewer saved activations, the same names."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_overrides

from titanlite import TitanliteError
from titanlite.config import load_config
from titanlite.efficiency.activation_checkpoint import apply_ac
from titanlite.models.llama import ModelArgs, build_model
from titanlite.tools.predict.activation_memory import (
    activation_memory_estimate,
    checkpointed_blocks,
    saved_activation_bytes,
    saved_tensors_hook_bytes,
    tokens_for,
)
from titanlite.train import Trainer

# Three layers, so that "selective" with every=2 leaves a block unwrapped between two wrapped.
ARGS = ModelArgs.preset("debug", vocab_size=512, n_layers=3)
MODES = [("full", 2), ("selective", 2), ("selective", 3), ("op", 2)]


def model_with(mode: str, every: int = 2, dtype=torch.float32):
    torch.manual_seed(0)
    return apply_ac(build_model(ARGS, "cpu").to(dtype), mode, every=every)


def loss_and_grads(model, tokens):
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("mode, every", MODES)
def test_recomputation_gives_bit_identical_loss_and_gradients(mode, every):
    tokens = tokens_for(ARGS, 4, 65)
    ref_loss, ref_grads = loss_and_grads(model_with("none"), tokens)
    loss, grads = loss_and_grads(model_with(mode, every), tokens)
    # Recomputation replays the same kernels on the same inputs: not close, identical (fp32, CPU).
    assert torch.equal(loss, ref_loss)
    assert len(grads) == len(ref_grads)
    for g, ref in zip(grads, ref_grads):
        assert torch.equal(g, ref)


def test_wrapping_keeps_names_and_shares_parameters(tmp_path):
    plain = build_model(ARGS, "cpu")
    params_before = [id(p) for p in plain.parameters()]
    keys_before = list(plain.state_dict())
    model = apply_ac(plain, "op")
    assert model is plain and checkpointed_blocks(model) == ["0", "1", "2"]
    assert list(model.state_dict()) == keys_before  # safetensors / HF export see plain names
    assert [id(p) for p in model.parameters()] == params_before  # wrapped, never copied
    assert model.output.weight is model.tok_embeddings.weight  # still tied
    # Weights saved from a checkpointed model load into a plain one, and back.
    from safetensors.torch import load_model, save_model

    save_model(model, str(tmp_path / "m.safetensors"))
    fresh = build_model(ARGS, "cpu")
    load_model(fresh, str(tmp_path / "m.safetensors"))
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    model.load_state_dict(fresh.state_dict())  # strict: every plain key finds its wrapped slot


def test_which_blocks_each_mode_wraps():
    args = ModelArgs.preset("debug", vocab_size=512, n_layers=5)
    assert checkpointed_blocks(apply_ac(build_model(args), "none")) == []
    assert checkpointed_blocks(apply_ac(build_model(args), "full")) == ["0", "1", "2", "3", "4"]
    assert checkpointed_blocks(apply_ac(build_model(args), "selective", every=2)) == ["0", "2", "4"]
    assert checkpointed_blocks(apply_ac(build_model(args), "selective", every=3)) == ["0", "3"]
    every_block = checkpointed_blocks(apply_ac(build_model(args), "selective", every=1))
    assert every_block == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_activations_shrink_in_order_and_match_the_formula(dtype):
    tokens = tokens_for(ARGS, 4, 64)
    measured = {}
    for mode, every in [("none", 2), ("op", 2), ("full", 2), ("selective", 2), ("selective", 3)]:
        measured[mode, every] = saved_activation_bytes(model_with(mode, every, dtype), tokens)
        formula = activation_memory_estimate(ARGS, 4, 64, dtype.itemsize, mode, every)
        # On CPU every saved tensor is a term of the formula (today they agree to the byte);
        # 1% leaves room only for tiny terms such as the exact form of the rotary sign table.
        assert measured[mode, every] == pytest.approx(formula, rel=0.01), (mode, every)
    none, op, full = measured["none", 2], measured["op", 2], measured["full", 2]
    assert none > op > full
    assert none > measured["selective", 3] > measured["selective", 2] > full
    # Under full checkpointing, each block costs exactly its input: one [B, T, dim] tensor.
    deeper = ModelArgs.preset("debug", vocab_size=512, n_layers=ARGS.n_layers + 1)
    torch.manual_seed(0)
    one_more = saved_activation_bytes(apply_ac(build_model(deeper).to(dtype), "full"), tokens)
    assert one_more - full == 4 * 64 * ARGS.dim * dtype.itemsize


def test_saved_tensor_hooks_alone_miss_the_sac_cache():
    tokens = tokens_for(ARGS, 2, 32)
    for mode in ("none", "full", "selective"):  # plain autograd and checkpoint inputs: both see it
        model = model_with(mode)
        assert saved_tensors_hook_bytes(model, tokens) == saved_activation_bytes(model, tokens)
    op = model_with("op")
    assert saved_tensors_hook_bytes(op, tokens) < saved_activation_bytes(op, tokens)


@pytest.mark.parametrize(
    "mode, every, message",
    [
        ("ful", 2, r"'ful' is not one of none, full, selective, op \(did you mean: full"),
        ("selctive", 2, r"did you mean: selective"),
        ("full", 0, r"every must be a positive integer, got 0"),
        ("selective", -1, r"every must be a positive integer, got -1"),
    ],
)
def test_bad_input_is_one_clear_line(mode, every, message):
    with pytest.raises(TitanliteError, match=message) as e:
        apply_ac(build_model(ARGS), mode, every=every)
    assert "\n" not in str(e.value)
    with pytest.raises(TitanliteError, match="not one of"):
        activation_memory_estimate(ARGS, 1, 8, 4, "partial")


def test_applying_twice_is_refused():
    model = apply_ac(build_model(ARGS), "full")
    with pytest.raises(TitanliteError, match="already checkpointed"):
        apply_ac(model, "op")


def test_trainer_runs_every_mode_with_the_same_losses(data_dir, tmp_path):
    losses = {}
    for mode in ("none", "full", "selective", "op"):
        cfg = load_config(
            None,
            tiny_overrides(
                data_dir,
                tmp_path / mode,
                **{
                    "training.steps": 3,
                    "eval.every": 0,
                    "model.n_layers": 3,
                    "activation_checkpoint.mode": mode,
                },
            ),
        )
        trainer = Trainer(cfg)
        losses[mode] = trainer.fit().losses
        assert (
            len(checkpointed_blocks(trainer.model))
            == {"none": 0, "full": 3, "selective": 2, "op": 3}[mode]
        )
    assert losses["full"] == losses["selective"] == losses["op"] == losses["none"]


def test_op_mode_saves_fp8_matmuls_and_tensor_parallel_reduce_scatters():
    # torchtitan's _save_list: recomputing these would redo an FP8 matmul or a collective.
    from torch.utils.checkpoint import CheckpointPolicy

    from titanlite.efficiency.activation_checkpoint import save_matmuls_policy

    for op in (
        torch.ops.aten._scaled_mm.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops.aten.mm.default,
    ):
        assert save_matmuls_policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    for op in (
        torch.ops.aten.mul.Tensor,
        torch.ops.aten.silu.default,
        torch.ops.aten.rsqrt.default,
    ):
        assert save_matmuls_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op
