"""Mixture of experts and expert parallelism: the router, both balancing methods, dropping, FLOPs
of active parameters, EP = one process (alone and with FSDP), EP checkpoints resumed and resharded,
Mixtral export and import with equal logits, and the CUDA path pinned on meta tensors."""

from __future__ import annotations

import pytest
import torch
from conftest import parity_overrides

from titanlite import TitanliteError
from titanlite.config import load_config
from titanlite.models.llama import ModelArgs, build_model
from titanlite.models.moe import MoE, MoEArgs, Router, expert_kernel, grouped_swiglu
from titanlite.resilience.checkpoint import Checkpointer
from titanlite.resilience.checkpoint_files import committed
from titanlite.tools.formats.export import from_hf, load_model, to_hf, to_hf_model
from titanlite.tools.jobs.launcher import launch, launch_function
from titanlite.tools.measure.flops import count_training_flops
from titanlite.train import Trainer

# ----- the pieces ------------------------------------------------------------------------------


def test_the_router_picks_the_top_k_with_the_bias_and_weights_them_without_it():
    router = Router(8, MoEArgs(n_experts=4, experts_per_token=2, balance="aux_free"))
    torch.manual_seed(0)
    torch.nn.init.normal_(router.gate.weight)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 always chosen
    tokens = torch.randn(16, 8)
    weights, chosen, scores = router(tokens)
    assert (chosen == 3).any(-1).all() and chosen.shape == (16, 2)
    assert torch.allclose(weights.sum(-1), torch.ones(16))
    # The weights are the scores (not the biased ones) of the chosen, normalised.
    picked = scores.gather(-1, chosen)
    assert torch.allclose(weights, picked / picked.sum(-1, keepdim=True))
    assert router.tokens_per_expert.sum() == 32 and router.tokens_per_expert[3] == 16


def test_aux_free_balancing_moves_each_bias_against_its_load():
    router = Router(8, MoEArgs(n_experts=4, bias_update=0.01))
    router.tokens_per_expert.copy_(torch.tensor([10.0, 4.0, 1.0, 1.0]))  # mean 4
    router.after_optimizer_step()
    assert router.expert_bias.tolist() == pytest.approx([-0.01, 0.0, 0.01, 0.01])
    assert router.load.tolist() == [10.0, 4.0, 1.0, 1.0] and router.tokens_per_expert.sum() == 0


def test_the_aux_loss_is_switchs_and_its_gradient_reaches_the_router():
    moe = MoE(8, MoEArgs(n_experts=4, balance="aux_loss", aux_loss_coef=0.5), 16)
    torch.manual_seed(1)
    moe.init_weights(0.5, 0.5)
    x = torch.randn(2, 5, 8)
    _, chosen, scores = moe.router(x.reshape(-1, 8))
    share = torch.bincount(chosen.flatten(), minlength=4).float() / chosen.numel()
    expected = 0.5 * 4 * (share * scores.mean(0)).sum()
    assert moe.aux_loss(scores, chosen).item() == pytest.approx(expected.item())
    moe(x).sum().backward()
    with_loss = moe.router.gate.weight.grad.clone()
    moe.zero_grad()
    moe.args.balance = "none"
    moe(x).sum().backward()
    assert not torch.allclose(with_loss, moe.router.gate.weight.grad)  # the loss adds its pull


def test_a_built_model_starts_with_no_bias_and_no_counted_tokens():
    """Built on the meta device then materialised with to_empty(): the router's buffers hold
    whatever memory held until init_weights clears them (the first bias update reads them)."""
    model = build_model(ModelArgs.preset("debug", moe=MoEArgs(n_experts=4)))
    for block in model.layers.values():
        router = block.feed_forward.router
        assert router.expert_bias.eq(0).all() and router.tokens_per_expert.eq(0).all()


def test_a_mixture_trains_under_autocast_as_gpus_run_it():
    """bf16 autocast (the CUDA default): the experts' outputs come out bf16, the router's weights
    fp32; the combine once refused to add one to the other (index_add_ dtype error)."""
    model = build_model(ModelArgs.preset("debug", moe=MoEArgs(n_experts=4, n_shared_experts=1)))
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    with torch.no_grad():
        fp32 = model(tokens)
    assert logits.dtype == torch.bfloat16 and (logits.float() - fp32).abs().max() < 0.1
    logits.float().logsumexp(-1).mean().backward()
    experts = model.layers["0"].feed_forward.experts
    assert experts.w_gate.grad.dtype == torch.float32 and experts.w_gate.grad.abs().sum() > 0


def test_a_capacity_drops_only_the_choices_beyond_it_and_dropless_drops_none():
    x = torch.randn(1, 64, 8)
    dropless = MoE(8, MoEArgs(n_experts=4), 16)
    dropless.init_weights(0.5, 0.5)
    dropless(x)
    assert dropless.dropped == 0
    tight = MoE(8, MoEArgs(n_experts=4, capacity_factor=0.5), 16)
    tight.load_state_dict(dropless.state_dict())
    out = tight(x)
    # 64 tokens × 2 choices / 4 experts × 0.5 = 16 per expert: at least half of 128 dropped.
    assert int(tight.dropped) >= 64 and out.shape == x.shape


def test_flops_count_the_experts_a_token_uses_not_all_of_them():
    args = ModelArgs.preset("debug", max_seq_len=64, moe=MoEArgs(n_experts=8, experts_per_token=2))
    torch.manual_seed(0)
    model = build_model(args)
    T = 64
    counted = count_training_flops(model, torch.randint(0, args.vocab_size, (2, T)))
    formula = model.flops_per_token(T)
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * T
    norms = (2 * args.n_layers + 1) * args.dim
    assert counted["by_op"]["aten.mm"] / (2 * T) == formula - attention - 6 * norms
    expert = 3 * args.dim * args.hidden_dim
    assert model.num_params() - model.active_params() == args.n_layers * 6 * expert


@pytest.mark.parametrize(
    "device, dtype, capability, rocm, widths, kernel",
    [
        ("cuda", torch.bfloat16, (9, 0), False, (64, 96), "grouped_mm"),  # H100
        ("cuda", torch.bfloat16, (10, 0), False, (64, 96), "grouped_mm"),  # B200
        ("cuda", torch.bfloat16, (10, 3), False, (64, 96), "grouped_mm"),  # B300
        ("cuda", torch.bfloat16, (12, 0), False, (64, 96), "loop"),  # RTX 50: torch's fallback
        ("cuda", torch.bfloat16, (8, 0), False, (64, 96), "loop"),  # A100: torch's fallback
        ("cuda", torch.bfloat16, (9, 4), True, (64, 96), "loop"),  # MI300X under ROCm
        ("cuda", torch.bfloat16, (9, 0), False, (64, 100), "loop"),  # rows not 16-byte aligned
        ("cuda", torch.float32, (9, 0), False, (64, 96), "loop"),  # the fast path is bf16
        ("cpu", torch.bfloat16, None, False, (64, 96), "loop"),
        ("mps", torch.bfloat16, None, False, (64, 96), "loop"),
    ],
)
def test_grouped_gemm_where_torch_runs_its_kernel_a_loop_elsewhere(
    device, dtype, capability, rocm, widths, kernel
):
    assert expert_kernel(device, dtype, capability, rocm, widths) == kernel


def test_the_grouped_gemm_path_takes_the_experts_weights_as_they_are_stacked():
    """Pinned on meta tensors (shapes and dtypes, no GPU): bf16 rows of 4 experts."""
    x = torch.empty(40, 64, device="meta", dtype=torch.bfloat16)
    w_gate, w_up = (torch.empty(4, 96, 64, device="meta", dtype=torch.bfloat16) for _ in range(2))
    w_down = torch.empty(4, 64, 96, device="meta", dtype=torch.bfloat16)
    ends = torch.empty(4, device="meta", dtype=torch.int32)
    out = grouped_swiglu(x, w_gate, w_up, w_down, ends)
    assert out.shape == (40, 64) and out.dtype == torch.bfloat16


def skip_without_cpu_grouped_gemm():
    probe = torch.ones(2, 8, dtype=torch.bfloat16)
    try:
        torch._grouped_mm(
            probe,
            torch.ones(1, 8, 8, dtype=torch.bfloat16),
            offs=torch.tensor([2], dtype=torch.int32),
        )
    except (RuntimeError, NotImplementedError) as e:  # CPU grouped GEMM arrived after torch 2.11
        pytest.skip(f"this torch has no CPU _grouped_mm: {str(e).splitlines()[0]}")


def test_the_grouped_gemm_path_computes_what_the_loop_computes(monkeypatch):
    """The numbers too, not only the shapes: torch's CPU `_grouped_mm` runs the GPU path's very
    code here. A whole MoE model, forward and backward, with an expert that gets no token, in
    bf16: the grouped path (forced) against the loop, outputs and every gradient."""
    from titanlite.models import moe

    skip_without_cpu_grouped_gemm()

    def run(kernel):
        monkeypatch.setattr(moe, "expert_kernel", lambda *a, **k: kernel)
        torch.manual_seed(0)
        model = build_model(ModelArgs.preset("debug", vocab_size=128, moe=MoEArgs(n_experts=4)))
        model.to(torch.bfloat16)
        for router in (m for m in model.modules() if isinstance(m, Router)):
            router.expert_bias[3] = -100.0  # the bias only chooses: expert 3 gets no token
        tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        logits = model(tokens)
        logits.float().square().mean().backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        return logits.float(), grads

    (grouped, grads_grouped), (looped, grads_looped) = run("grouped_mm"), run("loop")
    assert torch.allclose(grouped, looped, rtol=2e-2, atol=2e-2), (grouped - looped).abs().max()
    assert grads_grouped.keys() == grads_looped.keys()
    for name, g in grads_grouped.items():
        scale = grads_looped[name].abs().max().clamp(min=1e-6)
        assert (g - grads_looped[name]).abs().max() / scale < 5e-2, name


def test_under_autocast_the_kernel_is_chosen_and_fed_in_the_autocast_dtype(monkeypatch):
    """fp32 weights under bf16 autocast (one GPU's default): the rows reach the experts in fp32,
    yet the matmuls run in bf16, so an H100 must get the grouped GEMM, fed bf16 (it takes no
    fp32), not the loop. Spied on CPU autocast: the dtype the choice sees, and the kernel's."""
    from titanlite.models import moe

    seen, fed = [], []
    monkeypatch.setattr(moe, "expert_kernel", lambda dev, dtype, *facts: seen.append(dtype))
    grouped = moe.grouped_swiglu
    monkeypatch.setattr(moe, "grouped_swiglu", lambda x, *w: fed.append(x.dtype) or grouped(x, *w))
    model = build_model(ModelArgs.preset("debug", moe=MoEArgs(n_experts=4)))
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
    model(tokens)
    assert seen == [torch.bfloat16] * 2 + [torch.float32] * 2 and not fed  # the loop ran
    skip_without_cpu_grouped_gemm()
    monkeypatch.setattr(moe, "expert_kernel", lambda *a, **k: "grouped_mm")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the kernel itself, bf16 in and out
        logits = model(tokens)
    logits.float().square().mean().backward()
    assert fed == [torch.bfloat16] * 2
    w_gate = model.layers["0"].feed_forward.experts.w_gate
    assert w_gate.dtype == w_gate.grad.dtype == torch.float32 and w_gate.grad.abs().sum() > 0


def test_bad_mixtures_are_one_line():
    with pytest.raises(TitanliteError, match="at least 2 experts"):
        ModelArgs.preset("debug", moe=MoEArgs(n_experts=1))
    with pytest.raises(TitanliteError, match="experts_per_token <= n_experts"):
        ModelArgs.preset("debug", moe=MoEArgs(n_experts=4, experts_per_token=5))
    with pytest.raises(TitanliteError, match="moe_every=3 leaves none"):
        ModelArgs.preset("debug", moe=MoEArgs(every=3))


# ----- the trainer: expert parallel = one process ------------------------------------------------

MOE = {"model.n_experts": 4, "model.experts_per_token": 2, "model.n_shared_experts": 1}


def _overrides(data_dir, tmp_path, **extra):
    return parity_overrides(data_dir, tmp_path, **{"training.steps": 4, **MOE, **extra})


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    history = Trainer(load_config(None, _overrides(data_dir, tmp_path_factory.mktemp("r")))).fit()
    return history.losses, history.val_losses


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, {"parallel.ep": 2, "parallel.dp_shard": 1, "training.batch_size": 4}),
        (4, {"parallel.ep": 2, "parallel.dp_shard": 2, "training.batch_size": 2}),
        (2, {"parallel.tp": 2, "parallel.dp_shard": 1}),
        (2, {"parallel.tp": 2, "parallel.dp_shard": 1, "parallel.sequence_parallel": False}),
        (4, {"parallel.tp": 2, "parallel.dp_shard": 2, "training.batch_size": 4}),
    ],
    ids=["ep2", "ep2-fsdp2", "tp2-sp", "tp2", "tp2-fsdp2"],
)
def test_expert_and_tensor_parallel_train_like_one_process(
    nproc, layout, data_dir, tmp_path, reference
):
    result = launch(
        load_config(None, _overrides(data_dir, tmp_path)), nproc=nproc, overrides=layout
    )
    losses, val_losses = reference
    assert result.losses == pytest.approx(losses, abs=1e-5)
    assert [r["val_loss"] for r in result.rank(0, "val")] == pytest.approx(val_losses, abs=1e-5)


def test_an_ep_checkpoint_resumes_exactly_and_loads_into_one_process_and_ep4(data_dir, tmp_path):
    """Through the command line (`launch` runs `titanlite train` under torchrun): an EP2 run's
    checkpoint continues on EP2, on one process and on EP4. Issue 47: one process died at its
    first step in LambdaLR (`zip() argument 2 is longer`), the schedule restored with one lr per
    parameter group of the EP run, which has a group more (the experts' own mesh)."""
    from titanlite._compat.torch_tools import load_whole_dcp_state
    from titanlite.resilience.checkpoint_files import RawReader

    o = _overrides(data_dir, tmp_path, **{"checkpoint.enable": True, "checkpoint.every": 2})
    ep2 = {"parallel.ep": 2, "parallel.dp_shard": 1, "training.batch_size": 4}
    whole = launch(load_config(None, {**o, "metrics.run_name": "whole"}), nproc=2, overrides=ep2)
    path = committed(whole.run_dir / "checkpoints")[0]
    resumed = launch(
        load_config(None, {**o, "metrics.run_name": "resumed", "checkpoint.load": str(path)}),
        nproc=2,
        overrides=ep2,
    )
    assert resumed.losses == whole.losses[2:]  # bit for bit
    one = launch(
        load_config(None, {**o, "metrics.run_name": "one", "checkpoint.load": str(path)}), nproc=1
    )
    assert one.losses == pytest.approx(whole.losses[2:], abs=1e-5)
    # What one process loaded is the checkpoint's, whole: the weights and, by parameter name, the
    # optimizer's moments, step and group settings (the EP run kept the experts' apart).
    trainer = Trainer(load_config(None, {**o, "checkpoint.enable": False}))
    assert Checkpointer(path.parent).load(trainer.train_state(), path) == 2
    saved = load_whole_dcp_state(RawReader(path))
    assert (
        any("experts.w_gate" in k for k in saved["model"])
        and len(saved["scheduler"]["base_lrs"]) == 3
    )
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in saved["model"].items())
    names = {p: n for n, p in trainer.model.named_parameters()}
    moments = [
        (names[p], k, v) for p, state in trainer.optimizer.state.items() for k, v in state.items()
    ]
    assert len(moments) == 3 * len(names) and "layers.0.feed_forward.experts.w_up" in names.values()
    assert all(torch.equal(v, saved["optimizer"][f"state.{n}.{k}"]) for n, k, v in moments)
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            for key in ("lr", "initial_lr", "weight_decay"):
                assert group[key] == saved["optimizer"][f"param_groups.{names[p]}.{key}"]
    trainer.close()
    ep4 = launch(
        load_config(None, {**o, "metrics.run_name": "ep4", "checkpoint.load": str(path)}),
        nproc=4,
        overrides={"parallel.ep": 4, "parallel.dp_shard": 1, "training.batch_size": 2},
    )
    assert ep4.losses == pytest.approx(whole.losses[2:], abs=1e-5)
    assert ep4.losses == pytest.approx(one.losses, abs=1e-5)
    eight = {**o, "metrics.run_name": "eight", "checkpoint.load": str(path), "model.n_experts": 8}
    with pytest.raises(TitanliteError, match="n_experts"):
        Trainer(load_config(None, eight)).fit()


def test_a_tp_mixtures_checkpoint_loads_into_one_process_exactly(data_dir, tmp_path):
    """The experts saved split over tp on their hidden units (Shard(1), Shard(2)) load whole."""
    o = _overrides(data_dir, tmp_path, **{"checkpoint.enable": True, "checkpoint.every": 2})
    tp2 = {"parallel.tp": 2, "parallel.dp_shard": 1}
    run = launch(load_config(None, {**o, "metrics.run_name": "tp"}), nproc=2, overrides=tp2)
    path = committed(run.run_dir / "checkpoints")[-1]
    trainer = Trainer(load_config(None, {**o, "checkpoint.enable": False}))
    assert Checkpointer(path.parent).load(trainer.train_state(), path) == 4
    saved = load_model(path).state_dict()
    assert saved["layers.0.feed_forward.experts.w_down"].shape == (4, 64, 192)  # [E, D, H]: whole
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in saved.items())
    trainer.close()


# ----- Hugging Face: Mixtral -------------------------------------------------------------------


def test_a_mixture_exports_to_mixtral_that_transformers_loads_with_our_logits(tmp_path):
    from transformers import MixtralForCausalLM

    args = ModelArgs.preset(
        "debug", vocab_size=512, moe=MoEArgs(n_experts=4, experts_per_token=2, balance="aux_loss")
    )
    torch.manual_seed(0)
    model = build_model(args)
    tokens = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        ours = model(tokens)
        assert (to_hf_model(model)(tokens).logits - ours).abs().max() <= 1e-4
        to_hf(model, tmp_path / "mixtral")
        theirs = MixtralForCausalLM.from_pretrained(tmp_path / "mixtral").eval()(tokens).logits
        assert (theirs - ours).abs().max() <= 1e-4
        back = from_hf(tmp_path / "mixtral")
        assert back.args.moe.n_experts == 4 and (back(tokens) - ours).abs().max() <= 1e-4
    model.layers["0"].feed_forward.router.expert_bias[0] = 0.1  # aux_free balancing happened
    with pytest.raises(TitanliteError, match="aux_free balancing bias"):
        to_hf_model(model)


# ----- notebook 18's lab: a hot expert's cost, and the interval its timing is judged by --------


def test_the_median_interval_holds_the_median_as_often_as_it_says():
    import math

    from titanlite.labs.nb18_mixture_of_experts import median_interval

    assert median_interval([5, 1, 4, 2, 3, 7, 6]) == (1, 4, 7, 1 - 2 / 2**7)
    low, middle, high, coverage = median_interval(range(15))
    assert (low, middle, high) == (3, 7, 11) and 0.95 <= coverage < 0.97
    with pytest.raises(TitanliteError, match="cannot bound a median"):
        median_interval([1, 2, 3, 4, 5])
    g = torch.Generator().manual_seed(0)
    trials = 2000
    held = 0
    for _ in range(trials):  # exponential draws, a skewed distribution: its median is ln 2
        low, _, high, _ = median_interval(torch.empty(7).exponential_(generator=g).tolist())
        held += low <= math.log(2) <= high
    assert held / trials >= 0.97  # it claims 98.4%


def test_a_hot_experts_rank_is_counted_and_timed_round_by_round():
    from titanlite.labs.nb18_mixture_of_experts import hot_expert_cost

    threads = torch.get_num_threads()
    cost = hot_expert_cost(tokens=256, repeats=3)  # 4 ranks of 2 experts, top-2 of 8
    assert cost["balanced"]["choices"] == 2 * 64  # 256·2/8 each
    assert cost["hot"]["choices"] == 256 + 256 // 7  # all 256 tokens, and a share of the rest
    assert all(len(c["seconds"]) == 3 and min(c["seconds"]) > 0 for c in cost.values())
    assert torch.get_num_threads() == threads


def test_an_expert_parallel_layer_waits_once_and_op_sac_keeps_its_exchanges(data_dir, tmp_path):
    """EP 2 on two gloo ranks, one step, counted: each MoE layer's forward reads its split sizes
    on the host once (a GPU's one wait a layer: models/moe.host_waits, what run.json records), and
    under op-level SAC its all-to-alls are kept, not issued again by the backward's recompute."""
    o = _overrides(data_dir, tmp_path, **{"parallel.ep": 2, "parallel.dp_shard": 1})
    o.update({"training.batch_size": 4, "training.grad_accum_steps": 1})
    target = "titanlite.labs.nb18_mixture_of_experts:ep_step_costs"
    plain = launch_function(target, nproc=2, overrides=o)
    sac = launch_function(target, nproc=2, overrides={**o, "activation_checkpoint.mode": "op"})
    full = launch_function(target, nproc=2, overrides={**o, "activation_checkpoint.mode": "full"})
    for r in plain:
        assert len(r["host_reads"]) == r["moe_layers"] >= 1, r["host_reads"]
        assert all("expert_parallel.py" in site for site in r["host_reads"]), r["host_reads"]
    calls = [r["all_to_all"] for r in plain]
    assert [r["all_to_all"] for r in sac] == calls  # kept: none issued twice
    assert all(f > c for f, c in zip((r["all_to_all"] for r in full), calls))  # full AC re-issues
