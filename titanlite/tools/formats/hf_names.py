"""titanlite's names for a Llama's tensors and config, and Hugging Face's (transformers'), both
ways: one table and its inverse. What hf_start (a run from a published folder), hf_moe (Mixtral's
experts) and export (a checkpoint out, and back) all map through."""

import re

from ...errors import TitanliteError
from ...models.llama import ModelArgs

# Per-layer names, titanlite → HF; everything under `layers.{i}.` / `model.layers.{i}.`.
_LAYER_NAMES = (
    {f"attention.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"}
    | {f"feed_forward.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    | {
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
)
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES_BACK = {v: k for k, v in _LAYER_NAMES.items()}
_TOP_NAMES_BACK = {v: k for k, v in _TOP_NAMES.items()}


def hf_name(name: str) -> str:
    """titanlite parameter name → the HF `LlamaForCausalLM` name of the same tensor."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise TitanliteError(
        f"no Hugging Face name for titanlite tensor '{name}': only Llama "
        f"weights map (embeddings, q/k/v/o, gate/up/down, norms, output)"
    )


def titanlite_name(name: str) -> str:
    """HF `LlamaForCausalLM` tensor name → titanlite parameter name."""
    if name in _TOP_NAMES_BACK:
        return _TOP_NAMES_BACK[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_NAMES_BACK:
        return f"layers.{m.group(1)}.{_LAYER_NAMES_BACK[m.group(2)]}"
    raise TitanliteError(
        f"unexpected tensor '{name}' in the Hugging Face checkpoint: titanlite "
        f"maps only plain Llama weights (no biases, no extra heads)"
    )


def decoder_config(args: ModelArgs) -> dict:
    """The keywords every Hugging Face config of a Llama-style decoder (Llama, Mixtral) takes from
    ModelArgs; each architecture adds its own (tools/formats/hf_moe.py: the experts)."""
    return dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        max_position_embeddings=args.max_seq_len,
        initializer_range=args.init_std,
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings,
        # transformers 5 folds `rope_theta`/`rope_scaling` into `rope_parameters`; 4.x keeps
        # them as attributes. Passing the legacy keywords works with both.
        rope_theta=args.rope_theta,
        rope_scaling=dict(args.rope_scaling) if args.rope_scaling else None,
        # LlamaConfig's defaults (bos=1, eos=2) are ids of Llama 2's vocabulary, not ours.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
