"""A Llama-3-style decoder, small enough to read in one sitting.

RMSNorm → grouped-query attention (rotary embeddings, `scaled_dot_product_attention`) →
RMSNorm → SwiGLU MLP, repeated `n_layers` times. The layout and names follow Hugging Face's
`LlamaForCausalLM` closely (q/k/v/o_proj, gate/up/down_proj, rotate-half rotary) so weights
map one to one (see `hf_interop.py`) and the later parallelism plans read like torchtitan's.

Build on the meta device and call `init_weights()` on the target device, so that later
notebooks can shard a model (FSDP, TP) before any memory is spent on it:

    with torch.device("meta"):
        model = Transformer(ModelArgs.preset("small", vocab_size=4096))
    model.to_empty(device="cpu"); model.init_weights()
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..device_policy import expand_kv_for_sdpa
from ..errors import TitanliteError, closest


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
    # Llama 3.1+ long-context RoPE: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}, as in HF's config. None: plain.
    rope_scaling: dict | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden_dim:
            return self.ffn_hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def validate(self) -> "ModelArgs":
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise TitanliteError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise TitanliteError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: "
                f"choose n_heads dividing dim (e.g. {self.dim // 64 or 1})")
        if self.n_heads % self.n_kv_heads:
            raise TitanliteError(
                f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads="
                f"{self.n_kv_heads}: grouped-query attention shares each KV head among "
                f"n_heads/n_kv_heads query heads")
        if self.head_dim % 2:
            raise TitanliteError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            keys = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
            if self.rope_scaling.get("rope_type") != "llama3" or not keys <= set(self.rope_scaling):
                raise TitanliteError(
                    f"model.rope_scaling={self.rope_scaling} is not supported: use None or "
                    f"{{'rope_type': 'llama3', {', '.join(sorted(keys))}}} (Llama 3.1+)")
        return self

    @staticmethod
    def preset(name: str, **overrides) -> "ModelArgs":
        if name not in PRESETS:
            raise TitanliteError(
                f"unknown model preset '{name}'{closest(name, PRESETS)}; "
                f"choose one of {', '.join(PRESETS)}")
        overrides = {k: v for k, v in overrides.items() if v is not None}
        return replace(PRESETS[name], **overrides).validate()

    def to_dict(self) -> dict:
        return asdict(self)


# "debug" and "small" train on a laptop CPU; the large ones are for formulas and GPU demos.
# 1B and 8B are Llama 3.2 1B and Llama 3 8B (hidden sizes 8192 and 14336 as published).
PRESETS: dict[str, ModelArgs] = {
    "debug": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096,
                       max_seq_len=256),
    "small": ModelArgs(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, vocab_size=8192,
                       max_seq_len=512),
    "125M": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32_000,
                      max_seq_len=2048, tie_embeddings=False),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128_256,
                    ffn_hidden_dim=8192, max_seq_len=8192),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128_256,
                    ffn_hidden_dim=14336, max_seq_len=8192, tie_embeddings=False),
}


class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in fp32 so bf16 activations do not lose the mean square."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's context extension: slow the low frequencies (wavelengths longer than the
    original context) by `factor`, keep the high ones, and blend smoothly in between."""
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - lo) / (hi - lo)).clamp(0, 1)  # 0: long waves, 1: short
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_cache(args: ModelArgs, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [max_seq_len, head_dim] in the rotate-half layout HF uses."""
    inv_freq = 1.0 / (args.rope_theta ** (
        torch.arange(0, args.head_dim, 2, device=device, dtype=torch.float32) / args.head_dim))
    if args.rope_scaling:
        inv_freq = llama3_scaled(inv_freq, args.rope_scaling)
    t = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) by position-dependent angles; x: [B, H, T, D].

    This is HF's `x·cos + rotate_half(x)·sin` with rotate_half(x) = [-x2, x1], written so
    the big tensor sees one `roll` instead of chunk + neg + cat: roll(x) = [x2, x1], and the
    minus sign moves onto the first half of the small [T, D] sin table (exact in IEEE: the
    same products, so the same bits). Computed in x's dtype, as HF does: no fp32 upcast."""
    half = x.shape[-1] // 2
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return x * cos + x.roll(half, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = causal_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     expand_kv: bool | None = None) -> torch.Tensor:
    """Causal SDPA with grouped-query attention: each KV head serves n_heads/n_kv_heads query
    heads. Either SDPA repeats the KV heads (`enable_gqa`) or we do, with repeat_interleave,
    before calling it: the same numbers in the same order, so the same result. Which one is a
    device decision (device_policy.expand_kv_for_sdpa, None: decide): on CUDA only flash takes
    `enable_gqa`, and anything it refuses would otherwise land on the slow math kernel."""
    groups = q.shape[1] // k.shape[1]
    if expand_kv is None:
        expand_kv = groups > 1 and q.device.type == "cuda" and _expand_on_cuda(q)
    if expand_kv and groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _expand_on_cuda(q: torch.Tensor) -> bool:
    # get_device_properties (not get_device_capability): torch.compile folds it to a constant.
    props = torch.cuda.get_device_properties(q.device)
    return expand_kv_for_sdpa("cuda", q.dtype, q.shape[-1], (props.major, props.minor))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.down_proj = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args.validate()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0", "1", ... (not a ModuleList) keeps the names stable when
        # pipeline parallelism later deletes the layers another stage owns.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Rotary tables are derived data, not state: not saved in checkpoints.
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.head_dim), persistent=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise in place on whatever device the parameters live on (after `to_empty`)."""
        std = self.args.init_std
        if self.args.tie_embeddings:
            # `to_empty()` gives each module a fresh tensor, which unties shared weights.
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_cache(self.args, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        # GPT-2/nanoGPT: scale the projections that write into the residual stream by
        # 1/sqrt(2·n_layers) so its variance does not grow with depth.
        out_std = std / math.sqrt(2 * self.args.n_layers)
        for block in self.layers.values():
            for lin in (block.attention.q_proj, block.attention.k_proj, block.attention.v_proj,
                        block.feed_forward.gate_proj, block.feed_forward.up_proj):
                nn.init.normal_(lin.weight, std=std)
            nn.init.normal_(block.attention.o_proj.weight, std=out_std)
            nn.init.normal_(block.feed_forward.down_proj.weight, std=out_std)
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        if not self.args.tie_embeddings:
            nn.init.normal_(self.output.weight, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] → logits [B, T, vocab].

        A pipeline stage (distributed/pipeline.py) is this model with parts set to None:
        without `tok_embeddings` its input is the previous stage's hidden states [B, T, dim];
        without `output` (and `norm`) it returns hidden states for the next stage."""
        T = tokens.shape[1]
        if T > self.args.max_seq_len:
            raise TitanliteError(
                f"sequence length {T} exceeds the model's max_seq_len={self.args.max_seq_len}: "
                f"use a shorter training.seq_len or raise model.max_seq_len")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope_cos[:T].to(h.dtype), self.rope_sin[:T].to(h.dtype)
        for block in self.layers.values():
            h = block(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    # ----- counting -------------------------------------------------------------------
    def num_params(self, exclude_embedding: bool = False) -> int:
        """Unique parameters (a tied output matrix counts once). With exclude_embedding,
        the token-embedding table is left out: a lookup, not a matmul."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, counted as PaLM (appendix B), nanoGPT and torchtitan do:
        6·N (forward 2·N, backward 4·N, for the N weights that take part in matmuls)
        plus 12·L·H·Q·T for attention scores and their weighted sum (causal masking ignored).
        """
        n_matmul = self.num_params(exclude_embedding=True)
        if self.args.tie_embeddings:  # the shared matrix still does the output matmul
            n_matmul += self.output.weight.numel()
        a = self.args
        return 6 * n_matmul + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len


def build_model(args: ModelArgs, device: torch.device | str = "cpu") -> Transformer:
    """Construct on the meta device (no memory, no init cost), then materialise and init."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights()
    return model
