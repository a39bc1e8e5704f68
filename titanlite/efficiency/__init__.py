"""Single-device efficiency, one technique per module, each with one entry point:

    accumulation.py        split_batch / global-token loss normalisation (notebook 02)
    mixed_precision.py     Precision: autocast + GradScaler, support matrix (notebook 03)
    checkpointing.py       apply_ac: full, every-N-th block, op-level selective (notebook 04)
    compile.py             apply_compile: per-block or whole model, graph breaks (notebook 05)
    fp8.py                 apply_fp8: torchao Float8Linear, tensorwise/rowwise (notebook 06)

The trainer applies them in torchtitan's order: FP8 swaps Linear modules first (everything
after sees the final modules), then activation checkpointing wraps blocks, then compile
traces the wrapped blocks (so recomputation is compiled too).
"""
from __future__ import annotations

import torch


def apply_efficiency(model: torch.nn.Module, cfg, device: torch.device,
                     autocast_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """torchtitan's order: FP8 swaps Linear modules first, so everything after sees the final
    modules; checkpointing wraps blocks next; compile comes last, so it traces the wrapped
    blocks and the recomputation is compiled too. Each step is one module's entry point.
    `autocast_dtype`: the run's mixed precision (`Precision.dtype`), for the trial compile."""
    if cfg.float8.enable:
        from .fp8 import apply_fp8
        f = cfg.float8
        model = apply_fp8(model, recipe=f.recipe, device=device, min_dim=f.min_dim,
                          emulate=None if f.emulate == "auto" else f.emulate == "true",
                          fsdp_all_gather=f.fsdp_all_gather)
        if cfg.compile.enable:
            from .fp8 import set_precision_casts_for
            set_precision_casts_for(f.recipe, compiled=True)
    if cfg.activation_checkpoint.mode != "none":
        from .checkpointing import apply_ac
        model = apply_ac(model, cfg.activation_checkpoint.mode, every=cfg.activation_checkpoint.every)
    if cfg.compile.enable:
        from .compile import apply_compile
        backend = {} if cfg.compile.backend == "inductor" else {"backend": cfg.compile.backend}
        # The trial compile runs a real block on a batch of the run's shape, so a model that
        # cannot compile falls back here, not at step 1.
        model = apply_compile(model, scope=cfg.compile.scope, fallback=cfg.compile.fallback,
                              device=device, example_shape=(cfg.training.batch_size,
                                                            cfg.training.seq_len),
                              autocast_dtype=autocast_dtype, **backend)
    return model
