"""Mixed precision: the support matrix is probed and explained, fp32 is the plain loop, autocast
computes in 16 bits while the weights stay fp32, and the fp16 scaler skips exactly the steps
that overflow, halving its scale, with clipping done on the true (unscaled) gradients."""

import contextlib
import copy
import math
import re
import warnings

import pytest
import torch
from conftest import tiny_overrides

from titanlite import TitanliteError
from titanlite.config import load_config
from titanlite.efficiency import mixed_precision as mp
from titanlite.efficiency.mixed_precision import MODES, Precision
from titanlite.models.llama import ModelArgs, build_model
from titanlite.tools.probe import precision_support as ps
from titanlite.tools.probe.precision_support import support, support_matrix
from titanlite.train import Trainer

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_probes():
    """Each test sees probes run afresh (a test may break GradScaler on purpose)."""
    mp.probe.cache_clear()
    ps._probed.cache_clear()
    yield
    mp.probe.cache_clear()
    ps._probed.cache_clear()


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return build_model(
        ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, max_seq_len=16), CPU
    )


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)


def forward_backward(model, precision, x, y):
    with precision.autocast():
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    precision.backward(loss)
    return loss.detach()


# ---- the support matrix ---------------------------------------------------------------------


def test_support_matrix_has_a_row_per_mode_for_this_device_with_reasons():
    rows = support_matrix(CPU)
    assert [(r.device, r.mode) for r in rows] == [(d, m) for d in ps.DEVICE_TYPES for m in MODES]
    here = [r for r in rows if r.device == "cpu"]
    assert all(r.here and r.works and r.source == "probed on this machine" for r in here)
    assert all(len(r.why) > 20 for r in rows), "every row says why"
    flags = ps.cpu_flags()
    if flags is not None:  # x86: "fast" must follow the CPU's bf16/fp16 units, not a guess
        for r in here[1:]:
            assert r.fast == bool(set(ps.FAST_CPU_FLAGS[r.mode]) & flags), r
            assert ("slower than fp32" in r.why) == (not r.fast), r.why
    for kind in ("cuda", "mps"):
        absent = [r for r in rows if r.device == kind and not mp._present(kind)]
        assert all(not r.here and r.source == "documented, not this machine" for r in absent)


def test_probing_leaves_the_random_stream_alone():
    # Trainer seeds, then builds Precision, then initialises the model: a probe that drew
    # random numbers would give every mode a different model.
    state = torch.get_rng_state()
    for mode in MODES:
        support(mode, CPU)
    assert torch.equal(state, torch.get_rng_state())


# ---- the three modes ------------------------------------------------------------------------


def test_fp32_precision_is_exactly_the_plain_path():
    plain, ours = tiny_model(), tiny_model()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    precision = Precision("fp32", CPU)
    for step in range(3):
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(plain(x).flatten(0, 1), y.flatten())
        loss.backward()
        norm_plain = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        opt_plain.step()
        opt_plain.zero_grad()
        forward_backward(ours, precision, x, y)
        norm, skipped = precision.step(opt_ours, ours.parameters(), grad_clip=0.5)
        opt_ours.zero_grad()
        assert norm == norm_plain.item() and not skipped
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), ours.parameters()))
    assert precision.scale == 1.0 and precision.skipped_steps == 0


def test_bf16_autocast_runs_matmuls_in_bf16_while_parameters_stay_fp32():
    model, precision = tiny_model(), Precision("bf16", CPU)
    seen = {}
    model.layers["0"].attention.q_proj.register_forward_hook(
        lambda mod, args, out: seen.update(q=out.dtype)
    )
    x, y = batch()
    forward_backward(model, precision, x, y)
    assert seen["q"] == torch.bfloat16
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        model(x)  # outside autocast: back to fp32
    assert seen["q"] == torch.float32


def test_fp16_scaler_skips_an_overflowing_step_and_halves_the_scale():
    model, precision = tiny_model(), Precision("fp16", CPU)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert precision.scale == 65536.0  # GradScaler's default initial scale
    history = []
    for step, poison in enumerate([None, math.inf, None, math.nan, None]):
        before = copy.deepcopy(model.state_dict())
        forward_backward(model, precision, *batch(step))
        if poison is not None:
            model.layers["0"].feed_forward.down_proj.weight.grad[0, 0] = poison
        _, skipped = precision.step(opt, model.parameters(), grad_clip=1.0)
        opt.zero_grad()
        unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        history.append((skipped, unchanged, precision.scale))
    assert history == [
        (False, False, 65536.0),
        (True, True, 32768.0),
        (False, False, 32768.0),
        (True, True, 16384.0),
        (False, False, 16384.0),
    ]
    assert precision.skipped_steps == 2
    assert opt.state[next(model.parameters())]["step"].item() == 3  # AdamW never saw the skips


def test_clipping_sees_unscaled_gradients():
    x, y = batch()
    ref_model, model = tiny_model(), tiny_model()
    fp32 = Precision("fp32", CPU)
    forward_backward(ref_model, fp32, x, y)
    ref_norm, _ = fp32.step(
        torch.optim.SGD(ref_model.parameters(), lr=0.0), ref_model.parameters(), grad_clip=0.0
    )
    fp16 = Precision("fp16", CPU)
    forward_backward(model, fp16, x, y)
    ref_norm = float(ref_norm)  # step() returns the norm as a tensor: no host sync per step
    clip = ref_norm / 4
    norm, skipped = fp16.step(
        torch.optim.SGD(model.parameters(), lr=0.0), model.parameters(), grad_clip=clip
    )
    # fp16 keeps 11 significant bits (relative rounding 2**-11 ~ 5e-4 per value); through a
    # forward and backward pass the norm moves by well under 1%. Without unscaling it would be
    # 65536 times larger.
    assert not skipped and float(norm) == pytest.approx(ref_norm, rel=1e-2)
    clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert clipped.item() == pytest.approx(clip, rel=1e-3), "clipped to grad_clip, in true units"


# ---- the trainer, in each mode --------------------------------------------------------------


@pytest.fixture(scope="module")
def fp32_records(data_dir, tmp_path_factory):
    return run_trainer(data_dir, tmp_path_factory.mktemp("fp32"), "fp32")[1].train


def run_trainer(data_dir, tmp_path, mode, **extra):
    # bf16/fp16 matmuls are emulated (tens of times slower) on CPUs without bf16 units: tiny.
    o = {
        "training.mixed_precision": mode,
        "training.steps": 3,
        "training.batch_size": 2,
        "training.seq_len": 16,
        "eval.every": 0,
        "eval.sample_tokens": 2,
        **extra,
    }
    trainer = Trainer(load_config(None, tiny_overrides(data_dir, tmp_path, **o)))
    return trainer, trainer.fit()


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_trainer_runs_in_each_mode_and_logs_the_scaler(mode, data_dir, tmp_path, fp32_records):
    trainer, history = run_trainer(data_dir, tmp_path, mode)
    assert trainer.compute_dtype == MODES[mode]
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    # Same seed, same data, same initial weights: the first loss differs only by rounding.
    assert history.losses[0] == pytest.approx(fp32_records[0]["loss"], abs=0.05)
    assert all(math.isfinite(x) for x in history.losses)
    if mode == "fp16":
        assert [(r["loss_scale"], r["skipped"], r["skipped_steps"]) for r in history.train] == [
            (65536.0, False, 0)
        ] * 3
    else:
        assert not any("loss_scale" in r for r in history.train)
    assert not any("loss_scale" in r for r in fp32_records)  # only fp16 has a scaler


def test_trainer_logs_skipped_steps_when_the_scale_is_too_large(data_dir, tmp_path):
    cfg = load_config(
        None,
        tiny_overrides(
            data_dir,
            tmp_path,
            **{
                "training.mixed_precision": "fp16",
                "training.steps": 3,
                "training.batch_size": 2,
                "training.seq_len": 16,
                "eval.every": 0,
                "eval.sample_tokens": 2,
            },
        ),
    )
    trainer = Trainer(cfg)
    trainer.precision = Precision("fp16", CPU, init_scale=2.0**40)  # scaled grads overflow fp16
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"))
        history = trainer.fit()
    scales = [r["loss_scale"] for r in history.train]
    assert scales == [2.0**39, 2.0**38, 2.0**37]
    assert [r["skipped_steps"] for r in history.train] == [1, 2, 3]
    assert all(r["skipped"] for r in history.train)


# ---- bad input ------------------------------------------------------------------------------


def test_unknown_mode_suggests_the_closest():
    for call in (lambda: Precision("bf61", CPU), lambda: support("fp61", CPU)):
        with pytest.raises(TitanliteError, match=r"did you mean: .*16"):
            call()
    with pytest.raises(TitanliteError, match="not one of auto, fp32, bf16, fp16"):
        load_config(None, {"training.mixed_precision": "fp8"})


def test_fp16_without_a_working_scaler_says_what_to_use_instead(monkeypatch):
    class NoKernelScaler(torch.amp.GradScaler):  # e.g. MPS before torch 2.8
        def unscale_(self, optimizer):
            if self._enabled:
                raise RuntimeError("no _amp_foreach_non_finite_check_and_unscale_ kernel here")
            super().unscale_(optimizer)

        def step(self, optimizer, *a, **k):
            self.unscale_(optimizer)
            return super().step(optimizer, *a, **k)

    monkeypatch.setattr(torch.amp, "GradScaler", NoKernelScaler)
    row = support("fp16", CPU)
    assert row.works is False and row.here
    with pytest.raises(TitanliteError) as err:
        Precision("fp16", CPU)
    message = str(err.value)
    assert "\n" not in message and "no _amp_foreach" in message
    assert message.endswith("use bf16 (no scaler needed) or fp32")
    assert support("bf16", CPU).works  # only the scaler is broken


def test_autocast_that_silently_disables_itself_is_caught(monkeypatch):
    # torch.autocast does not raise on a dtype the device lacks: it warns and runs in fp32.
    def autocast_without_bf16(device_type, dtype=None, **kw):
        warnings.warn(
            "In CPU autocast, but the target dtype is not supported. Disabling autocast.",
            stacklevel=2,
        )
        return contextlib.nullcontext()

    monkeypatch.setattr(torch, "autocast", autocast_without_bf16)
    row = support("bf16", CPU)
    assert row.works is False and "autocast did not run the matmul in bf16" in row.why
    assert "Disabling autocast" in row.why
    with pytest.raises(TitanliteError, match="use fp32$"):
        Precision("bf16", CPU)


def test_bf16_on_a_pre_ampere_gpu_is_refused_with_the_fix(monkeypatch):
    # What torch reports on a T4 (SM 7.5); decided before any probe touches the (absent) GPU.
    monkeypatch.setattr(mp, "_present", lambda kind: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(
        torch.cuda,
        "is_bf16_supported",  # True only counting emulation
        lambda including_emulation=True: including_emulation,
    )
    with pytest.raises(TitanliteError, match=r"SM 7\.5: use fp16 \(with the scaler\) or fp32$"):
        Precision("bf16", torch.device("cuda"))


def test_a_device_this_machine_lacks_is_refused_in_one_line():
    kind = next((k for k in ("cuda", "mps") if not mp._present(k)), None)
    if kind is None:
        pytest.skip("this machine has both CUDA and MPS")
    with pytest.raises(TitanliteError, match=f"on {kind}, which this machine does not have"):
        Precision("bf16", torch.device(kind))
    with pytest.raises(TitanliteError, match="use cuda, mps or cpu"):
        support("bf16", torch.device("meta"))


# ---- accelerators (skipped cleanly without one) ---------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rows_follow_what_torch_reports():
    gpu = torch.device("cuda")
    assert support("fp16", gpu).works and support("fp32", gpu).works
    assert support("bf16", gpu).works == torch.cuda.is_bf16_supported(including_emulation=False)
    p = Precision("fp16", gpu)
    w = torch.ones(8, 8, device=gpu)
    with p.autocast():
        assert (w @ w).dtype == torch.float16


@pytest.mark.skipif(not mp._present("mps"), reason="needs Apple MPS")
def test_mps_rows_follow_what_torch_reports():
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    assert support("fp16", torch.device("mps")).works == (version >= (2, 8))
    assert support("bf16", torch.device("mps")).works == torch.backends.mps.is_macos_or_newer(14, 0)


# ---- "auto" and the fp16 + fp16-weights trap ------------------------------------------------
def test_auto_is_the_default_and_is_fp32_on_the_cpu():
    assert load_config(None, {}).training.mixed_precision == "auto"
    precision = Precision("auto", CPU)
    assert (
        precision.mode == "fp32" and precision.dtype is None and not precision.scaler.is_enabled()
    )


def test_auto_on_a_faked_t4_is_fp16_with_the_scaler(monkeypatch):
    # What torch reports on a T4 (SM 7.5); the probe itself is cached as if it had run there.
    monkeypatch.setattr(mp, "_present", lambda kind: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(mp, "probe", lambda mode, device: None)  # as if it had run there
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **k: None)  # no CUDA to build one on
    assert Precision("auto", torch.device("cuda")).mode == "fp16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert Precision("auto", torch.device("cuda"), tf32=False).mode == "bf16"


def test_trainer_default_on_cpu_is_the_fp32_path(data_dir, tmp_path, fp32_records):
    trainer, history = run_trainer(data_dir, tmp_path, "auto")
    assert trainer.precision.mode == "fp32" and trainer.compute_dtype == torch.float32
    assert history.losses == [r["loss"] for r in fp32_records]  # same losses, bit for bit
    assert all(
        r["mfu_datasheet"] is None
        and r["reserved_memory_bytes"] is None
        and r["alloc_retries"] is None
        for r in history.train
    )


def test_fp16_weights_with_the_fp16_scaler_are_refused_in_one_line():
    model = tiny_model().half()
    precision = Precision("fp16", CPU)
    x, y = batch()
    forward_backward(model, precision, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        TitanliteError
    ) as err:  # not GradScaler's "Attempting to unscale FP16 gradients"
        precision.step(opt, model.parameters(), grad_clip=1.0)
    assert "\n" not in str(err.value) and "--training.dtype float32" in str(err.value)


def test_the_trainer_refuses_fp16_weights_with_the_scaler_before_any_step(data_dir, tmp_path):
    from conftest import tiny_overrides

    from titanlite.config import load_config
    from titanlite.train import Trainer

    cfg = load_config(
        None,
        tiny_overrides(
            data_dir, tmp_path, **{"training.dtype": "float16", "training.mixed_precision": "fp16"}
        ),
    )
    with pytest.raises(TitanliteError) as err:
        Trainer(cfg)
    assert "\n" not in str(err.value) and "--training.dtype float32" in str(err.value)
    assert not (tmp_path / "runs").exists()  # refused at construction: nothing written
