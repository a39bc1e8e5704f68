"""Notebook 09's tensor-parallel lab: communication counted vs predicted, the from-scratch
MLP (distributed/scratch_tp.py) checked against apply_tp, and the experiments each rank runs
(`launch_function("titanlite.labs.nb09_tensor_parallel:tp_lab", nproc=2)`; the tests run
them too).

The technique itself lives in distributed/tensor_parallel.py (apply_tp); this measures it.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ..distributed.tensor_parallel import apply_tp, loss_context, tp_loss_sum
from ..efficiency.accumulation import IGNORE_INDEX, loss_sum
from ..models.llama import ModelArgs
from ..tools.jobs.run_function import report
from ..tools.measure.comm import CommCounter
from ._common import Progress, join, random_tokens, seeded_model, train_adamw
from .nb09_scratch_tp import ScratchParallelMLP

# ----- communication: counted, and predicted -------------------------------------------------


def tp_comm_formula(
    args,
    batch: int,
    seq_len: int,
    tp: int,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    act_bytes: int = 4,
    param_bytes: int = 4,
    loss_bytes: int = 4,
) -> dict:
    """The collectives of one training step, per block and outside the blocks:
    {"per_block" | "outside": {"forward" | "backward": {op: {"calls", "bytes"}}}}.
    Bytes as CommCounter counts them (S: the whole tensor, the gathered output of an
    all-gather, the whole input of a reduce-scatter). A = B·T·D activations."""
    A = batch * seq_len * args.dim * act_bytes
    if tp == 1:
        return {part: {"forward": {}, "backward": {}} for part in ("per_block", "outside")}

    def ops(**calls):  # op=(count, bytes each)
        return {op: {"calls": n, "bytes": n * b} for op, (n, b) in calls.items() if n}

    if sequence_parallel:
        # Forward: all-gather before attention and MLP, reduce-scatter after them; backward
        # mirrors it; plus one all-reduce of each norm's partial weight gradient (D numbers).
        norm_grad = args.dim * param_bytes
        block = {
            "forward": ops(all_gather=(2, A), reduce_scatter=(2, A)),
            "backward": ops(all_gather=(2, A), reduce_scatter=(2, A), all_reduce=(2, norm_grad)),
        }
        # Embedding: reduce-scatter (backward: all-gather); output's input: all-gather
        # (backward: reduce-scatter); the final norm's weight gradient.
        outside = {
            "forward": ops(all_gather=(1, A), reduce_scatter=(1, A)),
            "backward": ops(all_gather=(1, A), reduce_scatter=(1, A), all_reduce=(1, norm_grad)),
        }
    else:
        # Forward: all-reduce after o_proj and down_proj; backward: all-reduce the gradient
        # of the whole input of attention and of the MLP.
        block = {"forward": ops(all_reduce=(2, A)), "backward": ops(all_reduce=(2, A))}
        outside = {"forward": ops(all_reduce=(1, A)), "backward": ops(all_reduce=(1, A))}
    fwd = outside["forward"]
    if loss_parallel:  # per token: max, sum of exponentials, target logit (fp32: loss_sum)
        fwd["all_reduce"] = _add(fwd.get("all_reduce"), 3, 3 * batch * seq_len * loss_bytes)
    else:  # gather the whole logits
        fwd["all_gather"] = _add(
            fwd.get("all_gather"), 1, batch * seq_len * args.vocab_size * act_bytes
        )
    return {"per_block": block, "outside": outside}


def _add(row, calls, nbytes):
    row = row or {"calls": 0, "bytes": 0}
    return {"calls": row["calls"] + calls, "bytes": row["bytes"] + nbytes}


def step_comm_expected(formula: dict, n_layers: int) -> dict:
    """Whole-step totals from `tp_comm_formula`: n_layers × per block + outside."""
    out = {}
    for phase in ("forward", "backward"):
        total = {op: dict(v) for op, v in formula["outside"][phase].items()}
        for op, v in formula["per_block"][phase].items():
            total[op] = _add(total.get(op), n_layers * v["calls"], n_layers * v["bytes"])
        out[phase] = total
    return out


def count_step_comm(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, *, loss_parallel: bool
) -> dict:
    """Run forward+loss and backward under CommCounter; {"forward" | "backward": {op:
    {"calls", "bytes"}}} on this rank. Gradients are left in .grad."""
    fwd, bwd = CommCounter(), CommCounter()
    with loss_context(loss_parallel):
        with fwd:
            loss = tp_loss_sum(model(tokens), targets)
        with bwd:
            loss.backward()
    return {
        phase: {
            op: {"calls": int(v["calls"]), "bytes": int(v["bytes"])}
            for op, v in c.summary().items()
        }
        for phase, c in (("forward", fwd), ("backward", bwd))
    }


# ----- notebook 09's experiments, run inside every rank (launch_function) ---------------------


def _batches(vocab, n, batch, seq_len, seed, device):
    """n pairs [2, batch, seq_len] of inputs and targets, the same on every rank: a TP group
    reads one batch."""
    return random_tokens(vocab, (n, 2, batch, seq_len), seed, device).unbind(0)


def _exact_loss(logits, y):
    """loss_sum without its fp32 cast, for float64 runs (see train_parity)."""
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss.to_local() if isinstance(loss, DTensor) else loss


def train_parity(
    args,
    mesh,
    device,
    *,
    sequence_parallel=True,
    loss_parallel=True,
    steps=3,
    batch=2,
    seq_len=16,
    lr=1e-2,
    dtype=torch.float64,
    seed=0,
    report_as=None,
) -> dict:
    """AdamW steps (clipped at 1.0) with apply_tp vs a single process on the same weights and
    batches. Returns {"losses", "reference_losses", "max_weight_diff", "max_loss_diff"}.

    float64 with `_exact_loss` isolates the parallelism from rounding. In float32, loss
    parallelism sums the softmax in another order (differences in the 7th digit), and AdamW's
    first step is ≈ lr·sign(g): where a gradient is ~0 that rounding can flip a sign."""
    loss_fn = _exact_loss if dtype == torch.float64 else tp_loss_sum
    reference = seeded_model(args, seed, device).to(dtype=dtype)
    model = apply_tp(
        seeded_model(args, seed, device).to(dtype=dtype),
        mesh,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
    )
    data = _batches(args.vocab_size, min(steps, 4), batch, seq_len, seed, device)  # a few, cycled
    batches = []
    for step in range(steps):
        x, y = data[step % len(data)].clone()
        y[0, :2] = IGNORE_INDEX  # padding targets count nowhere, as in the trainer
        batches.append((x, y))
    out = {}
    for key, net, parallel_loss, label in (
        ("reference_losses", reference, False, "single process"),
        ("losses", model, loss_parallel, report_as),
    ):

        def on_step(step, loss, label=label):
            if report_as:
                report({"kind": "train", "step": step, "loss": loss, "run": label})

        out[key] = train_adamw(
            net,
            batches,
            lr=lr,
            grad_clip=1.0,
            loss_sum_fn=loss_fn,
            loss_context=lambda p=parallel_loss: loss_context(p),
            on_step=on_step,
        )["losses"]
    full = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }
    out["max_weight_diff"] = max(
        (full[k] - v).abs().max().item() for k, v in reference.state_dict().items()
    )
    out["max_loss_diff"] = max(abs(a - b) for a, b in zip(out["losses"], out["reference_losses"]))
    return out


def comm_per_layer(
    args,
    mesh,
    device,
    *,
    sequence_parallel,
    loss_parallel,
    batch=2,
    seq_len=16,
    dtype=torch.float32,
) -> dict:
    """One step counted at 1 and at 2 blocks: the difference is one block's communication,
    the rest is outside the blocks. Returns {"measured", "formula"}, each {"per_block",
    "outside"}, plus "step" (the 2-block step) and its formula total."""
    counts = {}
    for n_layers in (1, 2):
        a = replace(args, n_layers=n_layers)
        model = apply_tp(
            seeded_model(a, 0, device).to(dtype=dtype),
            mesh,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
        )
        x, y = _batches(a.vocab_size, 1, batch, seq_len, 1, device)[0]
        counts[n_layers] = count_step_comm(model, x, y, loss_parallel=loss_parallel)
    per_block, outside = {}, {}
    for phase in ("forward", "backward"):
        one, two = counts[1][phase], counts[2][phase]
        per_block[phase] = {
            op: {k: two[op][k] - one.get(op, {}).get(k, 0) for k in ("calls", "bytes")}
            for op in two
            if two[op] != one.get(op)
        }
        outside[phase] = {
            op: {k: v[k] - per_block[phase].get(op, {}).get(k, 0) for k in v}
            for op, v in one.items()
        }
        outside[phase] = {op: v for op, v in outside[phase].items() if v["calls"]}
    size = torch.tensor([], dtype=dtype).element_size()
    formula = tp_comm_formula(
        args,
        batch,
        seq_len,
        mesh.size(),
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        act_bytes=size,
        param_bytes=size,
    )
    return {
        "measured": {"per_block": per_block, "outside": outside},
        "formula": formula,
        "step": counts[2],
        "step_formula": step_comm_expected(formula, 2),
    }


def dtensor_basics(mesh, device) -> dict:
    """Placements on a 4×6 tensor, and what a matmul does to them (column then row parallel)."""
    t = torch.arange(24.0, device=device).view(4, 6)
    local = {
        str(p): distribute_tensor(t, mesh, [p]).to_local().tolist()
        for p in (Shard(0), Shard(1), Replicate())
    }
    x = distribute_tensor(torch.ones(3, 6, device=device), mesh, [Replicate()])
    w1 = distribute_tensor(t, mesh, [Shard(0)])  # column parallel: rank r holds rows r of W1
    h = torch.nn.functional.linear(x, w1)  # x·W1ᵀ, [3, 4]: rank r holds its columns of h
    w2 = distribute_tensor(torch.ones(5, 4, device=device), mesh, [Shard(1)])  # row parallel
    y = torch.nn.functional.linear(h, w2)  # [3, 5]: each rank a partial sum of the whole
    with CommCounter() as cc:
        whole = y.redistribute(placements=[Replicate()])  # the one all-reduce
    rank_value = torch.full((2,), float(mesh.get_local_rank() + 1), device=device)
    partial = DTensor.from_local(rank_value, mesh, [Partial()])
    return {
        "local": local,
        "h_placements": str(h.placements),
        "y_placements": str(y.placements),
        "y": whole.to_local().tolist(),
        "y_expected": (
            torch.ones(3, 6, device=device) @ t.T @ torch.ones(5, 4, device=device).T
        ).tolist(),
        "redistribute_comm": {op: int(v["calls"]) for op, v in cc.summary().items()},
        "partial_full": partial.full_tensor().tolist(),
    }


def mlp_from_scratch_check(args, mesh, device, batch=2, seq_len=8, seed=0) -> dict:
    """ScratchParallelMLP vs block 0's MLP after apply_tp (no SP) vs the single-process MLP:
    outputs, input gradients and this rank's weight-gradient slices (max abs differences)."""
    full = seeded_model(args, seed, device)
    tp_model = apply_tp(
        seeded_model(args, seed, device), mesh, sequence_parallel=False, loss_parallel=False
    )
    scratch = ScratchParallelMLP(full.layers["0"].feed_forward, mesh.get_group())
    x = torch.randn(batch, seq_len, args.dim, generator=torch.Generator().manual_seed(seed)).to(
        device
    )
    results = {}
    for name, mlp in (
        ("single", full.layers["0"].feed_forward),
        ("scratch", scratch),
        ("apply_tp", tp_model.layers["0"].feed_forward),
    ):
        xi = x.clone().requires_grad_(True)
        out = mlp(xi)
        out.pow(2).sum().backward()
        results[name] = (out.detach(), xi.grad)
    dtp = tp_model.layers["0"].feed_forward
    gate_grads = (scratch.gate.grad, dtp.gate_proj.weight.grad.to_local())
    diff = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    return {
        "out_scratch_vs_single": diff(results["scratch"][0], results["single"][0]),
        "out_scratch_vs_apply_tp": diff(results["scratch"][0], results["apply_tp"][0]),
        "grad_x_scratch_vs_single": diff(results["scratch"][1], results["single"][1]),
        "grad_x_scratch_vs_apply_tp": diff(results["scratch"][1], results["apply_tp"][1]),
        "gate_grad_slice_scratch_vs_apply_tp": diff(*gate_grads),
        "local_gate_shape": list(scratch.gate.shape),
        "full_gate_shape": list(dtp.gate_proj.weight.shape),
    }


def loss_sum_check(args, mesh, device, batch=2, seq_len=16, seed=0) -> dict:
    """The trainer's fp32 loss on Shard(-1) DTensor logits under loss parallelism vs on whole
    logits in one process: the loss value and the first step's gradients (relative)."""
    reference = seeded_model(args, seed, device)
    model = apply_tp(seeded_model(args, seed, device), mesh)
    x, y = _batches(args.vocab_size, 1, batch, seq_len, seed, device)[0]
    y[0, :2] = -100
    ref_loss = loss_sum(reference(x), y)
    ref_loss.backward()
    with loss_context(True):
        logits = model(x)
        loss = tp_loss_sum(logits, y)
        loss.backward()
    grads = dict(model.named_parameters())
    rel = max(
        ((grads[k].grad.full_tensor() - p.grad).norm() / p.grad.norm()).item()
        for k, p in reference.named_parameters()
    )
    layout = {
        k: {
            "shape": list(p.shape),
            "local_shape": list(p.to_local().shape),
            "placements": str(p.placements),
        }
        for k, p in model.named_parameters()
    }
    return {
        "params": layout,
        "logits_type": type(logits).__name__,
        "logits_placements": str(logits.placements),
        "local_logits_shape": list(logits.to_local().shape),
        "loss_type": type(loss).__name__,
        "loss": loss.item(),
        "reference_loss": ref_loss.item(),
        "max_grad_rel_diff": rel,
    }


def any_length_check(args, mesh, device, lengths=(1, 5, 7)) -> dict:
    """Sequence parallel on lengths that do not split evenly (generation): the logits vs a
    single process's, max abs difference per length."""
    reference = seeded_model(args, 0, device)
    model = apply_tp(seeded_model(args, 0, device), mesh)
    out = {}
    with torch.no_grad():
        for T in lengths:
            x = torch.randint(
                0, args.vocab_size, (1, T), generator=torch.Generator().manual_seed(T)
            )
            out[T] = (
                (model(x.to(device)).full_tensor() - reference(x.to(device))).abs().max().item()
            )
    return out


def tp_lab(
    preset="debug",
    parity_configs=((True, True),),
    comm_configs=((True, True), (False, False)),
    train_steps=0,
    train_batch=4,
    train_seq=32,
    basics=True,
    device=None,
    **model_overrides,
) -> dict:
    """Notebook 09's (and the tests') experiments in one job: {"basics", "mlp", "loss_sum",
    "parity" and "comm" per (sequence_parallel, loss_parallel), "train"}. Each finished part is
    reported to the launcher's callbacks as {"kind": "lab", "done": name}, training steps as
    {"kind": "train", "step", "loss", "run"} (the live plot)."""
    env, mesh = join(device, mesh_dim="tp")
    model_overrides = {"vocab_size": 256, "max_seq_len": max(64, train_seq), **model_overrides}
    args = ModelArgs.preset(preset, **model_overrides)
    dev = env.device
    out = {
        "rank": env.rank,
        "world_size": env.world_size,
        "device": dev.type,
        "args": args.to_dict(),
    }
    progress = Progress()
    done, out["seconds"] = progress.done, progress.seconds

    if basics:
        out["basics"] = dtensor_basics(mesh, dev)
        out["mlp"] = mlp_from_scratch_check(args, mesh, dev)
        out["loss_sum"] = loss_sum_check(args, mesh, dev)
        out["any_length"] = any_length_check(args, mesh, dev)
        done("basics")
    out["parity"] = {
        (sp, lp): train_parity(args, mesh, dev, sequence_parallel=sp, loss_parallel=lp)
        for sp, lp in parity_configs
    }
    done("parity")
    out["comm"] = {
        (sp, lp): comm_per_layer(args, mesh, dev, sequence_parallel=sp, loss_parallel=lp)
        for sp, lp in comm_configs
    }
    done("comm")
    if train_steps:  # float32 and the trainer's own loss, streamed to a live plot
        label = f"TP={env.world_size} (SP, loss parallel)" if env.rank == 0 else None
        out["train"] = train_parity(
            args,
            mesh,
            dev,
            steps=train_steps,
            batch=train_batch,
            seq_len=train_seq,
            dtype=torch.float32,
            report_as=label,
        )
        done("train")
    return out
