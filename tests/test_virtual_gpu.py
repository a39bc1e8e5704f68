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
from titanlite.tools.host_syncs import HostSyncs, train_and_count

H100, A100, T4 = (9, 0), (8, 0), (7, 5)


# ----- host syncs ------------------------------------------------------------------------------


def test_the_counter_sees_every_kind_of_sync():
    """The check can fail: each way of waiting for the device is seen, with where it was made."""
    from titanlite.tools import host_syncs

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


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [{"parallel.dp_replicate": 2, "parallel.dp_shard": 1}, {"parallel.dp_shard": 2}],
    ids=["ddp", "fsdp"],
)
def test_an_unlogged_step_never_waits_for_the_device_on_two_ranks(data_dir, tmp_path, layout):
    """With the tools `titanlite train` hands in (goodput, stragglers): before, every step built a
    device tensor from the token count and gathered and read the stragglers' times."""
    from titanlite.tools.launcher import launch_function

    o = tiny_overrides(
        data_dir,
        tmp_path,
        **{"training.steps": 8, "metrics.log_every": 4, "eval.every": 0, **layout},
    )
    for rank, per_step in enumerate(
        launch_function(
            "titanlite.tools.host_syncs:train_and_count",
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
        "compile.enable": True,
        "metrics.log_every": 10,
    }
    # Not sharded: autocast is the mixed precision (bf16, resolved later by Precision).
    assert _defaults(H100, fsdp=False) == {
        "parallel.param_dtype": "float32",
        "compile.enable": True,
        "metrics.log_every": 10,
    }
    # No bf16 units on a T4: FSDP keeps fp32 weights; the scaler question is Precision's.
    assert _defaults(T4)["parallel.param_dtype"] == "float32"
    assert _defaults(None, device="cpu") == {
        "parallel.param_dtype": "float32",
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
            },
        )
        == {}
    )
    assert use_fused_adamw("cuda") and not use_fused_adamw("cpu") and not use_fused_adamw("mps")


def test_the_sdpa_order_puts_cudnn_first_on_cuda():
    from torch.nn.attention import SDPBackend

    assert sdpa_priority("cuda") == [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
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
    assert bf16["order"][:4] == sdpa_priority("cuda") and fp32["order"][:4] == sdpa_priority("cuda")
    assert bf16["heads"] == (32, 8) and bf16["enable_gqa"]
    # repeated to reach the efficient kernel
    assert fp32["heads"] == (32, 32) and not fp32["enable_gqa"]
    assert _cur_sdpa_kernel_backends(with_priority=True) == before
    calls.clear()
    causal_attention(torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))
    assert calls[0]["order"] == before  # the CPU keeps torch's own order


@pytest.mark.parametrize(
    "capability, kernel, expanded",
    [(H100, "cudnn", False), (A100, "cudnn", False), (T4, "efficient", True)],
)
def test_the_attention_kernel_each_preset_would_get(capability, kernel, expanded):
    """Predicted, not measured: every preset in the dtype CUDA's defaults give it on this GPU."""
    from titanlite.device_policy import default_mixed_precision, expand_kv_for_sdpa
    from titanlite.models.llama import PRESETS, ModelArgs
    from titanlite.tools.sdpa_kernels import sdpa_kernel_for

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[
        default_mixed_precision("cuda", capability)
    ]
    for preset in PRESETS:
        args = ModelArgs.preset(preset)
        gqa = args.n_kv_heads < args.n_heads
        assert sdpa_kernel_for("cuda", dtype, args.head_dim, gqa, capability) == kernel, preset
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

    from titanlite.resilience import checkpoint
    from titanlite.resilience.checkpoint import Checkpointer

    order, make_stager = [], checkpoint.make_stager

    def recording_stager(options, shared_memory):
        assert options["use_staging_stream"]  # what CUDA tensors get
        # a CPU copy stands in
        stager = make_stager(checkpoint.staging_options({"cpu"}), shared_memory)
        stage = stager.stage
        stager.stage = lambda state_dict, **kw: (order.append("stage"), stage(state_dict, **kw))[1]
        return stager

    monkeypatch.setattr(checkpoint, "tensor_device_types", lambda state: {"cuda"})
    monkeypatch.setattr(checkpoint, "make_stager", recording_stager)
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
from titanlite.train import Trainer
trainer = Trainer(load_config(None, json.loads(sys.argv[1])))
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
    from titanlite.tools.predict_memory import predict

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


def test_the_predicted_h100_table_in_docs_is_what_the_script_prints_now():
    from pathlib import Path

    from titanlite.tools.predict_memory import markdown

    doc = Path(__file__).resolve().parents[1] / "docs" / "hardware" / "predicted-h100.md"
    assert doc.read_text() == markdown(), (
        "regenerate: python -m titanlite.tools.predict_memory > " + str(doc)
    )
    assert "not measured" in doc.read_text().splitlines()[0]
