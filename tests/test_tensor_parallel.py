"""Tensor, sequence and loss parallelism (apply_tp) against a single process, and their
communication against the formula.

Two jobs (titanlite's launcher over torchrun, gloo) run `titanlite.labs.nb09_tensor_parallel.tp_lab` in every rank:
TP=2 on the debug model (every combination of sequence / loss parallel; tied embeddings), and
TP=4 on a debug model with 8 query and 4 key/value heads and an untied output layer (4 processes
on 2 cores: slow, but exact). Each rank
also trains a single-process copy of the model on the same batches, so every comparison is
local. The tests then assert on the numbers; bad degrees need no processes at all.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from titanlite.distributed.tensor_parallel import apply_tp, check_tp
from titanlite.errors import TitanliteError
from titanlite.labs.nb09_tensor_parallel import tp_comm_formula
from titanlite.models.llama import ModelArgs, build_model
from titanlite.tools.jobs.launcher import launch_function

LAB = "titanlite.labs.nb09_tensor_parallel:tp_lab"
CONFIGS = [(True, True), (True, False), (False, True), (False, False)]  # (SP, loss parallel)
IDS = ["sp-lossparallel", "sp", "lossparallel", "plain"]
# float64 weights: only the order of additions differs from one process (each rank adds its
# half of the hidden units, then the all-reduce adds the halves), ~1e-16 relative per op; after
# 3 AdamW steps we measure ~4e-15. A wrong shard, a missed reduction or norms drifting apart
# moves weights by ~lr = 1e-2. 1e-9 is far from both.
EXACT = 1e-9


def _run(nproc, tmp_path_factory, **kwargs):
    with warnings.catch_warnings():  # 4 processes on 2 cores: fine for checking results
        warnings.simplefilter("ignore")
        return launch_function(
            LAB,
            nproc=nproc,
            timeout_s=240,
            log_dir=str(tmp_path_factory.mktemp(f"tp{nproc}")),
            **kwargs,
        )


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return _run(2, tmp_path_factory, parity_configs=CONFIGS, comm_configs=CONFIGS)


@pytest.fixture(scope="module")
def tp4(tmp_path_factory):
    return _run(
        4,
        tmp_path_factory,
        n_heads=8,
        n_kv_heads=4,
        tie_embeddings=False,
        basics=False,
        parity_configs=[(True, True)],
        comm_configs=[(True, True)],
    )


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_tp2_training_equals_single_process(tp2, config):
    for rank in tp2:
        run = rank["parity"][config]
        assert len(run["losses"]) == 3 and len(set(run["reference_losses"])) == 3
        assert run["max_loss_diff"] < EXACT, run
        assert run["max_weight_diff"] < EXACT, run  # full_tensor() of every weight
    # Every rank computed the same (whole) loss: a TP group is one model.
    assert len({tuple(r["parity"][config]["losses"]) for r in tp2}) == 1


def test_tp4_training_equals_single_process(tp4):
    """4 ranks: two query heads and their one key/value head each (GQA stays local); an
    untied output layer (TP=2 covers the tied one)."""
    assert (
        tp4[0]["args"]["n_kv_heads"] == 4 and not tp4[0]["args"]["tie_embeddings"] and len(tp4) == 4
    )
    for rank in tp4:
        run = rank["parity"][(True, True)]
        assert run["max_weight_diff"] < EXACT and run["max_loss_diff"] < EXACT, run


def test_trainer_loss_on_vocabulary_sharded_logits(tp2):
    """loss_sum (fp32) on Shard(-1) DTensor logits under loss_parallel: the same loss and
    gradients as on whole logits, and a plain tensor comes back. fp32 with the softmax summed
    in another order: ~1e-7 relative (measured ~4e-7 on gradients)."""
    for rank in tp2:
        check = rank["loss_sum"]
        assert check["logits_type"] == "DTensor" and check["logits_placements"] == "(Shard(dim=2),)"
        assert check["local_logits_shape"] == [2, 16, 256 // 2]  # each rank: half the vocabulary
        assert check["loss_type"] == "Tensor"
        assert check["loss"] == pytest.approx(check["reference_loss"], rel=1e-6)
        assert check["max_grad_rel_diff"] < 1e-5


def test_sequence_parallel_accepts_any_length(tp2):
    """Generation feeds lengths that do not split over the ranks: padded on the right, cut off."""
    for rank in tp2:
        assert set(rank["any_length"]) == {1, 5, 7}
        assert max(rank["any_length"].values()) < 1e-5  # fp32 logits of a single process


# ----------------------------------------------------------------------------- DTensor, MLP
def test_dtensor_placements(tp2):
    for r, rank in enumerate(tp2):
        b = rank["basics"]
        rows = torch.arange(24.0).view(4, 6)
        assert b["local"]["S(0)"] == rows[2 * r : 2 * r + 2].tolist()
        assert b["local"]["S(1)"] == rows[:, 3 * r : 3 * r + 3].tolist()
        assert b["local"]["R"] == rows.tolist()
        assert b["h_placements"] == "(Shard(dim=1),)"  # column parallel: output columns split
        assert b["y_placements"] == "(Partial(sum),)"  # row parallel: partial sums
        assert b["y"] == b["y_expected"]
        assert b["redistribute_comm"] == {"all_reduce": 1}
        assert b["partial_full"] == [3.0, 3.0]  # 1 + 2: ranks' values added


def test_scratch_mlp_equals_apply_tp_and_single_process(tp2):
    for rank in tp2:
        m = rank["mlp"]
        assert m["local_gate_shape"] == [96, 64] and m["full_gate_shape"] == [192, 64]
        for key in (
            "out_scratch_vs_apply_tp",
            "grad_x_scratch_vs_apply_tp",
            "gate_grad_slice_scratch_vs_apply_tp",
        ):
            assert m[key] < 1e-6, (key, m[key])  # the same products and sums in fp32
        for key in ("out_scratch_vs_single", "grad_x_scratch_vs_single"):
            assert m[key] < 1e-5, (key, m[key])  # fp32, different summation order


# ----------------------------------------------------------------------------- communication
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_tp2_communication_matches_formula(tp2, config):
    for rank in tp2:
        comm = rank["comm"][config]
        assert comm["measured"] == comm["formula"]
        assert comm["step"] == comm["step_formula"]


def test_tp4_communication_matches_formula(tp4):
    for rank in tp4:
        comm = rank["comm"][(True, True)]
        assert comm["measured"] == comm["formula"] and comm["step"] == comm["step_formula"]


def test_sequence_parallel_moves_the_same_bytes_per_block(tp2):
    """SP replaces each all-reduce by a reduce-scatter + all-gather: per block the same bus
    bytes (all-reduce: 2(n-1)/n·S; each half: (n-1)/n·S), but norms work on 1/tp of the tokens."""
    sp, plain = tp2[0]["comm"][(True, True)]["measured"], tp2[0]["comm"][(False, False)]["measured"]
    for phase in ("forward", "backward"):
        halves = sum(sp["per_block"][phase][op]["bytes"] for op in ("all_gather", "reduce_scatter"))
        assert halves == 2 * plain["per_block"][phase]["all_reduce"]["bytes"]
        assert plain["per_block"][phase]["all_reduce"]["calls"] == 2


def test_loss_parallel_avoids_gathering_logits(tp2):
    lp = tp2[0]["comm"][(True, True)]["measured"]["outside"]["forward"]
    gathered = tp2[0]["comm"][(True, False)]["measured"]["outside"]["forward"]
    B, T, V, D = 2, 16, 256, 64
    assert lp["all_reduce"] == {"calls": 3, "bytes": 3 * B * T * 4}  # max, sum exp, target
    assert gathered["all_gather"]["bytes"] == B * T * V * 4 + B * T * D * 4  # + the logits


def test_formula_scales_with_tokens_not_degree():
    args = ModelArgs.preset("debug", vocab_size=256)
    f2 = tp_comm_formula(args, 2, 16, 2)
    assert f2 == tp_comm_formula(args, 2, 16, 8)  # S: bus bytes carry the (n-1)/n
    assert (
        tp_comm_formula(args, 4, 16, 2)["per_block"]["forward"]["all_gather"]["bytes"]
        == 2 * f2["per_block"]["forward"]["all_gather"]["bytes"]
    )
    assert tp_comm_formula(args, 2, 16, 1)["per_block"]["forward"] == {}


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "tp, names, valid",
    [
        (3, ["n_heads=4", "n_kv_heads=2", "dim=64", "vocab_size=256", "max_seq_len=256"], "1, 2"),
        (4, ["n_kv_heads=2"], "1, 2"),
        (8, ["n_heads=4", "n_kv_heads=2"], "1, 2"),
    ],
)
def test_degrees_that_do_not_divide_the_model(tp, names, valid):
    args = ModelArgs.preset("debug", vocab_size=256)
    with pytest.raises(TitanliteError) as e:
        check_tp(args, tp)
    message = str(e.value)
    assert "\n" not in message and message.endswith(f"choose one of {valid}")
    named = [
        f"model.{k}={getattr(args, k)}"
        for k in ("n_heads", "n_kv_heads", "hidden_dim", "dim", "vocab_size", "max_seq_len")
    ]
    assert [n for n in named if n in message] == [f"model.{n}" for n in names]


def test_good_degrees_and_sequence_length():
    args = ModelArgs.preset("debug", vocab_size=256, n_heads=8, n_kv_heads=4)
    for tp in (1, 2, 4):
        check_tp(args, tp, seq_len=32)
    with pytest.raises(TitanliteError, match="training.seq_len=30 is not a multiple of 4"):
        check_tp(args, 4, seq_len=30)
    check_tp(args, 4, seq_len=30, sequence_parallel=False)  # without SP the sequence stays whole
    with pytest.raises(TitanliteError, match="must be positive"):
        check_tp(args, 0)


def test_apply_tp_refuses_a_wrapped_model():
    from titanlite.efficiency.activation_checkpoint import apply_ac

    model = apply_ac(build_model(ModelArgs.preset("debug", vocab_size=256)), "full")
    with pytest.raises(TitanliteError, match="apply tensor parallelism first"):
        apply_tp(model, tp_mesh=None)
    with pytest.raises(TitanliteError, match="expects titanlite's Transformer"):
        apply_tp(torch.nn.Linear(2, 2), tp_mesh=None)
