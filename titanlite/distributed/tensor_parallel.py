"""Tensor parallelism (Megatron-LM), sequence parallelism and loss parallelism with DTensor.

    model = apply_tp(model, tp_mesh)                 # in place, before AC / compile / FSDP
    with loss_context(True):                         # forward's loss AND its backward
        loss = tp_loss_sum(model(x), y) / num_tokens
        loss.backward()

Data parallelism splits the batch; tensor parallelism splits every weight matrix, so a model
too big for one device's memory (or too slow for one device's FLOP/s) runs on `tp` devices.
Every rank of a TP group reads the *same* batch. Each matmul pair of a block splits without
talking in between (Megatron-LM, Shoeybi et al. 2019):

- column-parallel q/k/v and gate/up: rank r holds rows r of the weight, so it computes its own
  attention heads / hidden units from the whole input, and needs nothing from the others;
- row-parallel o_proj and down_proj: rank r holds the matching input columns, so it computes
  a partial sum of the whole output; the ranks add them up (an all-reduce) once per pair.

So a block costs two all-reduces of the activations (B·T·D) in forward and two in backward.
Sequence parallelism (Korthikanti et al. 2022) splits the all-reduce into its two halves: a
reduce-scatter leaves each rank 1/tp of the *sequence*, the norms and residual adds run on that
slice only (1/tp of their activation memory), and an all-gather rebuilds the whole sequence
before the next column-parallel matmul. Same bytes on the wire, less memory.

Loss parallelism keeps the logits split over the vocabulary (Shard(-1)): cross-entropy needs
only each token's max, sum of exponentials and target logit, three all-reduces of B·T numbers
instead of gathering B·T·V logits.

DTensor does the bookkeeping: each parameter becomes a DTensor with a placement (Shard(dim) or
Replicate) on the TP mesh, and `parallelize_module` installs hooks that redistribute module
inputs and outputs between layouts; the collectives follow from those layouts.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ..errors import TitanliteError


def apply_tp(model: nn.Module, tp_mesh, *, sequence_parallel: bool = True,
             loss_parallel: bool = True) -> nn.Module:
    """torchtitan's plan for our Llama, in place. Between blocks the residual stream is split
    on the sequence (SP) or whole on every rank; inside a block the heads / hidden units are
    split. Returns the model; its logits are a Shard(-1) DTensor when `loss_parallel`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    _check_order(model)
    check_tp(model.args, tp_mesh.size(), sequence_parallel=sequence_parallel)
    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    norm = SequenceParallel if sequence_parallel else ReplicateParallel
    parallelize_module(model, tp_mesh, {
        # Vocabulary rows split; each rank looks up the tokens it owns, zeros for the rest,
        # and the sum over ranks (reduce-scatter to the sequence slice, or all-reduce) is exact.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "norm": norm(),
        # Each rank computes the logits of its slice of the vocabulary.
        "output": ColwiseParallel(input_layouts=between,
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": norm(),
            # The matmuls need the whole sequence: all-gather it (a no-op without SP).
            "attention": PrepareModuleInput(input_layouts=(between, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.q_proj": ColwiseParallel(),  # whole heads per rank: attention stays local
            "attention.k_proj": ColwiseParallel(),
            "attention.v_proj": ColwiseParallel(),
            "attention.o_proj": RowwiseParallel(output_layouts=between),  # sum of partial outputs
            "ffn_norm": norm(),
            "feed_forward": PrepareModuleInput(input_layouts=(between,),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.gate_proj": ColwiseParallel(),  # SwiGLU is elementwise per hidden unit
            "feed_forward.up_proj": ColwiseParallel(),
            "feed_forward.down_proj": RowwiseParallel(output_layouts=between),
        })
    if model.args.tie_embeddings:
        # Both layers split the same [vocab, dim] matrix by rows (Shard(0)); each got its own
        # DTensor copy above, so tie them again: one parameter, gradients from both uses.
        model.output.weight = model.tok_embeddings.weight
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(_finish_partial_grad)
    if sequence_parallel:
        tp = tp_mesh.size()
        model.register_forward_pre_hook(lambda m, args: _pad_sequence(m, args, tp))
        model.register_forward_hook(_cut_padding)
    return model


def _pad_sequence(model, args, tp):
    """SP splits every sequence evenly over the ranks, but generation and evaluation feed any
    length. In a causal model no position sees the ones after it, so appending tokens on the
    right and cutting their logits off afterwards changes nothing: pad to a multiple of tp."""
    tokens = args[0]
    model._tp_length = tokens.shape[1]
    pad = -tokens.shape[1] % tp
    return (torch.nn.functional.pad(tokens, (0, pad)), *args[1:]) if pad else None


def _cut_padding(model, args, logits):
    return logits[:, :model._tp_length] if logits.shape[1] != model._tp_length else None


def ReplicateParallel():
    """Without SP the norms see the whole sequence on every rank: their weights become
    Replicate DTensors (so every parameter is a DTensor: one kind for the optimizer, clipping
    and checkpoints) and they compute redundantly, without communication. The output leaves as
    a plain tensor, so the next matmul's input hook all-reduces the gradient coming back
    *before* it reaches the norm, and the norm's weight gradient is whole on every rank."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class _Replicate(ParallelStyle):
        def _apply(self, module, mesh):
            def as_dtensor(mod, inputs, mesh):
                return tuple(x if isinstance(x, DTensor) else
                             DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)
            return distribute_module(module, mesh, input_fn=as_dtensor,  # params: replicated
                                     output_fn=lambda mod, out, mesh: out.to_local())
    return _Replicate()


def _finish_partial_grad(p: torch.Tensor) -> None:
    """With SP each rank saw 1/tp of the tokens, so a norm weight's gradient is a partial sum
    (placement Partial). DTensor would all-reduce it lazily, each time AdamW reads it (three
    times a step); we all-reduce it once, as Megatron-LM does after backward. FSDP2, when
    it shards these parameters too, does the same itself."""
    if hasattr(p.grad, "placements") and any(pl.is_partial() for pl in p.grad.placements):
        p.grad = p.grad.redistribute(placements=p.placements)


def _check_order(model: nn.Module) -> None:
    """TP's plan names the plain model's modules and replaces its weights: it must come
    after FP8 (which swaps Linear modules) and before AC, compile and FSDP (which wrap)."""
    from torch.distributed.tensor import DTensor
    if not hasattr(model, "layers") or not hasattr(model, "args"):
        raise TitanliteError(f"apply_tp expects titanlite's Transformer, got {type(model).__name__}: "
                             f"apply it before compile, DDP or FSDP wrap the model")
    wrapped = any("_checkpoint_wrapped_module" in n for n, _ in model.named_modules())
    if wrapped or any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()):
        raise TitanliteError("apply_tp found activation-checkpointed or compiled blocks: apply tensor "
                             "parallelism first, then activation checkpointing, compile and FSDP")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise TitanliteError("this model's weights are already DTensors (FSDP or TP applied): apply "
                             "tensor parallelism once, before FSDP")


def check_tp(args, tp: int, seq_len: int | None = None, sequence_parallel: bool = True) -> None:
    """Refuse a TP degree that does not split the model (or the sequence) evenly, in one line
    naming what does not divide and which degrees would."""
    if tp < 1:
        raise TitanliteError(f"tensor-parallel degree must be positive, got tp={tp}")
    splits = {"n_heads": (args.n_heads, "each rank computes whole attention heads"),
              "n_kv_heads": (args.n_kv_heads, "each rank holds whole key/value heads"),
              "hidden_dim": (args.hidden_dim, "the MLP's hidden units split evenly"),
              "dim": (args.dim, "o_proj and down_proj split their inputs evenly"),
              "vocab_size": (args.vocab_size, "embedding rows and logits split evenly")}
    if sequence_parallel:
        splits["max_seq_len"] = (args.max_seq_len, "sequence parallel pads sequences to a multiple of tp")
    bad = [f"model.{k}={v} ({why})" for k, (v, why) in splits.items() if v % tp]
    if bad:
        g = math.gcd(*(v for v, _ in splits.values()))
        valid = ", ".join(str(d) for d in range(1, g + 1) if g % d == 0)
        raise TitanliteError(f"tensor-parallel degree {tp} does not divide {'; '.join(bad)}: "
                             f"choose one of {valid}")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise TitanliteError(f"sequence parallel splits each sequence over the {tp} TP ranks, but "
                             f"training.seq_len={seq_len} is not a multiple of {tp}: choose a "
                             f"multiple of {tp}, or turn sequence parallel off")


def loss_context(enabled: bool):
    """torch's `loss_parallel()` (cross-entropy on vocabulary-sharded logits) or a no-op.
    Wrap the loss computation AND its backward: backward runs the sharded softmax's gradient."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel()


def tp_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`loss_sum`, also for Shard(-1) DTensor logits (inside `loss_context(True)`), returned as
    a plain tensor: the loss is Replicate, every TP rank holds the whole sum, so the trainer
    can add, log and `.item()` it as always. Its backward still runs through DTensor."""
    from ..efficiency.accumulation import loss_sum
    loss = loss_sum(logits, targets)
    return loss.to_local() if hasattr(loss, "to_local") else loss


# ----- communication: counted, and predicted -------------------------------------------------

def tp_comm_formula(args, batch: int, seq_len: int, tp: int, *, sequence_parallel: bool = True,
                    loss_parallel: bool = True, act_bytes: int = 4, param_bytes: int = 4,
                    loss_bytes: int = 4) -> dict:
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
        block = {"forward": ops(all_gather=(2, A), reduce_scatter=(2, A)),
                 "backward": ops(all_gather=(2, A), reduce_scatter=(2, A), all_reduce=(2, norm_grad))}
        # Embedding: reduce-scatter (backward: all-gather); output's input: all-gather
        # (backward: reduce-scatter); the final norm's weight gradient.
        outside = {"forward": ops(all_gather=(1, A), reduce_scatter=(1, A)),
                   "backward": ops(all_gather=(1, A), reduce_scatter=(1, A), all_reduce=(1, norm_grad))}
    else:
        # Forward: all-reduce after o_proj and down_proj; backward: all-reduce the gradient
        # of the whole input of attention and of the MLP.
        block = {"forward": ops(all_reduce=(2, A)), "backward": ops(all_reduce=(2, A))}
        outside = {"forward": ops(all_reduce=(1, A)), "backward": ops(all_reduce=(1, A))}
    fwd = outside["forward"]
    if loss_parallel:  # per token: max, sum of exponentials, target logit (fp32: loss_sum)
        fwd["all_reduce"] = _add(fwd.get("all_reduce"), 3, 3 * batch * seq_len * loss_bytes)
    else:  # gather the whole logits
        fwd["all_gather"] = _add(fwd.get("all_gather"), 1, batch * seq_len * args.vocab_size * act_bytes)
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


def count_step_comm(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, *,
                    loss_parallel: bool) -> dict:
    """Run forward+loss and backward under CommCounter; {"forward" | "backward": {op:
    {"calls", "bytes"}}} on this rank. Gradients are left in .grad."""
    from .comm import CommCounter
    fwd, bwd = CommCounter(), CommCounter()
    with loss_context(loss_parallel):
        with fwd:
            loss = tp_loss_sum(model(tokens), targets)
        with bwd:
            loss.backward()
    plain = lambda s: {op: {"calls": int(v["calls"]), "bytes": int(v["bytes"])} for op, v in s.items()}  # noqa: E731
    return {"forward": plain(fwd.summary()), "backward": plain(bwd.summary())}


# ----- from scratch: what ColwiseParallel + RowwiseParallel do to an MLP (notebook 09) --------

class _CopyToTP(torch.autograd.Function):
    """Megatron's f: every rank uses the whole input (forward: identity); each rank's slice
    contributes part of the input's gradient, so backward adds them up (all-reduce)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: forward adds the ranks' partial outputs (all-reduce); the sum's gradient
    with respect to each part is the whole gradient (backward: identity)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScratchParallelMLP(nn.Module):
    """A SwiGLU MLP split over the ranks by hand: rank r keeps hidden units
    [r·h/n, (r+1)·h/n) — those rows of gate/up (column-parallel) and those columns of down
    (row-parallel) — and the whole forward needs one all-reduce."""

    def __init__(self, full, group=None):
        super().__init__()
        import torch.distributed as dist
        self.group, n, r = group, dist.get_world_size(group), dist.get_rank(group)
        rows = slice(r * full.gate_proj.out_features // n, (r + 1) * full.gate_proj.out_features // n)
        take = lambda w: nn.Parameter(w.detach().clone())  # noqa: E731
        self.gate = take(full.gate_proj.weight[rows])
        self.up = take(full.up_proj.weight[rows])
        self.down = take(full.down_proj.weight[:, rows])

    def forward(self, x):
        x = _CopyToTP.apply(x, self.group)
        hidden = torch.nn.functional.silu(x @ self.gate.T) * (x @ self.up.T)  # local units only
        return _ReduceFromTP.apply(hidden @ self.down.T, self.group)  # partial sums → whole


# ----- notebook 09's experiments, run inside every rank (launch_function) ---------------------

def _join(device):
    """This rank's DistEnv and a 1-D "tp" mesh over every rank (run_function joined the group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .env import init_distributed
    if device is None:  # nccl moves CUDA tensors
        device = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    env = init_distributed(device)
    return env, init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("tp",))


def _batches(vocab, n, batch, seq_len, seed, device):
    g = torch.Generator().manual_seed(seed)  # the same on every rank: a TP group reads one batch
    return [torch.randint(0, vocab, (2, batch, seq_len), generator=g).to(device) for _ in range(n)]


def _exact_loss(logits, y):
    """loss_sum without its fp32 cast, for float64 runs (see train_parity)."""
    import torch.nn.functional as F
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
    return loss.to_local() if hasattr(loss, "to_local") else loss


def train_parity(args, mesh, device, *, sequence_parallel=True, loss_parallel=True, steps=3,
                 batch=2, seq_len=16, lr=1e-2, dtype=torch.float64, seed=0, report_as=None) -> dict:
    """AdamW steps (clipped at 1.0) with apply_tp vs a single process on the same weights and
    batches. Returns {"losses", "reference_losses", "max_weight_diff", "max_loss_diff"}.

    float64 with `_exact_loss` isolates the parallelism from rounding. In float32, loss
    parallelism sums the softmax in another order (differences in the 7th digit), and AdamW's
    first step is ≈ lr·sign(g): where a gradient is ~0 that rounding can flip a sign."""
    from torch.distributed.tensor import DTensor

    from ..models.llama import build_model
    from .run_function import report
    loss_fn = _exact_loss if dtype == torch.float64 else tp_loss_sum
    torch.manual_seed(seed)
    reference = build_model(args).to(device=device, dtype=dtype)
    torch.manual_seed(seed)
    model = apply_tp(build_model(args).to(device=device, dtype=dtype), mesh,
                     sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    out = {"losses": [], "reference_losses": []}
    data = _batches(args.vocab_size, min(steps, 4), batch, seq_len, seed, device)  # a few, cycled
    for net, key, ctx in ((reference, "reference_losses", False), (model, "losses", loss_parallel)):
        opt = torch.optim.AdamW(net.parameters(), lr=lr)
        for step in range(steps):
            x, y = data[step % len(data)].clone()
            y[0, :2] = -100  # padding targets: ignored, as in the trainer
            with loss_context(ctx):
                loss = loss_fn(net(x), y) / int((y != -100).sum())
                loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            out[key].append(loss.item())
            if report_as:
                report({"kind": "train", "step": step + 1, "loss": loss.item(),
                        "run": report_as if net is model else "single process"})
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    out["max_weight_diff"] = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    out["max_loss_diff"] = max(abs(a - b) for a, b in zip(out["losses"], out["reference_losses"]))
    return out


def comm_per_layer(args, mesh, device, *, sequence_parallel, loss_parallel, batch=2, seq_len=16,
                   dtype=torch.float32) -> dict:
    """One step counted at 1 and at 2 blocks: the difference is one block's communication,
    the rest is outside the blocks. Returns {"measured", "formula"}, each {"per_block",
    "outside"}, plus "step" (the 2-block step) and its formula total."""
    from dataclasses import replace

    from ..models.llama import build_model
    counts = {}
    for n_layers in (1, 2):
        a = replace(args, n_layers=n_layers)
        model = apply_tp(build_model(a).to(device=device, dtype=dtype), mesh,
                         sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        x, y = _batches(a.vocab_size, 1, batch, seq_len, 1, device)[0]
        counts[n_layers] = count_step_comm(model, x, y, loss_parallel=loss_parallel)
    per_block, outside = {}, {}
    for phase in ("forward", "backward"):
        one, two = counts[1][phase], counts[2][phase]
        per_block[phase] = {op: {k: two[op][k] - one.get(op, {}).get(k, 0) for k in ("calls", "bytes")}
                            for op in two if two[op] != one.get(op)}
        outside[phase] = {op: {k: v[k] - per_block[phase].get(op, {}).get(k, 0) for k in v}
                          for op, v in one.items()}
        outside[phase] = {op: v for op, v in outside[phase].items() if v["calls"]}
    size = torch.tensor([], dtype=dtype).element_size()
    formula = tp_comm_formula(args, batch, seq_len, mesh.size(), sequence_parallel=sequence_parallel,
                              loss_parallel=loss_parallel, act_bytes=size, param_bytes=size)
    return {"measured": {"per_block": per_block, "outside": outside}, "formula": formula,
            "step": counts[2], "step_formula": step_comm_expected(formula, 2)}


def dtensor_basics(mesh, device) -> dict:
    """Placements on a 4×6 tensor, and what a matmul does to them (column then row parallel)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    from .comm import CommCounter
    t = torch.arange(24.0, device=device).view(4, 6)
    local = {str(p): distribute_tensor(t, mesh, [p]).to_local().tolist()
             for p in (Shard(0), Shard(1), Replicate())}
    x = distribute_tensor(torch.ones(3, 6, device=device), mesh, [Replicate()])
    w1 = distribute_tensor(t, mesh, [Shard(0)])                 # column parallel: rows of W
    h = F.linear(x, w1)                                          # [3, 4]: each rank its columns
    w2 = distribute_tensor(torch.ones(5, 4, device=device), mesh, [Shard(1)])  # row parallel
    y = F.linear(h, w2)                                          # [3, 5]: partial sums
    with CommCounter() as cc:
        whole = y.redistribute(placements=[Replicate()])         # the one all-reduce
    rank_value = torch.full((2,), float(mesh.get_local_rank() + 1), device=device)
    partial = torch.distributed.tensor.DTensor.from_local(rank_value, mesh, [Partial()])
    return {"local": local, "h_placements": str(h.placements), "y_placements": str(y.placements),
            "y": whole.to_local().tolist(), "y_expected": (torch.ones(3, 6, device=device) @ t.T
                                                           @ torch.ones(5, 4, device=device).T).tolist(),
            "redistribute_comm": {op: int(v["calls"]) for op, v in cc.summary().items()},
            "partial_full": partial.full_tensor().tolist()}


def mlp_from_scratch_check(args, mesh, device, batch=2, seq_len=8, seed=0) -> dict:
    """ScratchParallelMLP vs block 0's MLP after apply_tp (no SP) vs the single-process MLP:
    outputs, input gradients and this rank's weight-gradient slices (max abs differences)."""
    from ..models.llama import build_model
    torch.manual_seed(seed)
    full = build_model(args).to(device)
    torch.manual_seed(seed)
    tp_model = apply_tp(build_model(args).to(device), mesh, sequence_parallel=False, loss_parallel=False)
    scratch = ScratchParallelMLP(full.layers["0"].feed_forward, mesh.get_group())
    x = torch.randn(batch, seq_len, args.dim, generator=torch.Generator().manual_seed(seed)).to(device)
    results = {}
    for name, mlp in (("single", full.layers["0"].feed_forward), ("scratch", scratch),
                      ("apply_tp", tp_model.layers["0"].feed_forward)):
        xi = x.clone().requires_grad_(True)
        out = mlp(xi)
        out.pow(2).sum().backward()
        results[name] = (out.detach(), xi.grad)
    dtp = tp_model.layers["0"].feed_forward
    gate_grads = (scratch.gate.grad, dtp.gate_proj.weight.grad.to_local())
    diff = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    return {"out_scratch_vs_single": diff(results["scratch"][0], results["single"][0]),
            "out_scratch_vs_apply_tp": diff(results["scratch"][0], results["apply_tp"][0]),
            "grad_x_scratch_vs_single": diff(results["scratch"][1], results["single"][1]),
            "grad_x_scratch_vs_apply_tp": diff(results["scratch"][1], results["apply_tp"][1]),
            "gate_grad_slice_scratch_vs_apply_tp": diff(*gate_grads),
            "local_gate_shape": list(scratch.gate.shape), "full_gate_shape": list(dtp.gate_proj.weight.shape)}


def loss_sum_check(args, mesh, device, batch=2, seq_len=16, seed=0) -> dict:
    """The trainer's fp32 loss on Shard(-1) DTensor logits under loss parallelism vs on whole
    logits in one process: the loss value and the first step's gradients (relative)."""
    from ..efficiency.accumulation import loss_sum
    from ..models.llama import build_model
    torch.manual_seed(seed)
    reference = build_model(args).to(device)
    torch.manual_seed(seed)
    model = apply_tp(build_model(args).to(device), mesh)
    x, y = _batches(args.vocab_size, 1, batch, seq_len, seed, device)[0]
    y[0, :2] = -100
    ref_loss = loss_sum(reference(x), y)
    ref_loss.backward()
    with loss_context(True):
        logits = model(x)
        loss = tp_loss_sum(logits, y)
        loss.backward()
    grads = dict(model.named_parameters())
    rel = max(((grads[k].grad.full_tensor() - p.grad).norm() / p.grad.norm()).item()
              for k, p in reference.named_parameters())
    return {"logits_type": type(logits).__name__, "logits_placements": str(logits.placements),
            "local_logits_shape": list(logits.to_local().shape), "loss_type": type(loss).__name__,
            "loss": loss.item(), "reference_loss": ref_loss.item(), "max_grad_rel_diff": rel}


def tp_lab(preset="debug", vocab_size=256, n_heads=None, n_kv_heads=None, parity_configs=((True, True),),
           comm_configs=((True, True), (False, False)), train_steps=0, train_batch=4, train_seq=32,
           basics=True, device=None) -> dict:
    """Notebook 09's (and the tests') experiments in one job; each finished part is reported
    to the launcher's callbacks as {"kind": "lab", "done": name}."""
    from ..models.llama import ModelArgs
    from .run_function import report
    env, mesh = _join(device)
    args = ModelArgs.preset(preset, vocab_size=vocab_size, n_heads=n_heads, n_kv_heads=n_kv_heads,
                            max_seq_len=max(64, train_seq))
    dev = env.device
    out = {"rank": env.rank, "world_size": env.world_size, "device": dev.type, "args": args.to_dict()}
    if basics:
        out["basics"] = dtensor_basics(mesh, dev)
        out["mlp"] = mlp_from_scratch_check(args, mesh, dev)
        out["loss_sum"] = loss_sum_check(args, mesh, dev)
        report({"kind": "lab", "done": "basics"})
    out["parity"] = {(sp, lp): train_parity(args, mesh, dev, sequence_parallel=sp, loss_parallel=lp)
                     for sp, lp in parity_configs}
    report({"kind": "lab", "done": "parity"})
    out["comm"] = {(sp, lp): comm_per_layer(args, mesh, dev, sequence_parallel=sp, loss_parallel=lp)
                   for sp, lp in comm_configs}
    report({"kind": "lab", "done": "comm"})
    if train_steps:  # float32 and the trainer's own loss, streamed to a live plot
        out["train"] = train_parity(args, mesh, dev, steps=train_steps, batch=train_batch,
                                    seq_len=train_seq, lr=1e-2, dtype=torch.float32,
                                    report_as=f"TP={env.world_size} (SP, loss parallel)" if env.rank == 0 else None)
    return out
