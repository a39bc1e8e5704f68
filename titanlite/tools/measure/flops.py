"""Count the FLOPs a training step really executes, to check the 6·N + 12·L·H·Q·T formula.

`torch.utils.flop_counter.FlopCounterMode` counts matmuls and the CUDA attention kernels,
but (as of torch 2.13) not the CPU flash-attention kernel that `scaled_dot_product_attention`
dispatches to on CPU. We register torch's own SDPA formulas for that kernel too, so the count
is the same on every device — the formula's attention term would otherwise look "wrong" on a
laptop for a reason that has nothing to do with the model.
"""

from __future__ import annotations

import torch
from torch.utils import flop_counter as fc

aten = torch.ops.aten
_CPU_FWD = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_BWD = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _register_cpu_sdpa() -> None:
    if _CPU_FWD is None or _CPU_FWD in fc.flop_registry:
        return

    @fc.register_flop_formula(_CPU_FWD)
    def _fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(query_shape, key_shape, value_shape)

    if _CPU_BWD is not None and _CPU_BWD not in fc.flop_registry:

        @fc.register_flop_formula(_CPU_BWD)
        def _bwd(
            grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
        ) -> int:
            return fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_register_cpu_sdpa()


def count_training_flops(model: torch.nn.Module, tokens: torch.Tensor) -> dict:
    """FLOPs of one forward + backward on `tokens` [B, T], counted op by op.

    Returns {"total": int, "per_token": float, "by_op": {op name: FLOPs}}.
    """
    counter = fc.FlopCounterMode(display=False)
    with counter:
        model(tokens).float().sum().backward()
    model.zero_grad(set_to_none=True)
    total = counter.get_total_flops()
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return {"total": total, "per_token": total / tokens.numel(), "by_op": by_op}
