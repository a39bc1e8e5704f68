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
