"""Single-device efficiency, one technique per module, each with one entry point:

    accumulation.py           resolve_batch / global-token loss normalisation (notebook 02)
    mixed_precision.py        Precision: autocast + GradScaler (notebook 03)
    activation_checkpoint.py  apply_ac: full, every-N-th block, op-level selective (notebook 04)
    compile.py                apply_compile: per block or whole model, a trial first (notebook 05)
    fp8.py                    apply_fp8: torchao Float8Linear, tensorwise/rowwise (notebook 06)

The trainer applies FP8, AC, then compile, in torchtitan's order (parallelize.py's apply_efficiency)."""
