"""FP8 training (torchao Float8Linear): what converts, how close it stays, that it trains,
and that bad requests fail with one clear line.

Tolerances come from the formats. Round-to-nearest into a float with m mantissa bits is off
by at most u = 2^-(m+1) relative (for values in the normal range): e4m3 u = 1/16, e5m2 u = 1/8.
A product of two quantised operands is then off by at most u_a + u_b (+ u_a·u_b), and a sum
of such products with Gaussian data has about the same norm-wise relative error - so one
FP8 matmul stays within u_a + u_b of fp32. We also require the error to exceed u_a/8: an
untouched fp32 layer (conversion silently skipped) would sit at ~1e-7 and fail.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_overrides
from torch import nn

from titanlite import TitanliteError
from titanlite.config import load_config
from titanlite.efficiency import fp8
from titanlite.efficiency.fp8 import apply_fp8, fp8_support
from titanlite.labs.nb06_fp8_numerics import fp8_roundtrip
from titanlite.models.llama import ModelArgs, build_model
from titanlite.train import Trainer

E4M3_U, E5M2_U = 2.0**-4, 2.0**-3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tiny_model(**kw) -> nn.Module:
    torch.manual_seed(0)
    return build_model(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, **kw))


def test_converts_blocks_skips_output_and_small_layers_and_keeps_state_dict_keys():
    model = tiny_model()
    keys = list(model.state_dict())
    apply_fp8(model, "tensorwise", min_dim=64)
    info = model.fp8_info
    # dim 64, 2 KV heads of 16: k/v project 64→32, below min_dim; q/o 64→64 and the MLP
    # (64→192→64) convert; the output projection never does.
    for i in ("0", "1"):
        for name in (
            "attention.q_proj",
            "attention.o_proj",
            "feed_forward.gate_proj",
            "feed_forward.up_proj",
            "feed_forward.down_proj",
        ):
            assert f"layers.{i}.{name}" in info["converted"]
            assert type(model.get_submodule(f"layers.{i}.{name}")).__name__ == "Float8Linear"
        for name in ("attention.k_proj", "attention.v_proj"):
            assert "below min_dim=64" in info["skipped"][f"layers.{i}.{name}"]
            assert type(model.get_submodule(f"layers.{i}.{name}")) is nn.Linear
    assert "output projection" in info["skipped"]["output"] and type(model.output) is nn.Linear
    assert len(info["converted"]) == 10 and len(info["skipped"]) == 5
    assert info["recipe"] == "tensorwise" and info["label"].startswith("FP8 tensorwise")
    assert list(model.state_dict()) == keys  # Float8Linear keeps `weight`: checkpoints still load
    assert model.output.weight is model.tok_embeddings.weight  # tying survives


def test_sizes_not_divisible_by_16_are_skipped_with_the_reason():
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 40, bias=False))
    apply_fp8(model, min_dim=16)
    assert model.fp8_info["converted"] == ["0"]
    assert "not divisible by 16" in model.fp8_info["skipped"]["1"]


@pytest.mark.parametrize("recipe,grad_u", [("tensorwise", E5M2_U), ("rowwise", E4M3_U)])
def test_emulated_linear_forward_and_backward_stay_within_the_format_bounds(recipe, grad_u):
    # tensorwise casts gradients to e5m2 (2 mantissa bits), rowwise to e4m3 (3 bits).
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(128, 256, bias=False))
    f8 = apply_fp8(copy.deepcopy(ref), recipe, device="cpu", min_dim=16)
    assert f8.fp8_info["emulated"] is True  # no FP8 units on a CPU
    x, g = torch.randn(64, 128), torch.randn(64, 256)
    x_ref, x_f8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_f8 = ref(x_ref), f8(x_f8)
    y_ref.backward(g)
    y_f8.backward(g)
    checks = {
        "output": (y_f8, y_ref, E4M3_U + E4M3_U),
        "grad_input": (x_f8.grad, x_ref.grad, grad_u + E4M3_U),
        "grad_weight": (f8[0].weight.grad, ref[0].weight.grad, grad_u + E4M3_U),
    }
    for name, (got, want, bound) in checks.items():
        err = rel_err(got, want)
        assert E4M3_U / 8 < err < bound, f"{recipe} {name}: relative error {err:.4f}, bound {bound}"


def test_emulated_model_logits_and_loss_stay_close_to_fp32():
    ref = tiny_model()
    f8 = apply_fp8(copy.deepcopy(ref), "tensorwise", min_dim=16)
    tokens = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits_ref, logits_f8 = ref(tokens), f8(tokens)
    # Each layer adds at most one matmul's error to the residual stream, which carries the
    # unquantised embedding too: the logits stay well inside one matmul's bound.
    assert E4M3_U / 16 < rel_err(logits_f8, logits_ref) < 2 * E4M3_U
    loss = [
        F.cross_entropy(lg.flatten(0, 1), tokens.flatten()).item() for lg in (logits_ref, logits_f8)
    ]
    assert abs(loss[0] - loss[1]) < 0.01 * loss[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_roundtrip_matches_what_the_layer_computes(recipe):
    # fp8_roundtrip (used for the notebook's error histograms) must be the layer's own cast:
    # an FP8 matmul equals the fp32 matmul of the round-tripped operands (up to fp32 rounding).
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(64, 32, bias=False))
    x = torch.randn(16, 64) * torch.logspace(-2, 1, 16).unsqueeze(1)  # rows of very different size
    want = fp8_roundtrip(x, recipe, "input") @ fp8_roundtrip(lin[0].weight, recipe, "weight").t()
    apply_fp8(lin, recipe, min_dim=16)
    with torch.no_grad():
        got = lin(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert rel_err(got, x @ lin[0].weight.t()) > 1e-3  # and it is not the fp32 result


def test_rowwise_keeps_small_rows_that_tensorwise_flushes():
    # One huge row sets the tensorwise scale; rows 1e-6 smaller fall below e4m3's smallest
    # subnormal and flush to zero. Rowwise gives each row its own scale.
    x = torch.randn(4, 64)
    x[0] *= 1e5
    x[1:] *= 1e-2
    tensorwise, rowwise = fp8_roundtrip(x, "tensorwise"), fp8_roundtrip(x, "rowwise")
    assert (tensorwise[1:] == 0).float().mean() > 0.9
    assert rel_err(rowwise[1:], x[1:]) < E4M3_U


@pytest.fixture
def one_thread():
    # Emulated FP8 is many tiny ops; on a shared 2-core machine OpenMP threads spin-wait
    # against other processes and a step takes 10x longer. Restore the setting afterwards.
    before = torch.get_num_threads()
    yield 1
    torch.set_num_threads(before)


def test_trains_with_fp8_loss_falls_and_stays_finite(data_dir, tmp_path, one_thread):
    cfg = load_config(
        None,
        tiny_overrides(
            data_dir,
            tmp_path,
            **{
                "training.steps": 24,
                "float8.enable": True,
                "float8.min_dim": 16,
                "eval.every": 0,
                "training.threads": one_thread,
            },
        ),
    )
    trainer = Trainer(cfg)
    info = trainer.model.fp8_info
    assert info["emulated"] and len(info["converted"]) == 14 and list(info["skipped"]) == ["output"]
    history = trainer.fit()
    losses = history.losses
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.4


def test_bad_requests_fail_with_one_clear_line(data_dir, tmp_path):
    with pytest.raises(TitanliteError, match=r"did you mean: rowwise"):
        apply_fp8(tiny_model(), "rowwsie")
    with pytest.raises(
        TitanliteError,
        match=r"no Linear layer qualifies.*min_dim=4096.*"
        r"divisible by 16.*lower float8.min_dim",
    ):
        apply_fp8(tiny_model(), min_dim=4096)
    if not fp8_support("cpu").real:
        with pytest.raises(TitanliteError, match=r"SM >= 8.9.*float8.emulate auto"):
            apply_fp8(tiny_model(), device="cpu", emulate=False)
    model = apply_fp8(tiny_model(), min_dim=16)
    with pytest.raises(TitanliteError, match="already converted"):
        apply_fp8(model)
    with pytest.raises(TitanliteError, match="did you mean: grad_output"):
        fp8_roundtrip(torch.ones(4, 16), "tensorwise", "grad_outptu")
    # Through the trainer's config, as a user would hit it.
    cfg = load_config(
        None,
        tiny_overrides(data_dir, tmp_path, **{"float8.enable": True, "float8.emulate": "false"}),
    )
    with pytest.raises(TitanliteError, match="SM >= 8.9"):
        Trainer(cfg)


def test_a_device_where_the_probe_fails_is_refused():
    # The meta device holds no data: the probe's Float8Linear runs and cannot be read back,
    # as on an MPS build without float8 dtypes or float64 - and the device is refused.
    assert not fp8_support("meta").available
    with pytest.raises(TitanliteError, match="cannot run on meta.*--training.device cpu"):
        apply_fp8(tiny_model().to("meta"), device="meta")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_probe_runs_a_real_float8_linear_with_torchaos_scale_math(recipe):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen.append((func, getattr(out, "dtype", None)))
            return out

    with Ops() as ops:
        assert fp8._fp8_linear_works(torch.device("cpu"), recipe, emulate=True)
    dtypes = {dtype for _, dtype in ops.seen}
    # Scales are computed from amaxes in float64 (the step MPS cannot do), values are cast to
    # both FP8 formats' dtypes the recipe uses, and the backward ran (a weight gradient).
    assert torch.float64 in dtypes and torch.float8_e4m3fn in dtypes
    assert any(
        func in (torch.ops.aten.amax.default, torch.ops.aten.max.default) for func, _ in ops.seen
    )
    assert (
        sum(
            func in (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default)
            for func, _ in ops.seen
        )
        >= 3
    )  # forward, grad input, grad weight


@pytest.mark.parametrize(
    "recipe, compiled, expected",
    [
        ("rowwise", True, True),
        ("rowwise", False, False),
        ("tensorwise", True, False),
        ("tensorwise", False, False),
    ],
)
def test_inductor_emulates_precision_casts_only_for_compiled_rowwise(recipe, compiled, expected):
    import torch._inductor.config as inductor_config

    with inductor_config.patch(emulate_precision_casts=False):
        assert fp8.set_precision_casts_for(recipe, compiled) is expected


def test_the_trainer_turns_on_precision_cast_emulation_for_compiled_rowwise():
    import torch._inductor.config as inductor_config

    with inductor_config.patch(emulate_precision_casts=False):
        assert fp8.set_precision_casts_for("tensorwise", compiled=True) is False
        assert fp8.set_precision_casts_for("rowwise", compiled=False) is False
        assert fp8.set_precision_casts_for("rowwise", compiled=True) is True
        assert inductor_config.emulate_precision_casts


def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(
    not _has_fp8_gpu(),
    reason="real FP8 needs a CUDA GPU with SM >= 8.9 (H100, L4, L40S, RTX 4090); none is visible",
)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_real_fp8_on_a_capable_gpu_matches_bf16(recipe):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(256, 512, bias=False)).to("cuda", torch.bfloat16)
    f8 = apply_fp8(copy.deepcopy(ref), recipe, min_dim=16)
    if recipe == "rowwise" and f8.fp8_info["emulated"]:
        pytest.skip(f"this torch has no real rowwise kernel here: {f8.fp8_info['why']}")
    assert f8.fp8_info["emulated"] is False
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        # bf16's own rounding (u = 2^-9) is negligible next to e4m3's.
        assert E4M3_U / 8 < rel_err(f8(x), ref(x)) < 2 * E4M3_U
