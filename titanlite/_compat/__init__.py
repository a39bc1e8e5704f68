"""Private torch / torchao APIs titanlite depends on, isolated: nothing outside this folder imports
`torch._*`, `torch.*._*` or torchao's internal modules, or reads those attributes (tests/test_imports.py
checks; documented toggles like `torch._inductor.config.patch` excepted), so an upgrade that moves one
is fixed here, with a clear message or a fallback.

    torch_internals    the core's: checkpoint_wrapper, Module.compile's slot, Inductor probes, DCP, allocator
    torch_tools        the tools': dispatch modes, pytree, fake tensors, process-group names, PipelineStage
    torchao_internals  the core's: Float8Linear
    torchao_tools      the tools': the FP8 cast Float8Linear uses (notebook 06's numerics)"""
