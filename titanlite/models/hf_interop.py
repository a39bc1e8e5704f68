"""Move weights between titanlite's `Transformer` and Hugging Face's `LlamaForCausalLM`.

The two share one architecture (RMSNorm, GQA, rotate-half RoPE, SwiGLU, optional tied
embeddings), so the bridge is only a renaming of tensors plus a translation of the config:

    titanlite                                    Hugging Face
    tok_embeddings.weight                        model.embed_tokens.weight
    layers.{i}.attention.{q,k,v,o}_proj.weight   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.feed_forward.{gate,up,down}_proj  model.layers.{i}.mlp.{gate,up,down}_proj
    layers.{i}.attention_norm.weight             model.layers.{i}.input_layernorm.weight
    layers.{i}.ffn_norm.weight                   model.layers.{i}.post_attention_layernorm.weight
    norm.weight / output.weight                  model.norm.weight / lm_head.weight

No q/k permutation is needed: both apply RoPE to the halves [x1, x2] of each head
(`rotate_half`). Meta's original checkpoints pair interleaved dims instead, which is why
HF's conversion script permutes q/k; tests/test_hf_interop.py checks logits agree.

    to_hf(model, "out/hf")          # a directory `LlamaForCausalLM.from_pretrained` loads
    model = from_hf("out/hf")       # or from an in-memory LlamaForCausalLM
    hf = to_hf_model(model)         # in memory, for side-by-side checks

transformers is imported inside the functions: it takes seconds to import and most
titanlite runs never need it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..errors import TitanliteError
from ..paths import check_output_dir
from .llama import ModelArgs, Transformer, rope_cache

# Per-layer names, titanlite → HF; everything under `layers.{i}.` / `model.layers.{i}.`.
_LAYER_NAMES = {
    "attention.q_proj.weight": "self_attn.q_proj.weight",
    "attention.k_proj.weight": "self_attn.k_proj.weight",
    "attention.v_proj.weight": "self_attn.v_proj.weight",
    "attention.o_proj.weight": "self_attn.o_proj.weight",
    "feed_forward.gate_proj.weight": "mlp.gate_proj.weight",
    "feed_forward.up_proj.weight": "mlp.up_proj.weight",
    "feed_forward.down_proj.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES_BACK = {v: k for k, v in _LAYER_NAMES.items()}
_TOP_NAMES_BACK = {v: k for k, v in _TOP_NAMES.items()}
_ROPE_TYPES = ("default", "llama3")  # what titanlite's `rope_cache` implements


def hf_name(name: str) -> str:
    """titanlite parameter name → the HF `LlamaForCausalLM` name of the same tensor."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise TitanliteError(f"no Hugging Face name for titanlite tensor '{name}': only Llama "
                         f"weights map (embeddings, q/k/v/o, gate/up/down, norms, output)")


def titanlite_name(name: str) -> str:
    """HF `LlamaForCausalLM` tensor name → titanlite parameter name."""
    if name in _TOP_NAMES_BACK:
        return _TOP_NAMES_BACK[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_NAMES_BACK:
        return f"layers.{m.group(1)}.{_LAYER_NAMES_BACK[m.group(2)]}"
    raise TitanliteError(f"unexpected tensor '{name}' in the Hugging Face checkpoint: titanlite "
                         f"maps only plain Llama weights (no biases, no extra heads)")


# ----- configs ------------------------------------------------------------------------
def to_hf_config(args: ModelArgs, **extra):
    """ModelArgs → `LlamaConfig`; `extra` (e.g. bos_token_id) is passed through."""
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim, hidden_act="silu",
        max_position_embeddings=args.max_seq_len, initializer_range=args.init_std,
        rms_norm_eps=args.norm_eps, tie_word_embeddings=args.tie_embeddings,
        attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        # transformers 5 folds `rope_theta`/`rope_scaling` into `rope_parameters`; 4.x keeps
        # them as attributes. Passing the legacy keywords works with both.
        rope_theta=args.rope_theta, rope_scaling=dict(args.rope_scaling) if args.rope_scaling else None,
        # LlamaConfig's defaults (bos=1, eos=2) are ids of Llama 2's vocabulary, not ours.
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        attn_implementation="sdpa",
    )
    kw.update(extra)
    return LlamaConfig(**kw)


def _rope_of(cfg) -> tuple[float, dict]:
    """(rope_theta, rope parameters dict) from a 4.x (`rope_theta` + `rope_scaling`) or a
    5.x (`rope_parameters`) LlamaConfig."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        params = dict(params)
        return float(params.pop("rope_theta")), params
    params = dict(getattr(cfg, "rope_scaling", None) or {})
    return float(getattr(cfg, "rope_theta", 10_000.0)), params


def from_hf_config(cfg) -> ModelArgs:
    """`LlamaConfig` → ModelArgs, or a TitanliteError naming what titanlite cannot represent."""
    where = f"Hugging Face config ({getattr(cfg, 'model_type', '?')})"
    if getattr(cfg, "model_type", None) != "llama":
        raise TitanliteError(
            f"{where}: only model_type 'llama' maps onto titanlite's Transformer; "
            f"pick a Llama-architecture checkpoint (Llama 2/3, TinyLlama, SmolLM)")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise TitanliteError(f"{where} uses attention_bias/mlp_bias, but titanlite's linear "
                             f"layers have no bias: pick a checkpoint without biases")
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        raise TitanliteError(f"{where}: hidden_act '{cfg.hidden_act}' is not supported; "
                             f"titanlite's MLP is SwiGLU (silu)")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if head_dim * heads != cfg.hidden_size:
        raise TitanliteError(f"{where}: head_dim={head_dim} × {heads} heads != hidden_size="
                             f"{cfg.hidden_size}; titanlite derives head_dim as dim // n_heads")
    theta, rope = _rope_of(cfg)
    rope_type = rope.pop("rope_type", rope.pop("type", "default")) or "default"
    if rope.pop("partial_rotary_factor", 1.0) != 1.0:
        raise TitanliteError(f"{where}: partial_rotary_factor != 1 is not supported; "
                             f"titanlite rotates the whole head")
    if rope_type not in _ROPE_TYPES:
        raise TitanliteError(
            f"{where}: rope scaling '{rope_type}' is not supported; titanlite implements "
            f"{' and '.join(_ROPE_TYPES)} (Llama 3.1+) RoPE only")
    scaling = None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = {"rope_type": "llama3", **{k: rope[k] for k in keys}}
    args = ModelArgs(
        dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        vocab_size=cfg.vocab_size, norm_eps=float(cfg.rms_norm_eps), rope_theta=theta,
        max_seq_len=cfg.max_position_embeddings,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        init_std=float(getattr(cfg, "initializer_range", 0.02)), rope_scaling=scaling)
    # Keep ffn_hidden_dim None when Llama's default rule gives the same size, so a
    # titanlite → HF → titanlite round trip returns equal ModelArgs.
    if args.hidden_dim != cfg.intermediate_size:
        args.ffn_hidden_dim = cfg.intermediate_size
    return args.validate()


# ----- models -------------------------------------------------------------------------
def to_hf_model(model: Transformer, dtype: torch.dtype | None = None):
    """A `LlamaForCausalLM` (sdpa attention) holding copies of `model`'s weights."""
    from transformers import LlamaForCausalLM

    config = to_hf_config(model.args)
    # Build on meta (no random init of weights we overwrite anyway), then adopt the tensors.
    with torch.device("meta"):
        hf = LlamaForCausalLM(config)
    sd = {hf_name(k): v.detach().clone().to(dtype or v.dtype)
          for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        sd.pop("lm_head.weight", None)  # re-tied to embed_tokens just below
    hf.load_state_dict(sd, strict=not model.args.tie_embeddings, assign=True)
    if model.args.tie_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    # The rotary inverse frequencies are a non-persistent buffer: rebuild it off meta.
    device = next(iter(sd.values())).device
    with torch.device(device):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)
    leftover = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if leftover:
        raise TitanliteError(f"internal: HF tensors left unset after conversion: {leftover}; "
                             f"this transformers version lays out LlamaForCausalLM differently")
    return hf.eval()


def to_hf(model: Transformer, out_dir, tokenizer=None, dtype: torch.dtype | None = None) -> Path:
    """Write a `LlamaForCausalLM` directory (config.json + model.safetensors [+ tokenizer])."""
    out = check_output_dir(out_dir, "Hugging Face output folder")
    out.mkdir(parents=True, exist_ok=True)
    hf = to_hf_model(model, dtype=dtype)
    if tokenizer is not None:
        tokenizer = _as_hf_tokenizer(tokenizer)
        if len(tokenizer) > model.args.vocab_size:
            raise TitanliteError(
                f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                f"{model.args.vocab_size}: export the tokenizer the model was trained with")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(hf.config, key, getattr(tokenizer, key, None))
        tokenizer.save_pretrained(out)
    hf.save_pretrained(out, safe_serialization=True)
    _add_legacy_rope_keys(out / "config.json")
    return out


def _add_legacy_rope_keys(config_json: Path) -> None:
    """transformers 5 writes RoPE settings only as `rope_parameters`; transformers 4.x and
    tools such as llama.cpp's converter read `rope_theta` / `rope_scaling` and would silently
    fall back to theta=10000. Writing both keeps the directory right for every reader (5.x
    ignores the legacy keys when `rope_parameters` is present)."""
    cfg = json.loads(config_json.read_text())
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" in cfg:
        return
    cfg["rope_theta"] = params["rope_theta"]
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    cfg["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _as_hf_tokenizer(tokenizer):
    """A raw `tokenizers.Tokenizer` becomes a `PreTrainedTokenizerFast` so AutoTokenizer loads it."""
    if hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    from tokenizers import Tokenizer
    if isinstance(tokenizer, Tokenizer):
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    raise TitanliteError(f"cannot save a tokenizer of type {type(tokenizer).__name__}: pass a "
                         f"tokenizers.Tokenizer or a transformers tokenizer")


def from_hf(src, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> Transformer:
    """A titanlite Transformer from a HF Llama directory or an in-memory `LlamaForCausalLM`.
    dtype None keeps the checkpoint's dtype."""
    if isinstance(src, (str, Path)):
        config, tensors = _read_dir(Path(src))
    elif hasattr(src, "config") and hasattr(src, "state_dict"):
        # Copies: the two models must not share storage (training one would change the other).
        config = src.config
        tensors = {k: v.detach().clone() for k, v in src.state_dict().items()}
    else:
        raise TitanliteError(f"from_hf expects a directory or a LlamaForCausalLM, got "
                             f"{type(src).__name__}")
    args = from_hf_config(config)
    sd = {titanlite_name(k): v for k, v in tensors.items()
          if not k.endswith("rotary_emb.inv_freq")}  # old checkpoints saved this derived buffer
    if args.tie_embeddings:
        sd.pop("output.weight", None)
    with torch.device("meta"):
        model = Transformer(args)
    expected = {k for k in model.state_dict() if not (args.tie_embeddings and k == "output.weight")}
    if set(sd) != expected:
        missing, extra = sorted(expected - set(sd)), sorted(set(sd) - expected)
        raise TitanliteError(f"checkpoint does not match its config: missing {missing[:4]}, "
                             f"unexpected {extra[:4]}; is the directory complete?")
    dtype = dtype or next(iter(sd.values())).dtype
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in sd.items()},
                          strict=False, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    # The rotary tables are derived, non-persistent buffers: compute them (still on meta).
    model.rope_cos, model.rope_sin = rope_cache(args, device=device)
    return model


def read_hf_config(path: str | Path):
    """The `LlamaConfig` of a save_pretrained directory, checked to hold safetensors weights;
    offline (local_files_only), and one line naming the problem if the directory is not one."""
    from transformers import AutoConfig

    path = Path(path).expanduser()
    if not path.is_dir():
        raise TitanliteError(f"no Hugging Face checkpoint directory at '{path}': download one "
                             f"first (huggingface-cli download <repo> --local-dir {path}) or fix "
                             f"the path")
    if not (path / "config.json").is_file():
        raise TitanliteError(f"'{path}' has no config.json: point at a directory written by "
                             f"save_pretrained / titanlite's to_hf / huggingface-cli download")
    if not sorted(path.glob("*.safetensors")):
        raise TitanliteError(f"'{path}' holds no *.safetensors weights: re-save it with "
                             f"save_pretrained(..., safe_serialization=True)")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as err:  # a damaged or foreign config.json
        raise TitanliteError(f"cannot read '{path / 'config.json'}' ({str(err)[:160]}); "
                             f"re-download the checkpoint") from None


def _read_dir(path: Path):
    """(LlamaConfig, {name: tensor}) from a save_pretrained directory, via safetensors so no
    second full HF model is built in memory."""
    config = read_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    from safetensors.torch import load_file
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    return config, tensors
