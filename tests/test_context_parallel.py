"""Context parallelism: ring attention written from scratch equals full attention (values and
gradients), moves the bytes its formula says, and the trainer with --parallel.cp trains like one
process, alone and composed with FSDP, TP and PP; its checkpoints resume and reshard exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import parity_overrides

from titanlite.config import load_config
from titanlite.distributed import context_parallel as cpmod
from titanlite.distributed.context_parallel import (
    ContextAttention,
    ContextParallel,
    block_kernel,
    chunks_of,
    positions_of,
    shard_sequence,
)
from titanlite.distributed.mesh import ParallelDims
from titanlite.labs import nb17_context_parallel as lab
from titanlite.resilience.checkpoint import Checkpointer
from titanlite.resilience.checkpoint_files import committed
from titanlite.tools.formats.export import load_model
from titanlite.tools.jobs.launcher import launch, launch_function
from titanlite.train import Trainer

ATTENTION = "titanlite.labs.nb17_context_parallel:attention_matches_full"


# ----- the pieces: which chunks, which positions, which kernel ---------------------------------


def test_zigzag_gives_each_rank_a_head_and_a_tail_chunk_and_equal_work():
    assert [chunks_of(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert positions_of(0, 2, 8).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions_of(1, 2, 8).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    t = torch.arange(16).view(1, 16)
    parts = [shard_sequence(t, r, 2) for r in range(2)]
    assert sorted(torch.cat(parts, 1).tolist()[0]) == list(range(16))  # every token once
    assert parts[0].tolist()[0] == positions_of(0, 2, 8).tolist()
    zig = lab.attention_flops_per_rank(1024, 4, "zigzag", heads=4, head_dim=32)
    naive = lab.attention_flops_per_rank(1024, 4, "contiguous", heads=4, head_dim=32)
    assert len(set(zig)) == 1 and sum(zig) == sum(naive)  # balanced; the same total
    assert naive == sorted(naive) and naive[-1] == 7 * naive[0]  # rank r: r + 1/2 blocks


def test_a_causal_zigzag_ring_step_is_half_a_block_and_each_ranks_work_is_timed_on_one_thread():
    whole = 4 * 512 * 512 * 4 * 32  # q·kᵀ and p·v of one rank's 512 queries on 512 keys, forward
    for rank in range(4):  # every step of every rank: 2 of the 4 chunk pairs (its own: causally)
        assert lab.ring_step_flops(2048, 4, rank, "zigzag", 4, 32) == [whole / 2] * 4
    zig = lab.attention_flops_per_rank(2048, 4, "zigzag", heads=4, head_dim=32)
    assert sum(lab.ring_step_flops(2048, 4, 2, "zigzag", 4, 32)) == zig[2]
    # contiguous: the first rank computes only at its own (causal) step; the last every step
    assert lab.ring_step_flops(2048, 4, 0, "contiguous", 4, 32) == [whole / 2, 0, 0, 0]
    assert lab.ring_step_flops(2048, 4, 3, "contiguous", 4, 32) == [whole / 2] + [whole] * 3
    threads = torch.get_num_threads()
    rounds = lab.attention_seconds_per_rank(256, 2, "zigzag", repeats=3)
    assert len(rounds) == 3 and all(len(r) == 2 and min(r) > 0 for r in rounds)
    assert torch.get_num_threads() == threads  # timed on one thread, then given back


@pytest.mark.parametrize(
    "device, dtype, capability, head_dim, rocm, kernel",
    [
        ("cpu", torch.float32, None, 64, False, "cpu_flash"),
        ("cpu", torch.bfloat16, None, 64, False, "cpu_flash"),
        ("cuda", torch.bfloat16, (9, 0), 128, False, "cuda_flash"),
        ("cuda", torch.float16, (8, 0), 64, False, "cuda_flash"),
        ("cuda", torch.bfloat16, (8, 9), 256, False, "cuda_flash"),  # > 224 trains on sm89
        ("cuda", torch.bfloat16, (8, 6), 200, False, "cuda_efficient"),  # (192, 224] does not
        ("cuda", torch.bfloat16, (12, 0), 208, False, "cuda_efficient"),  # nor on sm120
        ("cuda", torch.float16, (7, 5), 64, False, "cuda_efficient"),  # Turing: no flash
        ("cuda", torch.bfloat16, (7, 5), 64, False, "math"),  # no bf16 kernel before sm80
        ("cuda", torch.float32, (9, 0), 64, False, "cuda_efficient"),  # flash: half precision
        ("cuda", torch.float32, (9, 0), 36, False, "cuda_efficient"),  # fp32 rows: 4-aligned
        ("cuda", torch.bfloat16, (9, 0), 36, False, "math"),  # bf16 rows of 36: 8-aligned no
        ("cuda", torch.bfloat16, (9, 4), 64, True, "math"),  # ROCm (MI300X reports 9.4)
        ("mps", torch.bfloat16, None, 64, False, "math"),
    ],
)
def test_each_device_gets_the_block_kernel_sdpa_would_train_it_through(
    device, dtype, capability, head_dim, rocm, kernel
):
    assert block_kernel(device, dtype, capability, head_dim, rocm) == kernel


class _Ctx(SimpleNamespace):  # what autograd hands a Function, for calling it by hand
    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def test_on_cuda_each_block_calls_flash_attention_and_its_backward_with_the_right_shapes():
    """The CUDA path, run on meta tensors (shapes and dtypes, no GPU): forward and backward of a
    bf16 GQA block call aten's flash attention ops, and give bf16 gradients of the inputs'
    shapes; the log-sum-exp kept for the backward is fp32 [B, H, T]."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    q = torch.empty(2, 8, 64, 64, device="meta", dtype=torch.bfloat16)
    k, v = (torch.empty(2, 2, 64, 64, device="meta", dtype=torch.bfloat16) for _ in range(2))
    cp, ctx = ContextParallel(None, 1, 0, kernel="cuda_flash"), _Ctx()
    with Ops() as ops:
        out = ContextAttention.forward(ctx, q, k, v, cp)
        dq, dk, dv, _ = ContextAttention.backward(ctx, torch.empty_like(out))
    assert "_scaled_dot_product_flash_attention.default" in ops.names
    assert "_scaled_dot_product_flash_attention_backward.default" in ops.names
    assert not any("for_cpu" in n for n in ops.names)
    lse = ctx.saved_tensors[4]
    assert lse.shape == (2, 8, 64) and lse.dtype == torch.float32
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        assert grad.shape == like.shape and grad.dtype == torch.bfloat16


# ----- the ring against full attention, on 2 and 4 ranks --------------------------------------


@pytest.mark.parametrize("nproc", [2, 4])
def test_ring_and_allgather_equal_full_attention_and_move_the_bytes_of_the_formula(nproc):
    for layout in ("zigzag", "contiguous"):
        for method in ("ring", "allgather"):
            for kernel in (None, "math"):  # this device's fused kernel, and the plain ops
                results = launch_function(
                    ATTENTION, nproc=nproc, layout=layout, method=method, kernel=kernel
                )
                case = (layout, method, kernel)
                for r in results:
                    assert max(r["diffs"].values()) <= 1e-5, (case, r["diffs"])
                    bytes_moved = {op: row["bytes"] for op, row in r["comm"].items()}
                    assert bytes_moved == lab.cp_comm_formula(2, 2, 64, 16, nproc, method), case
                    assert r["host_syncs"] == [], case  # nothing waits for a GPU per block


def test_the_model_under_cp_equals_one_process_and_a_wrong_position_is_caught():
    target = "titanlite.labs.nb17_context_parallel:model_matches_full"
    right = launch_function(target, nproc=2)
    assert all(r["logits"] <= 1e-5 and r["grads"] <= 1e-4 for r in right), right
    wrong = launch_function(target, nproc=2, wrong_positions=True)
    assert all(r["logits"] > 1e-3 for r in wrong), wrong  # RoPE at the wrong positions


# ----- the trainer ---------------------------------------------------------------------------

MODEL = {"model.n_layers": 4, "model.tie_embeddings": False}
STEPS = 4


def _overrides(data_dir, tmp_path, **extra):
    return parity_overrides(data_dir, tmp_path, **{"training.steps": STEPS, **MODEL, **extra})


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """One process, global batch 8: losses and validation losses."""
    history = Trainer(load_config(None, _overrides(data_dir, tmp_path_factory.mktemp("ref")))).fit()
    return history.losses, history.val_losses


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, {"parallel.cp": 2, "parallel.dp_shard": 1}),
        (4, {"parallel.cp": 2, "parallel.dp_shard": 2, "training.batch_size": 4}),
        (
            2,
            {
                "parallel.cp": 2,
                "parallel.cp_method": "allgather",
                "parallel.cp_layout": "contiguous",
            },
        ),
        (4, {"parallel.cp": 2, "parallel.tp": 2, "parallel.dp_shard": 1}),
        (4, {"parallel.cp": 2, "parallel.pp": 2, "parallel.dp_shard": 1}),
    ],
    ids=["cp2", "cp2-fsdp2", "cp2-allgather-contiguous", "cp2-tp2", "cp2-pp2"],
)
def test_the_trainer_with_cp_gives_one_process_losses(nproc, layout, data_dir, tmp_path, reference):
    result = launch(
        load_config(None, _overrides(data_dir, tmp_path)), nproc=nproc, overrides=layout
    )
    losses, val_losses = reference
    assert result.losses == pytest.approx(losses, abs=1e-5)
    evals = [r["val_loss"] for r in result.rank(0, "val")]
    assert evals == pytest.approx(val_losses, abs=1e-5) and len(evals) == len(val_losses)
    assert {r["rank"] for r in result.records} == set(range(nproc))


def test_a_cp_checkpoint_resumes_bit_identically_and_loads_into_one_process_and_fsdp(
    data_dir, tmp_path, reference
):
    cp = {"parallel.cp": 2, "parallel.dp_shard": 1}
    o = _overrides(data_dir, tmp_path, **{"checkpoint.enable": True, "checkpoint.every": 2})
    whole = launch(load_config(None, {**o, "metrics.run_name": "whole"}), nproc=2, overrides=cp)
    path = committed(whole.run_dir / "checkpoints")[0]  # step 2
    assert path.name.endswith("00002")
    # A new CP run from step 2: the same last two steps, bit for bit.
    resumed = launch(
        load_config(None, {**o, "metrics.run_name": "resumed", "checkpoint.load": str(path)}),
        nproc=2,
        overrides=cp,
    )
    assert resumed.losses == whole.losses[2:]
    # One process (cp 1) loads the same weights and optimizer state exactly.
    trainer = Trainer(load_config(None, {**o, "checkpoint.enable": False}))
    assert Checkpointer(path.parent).load(trainer.train_state(), path) == 2
    saved = load_model(path).state_dict()
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in saved.items())
    trainer.close()
    # And FSDP on 2 ranks continues from it like the CP run (the same sums, reordered).
    fsdp = launch(
        load_config(None, {**o, "metrics.run_name": "fsdp", "checkpoint.load": str(path)}),
        nproc=2,
        overrides={"parallel.dp_shard": 2, "training.batch_size": 4},
    )
    assert fsdp.losses == pytest.approx(whole.losses[2:], abs=1e-5)


def test_the_layout_folds_cp_into_fsdp_and_reads_one_data_slice_per_cp_group():
    dims = ParallelDims.resolve(1, 2, 8, tp=1, pp=1, cp=4)
    assert dims.shape == (1, 1, 2, 1, 4, 1) and dims.strategy == "fsdp" and dims.dp == 2
    # cp ranks read the same slice of the batch (and keep their parts of its sequences)
    assert all(len({dims.dp_rank(r) for r in g}) == 1 for g in dims.groups("cp"))
    part = dims.sequence_part(5, "zigzag")
    assert part(torch.arange(16).view(1, 16)).tolist() == [[2, 3, 12, 13]]
    assert ParallelDims.resolve(2, 1, 4, cp=2).strategy == "hsdp"
    assert ParallelDims.resolve(1, 1, 2, cp=2).strategy == "fsdp"
    assert cpmod.METHODS == ("ring", "allgather") and cpmod.LAYOUTS == ("zigzag", "contiguous")


def test_the_math_block_computes_its_scores_in_fp32_under_fp16_autocast():
    """The from-scratch block (ROCm, MPS) under a caller's fp16 autocast: q·kᵀ recast to fp16 by
    autocast before the scale would overflow (a logit of 700 at head_dim 64 is 5,600 unscaled, and
    products beyond 65,504 are inf). Its scores stay fp32: the same output and log-sum-exp as fp32."""
    from titanlite.distributed.attention_block import block_forward

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 8, 64, generator=g) * 40  # q·k up to ~10^5: past fp16's range
    k, v = torch.randn(1, 2, 8, 64, generator=g) * 40, torch.randn(1, 2, 8, 64, generator=g)
    ref_out, ref_lse = block_forward("math", q, k, v, causal=True)
    with torch.autocast("cpu", dtype=torch.float16):
        out, lse = block_forward("math", q, k, v, causal=True)
    assert torch.isfinite(lse).all() and torch.isfinite(out).all()
    assert torch.allclose(lse, ref_lse) and torch.allclose(out.float(), ref_out, atol=1e-5)
