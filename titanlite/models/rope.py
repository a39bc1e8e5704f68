"""Rotary position embeddings (RoPE), as Llama 3 uses them: each pair of a head's channels is
rotated by an angle proportional to the token's position, so attention scores depend on how far
apart two tokens are, not where they are. The tables are computed once (`rope_cache`); a rank that
holds a slice of the sequence (context parallelism) indexes them at its tokens' real positions."""

import math

import torch

CONTEXT_KEY = "original_max_position_embeddings"  # Llama 3.1's scaling: the context it extends


def llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's context extension: slow waves longer than the old context by `factor`, blend the middle."""
    factor, lo, hi, old_ctx = (
        s[k] for k in ("factor", "low_freq_factor", "high_freq_factor", CONTEXT_KEY)
    )
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - lo) / (hi - lo)).clamp(0, 1)  # 0: long waves, 1: short
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_cache(args, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [max_seq_len, head_dim] in the rotate-half layout HF uses."""
    pairs = torch.arange(0, args.head_dim, 2, device=device, dtype=torch.float32)
    inv_freq = 1.0 / (args.rope_theta ** (pairs / args.head_dim))
    if args.rope_scaling:
        inv_freq = llama3_scaled(inv_freq, args.rope_scaling)
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    emb = torch.outer(positions, inv_freq).repeat(1, 2)  # [freqs, freqs]: the rotate-half layout
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) of x [B, H, T, D]: HF's `x·cos + rotate_half(x)·sin` with a `roll`
    ([x2, x1]), the minus on the small sin table (same products, same bits). The result keeps x's dtype,
    as torchtitan's does: under autocast, bf16 q/k times fp32 tables would reach attention as fp32."""
    half = x.shape[-1] // 2
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return (x * cos + x.roll(half, dims=-1) * signed_sin).to(x.dtype)
