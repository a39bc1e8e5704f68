"""One block of attention and its log-sum-exp, on each device's own kernel: what context
parallelism (context_parallel.py) computes for each pair of query and key chunks, then merges.

From scratch teaches; on CUDA the trainer runs what torch runs on CUDA. The from-scratch block
(`math`) is proven equal to torch's fused kernels on the CPU (tests/test_context_parallel.py); on
CUDA each block goes through the fused kernel SDPA itself would pick for it, called with the
arguments torch's own ring attention uses (torch/distributed/tensor/experimental/_context_parallel/
_attention.py), and every such call of a private aten op is checked against the preconditions
torch's kernel enforces, on fake CUDA tensors (tests/test_cuda_contracts.py, each cited to torch's
source)."""

import math

import torch

from ..device_policy import flash_takes

aten = torch.ops.aten


def block_kernel(device_type: str, dtype, capability=None, head_dim: int = 64, rocm=False) -> str:
    """The kernel that computes one block and returns its log-sum-exp. From scratch teaches; on CUDA
    the trainer runs what torch runs on CUDA: the kernel SDPA itself would train these inputs through
    (aten's sdp_utils.cpp gates, device_policy.flash_takes), called as torch's own ring attention
    calls it (torch/distributed/tensor/experimental/_context_parallel/_attention.py), each call
    contract-tested (tests/test_cuda_contracts.py). CPU: its flash kernel, any float dtype. CUDA:
    flash in fp16/bf16 on SM 8.0+ with head_dim a multiple of 8 up to 256 (not (192, 224] on SM
    8.6-8.9 and 12.x, where SDPA does not train it); else the memory-efficient kernel (fp32 too;
    T4, V100) where head_dim is a multiple of 16 bytes; the plain-ops `math` elsewhere (ROCm, whose
    kernels lay the log-sum-exp out otherwise; MPS)."""
    if device_type == "cpu":
        return "cpu_flash"
    if device_type != "cuda" or rocm or capability is None or tuple(capability) > (12, 1):
        return "math"  # SDPA's fused kernels span sm50..sm121 (flash from sm80)
    # SDPA trains flash on SM 8.6-8.9 and 12.0-12.1 except for head_dim in (192, 224]
    consumer = (8, 6) <= tuple(capability) <= (8, 9) or (12, 0) <= tuple(capability) <= (12, 1)
    trains = not (consumer and 192 < head_dim <= 224)
    if flash_takes(device_type, dtype, head_dim, capability) and trains:
        return "cuda_flash"
    alignment = 4 if dtype == torch.float32 else 8  # 16 bytes (check_head_dim_size_mem_efficient)
    takes = dtype != torch.bfloat16 or tuple(capability) >= (8, 0)  # cutlassF/B: bf16 from sm80
    return "cuda_efficient" if head_dim % alignment == 0 and takes else "math"


def native_gqa(kind: str) -> bool:
    """Whether the kernel takes fewer K/V heads than query heads as they are (flash does, on the
    CPU and on CUDA); the others get each K/V head repeated for its query heads."""
    return kind in ("cpu_flash", "cuda_flash")


def block_forward(kind: str, q, k, v, causal: bool, keep: list | None = None):
    """(output, log-sum-exp in fp32 [B, H, Tq]) of softmax(q·kᵀ/√d)·v over one block. `keep`:
    a list that receives what this kernel's backward takes from its forward (CUDA's rng state)."""
    scale = 1 / math.sqrt(q.shape[-1])
    keep = [] if keep is None else keep
    if kind == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if kind == "cuda_flash":
        # (output, log-sum-exp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug):
        # the backward takes rng_state and unused as its philox_seed and philox_offset, as
        # SDPA's own derivative does (tools/autograd/derivatives.yaml).
        out, lse, *_, rng_state, unused, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, scale=scale
        )
        keep[:] = rng_state, unused
        return out, lse
    if kind == "cuda_efficient":
        # Its log-sum-exp is padded to a multiple of 32 rows on CUDA: the rows that exist merge.
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        keep[:] = seed, offset
        return out, lse[..., : q.shape[2]]
    with torch.autocast(q.device.type, enabled=False):  # fp32 scores, not autocast's fp16
        scores = _scores(q, k, causal, scale)
        lse = scores.logsumexp(-1)
        return ((scores - lse[..., None]).exp() @ v.float()).to(q.dtype), lse


def block_backward(kind: str, dout, q, k, v, out, lse, causal: bool, extra=()):
    """Gradients (dq, dk, dv) of one block, given the *merged* output and log-sum-exp of all
    blocks: softmax probabilities recomputed as exp(s − lse) are then the true ones, and
    rowsum(dout·out) the true softmax correction (flash attention's backward). `extra`: what
    `block_forward` returned for this kernel's backward."""
    scale = 1 / math.sqrt(q.shape[-1])
    # A slice of the merged log-sum-exp is strided: the fused backwards read it as contiguous
    # [B, H, T] through its data pointer, unchecked (torch's ring makes it contiguous alike).
    lse = lse.contiguous()
    if kind == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    if kind == "cuda_flash":
        # cum_seq_q/k as the forward returned them, undefined (None): a defined tensor, even
        # empty, takes the variable-length branch, which wants int32 offsets.
        seed, offset = extra
        return aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            None,
            None,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
    if kind == "cuda_efficient":
        seed, offset = extra
        rows = -(-q.shape[2] // 32) * 32  # its forward's padded length
        padded = torch.nn.functional.pad(lse, (0, rows - q.shape[2])).contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout,
            q,
            k,
            v,
            None,
            out,
            padded,
            seed,
            offset,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return dq, dk, dv
    with torch.autocast(q.device.type, enabled=False):
        probs = (_scores(q, k, causal, scale) - lse[..., None]).exp()
        dout32 = dout.float()
        dv = probs.transpose(-2, -1) @ dout32
        correction = (dout32 * out.float()).sum(-1, keepdim=True)
        dscores = probs * (dout32 @ v.float().transpose(-2, -1) - correction)
        return dscores @ k.float() * scale, dscores.transpose(-2, -1) @ q.float() * scale, dv


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    # fp32 scores of the whole block, B·H·T_blk² of them: the from-scratch path's memory, which
    # the fused kernels never hold
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if causal:  # square diagonal blocks only: a query sees the keys up to its own position
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores
