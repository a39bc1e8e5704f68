"""preflight's memory floor: what it refuses a run by before anything allocates, a lower bound of
what one process holds. Under context and expert parallelism FSDP shards over dp_shard × ep × cp
and a CP rank holds seq_len/cp tokens of each sequence: for an 8B Llama on 8×H100 the floor used
to leave cp and ep out (state ÷ dp_shard·tp·pp, every token's logits), refusing cp 8 at 8k as
"needs ≥ 127.5 GiB" and cp 4 × dp_shard 2 at 32k at 91.1 GiB. Checked against notebook 17's formula
for those layouts, and on this CPU against what each rank of a cp 2, cp 4 and ep 2 run holds."""

import pytest
from conftest import tiny_overrides

from titanlite import TitanliteError
from titanlite.config import Config
from titanlite.labs.nb17_context_parallel import memory_floor_formula
from titanlite.preflight import check_memory_fits, memory_floor, preflight
from titanlite.tools.jobs.launcher import launch_function

H100 = 80 * 2**30
LLAMA3_VOCAB = 128_256


def _plan(world: int, **overrides):
    cfg = Config().with_overrides(
        {"model.preset": "8B", "training.batch_size": 1, "data.vocab_size": LLAMA3_VOCAB}
        | overrides
    )
    return preflight(cfg, world, LLAMA3_VOCAB), cfg


@pytest.mark.parametrize(
    "world, layout, seq_len",
    [
        (8, {"parallel.cp": 8}, 8192),
        (8, {"parallel.cp": 4, "parallel.dp_shard": 2}, 32768),
        (8, {"parallel.dp_shard": 8}, 8192),
        (2, {"parallel.cp": 2, "parallel.dp_shard": 1}, 32768),
    ],
)
def test_an_8b_model_on_h100s_is_admitted_with_notebook_17s_memory(world, layout, seq_len):
    plan, cfg = _plan(
        world, **layout, **{"training.seq_len": seq_len, "model.max_seq_len": seq_len}
    )
    state, per_sequence = memory_floor(plan, cfg)
    need = state + plan.micro_batch * per_sequence
    formula = memory_floor_formula(
        params=8.03e9,
        bytes_per_param=16,  # fp32 weights and gradients, AdamW's two fp32 moments
        shards=plan.dims.dp_shard * plan.dims.cp,
        micro_batch=1,
        seq_len=seq_len,
        cp=plan.dims.cp,
        vocab=LLAMA3_VOCAB,
        logit_bytes=4,
    )
    assert abs(need - formula) / formula < 0.10, (need / 2**30, formula / 2**30)
    check_memory_fits(plan, cfg, H100, "NVIDIA H100 80GB HBM3")  # admitted


@pytest.mark.parametrize(
    "world, layout, seq_len",
    [
        (1, {"parallel.dp_shard": 1}, 8192),  # 120 GiB of state alone
        (2, {"parallel.cp": 2, "parallel.dp_shard": 1}, 65536),  # 60 GiB + 31 GiB of logits
    ],
)
def test_what_does_not_fit_an_h100_is_refused_in_one_line(world, layout, seq_len):
    plan, cfg = _plan(
        world, **layout, **{"training.seq_len": seq_len, "model.max_seq_len": seq_len}
    )
    with pytest.raises(TitanliteError, match="needs at least") as refused:
        check_memory_fits(plan, cfg, H100, "NVIDIA H100 80GB HBM3")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, {"parallel.cp": 2, "parallel.dp_shard": 1}),
        (4, {"parallel.cp": 4, "parallel.dp_shard": 1, "training.seq_len": 64}),
        (2, {"parallel.ep": 2, "parallel.dp_shard": 1, "model.n_experts": 4}),
    ],
    ids=["cp2", "cp4", "ep2"],
)
def test_each_rank_holds_at_least_the_floor_and_not_much_more(data_dir, tmp_path, nproc, layout):
    """Measured after a step, read off each rank's tensors: its weight shards, gradients and
    AdamW moments (FSDP pads a shard at most to a multiple of the ranks)."""
    o = tiny_overrides(data_dir, tmp_path, **{"training.steps": 1, **layout})
    results = launch_function("titanlite.labs._common:state_against_floor", nproc, overrides=o)
    for r in results:
        assert r["floor"] <= r["held"] <= 1.10 * r["floor"], (layout, r)
