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

import contextlib
import re
from pathlib import Path

import torch

from ...errors import TitanliteError
from ...models.llama import ModelArgs, Transformer
from ...models.moe import MoEArgs
from .hf_names import decoder_config

_EXPERTS = re.compile(
    r"layers\.(\d+)\.feed_forward\.(router\.gate\.weight|experts\.w_(gate|up|down))"
)
# [model]'s mixture keys and the MoEArgs field each sets (preflight.moe_args_of): a published
# Mixtral sets them all (from_mixtral_config), so a start checks each given one against it.
MOE_FIELDS = {
    "n_experts": "n_experts",
    "experts_per_token": "experts_per_token",
    "n_shared_experts": "n_shared_experts",
    "moe_every": "every",
    "expert_hidden_dim": "hidden_dim",
    "moe_router": "router",
    "moe_balance": "balance",
    "moe_aux_loss_coef": "aux_loss_coef",
    "moe_bias_update": "bias_update",
    "moe_capacity_factor": "capacity_factor",
}


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


def mixtral_only(name: str) -> bool:
    """Is titanlite's tensor `name` one a Llama has not: a router's (gate, expert_bias) or experts'?"""
    return bool(_EXPERTS.fullmatch(name)) or name.endswith("router.expert_bias")


def load_mixtral_parts(tensors: dict, path: str | Path) -> None:
    """Fill `tensors` (titanlite names: this rank's parameters, plain or DTensors) in place from the
    Mixtral folder `path`: each router's gate and each expert's slices read from the safetensors
    files, only the slices this rank holds (EP: its experts; TP: its rows or columns). Either layout
    (see from_mixtral_state): one tensor per expert, or transformers 5's gate_up_proj/down_proj. The
    routers' expert_bias, which Mixtral has not (its routing has no bias), starts at zero."""
    from safetensors import safe_open

    from ..._compat.torch_tools import local_piece

    with contextlib.ExitStack() as files, torch.no_grad():
        opened = [
            files.enter_context(safe_open(f, "pt"))
            for f in sorted(Path(path).glob("*.safetensors"))
        ]
        where = {name: f for f in opened for name in f.keys()}

        def read(name: str, *index: slice) -> torch.Tensor:  # only these slices leave the file
            if name not in where:
                raise TitanliteError(
                    f"no tensor '{name}' in {path}, which a Mixtral of this shape has"
                )
            return where[name].get_slice(name)[index]

        for name, tensor in tensors.items():
            local, start, size = local_piece(tensor)
            here = [slice(a, a + n) for a, n in zip(start, size)]
            layer = f"model.layers.{name.split('.')[1]}"
            moe = (
                f"{layer}.block_sparse_moe"
                if f"{layer}.block_sparse_moe.gate.weight" in where
                else f"{layer}.mlp"
            )
            if name.endswith("expert_bias"):
                local.zero_()
            elif name.endswith("router.gate.weight"):
                local.copy_(read(f"{moe}.gate.weight", *here))
            else:  # experts.w_gate / w_up / w_down [E, ...]: expert j's rows of this rank's slice
                kind = name.rsplit("_", 1)[1]
                for j in range(start[0], start[0] + size[0]):
                    local[j - start[0]].copy_(
                        _expert(read, moe, j, kind, here[1:], tensor.shape[1])
                    )


def _expert(read, moe: str, j: int, kind: str, here: list, hidden: int) -> torch.Tensor:
    """Expert j's `kind` (gate, up, down), the slice `here` of it, in the folder's layout."""
    if moe.endswith("block_sparse_moe"):  # Mixtral's original: w1 gate, w2 down, w3 up
        return read(f"{moe}.experts.{j}.w{dict(gate=1, down=2, up=3)[kind]}.weight", *here)
    if kind == "down":
        return read(f"{moe}.experts.down_proj", slice(j, j + 1), *here)[0]
    rows, cols = here  # gate_up_proj [E, 2H, D]: the gate's rows, then the up's
    shift = hidden if kind == "up" else 0
    return read(
        f"{moe}.experts.gate_up_proj",
        slice(j, j + 1),
        slice(rows.start + shift, rows.stop + shift),
        cols,
    )[0]
