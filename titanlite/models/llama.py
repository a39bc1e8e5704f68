"""A Llama-3-style decoder, small enough to read in one sitting.

Pre-norm grouped-query attention with rotary embeddings, then a SwiGLU MLP, `n_layers` times; names follow
Hugging Face's `LlamaForCausalLM`, so weights map one to one (tools/formats/export.py). Built on the meta device, then
`to_empty` + `init_weights()` on the target one, so a model can be sharded before memory is spent:

    model = build_model(ModelArgs.preset("small", vocab_size=4096), device="cpu")  # does just that"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from ..device_policy import capability_of, expand_kv_for_sdpa, sdpa_priority
from ..errors import TitanliteError, closest
from .layers import FeedForward, initialise
from .rope import CONTEXT_KEY, apply_rope, rope_cache

if TYPE_CHECKING:  # a dense model never imports the mixture of experts (notebook 18)
    from .moe import MoEArgs


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 4096
    ffn_hidden_dim: int | None = None  # None: Llama's 8/3·dim rounded up to `multiple_of`
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0  # Llama 3's base: longer wavelengths for long contexts
    max_seq_len: int = 256
    tie_embeddings: bool = True
    init_std: float = 0.02
    rope_scaling: dict | None = None  # Llama 3.1+ long context: HF's {"rope_type": "llama3", ...}
    moe: MoEArgs | None = None  # mixture of experts (models/moe.py); None: every block dense

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        multiple = self.multiple_of
        return self.ffn_hidden_dim or multiple * math.ceil(int(8 * self.dim / 3) / multiple)

    def validate(self) -> ModelArgs:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise TitanliteError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise TitanliteError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: "
                f"choose n_heads dividing dim (e.g. {self.dim // 64 or 1})"
            )
        if self.n_heads % self.n_kv_heads:
            raise TitanliteError(
                f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads="
                f"{self.n_kv_heads}: grouped-query attention shares each KV head among "
                f"n_heads/n_kv_heads query heads"
            )
        if self.head_dim % 2:
            raise TitanliteError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            keys = {"factor", "low_freq_factor", "high_freq_factor"} | {CONTEXT_KEY}
            if self.rope_scaling.get("rope_type") != "llama3" or not keys <= set(self.rope_scaling):
                raise TitanliteError(
                    f"model.rope_scaling={self.rope_scaling} is not supported: use None or "
                    f"{{'rope_type': 'llama3', {', '.join(sorted(keys))}}} (Llama 3.1+)"
                )
        if self.moe is not None:
            from .moe import MoEArgs

            moe = self.moe  # a dict when read back from a checkpoint's record
            self.moe = (MoEArgs(**moe) if isinstance(moe, dict) else moe).validate(self.n_layers)
        return self

    @staticmethod
    def preset(name: str, **overrides) -> ModelArgs:
        if name not in PRESETS:
            raise TitanliteError(
                f"unknown model preset '{name}'{closest(name, PRESETS)}; "
                f"choose one of {', '.join(PRESETS)}"
            )
        return replace(
            PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}
        ).validate()

    def to_dict(self) -> dict:
        return asdict(self)


# debug and small train on a laptop CPU; 1B and 8B are Llama 3.2 1B and Llama 3 8B, for formulas and GPUs.
# One preset a line: a table is read across (the formatter would give each field a line of its own).
# fmt: off
PRESETS: dict[str, ModelArgs] = {
    "debug": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, max_seq_len=256),
    "small": ModelArgs(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, vocab_size=8192, max_seq_len=512),
    "125M": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32_000,
                      max_seq_len=2048, tie_embeddings=False),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128_256,
                    ffn_hidden_dim=8192, max_seq_len=8192),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128_256,
                    ffn_hidden_dim=14336, max_seq_len=8192, tie_embeddings=False),
}
# fmt: on


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x / rms(x) · weight in fp32, so bf16 activations do not lose the mean square
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    context_parallel = None  # set by distributed/context_parallel.py: attention across cp ranks
    masked = None  # set by models/masked_attention.py: the kernel that takes a mask

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x, cos, sin, mask=None):
        B, T, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        q, k, v = (
            proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cp = self.context_parallel
        attend = causal_attention if cp is None else cp.attention
        out = attend(q, k, v) if mask is None else self.masked.attend(q, k, v, mask, cp)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def causal_attention(q, k, v, expand_kv: bool | None = None, mask=None) -> torch.Tensor:
    """Causal SDPA with grouped-query attention: SDPA repeats the KV heads (`enable_gqa`) or we do first.
    expand_kv None: device_policy decides (on CUDA only flash takes `enable_gqa`; else slow math runs).
    `mask`: a boolean one (True: attend) in place of causality, itself causal (masked_attention.py)."""
    groups, capability = q.shape[1] // k.shape[1], capability_of(q)
    if expand_kv is None and groups > 1 and capability is not None:
        # flash takes no mask: a masked call on CUDA goes to cuDNN or the efficient kernel
        expand_kv = mask is not None or expand_kv_for_sdpa("cuda", q.dtype, q.shape[-1], capability)
    if expand_kv and groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    priority = sdpa_priority(q.device.type, capability)  # cuDNN first where torch would put it
    gqa = q.shape[1] != k.shape[1]  # not when the KV heads were repeated above
    with sdpa_kernel(priority, set_priority=True) if priority else contextlib.nullcontext():
        causal = mask is None  # a mask is causal itself
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
        )


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # A mixture of experts where [model] asks for one (moe.py: which blocks), else SwiGLU.
        moe = args.moe.feed_forward(layer, args.dim, args.hidden_dim) if args.moe else None
        self.feed_forward = moe if moe is not None else FeedForward(args.dim, args.hidden_dim)

    def forward(self, x, cos, sin, mask=None):
        # mask by keyword: tensor parallelism's plan lays out (x, cos, sin) alone
        x = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    context_parallel = None  # set by distributed/context_parallel.py: this rank's positions
    masked = None  # set by models/masked_attention.py: builds each batch's mask

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args.validate()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0", "1", ...: names stay when pipeline parallelism deletes other stages'.
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(args, i) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # rotary tables: derived data, not saved in checkpoints
        for name in ("rope_cos", "rope_sin"):
            self.register_buffer(
                name, torch.empty(args.max_seq_len, args.head_dim), persistent=False
            )

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise in place on whatever device the parameters live on (after `to_empty`)."""
        if self.args.tie_embeddings:  # `to_empty()` gave each module a fresh tensor: tie them again
            self.output.weight = self.tok_embeddings.weight
        # GPT-2/nanoGPT: projections into the residual stream get 1/sqrt(2·n_layers), so it does not grow.
        std = self.args.init_std
        initialise(self, std, std / math.sqrt(2 * self.args.n_layers))
        cos, sin = rope_cache(self.args, self.rope_cos.device)  # the buffers that are not zero
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] → logits [B, T, vocab]. A pipeline stage (distributed/pipeline.py) sets parts to
        None: without `tok_embeddings` it takes hidden states [B, T, dim]; without `output`, returns them.
        `documents` [B, T] (the whole sequence's, under CP): attention within each (masked_attention.py)."""
        T = tokens.shape[1]
        if T > self.args.max_seq_len:
            raise TitanliteError(
                f"sequence length {T} exceeds the model's max_seq_len={self.args.max_seq_len}: "
                f"use a shorter training.seq_len or raise model.max_seq_len"
            )
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cp = self.context_parallel  # a slice of the sequence: its tokens' real positions
        rows = slice(0, T) if cp is None else cp.positions(T, self.rope_cos.device)
        cos, sin = self.rope_cos[rows].to(h.dtype), self.rope_sin[rows].to(h.dtype)
        # Built once a batch, for every layer. RoPE's positions run on across documents: 0..T-1.
        if documents is not None and self.masked is None:
            raise TitanliteError("documents need masked attention: apply_masked_attention first")
        mask = None if documents is None else self.masked.mask_for(documents, T, h.device, cp)
        for block in self.layers.values():
            h = block(h, cos, sin, mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Unique parameters (a tied output counts once), less the embedding lookup if asked."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_embeddings.weight.numel() if exclude_embedding else n

    def active_params(self) -> int:
        """Parameters one token uses: all, less each MoE block's routed experts it skips."""
        return self.num_params() - sum(
            block.feed_forward.skipped_per_token for block in self.layers.values()
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as PaLM (appendix B), nanoGPT and torchtitan count them: 6·N (forward 2·N,
        backward 4·N) for the N matmul weights a token uses (an MoE block: its k experts, not all E),
        plus 12·L·H·Q·T for attention (causal masking ignored)."""
        a = self.args
        n_matmul = self.active_params() - self.tok_embeddings.weight.numel()
        if a.tie_embeddings:  # the shared matrix still does the output matmul
            n_matmul += self.output.weight.numel()
        return 6 * n_matmul + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len


def build_model(args: ModelArgs, device: torch.device | str = "cpu") -> Transformer:
    """Construct on the meta device (no memory, no init cost), then materialise and init."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights()
    return model


def count(args: ModelArgs, seq_len: int) -> tuple[float, int]:
    """(training FLOPs per token at `seq_len`, parameters) of a model of this shape, counted on a
    weightless (meta-device) copy: nothing is allocated."""
    with torch.device("meta"):
        model = Transformer(args)
    return model.flops_per_token(seq_len), model.num_params()
