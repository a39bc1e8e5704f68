"""What a GPU user would meet, established on a CPU ("virtual GPU" checks): no host sync on an
unlogged step, CUDA's defaults decided from an H100's / A100's / T4's facts, the dtypes that reach
attention, TF32's getters, the FP8 facts in run.json and MFU, the async save's ordering."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_overrides

from titanlite import TitanliteError
from titanlite.config import Config
from titanlite.device_policy import (
    allocator_settings,
    check_fp8_compiled,
    cuda_index_for,
    device_defaults,
    enable_tf32,
    sdpa_priority,
    use_fused_adamw,
)
from titanlite.tools.measure.host_syncs import HostSyncs, train_and_count

H100, A100, T4 = (9, 0), (8, 0), (7, 5)


# ----- host syncs ------------------------------------------------------------------------------


def test_the_counter_sees_every_kind_of_sync():
    """The check can fail: each way of waiting for the device is seen, with where it was made."""
    from titanlite.tools.measure import host_syncs

    t = torch.ones(3)
    with HostSyncs() as syncs:  # as if titanlite's own code made these calls
        host_syncs._every_kind_of_sync(t)
    kinds = " ".join(syncs.sites)
    for what in ("item", "scalar read", "tolist", "cpu", "torch.tensor(..., device=)"):
        assert what in kinds, (what, syncs.sites)
    with HostSyncs() as quiet:
        (t * 2).sum().item()  # made here, outside titanlite: not counted
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0).step()
    assert quiet.sites == []


def test_the_counter_sees_reads_torch_makes_for_titanlite_and_in_every_package(monkeypatch):
    """A read torch makes on titanlite's behalf counts (GradScaler.get_scale's .item(), made from
    titanlite's code), and so does one in titanlite/data; only the named host-by-design reads
    (the sampler's window indices) do not."""
    from titanlite.data import transfer
    from titanlite.data.sampler import StatefulBatchSampler
    from titanlite.efficiency.mixed_precision import Precision

    precision = Precision("fp16", "cpu")
    precision.scaler.scale(torch.ones(()))  # the scale exists from the first scaled loss on
    with HostSyncs() as syncs:
        assert precision.scale == 2.0**16  # get_scale(): .item() inside torch, from titanlite
    assert any("mixed_precision.py" in s and "(in torch)" in s for s in syncs.sites), syncs.sites
    real = transfer.to_device
    monkeypatch.setattr(transfer, "to_device", lambda b, d: (b[0].sum().item(), real(b, d))[1])
    batch = (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
    with HostSyncs() as syncs:
        transfer.micro_batches_to([batch], "cpu")  # a sync planted in titanlite/data
    assert any("test_virtual_gpu.py" in s or "transfer.py" in s for s in syncs.sites), syncs.sites
    with HostSyncs() as syncs:
        StatefulBatchSampler(64, 4).next_indices()  # host tensors by design
    assert syncs.sites == []


def _unlogged_syncs(per_step: dict) -> dict:
    return {step: sites for step, (logged, sites) in per_step.items() if not logged and sites}


def test_an_unlogged_step_never_waits_for_the_device_alone(data_dir, tmp_path):
    per_step = train_and_count(
        tiny_overrides(
            data_dir, tmp_path, **{"training.steps": 8, "metrics.log_every": 4, "eval.every": 0}
        )
    )
    assert _unlogged_syncs(per_step) == {}
    assert [s for s, (logged, _) in per_step.items() if logged] == [4, 8]
    # reading the loss: one, at least
    assert all(sites for logged, sites in per_step.values() if logged)


def test_an_unlogged_fp16_step_never_waits_for_the_device(data_dir, tmp_path):
    """fp16 with a GradScaler, the default on a T4 or V100: the scale and a skipped step stay on
    the device (reading them was two waits a step); with an overflow planted (a huge initial scale
    overflows the first steps), the skips are still found, and read only when a step is logged."""
    o = tiny_overrides(
        data_dir,
        tmp_path,
        **{
            "training.steps": 8,
            "metrics.log_every": 4,
            "eval.every": 0,
            "training.mixed_precision": "fp16",
        },
    )
    per_step = train_and_count(o)
    assert _unlogged_syncs(per_step) == {}
    records = (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()
    logged = [r for r in map(json.loads, records) if r["kind"] == "train"]
    assert [r["step"] for r in logged] == [4, 8]
    assert all(isinstance(r["skipped_steps"], int) and r["loss_scale"] > 0 for r in logged)


def test_an_overflowing_fp16_step_is_skipped_and_counted_without_a_wait():
    """The skip is found on the device (the scale halved), not by reading the scale back."""
    from titanlite.efficiency.mixed_precision import Precision

    w = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([w], lr=0.1, fused=True)
    precision = Precision("fp16", "cpu")
    for overflow in (False, True, False):
        precision.backward((w * 2).sum())
        if overflow:
            w.grad[0] = float("inf")
        before = w.detach().clone()
        with HostSyncs() as syncs:
            _, skipped = precision.step(optimizer, [w], grad_clip=1.0)
        assert syncs.sites == [], syncs.sites
        assert bool(skipped) == overflow and torch.equal(w.detach(), before) == overflow
        optimizer.zero_grad(set_to_none=True)
    assert int(precision.skipped_steps) == 1 and precision.scale == 2.0**15


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [{"parallel.dp_replicate": 2, "parallel.dp_shard": 1}, {"parallel.dp_shard": 2}],
    ids=["ddp", "fsdp"],
)
def test_an_unlogged_step_never_waits_for_the_device_on_two_ranks(data_dir, tmp_path, layout):
    """With the tools `titanlite train` hands in (goodput, stragglers): before, every step built a
    device tensor from the token count and gathered and read the stragglers' times."""
    from titanlite.tools.jobs.launcher import launch_function

    o = tiny_overrides(
        data_dir,
        tmp_path,
        **{"training.steps": 8, "metrics.log_every": 4, "eval.every": 0, **layout},
    )
    for rank, per_step in enumerate(
        launch_function(
            "titanlite.tools.measure.host_syncs:train_and_count",
            nproc=2,
            log_dir=str(tmp_path),
            overrides=o,
            timeout_s=400,
        )
    ):
        assert _unlogged_syncs(per_step) == {}, rank
        assert [s for s, (logged, _) in per_step.items() if logged] == [4, 8]


# ----- CUDA's defaults, from each GPU's facts ---------------------------------------------------


def _defaults(capability, fsdp=True, device="cuda", **cfg_overrides):
    return device_defaults(Config().with_overrides(cfg_overrides), device, capability, fsdp)


def test_cuda_gets_torchtitans_defaults_and_the_cpu_keeps_its_own():
    assert _defaults(H100) == {
        "parallel.param_dtype": "bfloat16",
        "training.mixed_precision": "fp32",
        "model.attention": "sdpa",  # no document mask: causal SDPA (flex only under a mask)
        "compile.enable": True,
        "metrics.log_every": 10,
    }
    # Not sharded: autocast is the mixed precision (bf16, resolved later by Precision).
    assert _defaults(H100, fsdp=False) == {
        "parallel.param_dtype": "float32",
        "model.attention": "sdpa",
        "compile.enable": True,
        "metrics.log_every": 10,
    }
    # No bf16 units on a T4: FSDP keeps fp32 weights; the scaler question is Precision's.
    assert _defaults(T4)["parallel.param_dtype"] == "float32"
    assert _defaults(None, device="cpu") == {
        "parallel.param_dtype": "float32",
        "model.attention": "sdpa",
        "compile.enable": False,
        "metrics.log_every": 1,
    }
    assert _defaults(None, device="mps", fsdp=False)["compile.enable"] is False
    # What a user set is never overridden.
    assert (
        _defaults(
            H100,
            **{
                "parallel.param_dtype": "float32",
                "compile.enable": False,
                "metrics.log_every": 1,
                "training.mixed_precision": "bf16",
                "model.attention": "sdpa",
            },
        )
        == {}
    )
    assert use_fused_adamw("cuda") and not use_fused_adamw("cpu") and not use_fused_adamw("mps")


def _h100_with_a_new_cudnn(monkeypatch):
    """An H100 with cuDNN 9.15.1 and a CUDA 12.8 build: where torch itself puts cuDNN first."""
    from titanlite import device_policy

    monkeypatch.setattr(device_policy, "_CUDNN", [91501])
    monkeypatch.setattr(torch.version, "cuda", "12.8")


def test_the_sdpa_order_puts_cudnn_first_on_cuda_only_where_torch_would(monkeypatch):
    from torch.nn.attention import SDPBackend

    from titanlite import device_policy

    # Facts set, not read off this machine: the suite runs on CPU and CUDA builds of torch alike.
    monkeypatch.setattr(device_policy, "_CUDNN", [None])  # a build without cuDNN
    assert sdpa_priority("cuda", H100) is None  # torch's own order
    monkeypatch.setattr(device_policy, "_CUDNN", [91500])  # 9.15.0: before the fix torch needs
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert sdpa_priority("cuda", H100) is None
    _h100_with_a_new_cudnn(monkeypatch)
    assert sdpa_priority("cuda", H100) == [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    assert sdpa_priority("cuda", A100) is None and sdpa_priority("cuda", (8, 9)) is None
    assert sdpa_priority("cpu") is None and sdpa_priority("mps") is None


def _spy_on_attention(monkeypatch, run: bool = True) -> list:
    """Record what each SDPA call is given: q/k/v dtypes and heads, enable_gqa, the kernel order in force."""
    import torch.nn.functional as F
    from torch.nn.attention import _cur_sdpa_kernel_backends

    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append(
            {
                "dtypes": (q.dtype, k.dtype, v.dtype),
                "heads": (q.shape[1], k.shape[1]),
                "enable_gqa": kwargs.get("enable_gqa", False),
                "is_causal": kwargs.get("is_causal", False),
                "masked": kwargs.get("attn_mask") is not None,
                "order": _cur_sdpa_kernel_backends(with_priority=True),
            }
        )
        return real(q, k, v, **kwargs) if run else torch.empty_like(q)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_under_autocast_q_k_and_v_reach_attention_in_one_dtype(monkeypatch):
    """RoPE's fp32 tables must not promote autocast's bf16 q/k back to fp32 (v stays bf16): the GQA
    decision would see fp32 and repeat k/v, and fp32 q/k reach no fast CUDA kernel."""
    from titanlite.models.llama import ModelArgs, build_model

    calls = _spy_on_attention(monkeypatch)
    model = build_model(ModelArgs.preset("debug", vocab_size=64))  # fp32 weights, as with autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 64, (2, 16)))
    assert len(calls) == model.args.n_layers
    assert all(call["dtypes"] == (torch.bfloat16,) * 3 for call in calls), [
        c["dtypes"] for c in calls
    ]


def test_on_an_h100_attention_tries_cudnn_first_and_keeps_gqa(monkeypatch):
    """Fake CUDA tensors (FakeTensorMode) with an H100's facts: the call is made under titanlite's
    kernel order, GQA goes to SDPA unexpanded in bf16 and expanded in fp32; torch's order returns after."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import _cur_sdpa_kernel_backends

    from titanlite.models.llama import causal_attention

    before = _cur_sdpa_kernel_backends(with_priority=True)
    _h100_with_a_new_cudnn(monkeypatch)
    calls = _spy_on_attention(monkeypatch, run=False)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(major=9, minor=0)
    )
    with FakeTensorMode():
        # the 1B preset: 32 heads, 8 KV
        q = torch.empty(2, 32, 128, 64, device="cuda", dtype=torch.bfloat16)
        kv = torch.empty(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16)
        causal_attention(q, kv, kv)
        causal_attention(q.float(), kv.float(), kv.float())
    bf16, fp32 = calls
    h100 = sdpa_priority("cuda", H100)
    assert h100[0].name == "CUDNN_ATTENTION"
    assert bf16["order"][:4] == h100 and fp32["order"][:4] == h100
    assert bf16["heads"] == (32, 8) and bf16["enable_gqa"]
    # repeated to reach the efficient kernel
    assert fp32["heads"] == (32, 32) and not fp32["enable_gqa"]
    assert _cur_sdpa_kernel_backends(with_priority=True) == before
    calls.clear()
    causal_attention(torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))
    assert calls[0]["order"] == before  # the CPU keeps torch's own order


@pytest.mark.parametrize(
    "capability, kernel, expanded",
    [(H100, "cudnn", False), (A100, "flash", False), (T4, "efficient", True)],
)
def test_the_attention_kernel_each_preset_would_get(capability, kernel, expanded):
    """Predicted, not measured: every preset in the dtype CUDA's defaults give it on this GPU."""
    from titanlite.device_policy import default_mixed_precision, expand_kv_for_sdpa
    from titanlite.labs.nb04_sdpa_kernels import sdpa_kernel_for
    from titanlite.models.llama import PRESETS, ModelArgs

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[
        default_mixed_precision("cuda", capability)
    ]
    for preset in PRESETS:
        args = ModelArgs.preset(preset)
        gqa = args.n_kv_heads < args.n_heads
        # a current build: cuDNN 9.15.1 with CUDA 12.8 (torch puts cuDNN first on Hopper only)
        new = {"cudnn_version": 91501, "cuda_version": "12.8"}
        got = sdpa_kernel_for("cuda", dtype, args.head_dim, gqa, capability, **new)
        assert got == kernel, preset
        assert expand_kv_for_sdpa("cuda", dtype, args.head_dim, capability) is expanded, preset


def test_expandable_segments_unless_the_user_chose():
    assert allocator_settings("cuda", env={}) == "expandable_segments:True"
    assert (
        allocator_settings("cuda", env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) is None
    )
    assert allocator_settings("cpu", env={}) is None


def test_real_fp8_needs_compile_emulated_fp8_does_not():
    with pytest.raises(TitanliteError, match="needs torch.compile.*--compile.enable true"):
        check_fp8_compiled("cuda", H100, True, "auto", compiled=False)
    check_fp8_compiled("cuda", H100, True, "auto", compiled=True)
    check_fp8_compiled("cuda", A100, True, "auto", compiled=False)  # no FP8 units: emulated
    check_fp8_compiled("cuda", H100, True, "true", compiled=False)  # emulation asked for
    check_fp8_compiled("cpu", None, True, "auto", compiled=False)  # the CPU notebooks


def test_one_gpu_visible_per_process_is_that_processs_gpu():
    # SLURM --gpus-per-task=1 / Kubernetes: local rank 3 of 4, but only one GPU to see.
    assert cuda_index_for(None, local_rank=3, local_world_size=4, device_count=1) == 0
    assert cuda_index_for(None, local_rank=3, local_world_size=4, device_count=4) == 3
    with pytest.raises(TitanliteError, match="local rank 3 has no GPU"):
        cuda_index_for(None, local_rank=3, local_world_size=4, device_count=2)


def test_after_enable_tf32_every_precision_getter_inductor_calls_still_works():
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    try:
        enable_tf32()
        assert matmul.allow_tf32 and cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() in ("high", "medium")
        assert matmul.fp32_precision == "tf32"  # the new getter reads the legacy flag fine
        assert torch.backends.mkldnn.matmul.fp32_precision != "tf32"  # the CPU's matmuls untouched
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


# ----- the final weights: only rank 0 holds the whole model, in CPU memory ----------------------

WEIGHTS_SCRIPT = """
import json, sys, torch
import torch.distributed as dist
from titanlite.config import load_config
from titanlite.train import Trainer
from titanlite.weights import full_state_dict, save_weights
import titanlite.weights as weights
overrides, out = json.loads(sys.argv[1]), sys.argv[2]
trainer = Trainer(load_config(None, overrides))
trainer.fit()
seen = []
real = weights.get_model_state_dict
weights.get_model_state_dict = lambda model, options: seen.append(options.cpu_offload) or real(model, options=options)
held = full_state_dict(trainer.model, rank0_only=True)
save_weights(trainer.model_parts, trainer.model_args, trainer.dtype, trainer.tokenizer,
             trainer.cfg.metrics.log_dir + "/t", pp=1, is_main=trainer.dist.is_main)
json.dump({"keys": len(held), "cpu_offload": seen, "devices": sorted({str(v.device) for v in held.values()})},
          open(f"{out}.rank{dist.get_rank()}.json", "w"))
trainer.close(barrier=True)
"""


@pytest.mark.slow
def test_under_fsdp_only_rank_0_holds_the_whole_model_and_in_cpu_memory(data_dir, tmp_path):
    """Before: every rank gathered the full model (on the GPU) and copied it to the CPU to write
    weights that only rank 0 writes - 32 GB per GPU at the 8B preset."""
    from conftest import run_torchrun

    script = tmp_path / "weights.py"
    script.write_text(WEIGHTS_SCRIPT)
    o = tiny_overrides(
        data_dir, tmp_path, **{"training.steps": 1, "eval.every": 0, "parallel.dp_shard": 2}
    )
    run_torchrun(script, json.dumps(o), tmp_path / "held", timeout=300)
    rank0, rank1 = (json.loads((tmp_path / f"held.rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["keys"] > 0 and rank0["devices"] == ["cpu"] and rank1["keys"] == 0
    # and save_weights asked for it too
    assert rank0["cpu_offload"] == rank1["cpu_offload"] == [True, True]
    assert (tmp_path / "runs" / "t" / "model.safetensors").is_file()


# ----- the async save's ordering ---------------------------------------------------------------


def test_an_async_save_of_cuda_tensors_lets_the_step_finish_before_staging(tmp_path, monkeypatch):
    """Mocked CUDA: torch's stager copies on its own stream, which does not wait for training's, so
    the compute stream is synchronised before every staging, logged step or not."""
    from types import SimpleNamespace

    from titanlite.resilience import async_saves
    from titanlite.resilience.checkpoint import Checkpointer

    order, make_stager = [], async_saves.make_stager

    def recording_stager(options, shared_memory):
        assert options["use_staging_stream"]  # what CUDA tensors get
        # a CPU copy stands in
        stager = make_stager(async_saves.staging_options({"cpu"}), shared_memory)
        stage = stager.stage
        stager.stage = lambda state_dict, **kw: (order.append("stage"), stage(state_dict, **kw))[1]
        return stager

    monkeypatch.setattr(async_saves, "tensor_device_types", lambda state: {"cuda"})
    monkeypatch.setattr(async_saves, "make_stager", recording_stager)
    monkeypatch.setattr(
        torch.cuda,
        "current_stream",
        lambda device=None: SimpleNamespace(synchronize=lambda: order.append("sync")),
    )
    ckpt = Checkpointer(tmp_path / "ck", mode="async")
    for step in (1, 2):
        ckpt.save({"w": torch.full((4,), float(step))}, step)
        ckpt.wait_for_staging()
    ckpt.close()
    assert order == ["sync", "stage", "sync", "stage"]


# ----- FP8 behind a DDP wrapper -------------------------------------------------------------------
TRAIN_SCRIPT = """
import json, sys
from titanlite.config import load_config
from titanlite.tools.probe.matmul_peak import MatmulPeaks
from titanlite.train import Trainer
trainer = Trainer(load_config(None, json.loads(sys.argv[1])), peaks=MatmulPeaks())
trainer.fit()
trainer.close(barrier=True)
"""


@pytest.mark.slow
def test_fp8_behind_ddp_reaches_run_json_and_the_mfu_dtype(data_dir, tmp_path):
    """Before: the FP8 facts were read from the DDP wrapper (which has none), so run.json said
    float8: null and MFU divided by the wrong peak. Emulated FP8 multiplies in fp32 here."""
    from conftest import run_torchrun

    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    o = tiny_overrides(
        data_dir,
        tmp_path,
        **{
            "training.steps": 2,
            "eval.every": 0,
            "parallel.dp_replicate": 2,
            "parallel.dp_shard": 1,
            "float8.enable": True,
            "float8.min_dim": 16,
        },
    )
    run_torchrun(script, json.dumps(o), timeout=300)
    info = json.loads((tmp_path / "runs" / "t" / "run.json").read_text())
    assert info["parallel"] == "ddp" and info["world_size"] == 2
    assert info["float8"]["emulated"] and len(info["float8"]["converted"]) == 14, info["float8"]
    assert info["compute_dtype"] == "torch.float32" and "float32" in info["peak_label"], info[
        "peak_label"
    ]


# ----- per-GPU memory under FSDP, on fake tensors -----------------------------------------------


@pytest.mark.parametrize("preset", ["1B", "8B"])
@pytest.mark.parametrize("seq_len", [2048, 8192])
def test_fsdp_defaults_keep_no_weight_copy_for_backward_and_match_the_formulas(preset, seq_len):
    """Eight fake H100 ranks: with CUDA's defaults no copy of a weight survives from forward to
    backward, the shards are ZeRO-3's formula and the saved activations the activation formula's;
    with the old defaults (fp32 params, bf16 autocast) every Linear's bf16 cast is kept."""
    from torch import nn

    from titanlite.models.llama import ModelArgs, Transformer
    from titanlite.tools.predict.predict_memory import predict

    now = predict(preset, seq_len, 8, H100)
    assert now["policy"] == {"param_dtype": torch.bfloat16, "autocast": None}
    assert now["weight_copies"] == 0
    assert now["params"] == now["formula"]["params"]
    # the fp32 table cast to bf16, once a forward
    rotary_cos = 2 * seq_len * ModelArgs.preset(preset).head_dim
    assert now["saved"] == now["formula"]["activations"] + rotary_cos
    before = predict(preset, seq_len, 8, H100, before=True)
    with torch.device("meta"):
        model = Transformer(ModelArgs.preset(preset))
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert before["weight_copies"] == 2 * linear_weights
    assert before["saved"] > now["saved"] + before["weight_copies"]


@pytest.mark.parametrize("preset, seq_len", [("8B", 8192), ("1B", 2048)])
def test_two_totals_of_the_predicted_table_recomputed_by_another_route(preset, seq_len):
    """The published table's totals (default dtypes, no AC) from formulas alone, no fake tensors:
    ZeRO-3's bytes per rank; the activation formula plus the bf16 rotary table the model casts;
    the gathered weights from the preset's shapes (embedding and, untied, output: V·D each; the
    final norm: D; the last block's matrices and norms); the logits, T·V·(2 + 4 + 4) bytes."""
    from pathlib import Path

    from titanlite.models.llama import ModelArgs
    from titanlite.tools.predict.activation_memory import activation_memory_estimate
    from titanlite.tools.predict.zero import zero_bytes_per_rank

    args = ModelArgs.preset(preset, max_seq_len=max(seq_len, ModelArgs.preset(preset).max_seq_len))
    D, F, V, hd = args.dim, args.hidden_dim, args.vocab_size, args.head_dim
    q_o, k_v = 2 * D * args.n_heads * hd, 2 * D * args.n_kv_heads * hd
    block = q_o + k_v + 3 * D * F + 2 * D
    n = (1 if args.tie_embeddings else 2) * V * D + D + args.n_layers * block
    zero = zero_bytes_per_rank(n, 8, stage=3)
    state = zero["params"] + zero["grads"] + zero["optimizer"]
    saved = (
        activation_memory_estimate(args, 1, seq_len, dtype_bytes=2, mode="none") + 2 * seq_len * hd
    )
    gathered = 2 * ((1 if args.tie_embeddings else 2) * V * D + D + block)
    logits = seq_len * V * (2 + 4 + 4)
    total = (state + saved + gathered + logits) / 2**30
    doc = (
        Path(__file__).resolve().parents[1] / "docs" / "hardware" / "predicted-h100.md"
    ).read_text()
    (row,) = [
        line
        for line in doc.splitlines()
        if line.startswith(f"| {preset} | {seq_len} | bfloat16 (default) | none | none |")
    ]
    assert float(row.split("|")[-2].split()[0]) == pytest.approx(total, abs=0.006), (row, total)
    assert float(row.split("|")[-3].split()[0]) == pytest.approx(logits / 2**30, abs=0.006)


def test_the_predicted_h100_table_in_docs_is_what_the_script_prints_now():
    from pathlib import Path

    from titanlite.tools.predict.predict_memory import markdown

    doc = Path(__file__).resolve().parents[1] / "docs" / "hardware" / "predicted-h100.md"
    assert doc.read_text() == markdown(), (
        "regenerate: python -m titanlite.tools.predict.predict_memory > " + str(doc)
    )
    assert "not measured" in doc.read_text().splitlines()[0]


# ----- which GPU each rank takes, and two ranks on one GPU ---------------------------------------


def _fake_gpus(monkeypatch, uuids: list[str], capability=H100) -> list:
    """torch sees these GPUs (one UUID each); returns the devices set_device is called with."""
    from types import SimpleNamespace

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)

    def properties(device=None):
        index = torch.device(device).index or 0 if device is not None else 0
        return SimpleNamespace(uuid=uuids[index], major=capability[0], minor=capability[1])

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    return chosen


def _join_as(monkeypatch, rank, local_rank, world, local_world, others: dict[int, str]):
    """init_distributed as rank `rank` of a job whose other ranks already wrote their GPUs to the
    store (`others`: rank -> "host/uuid"); returns (its DistEnv or the error, the process-group
    arguments it would have started NCCL with)."""
    import socket

    from conftest import join_as_rank

    from titanlite.distributed import env

    started = join_as_rank(monkeypatch, rank, local_rank, world, local_world, others)
    try:
        out = env.init_distributed("auto", "auto", 60)
    except TitanliteError as e:
        out = e
    return out, started, socket.gethostname()


def test_one_gpu_and_two_ranks_is_refused_in_one_line_before_nccl_starts(monkeypatch):
    """torchrun --nproc-per-node 2 on a one-GPU machine: both ranks would take cuda:0 (one visible
    GPU per process is each rank's own, as under SLURM, so the index cannot tell): the UUIDs the
    ranks exchange over torch's store can, and NCCL is never started."""
    _fake_gpus(monkeypatch, ["GPU-aaaa"])
    host = __import__("socket").gethostname()
    out, started, _ = _join_as(monkeypatch, 1, 1, 2, 2, {0: f"{host}/GPU-aaaa"})
    assert isinstance(out, TitanliteError) and "ranks 0, 1 took the same GPU" in str(out), out
    assert "\n" not in str(out) and started == {}


def test_slurm_one_gpu_per_task_each_rank_takes_its_own_gpu(monkeypatch):
    """SLURM --gpus-per-task=1: each task sees one GPU, its own (another UUID): cuda:0 for both,
    and NCCL starts with that device."""
    _fake_gpus(monkeypatch, ["GPU-bbbb"])
    host = __import__("socket").gethostname()
    out, started, _ = _join_as(monkeypatch, 1, 1, 2, 2, {0: f"{host}/GPU-aaaa"})
    assert out.device == torch.device("cuda", 0) and out.backend == "nccl"
    assert started["backend"] == "nccl" and started["device_id"] == torch.device("cuda", 0)
    assert started["rank"] == 1 and started["world_size"] == 2


def test_eight_gpus_each_local_rank_takes_its_own(monkeypatch):
    chosen = _fake_gpus(monkeypatch, [f"GPU-{i}" for i in range(8)])
    host = __import__("socket").gethostname()
    others = {r: f"{host}/GPU-{r}" for r in range(8) if r != 5}
    out, started, _ = _join_as(monkeypatch, 5, 5, 8, 8, others)
    assert out.device == torch.device("cuda", 5) and started["device_id"] == torch.device("cuda", 5)
    assert chosen == [torch.device("cuda", 5)]  # torch.cuda.set_device: kernels land there


def test_on_a_second_node_a_rank_takes_the_gpu_of_its_local_rank(monkeypatch):
    """Rank 13 of 16 on two 8-GPU nodes is local rank 5 on its node: cuda:5, set as the current
    device before NCCL starts (the global rank, 13, names no GPU here)."""
    chosen = _fake_gpus(monkeypatch, [f"GPU-{i}" for i in range(8)])
    host = __import__("socket").gethostname()
    others = {r: f"first-node/GPU-{r}" for r in range(8)}  # ranks 0-7: the other machine
    others |= {8 + r: f"{host}/GPU-{r}" for r in range(8) if r != 5}
    out, started, _ = _join_as(monkeypatch, 13, 5, 16, 8, others)
    assert out.device == torch.device("cuda", 5) and started["device_id"] == torch.device("cuda", 5)
    assert chosen == [torch.device("cuda", 5)] and started["rank"] == 13


def test_allocator_settings_reach_the_allocator_before_and_after_cuda_starts(monkeypatch):
    """hardware.use_allocator_settings: before CUDA's first allocation through the environment
    (read then), once CUDA is up through the allocator itself (the environment is read no more)."""
    from titanlite import hardware

    applied = []
    monkeypatch.setattr(hardware, "set_cuda_allocator_settings", applied.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    hardware.use_allocator_settings("expandable_segments:True")
    assert __import__("os").environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert applied == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    hardware.use_allocator_settings("expandable_segments:True")
    assert applied == ["expandable_segments:True"]
    hardware.use_allocator_settings(None)  # nothing asked: nothing changes
    assert applied == ["expandable_segments:True"]


def test_a_cuda_batch_is_pinned_then_copied_without_waiting():
    """data/transfer.to_device on CUDA: each tensor pinned (page-locked), then copied with
    non_blocking=True, so the copy overlaps the compute already queued; elsewhere a plain copy."""
    from titanlite.data.transfer import to_device

    class Spy:
        def __init__(self, log, name):
            self.log, self.name = log, name

        def pin_memory(self):
            self.log.append((self.name, "pin_memory"))
            return self

        def to(self, device, non_blocking=False):
            self.log.append((self.name, "to", str(device), non_blocking))
            return self

    log = []
    to_device((Spy(log, "x"), Spy(log, "y")), "cuda:0")
    assert log == [
        ("x", "pin_memory"),
        ("x", "to", "cuda:0", True),
        ("y", "pin_memory"),
        ("y", "to", "cuda:0", True),
    ]
    log.clear()
    to_device((Spy(log, "x"),), "mps")
    assert log == [("x", "to", "mps", False)]


def test_an_async_save_of_cuda_state_stages_into_pinned_memory(monkeypatch):
    """The stager made for CUDA tensors copies into pinned host memory, on its own stream,
    without blocking (torch's StagingOptions as staging_options says); for CPU tensors, none."""
    from titanlite.resilience import staging

    made = []
    monkeypatch.setattr(staging, "DefaultStager", lambda options: made.append(options))
    monkeypatch.setattr(staging, "HostStager", lambda options: made.append(options))
    staging.make_stager(staging.staging_options({"cuda", "cpu"}))
    staging.make_stager(staging.staging_options({"cpu"}))
    cuda, cpu = made
    assert cuda.use_pinned_memory and cuda.use_non_blocking_copy and cuda.use_async_staging
    assert not cpu.use_pinned_memory and not cpu.use_non_blocking_copy


# ----- the wiring: what the trainer passes on from each decision --------------------------------
# The decisions above are functions of a device's facts; these check that the Trainer hands each
# one to what it builds. Each was broken once in a scratch copy (the audit of issue 36) and the
# suite passed; each test here fails on its break.


@pytest.fixture
def two_fake_ranks(monkeypatch):
    """This process as rank 0 of a 2-rank torchrun job on torch's fake process group: the Trainer
    builds exactly what it builds there (DDP, FSDP, their dtypes) while no collective moves data."""
    from conftest import torchrun_environment

    from titanlite._compat.torch_tools import fake_process_group

    torchrun_environment(monkeypatch, 0, 0, 2, 2)
    fake_process_group(2)
    yield
    torch.distributed.destroy_process_group()


def _trainer(data_dir, tmp_path, **overrides):
    from titanlite.config import load_config
    from titanlite.train import Trainer

    return Trainer(load_config(None, tiny_overrides(data_dir, tmp_path, **overrides)))


def test_fsdp_gathers_in_the_param_dtype_the_config_resolved_to(data_dir, tmp_path, two_fake_ranks):
    """CUDA's default under FSDP is bf16 parameters (device_defaults): the trainer must hand that
    dtype to fully_shard, and MFU must divide by bf16's peak."""
    from titanlite.run_record import built

    trainer = _trainer(
        data_dir, tmp_path, **{"parallel.dp_shard": 2, "parallel.param_dtype": "bfloat16"}
    )
    record = built(trainer)
    assert record["fsdp"] == {"param_dtype": "torch.bfloat16", "reduce_dtype": "torch.float32"}
    assert record["weights_dtype"] == "torch.float32"  # the shards FSDP keeps, AdamW steps
    assert trainer.compute_dtype == torch.bfloat16


def test_behind_ddp_real_fp8_makes_mfu_divide_by_bf16(
    data_dir, tmp_path, two_fake_ranks, monkeypatch
):
    """The FP8 facts live on the model, not on its DDP wrapper: read through the wrapper, real FP8
    would count as fp32 and MFU divide by the wrong peak. (Real FP8 needs a GPU: its facts are
    planted on the model class, as apply_fp8 sets them on the model.)"""
    from titanlite.models.llama import Transformer

    monkeypatch.setattr(Transformer, "fp8_info", {"emulated": False}, raising=False)
    trainer = _trainer(data_dir, tmp_path, **{"parallel.dp_replicate": 2, "parallel.dp_shard": 1})
    assert trainer.dims.strategy == "ddp" and type(trainer.model).__name__.endswith("DataParallel")
    assert trainer.compute_dtype == torch.bfloat16


def test_the_optimizer_is_fused_where_the_policy_says(data_dir, tmp_path, monkeypatch):
    """use_fused_adamw answers per device type (CUDA: yes); the AdamW the trainer builds must be
    what it answered. Here the policy is asked to say yes for the CPU, which fused AdamW runs on."""
    import titanlite.optimizer
    from titanlite.run_record import built

    monkeypatch.setattr(titanlite.optimizer, "use_fused_adamw", lambda device_type: True)
    assert built(_trainer(data_dir, tmp_path))["fused"] is True
    monkeypatch.setattr(titanlite.optimizer, "use_fused_adamw", lambda device_type: False)
    assert built(_trainer(data_dir, tmp_path))["fused"] is False


def test_on_an_h100_real_fp8_without_compile_is_refused_when_the_config_is_resolved(monkeypatch):
    """resolve_for_device, which the trainer calls, applies check_fp8_compiled (itself tested above)."""
    from titanlite.device_policy import resolve_for_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: H100)
    cfg = Config().with_overrides({"float8.enable": True, "compile.enable": False})
    with pytest.raises(TitanliteError, match="compile"):
        resolve_for_device(cfg, torch.device("cuda", 0), fsdp=False)
    cfg = cfg.with_overrides({"compile.enable": True})
    assert resolve_for_device(cfg, torch.device("cuda", 0), fsdp=False).float8.enable


def test_a_cuda_process_sets_the_allocator_before_anything_allocates(monkeypatch):
    """prepare_process (the trainer's first step) hands device_policy.allocator_settings' answer
    for CUDA to the allocator: expandable segments, unless the user set PYTORCH_CUDA_ALLOC_CONF."""
    from titanlite import hardware, memory, preflight

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    applied = []
    monkeypatch.setattr(hardware, "detect_device", lambda requested: torch.device("cuda", 0))
    monkeypatch.setattr(hardware, "use_allocator_settings", applied.append)
    monkeypatch.setattr(hardware, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(memory, "memory_limit_bytes", lambda device: 80 * 2**30)
    cfg = Config()
    plan = preflight.preflight(cfg, 1, cfg.data.vocab_size, None)
    preflight.prepare_process(plan, cfg)
    assert applied == ["expandable_segments:True"]


# ----- document masks (issue 49): which kernel, one mask a batch, no wait --------------------


def test_a_document_mask_trains_through_flex_on_cuda_and_sdpa_on_the_cpu_and_mps(monkeypatch):
    """`--model.attention auto` under a document mask: FlexAttention where torch has its backward
    (CUDA), SDPA with the boolean mask elsewhere; no mask: SDPA as always. `flex` asked where torch
    has no backward is one line (asked of torch: a later torch that has one trains)."""
    from titanlite.models import flex

    masked = Config()
    masked.data.document_mask = True
    assert device_defaults(masked, "cuda", H100, fsdp=False)["model.attention"] == "flex"
    assert device_defaults(masked, "cpu", None, fsdp=False)["model.attention"] == "sdpa"
    assert device_defaults(masked, "mps", None, fsdp=False)["model.attention"] == "sdpa"
    assert device_defaults(Config(), "cuda", H100, fsdp=False)["model.attention"] == "sdpa"
    assert flex.flex_trains("cuda")
    assert flex.attention_for("flex", "cuda") == "flex"
    if not flex.flex_trains("cpu"):  # torch 2.13
        with pytest.raises(TitanliteError, match="no FlexAttention backward on cpu") as e:
            flex.attention_for("flex", "cpu")
        assert "\n" not in str(e.value)
    monkeypatch.setattr(flex, "flex_trains", lambda device_type: True)
    assert flex.attention_for("flex", "cpu") == "flex"  # once torch has it


def test_the_flex_path_builds_one_block_mask_a_batch_and_calls_flex_in_every_layer_unwaiting(
    monkeypatch,
):
    """The model as the trainer builds it on CUDA (compiled flex), run on the CPU with flex's
    compiled kernel replaced by a spy that records its BlockMask (and answers with SDPA under the
    same mask): one BlockMask built per batch, the same one in every layer, and no wait for the
    device anywhere on titanlite's side of the step."""
    import torch.nn.attention.flex_attention as flex

    from titanlite.distributed.mesh import ParallelDims
    from titanlite.distributed.parallelize import Techniques, parallelize
    from titanlite.labs.nb21_documents_and_masks import documents_of, masked_sdpa
    from titanlite.models import masked_attention
    from titanlite.models.llama import ModelArgs

    cfg = Config()
    cfg.data.document_mask, cfg.model.attention = True, "flex"  # as resolved on CUDA
    args = ModelArgs.preset("debug", vocab_size=64, max_seq_len=64)
    model = parallelize(
        args,
        ParallelDims.resolve(1, -1, 1),
        None,
        torch.device("cpu"),
        torch.float32,
        cfg.parallel,
        Techniques.of(cfg),
        example_shape=(2, 64),
    ).parts[0]
    assert model.masked.kernel == "flex" and model.masked.compiled  # torch.compile'd, once
    built, calls = [], []
    real_build = flex.create_block_mask
    monkeypatch.setattr(
        flex, "create_block_mask", lambda *a, **k: built.append(1) or real_build(*a, **k)
    )

    def spy(q, k, v, block_mask, enable_gqa):
        calls.append(block_mask)
        return masked_sdpa(q, k, v, documents)

    monkeypatch.setattr(masked_attention, "compiled_flex", lambda: spy)
    x = torch.randint(3, 64, (2, 64))
    x[:, [5, 40]] = 1
    documents = documents_of(x, 1)
    with HostSyncs() as syncs:
        model(x, documents)
    assert syncs.sites == []
    assert len(built) == 1 and len(calls) == args.n_layers
    assert all(c is calls[0] for c in calls) and isinstance(calls[0], flex.BlockMask)


def test_a_boolean_mask_takes_cuda_attention_off_flash_and_repeats_the_kv_heads(monkeypatch):
    """Predicted from each GPU's facts by torch's rules: flash takes no mask, so a masked A100
    trains through the memory-efficient kernel; an H100 with a new cuDNN through cuDNN, which
    takes one; a T4 through efficient either way. The core hands SDPA the mask in place of
    is_causal, with the K/V heads repeated (the masked kernels' GQA is not flash's)."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from titanlite.labs.nb21_documents_and_masks import cuda_sdpa_choice
    from titanlite.models.llama import causal_attention

    bf16, fp16 = torch.bfloat16, torch.float16
    assert [cuda_sdpa_choice(m, bf16, A100) for m in (False, True)] == ["flash", "efficient"]
    assert [cuda_sdpa_choice(m, bf16, H100) for m in (False, True)] == ["cudnn", "cudnn"]
    assert [cuda_sdpa_choice(m, fp16, T4) for m in (False, True)] == ["efficient", "efficient"]
    calls = _spy_on_attention(monkeypatch, run=False)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(major=8, minor=0)
    )
    with FakeTensorMode():
        q = torch.empty(2, 32, 128, 64, device="cuda", dtype=bf16)
        kv = torch.empty(2, 8, 128, 64, device="cuda", dtype=bf16)
        mask = torch.empty(2, 1, 128, 128, device="cuda", dtype=torch.bool)
        causal_attention(q, kv, kv)
        causal_attention(q, kv, kv, mask=mask)
    plain, masked = calls
    assert plain["heads"] == (32, 8) and plain["enable_gqa"] and plain["is_causal"]
    assert masked["heads"] == (32, 32) and not masked["enable_gqa"] and not masked["is_causal"]
    assert masked["masked"] and not plain["masked"]
