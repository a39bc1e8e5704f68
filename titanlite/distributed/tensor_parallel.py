"""Tensor parallelism (Megatron-LM), sequence parallelism and loss parallelism with DTensor.

    model = apply_tp(model, tp_mesh)                 # in place, before AC / compile / FSDP
    with loss_context(True):                         # forward's loss AND its backward
        loss = tp_loss_sum(model(x), y) / num_tokens
        loss.backward()

Data parallelism splits the batch; tensor parallelism splits every weight matrix, so a model
too big for one device's memory (or too slow for one device's FLOP/s) runs on `tp` devices.
Every rank of a TP group reads the *same* batch. Each matmul pair of a block splits without
talking in between (Megatron-LM, Shoeybi et al. 2019):

- column-parallel q/k/v and gate/up: rank r holds the r-th block of the weight's rows (output
  features), so it computes its own attention heads / hidden units from the whole input, and
  needs nothing from the others;
- row-parallel o_proj and down_proj: rank r holds the matching block of input columns, so it
  computes a partial sum of the whole output; the ranks add them up (an all-reduce) once per pair.

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
from torch.distributed.tensor import (DTensor, Replicate, Shard, distribute_module)
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

from .._compat.torch_internals import is_checkpoint_wrapped, is_compiled_in_place
from ..efficiency.accumulation import loss_sum
from ..errors import TitanliteError


def apply_tp(model: nn.Module, tp_mesh, *, sequence_parallel: bool = True,
             loss_parallel: bool = True) -> nn.Module:
    """torchtitan's plan for our Llama, in place. Between blocks the residual stream is split
    on the sequence (SP) or whole on every rank; inside a block the heads / hidden units are
    split. Returns the model; its logits are a Shard(-1) DTensor when `loss_parallel`."""
    _check_order(model)
    check_tp(model.args, tp_mesh.size(), sequence_parallel=sequence_parallel)
    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    norm = SequenceParallel if sequence_parallel else ReplicateParallel
    ends = {
        # Vocabulary rows split; each rank looks up the tokens it owns, zeros for the rest,
        # and the sum over ranks (reduce-scatter to the sequence slice, or all-reduce) is exact.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "norm": norm(),
        # Each rank computes the logits of its slice of the vocabulary.
        "output": ColwiseParallel(input_layouts=between,
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    # A pipeline stage holds only some of the ends (the others are None).
    parallelize_module(model, tp_mesh, {k: v for k, v in ends.items() if getattr(model, k) is not None})
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
    if model.args.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
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


class ReplicateParallel(ParallelStyle):
    """Without SP the norms see the whole sequence on every rank: their weights become
    Replicate DTensors (so every parameter is a DTensor: one kind for the optimizer, clipping
    and checkpoints) and they compute redundantly, without communication. The output leaves as
    a plain tensor, so the next matmul's input hook all-reduces the gradient coming back
    *before* it reaches the norm, and the norm's weight gradient is whole on every rank."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def as_dtensor(mod, inputs, mesh):
            return tuple(x if isinstance(x, DTensor) else
                         DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)
        return distribute_module(module, mesh, input_fn=as_dtensor,  # parameters: replicated
                                 output_fn=lambda mod, out, mesh: out.to_local())


def _finish_partial_grad(p: torch.Tensor) -> None:
    """With SP each rank saw 1/tp of the tokens, so a norm weight's gradient is a partial sum
    (placement Partial). DTensor would all-reduce it lazily, each time AdamW reads it (three
    times a step); we all-reduce it once, as Megatron-LM does after backward. FSDP2, when
    it shards these parameters too, does the same itself."""
    if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
        p.grad = p.grad.redistribute(placements=p.placements)


def _check_order(model: nn.Module) -> None:
    """TP's plan names the plain model's modules and replaces its weights: it must come
    after FP8 (which swaps Linear modules) and before AC, compile and FSDP (which wrap)."""
    if not hasattr(model, "layers") or not hasattr(model, "args"):
        raise TitanliteError(f"apply_tp expects titanlite's Transformer, got {type(model).__name__}: "
                             f"apply it before compile, DDP or FSDP wrap the model")
    if is_checkpoint_wrapped(model) or is_compiled_in_place(model):
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
        raise TitanliteError(f"tensor-parallel degree {tp} (parallel.tp) does not divide "
                             f"{'; '.join(bad)}: choose one of {valid}")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise TitanliteError(f"sequence parallel splits each sequence over the {tp} TP ranks, but "
                             f"training.seq_len={seq_len} is not a multiple of {tp}: choose a "
                             f"multiple of {tp}, or set parallel.sequence_parallel=false")


def loss_context(enabled: bool):
    """torch's `loss_parallel()` (cross-entropy on vocabulary-sharded logits) or a no-op.
    Wrap the loss computation AND its backward: backward runs the sharded softmax's gradient."""
    return torch_loss_parallel() if enabled else contextlib.nullcontext()


def tp_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`loss_sum`, also for Shard(-1) DTensor logits (inside `loss_context(True)`), returned as
    a plain tensor: the loss is Replicate, every TP rank holds the whole sum, so the trainer
    can add, log and `.item()` it as always. Its backward still runs through DTensor."""
    loss = loss_sum(logits, targets)
    return loss.to_local() if isinstance(loss, DTensor) else loss
