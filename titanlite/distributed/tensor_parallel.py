"""Tensor parallelism (Megatron-LM), sequence parallelism and loss parallelism with DTensor.

    model = apply_tp(model, tp_mesh)                 # in place, before AC / compile / FSDP
    with loss_context(True):                         # forward's loss AND its backward
        loss = tp_loss_sum(model(x), y) / num_tokens
        loss.backward()

TP splits every weight matrix over `tp` ranks reading the same batch. A block's matmuls pair column → row
(Shoeybi et al. 2019): column-parallel q/k/v and gate/up compute whole heads / hidden units, row-parallel
o_proj and down_proj partial sums, added by one all-reduce per pair. Sequence parallelism splits it into
reduce-scatter + all-gather: norms and residual adds run on 1/tp of the sequence. Loss parallelism keeps
the logits split over the vocabulary: cross-entropy all-reduces 3·B·T numbers, not B·T·V logits."""

import contextlib
import math

import torch
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

from .._compat.torch_internals import is_checkpoint_wrapped, is_compiled_in_place
from ..efficiency.accumulation import loss_sum
from ..errors import TitanliteError


def apply_tp(
    model: nn.Module, tp_mesh, *, sequence_parallel: bool = True, loss_parallel: bool = True
) -> nn.Module:
    """torchtitan's plan for our Llama, in place: between blocks the residual stream is split on the
    sequence (SP) or whole, inside a block the heads / hidden units; `loss_parallel`: Shard(-1) logits."""
    _check_order(model)
    check_tp(model.args, tp_mesh.size(), sequence_parallel=sequence_parallel)
    between, norm = (
        (Shard(1), SequenceParallel) if sequence_parallel else (Replicate(), ReplicateParallel)
    )
    # Vocabulary rows split: each rank embeds the tokens it owns (zeros elsewhere); the sum is exact.
    ends = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "norm": norm(),
        "output": ColwiseParallel(
            input_layouts=between,  # each rank: its vocabulary slice's logits
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    # A pipeline stage holds only some of the ends (the others are None).
    parallelize_module(
        model, tp_mesh, {k: v for k, v in ends.items() if getattr(model, k) is not None}
    )
    mlp = {
        "feed_forward": PrepareModuleInput(
            input_layouts=(between,), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.gate_proj": ColwiseParallel(),  # SwiGLU is elementwise per hidden unit
        "feed_forward.up_proj": ColwiseParallel(),
        "feed_forward.down_proj": RowwiseParallel(output_layouts=between),
    }
    for block in model.layers.values():
        ffn = block.feed_forward  # a dense MLP, or a mixture of experts (models/moe.py)
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": norm(),
                # The matmuls need the whole sequence: all-gather it (a no-op without SP).
                "attention": PrepareModuleInput(
                    input_layouts=(between, None, None),
                    desired_input_layouts=(Replicate(), None, None),
                ),
                "attention.q_proj": ColwiseParallel(),  # whole heads per rank: attention stays local
                "attention.k_proj": ColwiseParallel(),
                "attention.v_proj": ColwiseParallel(),
                "attention.o_proj": RowwiseParallel(
                    output_layouts=between
                ),  # sum of partial outputs
                "ffn_norm": norm(),
                **(_moe_plan(ffn, between) if hasattr(ffn, "experts") else mlp),
            },
        )
    if model.args.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        # Both split the same [vocab, dim] matrix by rows but got separate DTensors above: tie again.
        model.output.weight = model.tok_embeddings.weight
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(_finish_partial_grad)
    if sequence_parallel:
        model.register_forward_pre_hook(lambda m, args: _pad_sequence(m, args, tp_mesh.size()))
        model.register_forward_hook(_cut_padding)
    return model


def _moe_plan(moe, between) -> dict:
    """A mixture of experts: the whole sequence in, as a plain tensor (each rank routes every
    token, alike); the router replicated; each expert split as the dense MLP is (ExpertTensorParallel);
    the shared experts as the dense MLP; the whole output back to the residual's layout."""
    plan = {
        "feed_forward": PrepareModuleInputOutput(
            input_layouts=(between,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(between,),
        ),
        "feed_forward.router.gate": ReplicateParallel(),
        "feed_forward.experts": ExpertTensorParallel(),
    }
    if moe.shared is not None:
        plan |= {
            "feed_forward.shared.gate_proj": ColwiseParallel(),
            "feed_forward.shared.up_proj": ColwiseParallel(),
            "feed_forward.shared.down_proj": RowwiseParallel(output_layouts=Replicate()),
        }
    return plan


class ExpertTensorParallel(ParallelStyle):
    """Every expert's hidden units split over tp, as the dense MLP's: w_gate and w_up [E, H, D] by
    rows (Shard(1)), w_down [E, D, H] by columns (Shard(2)). The token rows arrive whole on every
    rank, each rank's experts give partial outputs, and one all-reduce sums them *before* the
    router's weights combine them, so all that follows is whole, as in one process (it moves k rows
    a token where reducing after the combine would move one: the simpler of the two). Backward:
    the rows' gradient is partial likewise, and all-reduced on its way out."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        for name, dim in (("w_gate", 1), ("w_up", 1), ("w_down", 2)):
            whole = getattr(module, name).detach()  # the same on every rank: one seed
            setattr(module, name, nn.Parameter(distribute_tensor(whole, mesh, [Shard(dim)])))

        def rows_in(mod, inputs, mesh):  # (rows, counts): rows as they are, gradient all-reduced
            rows = DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False)
            return rows.to_local(grad_placements=[Partial()]), inputs[1]

        def summed_out(mod, out, mesh):  # all-reduced forward, the gradient as it is
            return DTensor.from_local(out, mesh, [Partial()], run_check=False).full_tensor()

        return distribute_module(module, mesh, input_fn=rows_in, output_fn=summed_out)


def _pad_sequence(model, args, tp):
    """SP splits sequences evenly over the ranks, but generation and evaluation feed any length: pad
    to a multiple of tp on the right (in a causal model no position sees later ones), cut the logits."""
    model._tp_length = args[0].shape[1]
    pad = -model._tp_length % tp
    return (torch.nn.functional.pad(args[0], (0, pad)), *args[1:]) if pad else None


def _cut_padding(model, args, logits):
    return logits[:, : model._tp_length] if logits.shape[1] != model._tp_length else None


class ReplicateParallel(ParallelStyle):
    """Without SP the norms compute redundantly, weights as Replicate DTensors (one parameter kind); the
    plain-tensor output makes the next matmul's hook all-reduce the gradient *before* the norm sees it."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def as_dtensor(mod, inputs, mesh):
            return tuple(
                x
                if isinstance(x, DTensor)
                else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                for x in inputs
            )

        return distribute_module(
            module,
            mesh,
            input_fn=as_dtensor,  # parameters: replicated
            output_fn=lambda mod, out, mesh: out.to_local(),
        )


def _finish_partial_grad(p: torch.Tensor) -> None:
    """With SP a norm weight's gradient is a partial sum (each rank saw 1/tp of the tokens): all-reduce it
    once after backward, as Megatron-LM does, not each time AdamW reads it (three times a step)."""
    if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
        p.grad = p.grad.redistribute(placements=p.placements)


def _check_order(model: nn.Module) -> None:
    """TP names plain modules: apply it after FP8 (swaps Linears), before AC, compile and FSDP (wrappers)."""
    if not hasattr(model, "layers") or not hasattr(model, "args"):
        raise TitanliteError(
            f"apply_tp expects titanlite's Transformer, got {type(model).__name__}: "
            f"apply it before compile, DDP or FSDP wrap the model"
        )
    if is_checkpoint_wrapped(model) or is_compiled_in_place(model):
        raise TitanliteError(
            "apply_tp found activation-checkpointed or compiled blocks: apply tensor "
            "parallelism first, then activation checkpointing, compile and FSDP"
        )
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise TitanliteError(
            "this model's weights are already DTensors (FSDP or TP applied): apply "
            "tensor parallelism once, before FSDP"
        )


def check_tp(args, tp: int, seq_len: int | None = None, sequence_parallel: bool = True) -> None:
    """Refuse a TP degree that does not split the model (or sequence) evenly, naming which degrees would."""
    if tp < 1:
        raise TitanliteError(f"tensor-parallel degree must be positive, got tp={tp}")
    splits = {
        "n_heads": (args.n_heads, "each rank computes whole attention heads"),
        "n_kv_heads": (args.n_kv_heads, "each rank holds whole key/value heads"),
        "hidden_dim": (args.hidden_dim, "the MLP's hidden units split evenly"),
        "dim": (args.dim, "o_proj and down_proj split their inputs evenly"),
        "vocab_size": (args.vocab_size, "embedding rows and logits split evenly"),
    }
    if args.moe is not None and args.moe.hidden_dim:
        splits["expert_hidden_dim"] = (args.moe.hidden_dim, "each expert's units split evenly")
    if sequence_parallel:
        splits["max_seq_len"] = (
            args.max_seq_len,
            "sequence parallel pads sequences to a multiple of tp",
        )
    if bad := [f"model.{k}={v} ({why})" for k, (v, why) in splits.items() if v % tp]:
        g = math.gcd(*(v for v, _ in splits.values()))  # the degrees that divide them all
        raise TitanliteError(
            f"tensor-parallel degree {tp} (parallel.tp) does not divide {'; '.join(bad)}: "
            f"choose one of {', '.join(str(d) for d in range(1, g + 1) if g % d == 0)}"
        )
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise TitanliteError(
            f"sequence parallel splits each sequence over the {tp} TP ranks, but "
            f"training.seq_len={seq_len} is not a multiple of {tp}: choose a "
            f"multiple of {tp}, or set parallel.sequence_parallel=false"
        )


def loss_context(enabled: bool):
    """torch's `loss_parallel()` or a no-op: wrap the loss AND its backward (the sharded softmax gradient)."""
    return torch_loss_parallel() if enabled else contextlib.nullcontext()


def tp_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`loss_sum`, also for Shard(-1) DTensor logits (inside `loss_context(True)`), as a plain tensor:
    every TP rank holds the whole (Replicate) sum to add, log and `.item()`; backward runs through DTensor."""
    loss = loss_sum(logits, targets)
    return loss.to_local() if isinstance(loss, DTensor) else loss
