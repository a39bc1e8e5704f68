"""Activation checkpointing: keep fewer activations from the forward pass, recompute the rest.

    apply_ac(model, "full")                 # every block recomputed in backward: the least memory
    apply_ac(model, "selective", every=2)   # blocks 0, 2, 4, ... recomputed, the rest kept
    apply_ac(model, "op")                   # every block: keep matmul outputs, recompute the rest

A checkpointed block keeps only its input; backward runs its forward again to rebuild the rest
(full: about 20-25% more FLOPs per step at Llama shapes). op is selective activation checkpointing
("SAC", as in torchtitan): keep the outputs of matmuls, attention and TP's reduce-scatters, recompute
the pointwise ops (RMSNorm, rotary, SiLU, gating). Matmuls are where the FLOPs are; pointwise ops are
nearly free to recompute, yet their outputs are as big as a matmul's: dropping them saves the memory."""

import functools

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from .._compat.torch_internals import CheckpointWrapper, checkpoint_wrapper
from ..errors import TitanliteError, closest
from ..models.llama import Transformer

MODES = ("none", "full", "selective", "op")

aten = torch.ops.aten
# Each fused attention kernel SDPA may pick (CUDA flash/efficient/cuDNN, CPU, MPS), where this build has it
_SDPA_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_attention_math_for_mps",
    "_scaled_dot_product_fused_attention_overrideable",
)
c10d = torch.ops._c10d_functional  # a torch without distributed has no c10d ops
# FP8 matmuls (torchao's `_scaled_mm`) and the experts' grouped GEMM are matmuls too. Collectives
# in a block are kept rather than run again in the backward (torchtitan's `_save_list` keeps the
# same): TP + sequence parallel's reduce-scatter, and expert parallel's all-to-alls (the tokens
# out to their experts and back, and the counts before them).
_COLLECTIVES = ("reduce_scatter_tensor", "all_to_all_single")
SAVE_OPS = frozenset(
    [aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_mm.default]
    + ([aten._grouped_mm.default] if hasattr(aten, "_grouped_mm") else [])
    + [getattr(c10d, name).default for name in _COLLECTIVES if hasattr(c10d, name)]
    + [getattr(aten, name).default for name in _SDPA_OPS if hasattr(aten, name)]
)


def apply_ac(model: Transformer, mode: str, every: int = 2) -> Transformer:
    """Checkpoint `model`'s transformer blocks in place: none | full | selective (blocks 0, every,
    2·every, ...) | op. After name-based plans (TP, FP8: parameter names gain a `_checkpoint_wrapped_module`
    level; state_dict() keeps the plain ones) and before compile, as the trainer's `apply_efficiency`."""
    if mode not in MODES:
        raise TitanliteError(
            f"activation checkpointing mode '{mode}' is not one of "
            f"{', '.join(MODES)}{closest(mode, MODES)}"
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise TitanliteError(
            f"activation_checkpoint.every must be a positive integer, got "
            f"{every!r}: e.g. every=2 checkpoints blocks 0, 2, 4, ..."
        )
    if mode == "none":
        return model
    # op: SAC, keeping what `save_matmuls_policy` says (the others recompute everything)
    sac = functools.partial(create_selective_checkpoint_contexts, save_matmuls_policy)
    for index, (name, block) in enumerate(list(model.layers.items())):
        if isinstance(block, CheckpointWrapper):
            raise TitanliteError(
                f"block {name} is already checkpointed: apply_ac once, on a freshly built model"
            )
        if mode == "selective" and index % every:
            continue
        # Non-reentrant: it works with keyword arguments, torch.compile and FSDP2, and (unlike the
        # old reentrant version) gives gradients even when the block's input does not require any.
        model.layers.register_module(  # on an existing key: keeps the block's position, name
            name,
            checkpoint_wrapper(
                block,
                checkpoint_fn=checkpoint,
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=sac if mode == "op" else noop_context_fn,
            ),
        )
    return model


def save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """SAC policy: keep matmuls and attention, recompute the cheap pointwise ops. It depends on the
    op alone, so the forward and backward's recompute always agree (no call counts to reset)."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE
