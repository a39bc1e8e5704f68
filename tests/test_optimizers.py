"""The optimizers of --optimizer.name (issue 48): Muon from scratch and the trainer's Muon equal
torch.optim.Muon; each optimizer's state is the formula's bytes; under FSDP, muon and adamw8bit give
one process's losses, and the sharded Muon gathers each matrix once; every optimizer resumes bit for
bit, and an FSDP checkpoint loads into one process exactly; what cannot work is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import parity_overrides, tiny_overrides
from torch import nn

from titanlite import TitanliteError
from titanlite.config import Config, load_config
from titanlite.labs import nb20_optimizers_and_memory as lab
from titanlite.models.llama import ModelArgs, build_model
from titanlite.muon import newton_schulz
from titanlite.optimizer import build_optimizer, check_optimizer, hidden_matrices
from titanlite.resilience.checkpoint import Checkpointer
from titanlite.resilience.checkpoint_files import committed
from titanlite.tools.jobs.launcher import launch, launch_function
from titanlite.tools.predict.zero import measure_state_bytes
from titanlite.train import Trainer

DEBUG = Path(__file__).resolve().parents[1] / "configs" / "debug.toml"
NAMES = ("adamw", "adamw8bit", "adamw4bit", "adafactor", "muon")


def quantized(t) -> bool:  # torchao's OptimState8bit / OptimState4bit
    return type(t).__name__.startswith("OptimState")


SHAPES = [(64, 64), (192, 64), (64, 192), (33, 70)]  # square, tall, wide, odd


def test_newton_schulz_and_the_scratch_step_are_torchs_muon_to_the_bit():
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        grad = torch.randn(shape, generator=g)
        want = _zeropower_via_newtonschulz(grad, lab.COEFFICIENTS, 5, 1e-7)
        assert torch.equal(newton_schulz(grad.bfloat16(), lab.COEFFICIENTS, 5), want), shape
        assert torch.equal(lab.orthogonalise(grad.bfloat16()), want), shape
        # three steps of the from-scratch Muon against torch's, momentum buffer included
        weight = torch.randn(shape, generator=g) * 0.02
        p = nn.Parameter(weight.clone())
        torchs = torch.optim.Muon([p], lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        mine, buffer = weight.clone(), torch.zeros(shape)
        for _ in range(3):
            grad = torch.randn(shape, generator=g)
            p.grad = grad.clone()
            torchs.step()
            lab.muon_step(mine, grad, buffer, lr=0.01, weight_decay=0.1)
        assert torch.equal(p.data, mine) and torch.equal(torchs.state[p]["momentum_buffer"], buffer)
    # in fp32 (the trainer's dtype off CUDA) the map drives the singular values towards 1
    s = lab.singular_values(newton_schulz(torch.randn(64, 192, generator=g), lab.COEFFICIENTS, 5))
    assert 0.6 < s.min() and s.max() < 1.3


def test_the_state_each_optimizer_keeps_is_the_formula_and_muon_takes_the_hidden_matrices():
    model = build_model(ModelArgs.preset("debug", vocab_size=512))
    names = {id(p): n for n, p in model.named_parameters()}
    hidden = {names[id(p)] for p in hidden_matrices([model])}
    assert hidden == {n for n in names.values() if ".attention." in n or ".feed_forward." in n}
    o = Config().optimizer
    for name in NAMES:
        torch.manual_seed(0)
        model = build_model(ModelArgs.preset("debug", vocab_size=512))
        o.name = name
        optimizer = build_optimizer([model], o, torch.device("cpu"))
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        optimizer.step()
        measured = measure_state_bytes(model, optimizer)["optimizer"]
        assert measured == lab.predicted_state(model, name), name
    assert type(optimizer).__name__ == "MuonWithAdamW"
    # one state dict for both parts; a load hands the new groups and state back to both
    saved = optimizer.state_dict()
    again = build_optimizer([model], o, torch.device("cpu"))
    again.load_state_dict(saved)
    assert again.muon.state is again.adamw.state is again.state
    groups = again.muon.param_groups + again.adamw.param_groups
    assert len(groups) == len(again.param_groups) and all(
        a is b for a, b in zip(groups, again.param_groups)
    )
    assert all(
        torch.equal(again.state[p]["momentum_buffer"], optimizer.state[p]["momentum_buffer"])
        for p in hidden_matrices([model])
    )


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit", "adafactor", "muon"])
def test_each_optimizer_resumes_bit_identically(name, data_dir, tmp_path):
    o = tiny_overrides(
        data_dir,
        tmp_path,
        **{
            "optimizer.name": name,
            "training.steps": 4,
            "eval.every": 0,
            "training.deterministic": True,
            "checkpoint.enable": True,
            "checkpoint.every": 2,
        },
    )
    whole = Trainer(load_config(None, o)).fit()
    path = committed(whole.run_dir / "checkpoints")[0]
    o.update({"metrics.run_name": "resumed", "checkpoint.load": str(path)})
    assert Trainer(load_config(None, o)).fit().losses == whole.losses[2:]


FSDP2 = {"parallel.dp_shard": 2, "training.batch_size": 4}
TP2 = {"parallel.tp": 2, "parallel.dp_shard": 1}  # the row-parallel matrices: column shards


@pytest.mark.parametrize(
    "name, layout",
    [("muon", FSDP2), ("adamw8bit", FSDP2), ("muon", TP2)],
    ids=["muon-fsdp", "adamw8bit-fsdp", "muon-tp"],
)
def test_debug_config_on_two_ranks_gives_one_process_losses(name, layout, data_dir, tmp_path):
    """`titanlite train --config configs/debug.toml --optimizer.name NAME` against the same under
    torchrun with --parallel.dp_shard 2 (launch runs exactly that), deterministic fp32; and Muon
    under tensor parallelism, whose gather also joins column shards."""
    o = parity_overrides(data_dir, tmp_path, **{"optimizer.name": name, "training.steps": 6})
    one = Trainer(load_config(DEBUG, o)).fit()
    two = launch(load_config(DEBUG, o), nproc=2, overrides=layout)
    assert len(two.losses) == 6 and two.losses == pytest.approx(one.losses, abs=1e-5)
    assert [r["val_loss"] for r in two.rank(0, "val")] == pytest.approx(one.val_losses, abs=1e-5)


def test_sharded_muon_gathers_each_matrix_once_and_equals_torchs_muon():
    shapes = [(64, 64), (192, 64), (64, 192)]
    for r in launch_function(
        "titanlite.labs.nb20_optimizers_and_memory:sharded_muon_step", nproc=2, shapes=shapes
    ):
        assert r["diff"] == 0.0  # the same bits as torch.optim.Muon on the whole matrices
        gathers = r["collectives"]
        assert set(gathers) == {"all_gather"} and gathers["all_gather"]["calls"] == 2 * len(shapes)
        # two steps, each matrix's bf16 update gathered whole: 2 bytes an element
        assert gathers["all_gather"]["bytes"] == 2 * 2 * sum(a * b for a, b in shapes)


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit", "muon"])
def test_an_fsdp4_checkpoint_loads_into_one_process_exactly(name, data_dir, tmp_path):
    """Saved by 4 FSDP ranks, loaded by one process: every moment is the whole of what the 4 ranks
    wrote (a quantized one: its codes and scales, read back as values). Adafactor is refused under
    FSDP (test_a_layout_or_an_option_that_cannot_work_is_refused_in_one_line)."""
    import torch.distributed.checkpoint as dcp

    o = tiny_overrides(
        data_dir,
        tmp_path,
        **{
            "optimizer.name": name,
            "training.steps": 3,
            "eval.every": 0,
            "training.batch_size": 2,
            "training.deterministic": True,
            "checkpoint.enable": True,
        },
    )
    fsdp = launch(load_config(None, o), nproc=4, overrides={"parallel.dp_shard": 4})
    path = committed(fsdp.run_dir / "checkpoints")[-1]
    # one process, the same global batch of 8
    o.update({"training.batch_size": 8, "checkpoint.enable": False, "metrics.run_name": "one"})
    trainer = Trainer(load_config(None, o))
    assert Checkpointer(path.parent).load(trainer.train_state(), path) == 3
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    held = {  # every moment this process holds, as values (a quantized one dequantized)
        f"optimizer.state.{names[id(p)]}.{key}": v.dequantize() if quantized(v) else v
        for p, state in trainer.optimizer.state.items()
        for key, v in state.items()
        if key != "step"
    }
    written = {k: torch.zeros_like(v) for k, v in held.items()}  # the 4 ranks' shards, whole
    dcp.load(written, checkpoint_id=str(path), no_dist=True)
    assert held and all(torch.equal(held[k], written[k]) for k in held)
    states = [v for state in trainer.optimizer.state.values() for v in state.values()]
    assert (name != "muon") == any(map(quantized, states))
    trainer.close()


def test_a_layout_or_an_option_that_cannot_work_is_refused_in_one_line():
    from titanlite.distributed.mesh import ParallelDims
    from titanlite.preflight import preflight

    one, fsdp = ParallelDims.resolve(1, 1, 1), ParallelDims.resolve(1, 2, 2)
    tp = ParallelDims.resolve(1, 1, 2, tp=2)
    cases = [
        ({"name": "adamw", "muon_momentum": 0.9}, one, "optimizer.muon_momentum is Muon's"),
        ({"name": "adamw8bit", "muon_ns_steps": 3}, one, "optimizer.muon_ns_steps is Muon's"),
        ({"name": "adafactor", "beta1": 0.8}, one, "optimizer.beta1 is AdamW's"),
        ({"name": "adafactor", "eps": 1e-6}, one, "optimizer.eps is AdamW's"),
        ({"name": "adafactor"}, fsdp, "row and column"),
        ({"name": "adafactor"}, tp, "row and column"),
        ({"name": "adamw4bit"}, tp, "tensor parallelism cuts row-parallel matrices"),
    ]
    for keys, dims, says in cases:
        o = Config().optimizer
        for k, v in keys.items():
            setattr(o, k, v)
        with pytest.raises(TitanliteError, match=says) as e:
            check_optimizer(o, dims)
        assert "\n" not in str(e.value) and "--" in str(e.value)  # the fix, as a flag
    o = Config().optimizer
    o.name = "muon"
    with pytest.raises(TitanliteError, match="cpu_offload"):
        check_optimizer(o, fsdp, cpu_offload=True)
    check_optimizer(o, fsdp)  # muon under FSDP is fine
    cfg = Config()  # and preflight asks, before any process group exists
    cfg.optimizer.name, cfg.parallel.dp_shard = "adafactor", 2
    with pytest.raises(TitanliteError, match="adafactor factors"):
        preflight(cfg, world_size=2, vocab_size=cfg.data.vocab_size)
    # Muon with nothing to take, and a quantized state where torchao does not run
    o.name = "muon"
    with pytest.raises(TitanliteError, match="has none"):
        build_optimizer(
            [nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4))], o, torch.device("cpu")
        )
    o.name = "adamw8bit"
    with pytest.raises(TitanliteError, match="not on mps: use --optimizer.name adamw"):
        build_optimizer([nn.Linear(4, 4)], o, torch.device("mps"))
