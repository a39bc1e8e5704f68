"""The degree planner: its memory model is ZeRO's formula with TP/PP division, its layouts obey
the rules (TP inside a node and dividing the heads, degrees multiplying to the GPUs), its
choices are the rules of thumb, impossible requests fail in one line; and on 4 real processes
the groups and per-rank parameters it assumes are the ones torch builds."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import tiny_overrides

from titanlite.config import load_config
from titanlite.distributed.mesh import ParallelDims
from titanlite.errors import TitanliteError
from titanlite.models.llama import ModelArgs, Transformer, build_model
from titanlite.tools.predict.activation_memory import saved_activation_bytes, tokens_for
from titanlite.tools.predict.planner import activation_bytes_per_layer, plan, stage_params
from titanlite.tools.predict.zero import zero_bytes_per_rank

# Llama 3 70B's published shape (Meta's params.json): built by hand, there is no preset.
LLAMA3_70B = ModelArgs(
    dim=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    vocab_size=128_256,
    ffn_hidden_dim=28_672,
    max_seq_len=8192,
    tie_embeddings=False,
)
GB = 1e9


def _num_params(args: ModelArgs) -> int:
    with torch.device("meta"):
        return Transformer(args).num_params()


def _find(p, shape):
    return next(c for c in p.candidates + p.rejected if c.shape == shape)


@pytest.mark.parametrize("precision", ["mixed", "fp32"])
@pytest.mark.parametrize("n", [8, 64])
def test_pure_fsdp_states_are_zero3_formula_exactly(precision, n):
    p = plan("8B", n, 80 * GB, seq_len=8192, precision=precision, reserve=0.0, checkpointing="full")
    fsdp = _find(p, (1, 1, n, 1, 1, 1)).memory
    z = zero_bytes_per_rank(_num_params(ModelArgs.preset("8B")), n, 3, precision=precision)
    assert (fsdp.params, fsdp.grads, fsdp.optimizer) == (z["params"], z["grads"], z["optimizer"])
    ddp = _find(p, (1, n, 1, 1, 1, 1)).memory  # dp_replicate saves nothing: ZeRO stage 0
    psi = _num_params(ModelArgs.preset("8B"))
    assert ddp.states == zero_bytes_per_rank(psi, n, 0, precision=precision)["total"]


def test_tp_and_pp_divide_the_parameters_as_the_model_is_built():
    a = ModelArgs.preset("8B")
    psi, norms = _num_params(a), (2 * a.n_layers + 1) * a.dim  # norm weights stay whole under TP
    assert stage_params(a, 1, 1) == [psi]
    assert stage_params(a, 1, 8) == [(psi - norms) // 8 + norms]
    # Two stages of 16 layers; the first adds the embedding, the last the final norm and output.
    block = (
        2 * a.dim * a.dim
        + 2 * a.dim * (a.n_kv_heads * a.head_dim)
        + 3 * a.dim * a.hidden_dim
        + 2 * a.dim
    )
    embedding = a.vocab_size * a.dim
    assert stage_params(a, 2, 1) == [16 * block + embedding, 16 * block + a.dim + embedding]
    assert sum(stage_params(a, 4, 1)) == psi
    # pp=2 × dp_shard=4: the heaviest GPU is on stage 0 (1F1B: 2 micro-batches of activations in
    # flight there, 1 on the last stage), with ZeRO-3 of stage 0's parameters over 4.
    p = plan(a, 8, 80 * GB, seq_len=1024)
    c = _find(p, (2, 1, 4, 1, 1, 1))
    assert (
        c.memory.states
        == zero_bytes_per_rank(stage_params(a, 2, 1)[0], 4, 3, precision="mixed")["total"]
    )


def test_activations_per_layer_are_measured_ones_split_over_tp():
    # One more layer of a bf16 model saves exactly what the planner counts for a layer.
    small = ModelArgs.preset("debug", vocab_size=512)
    tokens = tokens_for(small, 2, 64)
    measured = [
        saved_activation_bytes(build_model(replace(small, n_layers=n)).to(torch.bfloat16), tokens)
        for n in (2, 3)
    ]
    assert measured[1] - measured[0] == pytest.approx(
        activation_bytes_per_layer(small, 64, 2), rel=0.01
    )
    a, s, b = ModelArgs.preset("8B"), 4096, 2
    one = activation_bytes_per_layer(a, s, b)
    assert activation_bytes_per_layer(a, s, b, 8) == pytest.approx(one / 8)  # SP: all of it / t
    no_sp = [activation_bytes_per_layer(a, s, b, t, sequence_parallel=False) for t in (1, 2, 4, 8)]
    assert no_sp[0] == one and no_sp[3] > one / 8  # the norms' tensors stay whole on every rank
    assert no_sp[1] - no_sp[2] == pytest.approx(2 * (no_sp[2] - no_sp[3]))  # the rest: ∝ 1/t
    # bf16 input
    assert activation_bytes_per_layer(a, s, b, checkpointing="full") == 2 * s * b * a.dim
    whole_input = activation_bytes_per_layer(
        a, s, b, 8, sequence_parallel=False, checkpointing="full"
    )
    # without SP the residual stream is whole on every TP rank
    assert whole_input == 2 * s * b * a.dim
    # 1F1B: stage 0 of pp holds pp micro-batches of n_layers/pp layers: all layers' worth.
    p = plan(a, 8, 1000 * GB, seq_len=s, micro_batch=b)
    assert _find(p, (2, 1, 4, 1, 1, 1)).memory.activations == round(a.n_layers * one)
    with pytest.raises(TitanliteError, match="not one of"):
        plan(a, 8, 80 * GB, seq_len=s, checkpointing="partial")


@pytest.mark.parametrize(
    "args, n, per_node", [("8B", 16, 8), (LLAMA3_70B, 64, 8), ("debug", 8, 4), ("1B", 12, 4)]
)
def test_every_layout_obeys_the_rules(args, n, per_node):
    p = plan(args, n, 80 * GB, gpus_per_node=per_node, seq_len=2048, checkpointing="full")
    a = p.args
    for c in p.candidates:
        assert math.prod(c.shape) == n and c.problem is None
        assert a.n_heads % c.tp == 0 and a.n_kv_heads % c.tp == 0, "TP splits whole heads"
        assert c.tp <= per_node and per_node % c.tp == 0, "a TP group stays inside a node"
        assert c.pp <= a.n_layers and c.memory.total <= p.usable_bytes
    assert len(p.candidates) + len(p.rejected) == len({c.shape for c in p.candidates + p.rejected})
    too_wide = [c for c in p.rejected if c.tp > per_node]
    assert too_wide and all(c.problem.startswith("TP across nodes") for c in too_wide)


def test_tp_that_does_not_divide_the_heads_is_rejected_with_the_trainers_reason():
    p = plan(ModelArgs.preset("debug", n_heads=4, n_kv_heads=2), 8, GB, seq_len=64)  # kv heads: 2
    c = _find(p, (1, 1, 2, 1, 1, 4))
    assert c.problem.startswith("trainer refuses") and "n_kv_heads" in c.problem


def test_a_model_that_fits_one_gpu_gets_plain_data_parallel():
    p = plan("debug", 8, 80 * GB, seq_len=256, micro_batch=8)
    assert p.best.pp == p.best.tp == 1 and p.best.shape == (
        1,
        8,
        1,
        1,
        1,
        1,
    )  # DDP: least communication
    assert any("DDP" in r for r in p.best.reasons)


def test_llama3_8b_on_8_h100s():
    # torchtitan's Llama 3 8B recipe on 8 H100s: FSDP over the 8, sequence 8192, local batch 1,
    # selective (per-op) activation checkpointing. With that setting the planner picks the same.
    p = plan("8B", 8, 80 * GB, seq_len=8192, micro_batch=1, checkpointing="op")
    assert p.best.shape == (1, 1, 8, 1, 1, 1)
    assert 40 * GB < p.best.memory.total < 72 * GB  # ~16 GB states + ~27 GB activations + logits
    assert any(r.startswith("FSDP") for r in p.best.reasons)
    # Without checkpointing the activations (~53 GB) no longer fit next to the states: TP 2 inside
    # the node halves them, and the report says why plain FSDP was not enough.
    bare = plan("8B", 8, 80 * GB, seq_len=8192)
    assert (
        bare.best.shape == (1, 1, 4, 1, 1, 2) and "not dp_shard=8: out of memory" in bare.report()
    )
    two_nodes = plan("8B", 16, 80 * GB, seq_len=8192, checkpointing="op")
    assert two_nodes.best.shape == (1, 2, 8, 1, 1, 1), "shard within a node, replicate across"


def test_70b_needs_tensor_parallel_unless_it_recomputes_activations():
    p = plan(LLAMA3_70B, 64, 80 * GB, seq_len=8192)
    assert p.best.pp == 1 and 1 < p.best.tp <= 8
    assert "not dp_shard=64: out of memory" in p.report()  # why not plain FSDP, in words
    assert plan(LLAMA3_70B, 64, 80 * GB, seq_len=8192, checkpointing="full").best.tp == 1


def test_explain_prints_the_choice_and_its_reasons(capsys):
    p = plan("8B", 8, 80 * GB, seq_len=8192, checkpointing="op")
    p.explain()
    out = capsys.readouterr().out
    assert "dp_shard=8" in out and "fits:" in out and "layouts fit" in out
    assert p.best.overrides == {
        "parallel.pp": 1,
        "parallel.dp_replicate": 1,
        "parallel.dp_shard": 8,
        "parallel.ep": 1,
        "parallel.cp": 1,
        "parallel.tp": 1,
    }


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_gpus=12), "whole nodes"),
        (dict(n_gpus=0), "must be positive"),
        (dict(gpu_mem_bytes=16 * GB, n_gpus=1), "no layout of 1 GPUs"),
        (dict(global_batch=7, micro_batch=2), "not a multiple of micro_batch"),
        (dict(n_gpus=64, global_batch=4), "no layout"),  # 4 sequences cannot feed 64 GPUs
    ],
)
def test_impossible_requests_fail_in_one_line(kwargs, message):
    request = dict(args="8B", n_gpus=8, gpu_mem_bytes=80 * GB, seq_len=8192) | kwargs
    with pytest.raises(TitanliteError, match=message) as e:
        plan(**request)
    assert "\n" not in str(e.value) and ":" in str(e.value)


# ----- the layout, as torch builds it ------------------------------------------------------------
@pytest.mark.slow
def test_torch_builds_the_groups_and_shards_the_planner_assumes(data_dir, tmp_path):
    """4 processes, pp=2 × tp=2, through the trainer (`layout_lab`): every rank's process
    groups are ParallelDims.groups, every group answers an all-gather, each rank holds exactly
    stage_params of its stage, and the losses are one process's with the same batch."""
    from titanlite.tools.jobs.launcher import launch_function
    from titanlite.train import Trainer

    model = {
        "model.n_layers": 4,
        "model.tie_embeddings": False,
        "training.steps": 2,
        "eval.every": 0,
    }
    layout = {"parallel.pp": 2, "parallel.tp": 2}
    cfg = load_config(None, tiny_overrides(data_dir, tmp_path, **model, **layout))
    out = launch_function(
        "titanlite.labs.nb11_composing_parallelism:layout_lab",
        nproc=4,
        cfg=cfg,
        timeout_s=240,
        log_dir=str(tmp_path / "jobs"),
    )
    dims = ParallelDims.resolve(1, -1, 4, tp=2, pp=2)
    args = ModelArgs.preset("debug", n_layers=4, tie_embeddings=False, vocab_size=512)
    for rank, o in enumerate(out):
        lay = o["layout"]
        assert lay["coordinates"] == dims.coordinates(rank)
        for dim in ("pp", "dp_replicate", "dp_shard", "tp"):
            mine = next(g for g in dims.groups(dim) if rank in g)
            assert lay[dim]["group"] == lay[dim]["mesh"] == lay[dim]["answered"] == mine, (
                rank,
                dim,
            )
        assert lay["param_elements"] == stage_params(args, 2, 2)[lay["coordinates"]["pp"]]
    single = load_config(
        None, tiny_overrides(data_dir, tmp_path, **model, **{"metrics.run_name": "one"})
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each rank (OMP_NUM_THREADS=1): the same summation order
    try:
        ref = Trainer(single).fit()
    finally:
        torch.set_num_threads(threads)
    # fp32, the same batch: TP and PP only regroup sums (measured: losses within 1e-6, gradient
    # norms within 3e-5 relative). A wrong normalisation doubles the clipped norm; a lost stage
    # or shard moves the loss at the second decimal.
    assert max(abs(x - y) for x, y in zip(out[0]["losses"], ref.losses)) < 1e-5
    ref_norms = [r["grad_norm"] for r in ref.train]
    assert max(abs(x - y) / y for x, y in zip(out[0]["grad_norms"], ref_norms)) < 1e-4


def test_context_parallel_divides_activations_and_logits_and_shards_with_fsdp():
    """cp 2 beside dp_shard 2 shards the states four ways, like dp_shard 4, and halves what
    each GPU keeps of every sequence; it is chosen when nothing without it fits (TP limited to
    2 GPUs per node, a 128k sequence)."""
    p = plan("8B", 8, 80 * GB, seq_len=131072, checkpointing="full", cp=(1, 2, 4))
    with_cp, without = _find(p, (1, 1, 2, 1, 2, 2)).memory, _find(p, (1, 1, 4, 1, 1, 2)).memory
    assert with_cp.states == without.states
    assert with_cp.activations == pytest.approx(without.activations / 2, rel=1e-6)
    assert with_cp.logits == without.logits // 2
    narrow = plan(
        "8B", 8, 80 * GB, gpus_per_node=2, seq_len=131072, checkpointing="full", cp=(1, 2, 4)
    )
    assert narrow.best.cp > 1 and narrow.best.pp == 1, narrow.report()
    assert "CP " in narrow.report() and narrow.best.overrides["parallel.cp"] == narrow.best.cp
