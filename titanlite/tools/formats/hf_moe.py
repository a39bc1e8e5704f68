"""titanlite's mixture-of-experts models to and from Hugging Face's Mixtral (`MixtralForCausalLM`).

Mixtral is the Hugging Face architecture that matches titanlite's MoE block: Llama's attention
(grouped-query, RoPE, no QK-norm - Qwen3-MoE adds one, DeepSeek-V3 has latent attention), a router
whose softmax over all experts picks the top k and renormalises their weights, SwiGLU experts,
every block an MoE, no shared experts. transformers 5 keeps the experts stacked as titanlite does:
`gate_up_proj` [E, 2H, D] is our `w_gate` then `w_up`, `down_proj` [E, D, H] our `w_down`.
What Mixtral cannot hold is refused in one line: shared experts, dense blocks between the MoE
ones, sigmoid scores, a capacity factor, and an aux_free balancing bias that is no longer zero
(Mixtral's router has no bias, so the routing would change: train with --model.moe_balance
aux_loss to export). export.py calls these for any model with experts."""

from __future__ import annotations

import re

import torch

from ...errors import TitanliteError
from ...models.llama import ModelArgs, Transformer
from ...models.moe import MoEArgs
from .hf_names import decoder_config

_EXPERTS = re.compile(
    r"layers\.(\d+)\.feed_forward\.(router\.gate\.weight|experts\.w_(gate|up|down))"
)


def check_mixtral(model: Transformer) -> None:
    """One line for whatever in `model` Mixtral cannot hold (see the top)."""
    moe = model.args.moe
    why = (
        "it has shared experts" * bool(moe.n_shared_experts)
        or "it has dense blocks between the MoE ones" * (moe.every != 1)
        or "its router scores with a sigmoid" * (moe.router != "softmax")
        or "it drops tokens over a capacity" * (moe.capacity_factor is not None)
    )
    biased = [name for name, t in model.named_buffers() if name.endswith("expert_bias") and t.any()]
    if biased:
        why = f"its routers carry an aux_free balancing bias ({biased[0]}), which Mixtral has not"
    if why:
        raise TitanliteError(
            f"this mixture of experts cannot be written as Hugging Face's Mixtral: {why}; "
            f"train one with all blocks MoE, softmax scores, no shared experts, dropless and "
            f"--model.moe_balance aux_loss (or none) to export it"
        )


def to_mixtral_config(args: ModelArgs, **extra):
    """ModelArgs of a mixture → `MixtralConfig`: the decoder's keywords (export.py), the experts'."""
    from transformers import MixtralConfig

    moe = args.moe
    kw = decoder_config(args) | dict(
        intermediate_size=moe.hidden_dim or args.hidden_dim,
        num_local_experts=moe.n_experts,
        num_experts_per_tok=moe.experts_per_token,
        router_aux_loss_coef=moe.aux_loss_coef,
        router_jitter_noise=0.0,
        sliding_window=None,
    )
    return MixtralConfig(**kw | extra)


def to_mixtral_state(model: Transformer, hf_name, dtype=None) -> dict:
    """titanlite's state dict under Mixtral's names (`hf_name` maps the Llama parts)."""
    state, out = model.state_dict(), {}
    for name, t in state.items():
        t = t.detach().clone().to(dtype or t.dtype)
        m = _EXPERTS.fullmatch(name)
        if name.endswith(("expert_bias", "tokens_per_expert")):
            continue  # checked zero (check_mixtral); a counter
        if m is None:
            out[hf_name(name)] = t
        elif m.group(2) == "router.gate.weight":
            out[f"model.layers.{m.group(1)}.mlp.gate.weight"] = t
        elif m.group(3) == "gate":
            up = state[name.replace("w_gate", "w_up")].detach().to(t.dtype)
            out[f"model.layers.{m.group(1)}.mlp.experts.gate_up_proj"] = torch.cat([t, up], 1)
        elif m.group(3) == "down":
            out[f"model.layers.{m.group(1)}.mlp.experts.down_proj"] = t
    return out


def from_mixtral_config(cfg, llama_args) -> ModelArgs:
    """`MixtralConfig` → ModelArgs: the Llama part read as a Llama config is (`llama_args`)."""
    if getattr(cfg, "router_jitter_noise", 0.0):
        raise TitanliteError(
            "Hugging Face config (mixtral): router_jitter_noise > 0 is not supported; titanlite's "
            "router is deterministic"
        )
    args = llama_args(cfg, allow="mixtral")
    args.moe = MoEArgs(
        n_experts=cfg.num_local_experts,
        experts_per_token=cfg.num_experts_per_tok,
        hidden_dim=cfg.intermediate_size,
        balance="aux_loss",
        aux_loss_coef=float(cfg.router_aux_loss_coef),
    )
    args.ffn_hidden_dim = cfg.intermediate_size  # unused: every block is MoE
    return args.validate()


def from_mixtral_state(tensors: dict, titanlite_name) -> dict:
    """Mixtral's state dict under titanlite's names (`titanlite_name` maps the Llama parts). Two
    layouts: transformers 5's in memory (mlp.gate, mlp.experts.gate_up_proj / down_proj) and the
    files it writes, Mixtral's original (block_sparse_moe.gate, block_sparse_moe.experts.{j}.w1
    gate, w3 up, w2 down, one expert at a time)."""
    out, per_expert = {}, {}
    moe = r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
    for name, t in tensors.items():
        if m := re.fullmatch(moe + r"gate\.weight", name):
            out[f"layers.{m.group(1)}.feed_forward.router.gate.weight"] = t
        elif m := re.fullmatch(moe + r"experts\.(gate_up|down)_proj", name):
            prefix = f"layers.{m.group(1)}.feed_forward.experts"
            if m.group(2) == "down":
                out[f"{prefix}.w_down"] = t
            else:
                gate, up = t.chunk(2, dim=1)
                out[f"{prefix}.w_gate"], out[f"{prefix}.w_up"] = gate.contiguous(), up.contiguous()
        elif m := re.fullmatch(moe + r"experts\.(\d+)\.w([123])\.weight", name):
            which = {"1": "w_gate", "2": "w_down", "3": "w_up"}[m.group(3)]
            key = f"layers.{m.group(1)}.feed_forward.experts.{which}"
            per_expert.setdefault(key, {})[int(m.group(2))] = t
        else:
            out[titanlite_name(name)] = t
    for key, experts in per_expert.items():  # stacked in expert order
        out[key] = torch.stack([experts[j] for j in sorted(experts)])
    return out
