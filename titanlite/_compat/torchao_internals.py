"""The torchao internals titanlite touches beyond the public `torchao.float8`, checked in torchao
0.14-0.18. Imported on first use: one that moved fails with a TitanliteError naming the fix, never at
`import titanlite`."""

from ..errors import TitanliteError

# the operands a Linear casts; upper-cased, GemmInputRoles
ROLES = ("input", "weight", "grad_output")


def _moved(what: str, error: ImportError) -> TitanliteError:
    import torchao

    return TitanliteError(
        f"this torchao ({getattr(torchao, '__version__', '?')}) has no {what} "
        f"({error}); titanlite's FP8 was checked with torchao 0.14-0.18: "
        f"pip install 'torchao>=0.14,<0.19'"
    )


def float8_linear_class() -> type:
    """torchao's Float8Linear: convert_to_float8_training swaps it in, torchao.float8 does not export it."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        raise _moved("torchao.float8.float8_linear.Float8Linear", e) from e
    return Float8Linear


def is_float8_linear(module) -> bool:
    return isinstance(module, float8_linear_class())


def quantized_adamw(bits: int, compiled: bool) -> type:
    """torchao's AdamW8bit or AdamW4bit (torchao.optim, public), with two of its internals changed:

    - which moments are quantized is decided on the whole tensor, the same for one process and for
      N ranks: torchao's `_new_buffer` (private, 0.18) quantizes a tensor of >= 4096 values in whole
      blocks, asked of the *local* shard - so under FSDP a 4096-value matrix split in two kept fp32
      moments, and N ranks trained differently from one. Here: the whole tensor has >= 4096 values in
      whole blocks, and every rank's shard is an equal slice of whole blocks (FSDP's dim-0 shards then
      are the whole tensor's blocks, so each rank's block scales are one process's); else fp32.
    - the step runs eagerly unless `compiled`: torchao compiles `single_param_adam` at its first step
      (fused kernels on CUDA; half a minute of C++ compiling on a small CPU), so it follows the run's
      own compile decision (torch.compiler.set_stance("force_eager") otherwise)."""
    import math

    import torch
    from torch.distributed.tensor import DTensor
    from torchao.optim import AdamW4bit, AdamW8bit

    base = {8: AdamW8bit, 4: AdamW4bit}[bits]

    def _new_buffer(self, p, signed: bool):
        sharded = isinstance(p, DTensor)
        local = p.to_local() if sharded else p
        # how many shards the mesh cuts it into; equal ones on every rank iff local × that = whole
        shards = (
            math.prod(
                p.device_mesh.size(d) for d, place in enumerate(p.placements) if place.is_shard()
            )
            if sharded
            else 1
        )
        whole_blocks = p.numel() >= 4096 and p.numel() % self.block_size == 0
        even = local.numel() * shards == p.numel() and local.numel() % self.block_size == 0
        if whole_blocks and even:
            out = self._subclass_zeros(local, signed, self.block_size)
        else:
            out = torch.zeros_like(local)
        if sharded:  # the moments are sharded as the parameter is (torchao's own way)
            out = DTensor.from_local(
                out, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        return out.to(p.device)

    def step(self, closure=None):
        if compiled:
            return base.step(self, closure)
        with torch.compiler.set_stance("force_eager"):
            return base.step(self, closure)

    return type(base.__name__, (base,), {"_new_buffer": _new_buffer, "step": step})
