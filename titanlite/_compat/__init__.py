"""Private torch / torchao APIs titanlite depends on, isolated: one module per dependency.

    torch_internals     dispatch modes, checkpoint_wrapper, nn.Module.compile()'s slot,
                        DCP's writer process, PipelineStage methods, Inductor probes
    torchao_internals   Float8Linear and the FP8 cast Float8Linear uses

Nothing outside this folder imports `torch._*`, `torch.*._*` or torchao's internal modules
(tests/test_imports.py checks), so a torch or torchao upgrade that moves one is fixed here.
"""
