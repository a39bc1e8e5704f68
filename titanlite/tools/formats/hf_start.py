"""Start a run from a published Llama or Mixtral: its shape, its tokenizer, its weights - a tool
handed to the trainer (`Trainer(cfg, start_from=HuggingFaceStart(path))`; `titanlite train` reads
`--checkpoint.initial_load_path` and hands it in).

    titanlite train --checkpoint.initial_load_path ~/models/SmolLM-135M ...

The model's shape is the checkpoint's (a `[model]` setting that disagrees is refused), the corpus is
encoded with its tokenizer, and DCP's resharding load (`HuggingFaceStorageReader`) reads the weights
into this run's layout, each rank only the slices its parts and placements need. Optimizer, schedule
and data start at step 0. A titanlite checkpoint found on resume (or `checkpoint.load`) takes
precedence: a restarted run continues from its own checkpoint, not from the published weights.

The two models share one architecture (RMSNorm, GQA, rotate-half RoPE, SwiGLU, optional tied
embeddings), so reading one is a renaming of tensors plus a translation of the config. No q/k
permutation is needed: both rotate the halves [x1, x2] of each head (Meta's original checkpoints pair
interleaved dims, which is why HF's conversion script permutes q/k). A Mixtral's routers and experts
are read by hf_moe.py (its files keep one tensor per expert, ours one per kind, stacked), each rank
the experts and slices it holds; the routers' expert_bias, which Mixtral has not, starts at zero.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch

from ...config import ModelSection
from ...errors import TitanliteError
from ...models.llama import ModelArgs
from .hf_names import hf_name

# [model] settings the checkpoint decides; a value set away from its default must agree with it.
_SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "tie_embeddings")


class HuggingFaceStart:
    """A published Llama or Mixtral directory (config.json, *.safetensors, tokenizer.json) to start
    from; `label` names it in the run's "started from" line."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.config = read_hf_config(self.path)  # one line now if it is not a checkpoint
        self.tokenizer = str(path)  # the corpus is encoded with the checkpoint's own tokenizer
        self.label = str(self.path)
        if self.config.model_type == "mixtral":  # what the run has and the folder has not
            self.label += ", a Mixtral (the routers' expert_bias, which it has not, starts at zero)"

    @classmethod
    def from_config(cls, cfg) -> HuggingFaceStart | None:
        """The start `--checkpoint.initial_load_path` names, or None."""
        return cls(cfg.checkpoint.initial_load_path) if cfg.checkpoint.initial_load_path else None

    def model_args(self, cfg) -> ModelArgs:
        """The checkpoint's ModelArgs, checked against the run's `[model]`. `max_seq_len` may shorten
        the RoPE tables (no weight), not lengthen them."""
        from .hf_moe import MOE_FIELDS

        args, default = from_hf_config(self.config), ModelSection()
        theirs = {name: getattr(args, name) for name in _SHAPE_FIELDS}
        # The mixture's keys too (a Mixtral's, or none): a dense checkpoint has no experts.
        theirs |= {k: getattr(args.moe, f) if args.moe else None for k, f in MOE_FIELDS.items()}
        for name, value in theirs.items():
            mine = getattr(cfg.model, name)
            if mine != getattr(default, name) and mine != value:
                has = f"{name}={value}" if args.moe or name not in MOE_FIELDS else "no experts"
                raise TitanliteError(
                    f"model.{name}={mine} but the checkpoint at {self.path} has {has}: drop "
                    f"--model.{name} (the checkpoint sets the model) or point "
                    "checkpoint.initial_load_path at a matching checkpoint"
                )
        if cfg.model.max_seq_len is not None:
            if cfg.model.max_seq_len > args.max_seq_len:
                raise TitanliteError(
                    f"model.max_seq_len={cfg.model.max_seq_len} exceeds the checkpoint's "
                    f"max_position_embeddings ({args.max_seq_len}): lower --model.max_seq_len"
                )
            args.max_seq_len = cfg.model.max_seq_len
        return args.validate()

    def load(self, parts: list[torch.nn.Module], tie_embeddings: bool = False) -> float:
        return load_initial_weights(parts, self.path, tie_embeddings)


def load_initial_weights(
    parts: list[torch.nn.Module], path: str | Path, tie_embeddings: bool = False
) -> float:
    """Fill this rank's model parts (one, or one per pipeline stage) from the safetensors in `path`,
    each rank reading only its own slices; returns the seconds it took. Collective."""
    from torch.distributed.checkpoint import CheckpointException, load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    try:  # public in every torch titanlite supports (2.11+); torchtitan imports it alike
        from torch.distributed.checkpoint import HuggingFaceStorageReader
    except ImportError:
        raise TitanliteError(
            "checkpoint.initial_load_path needs DCP's HuggingFaceStorageReader, missing "
            f"from torch {torch.__version__}: upgrade torch to >= 2.11"
        ) from None
    from .hf_moe import load_mixtral_parts, mixtral_only

    start = time.perf_counter()
    path = Path(path).expanduser()
    read_hf_config(path)  # the same one-line refusals as at start-up, should it have changed
    # Plain names in every layout; FSDP and TP entries are DTensors that know their slice.
    states = [get_model_state_dict(part) for part in parts]
    named = [(n, t) for state in states for n, t in state.items()]
    mixtral = {n: t for n, t in named if mixtral_only(n)}  # routers and experts: hf_moe.py
    wanted = {
        hf_name(name): tensor
        for name, tensor in named
        if name not in mixtral and not (tie_embeddings and name == "output.weight")
    }  # tied: stored once, as the embedding
    try:
        with warnings.catch_warnings():  # DCP says it assumes one process when it is one
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            load(wanted, storage_reader=HuggingFaceStorageReader(str(path)))  # in place, cast
        load_mixtral_parts(mixtral, path)
    except (Exception, CheckpointException) as err:  # DCP's exception is a BaseException
        raise TitanliteError(
            f"cannot load the weights in {path}: {_first_line(err)}; is the "
            f"download complete and the checkpoint a plain Llama or Mixtral?"
        ) from None
    for part, state in zip(parts, states):
        # A no-op where the state dict's tensors are the parameters; a copy where a wrapper copied.
        set_model_state_dict(part, state, options=StateDictOptions(strict=False))
    return time.perf_counter() - start


def _first_line(err: BaseException) -> str:
    """The cause, not the traceback, of DCP's CheckpointException (each rank's, wrapped)."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))
        err = getattr(err, "exception", err)
    return " ".join(str(err).split())[:240]


_ROPE_TYPES = ("default", "llama3")  # what titanlite's `rope_cache` implements


def _rope_of(cfg) -> tuple[float, dict]:
    """(rope_theta, rope parameters) of a 4.x (`rope_theta`, `rope_scaling`) or 5.x LlamaConfig."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        params = dict(params)
        return float(params.pop("rope_theta")), params
    return float(getattr(cfg, "rope_theta", 10_000.0)), dict(
        getattr(cfg, "rope_scaling", None) or {}
    )


def from_hf_config(cfg, allow: str = "llama") -> ModelArgs:
    """`LlamaConfig` (or `MixtralConfig`: tools/formats/hf_moe.py) → ModelArgs, or a TitanliteError
    naming what titanlite cannot represent."""
    where = f"Hugging Face config ({getattr(cfg, 'model_type', '?')})"
    if getattr(cfg, "model_type", None) == "mixtral" and allow == "llama":
        from .hf_moe import from_mixtral_config

        return from_mixtral_config(cfg, from_hf_config)
    if getattr(cfg, "model_type", None) != allow:
        raise TitanliteError(
            f"{where}: only model_type 'llama' (and 'mixtral') maps onto titanlite's Transformer; "
            f"pick a Llama-architecture checkpoint (Llama 2/3, TinyLlama, SmolLM) or a Mixtral"
        )
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise TitanliteError(
            f"{where} uses attention_bias/mlp_bias, but titanlite's linear "
            f"layers have no bias: pick a checkpoint without biases"
        )
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        raise TitanliteError(
            f"{where}: hidden_act '{cfg.hidden_act}' is not supported; "
            f"titanlite's MLP is SwiGLU (silu)"
        )
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if head_dim * heads != cfg.hidden_size:
        raise TitanliteError(
            f"{where}: head_dim={head_dim} × {heads} heads != hidden_size="
            f"{cfg.hidden_size}; titanlite derives head_dim as dim // n_heads"
        )
    theta, rope = _rope_of(cfg)
    rope_type = rope.pop("rope_type", rope.pop("type", "default")) or "default"
    if rope.pop("partial_rotary_factor", 1.0) != 1.0:
        raise TitanliteError(
            f"{where}: partial_rotary_factor != 1 is not supported; "
            f"titanlite rotates the whole head"
        )
    if rope_type not in _ROPE_TYPES:
        raise TitanliteError(
            f"{where}: rope scaling '{rope_type}' is not supported; titanlite implements "
            f"{' and '.join(_ROPE_TYPES)} (Llama 3.1+) RoPE only"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    scaling = (
        {"rope_type": "llama3", **{k: rope[k] for k in keys}} if rope_type == "llama3" else None
    )
    args = ModelArgs(
        dim=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        vocab_size=cfg.vocab_size,
        norm_eps=float(cfg.rms_norm_eps),
        rope_theta=theta,
        max_seq_len=cfg.max_position_embeddings,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        init_std=float(getattr(cfg, "initializer_range", 0.02)),
        rope_scaling=scaling,
    )
    # ffn_hidden_dim stays None if Llama's rule gives that size: a round trip returns equal ModelArgs.
    if args.hidden_dim != cfg.intermediate_size:
        args.ffn_hidden_dim = cfg.intermediate_size
    return args.validate()


def read_hf_config(path: str | Path):
    """The `LlamaConfig` of a save_pretrained directory, checked to hold safetensors weights;
    offline (local_files_only), and one line naming the problem if the directory is not one."""
    from transformers import AutoConfig

    path = Path(path).expanduser()
    if not path.is_dir():
        raise TitanliteError(
            f"no Hugging Face checkpoint directory at '{path}': download one first "
            f"(huggingface-cli download <repo> --local-dir {path}) or fix the path"
        )
    if not (path / "config.json").is_file():
        raise TitanliteError(
            f"'{path}' has no config.json: point at a directory written by "
            f"save_pretrained / titanlite's to_hf / huggingface-cli download"
        )
    if not sorted(path.glob("*.safetensors")):
        raise TitanliteError(
            f"'{path}' holds no *.safetensors weights: re-save it with "
            f"save_pretrained(..., safe_serialization=True)"
        )
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as err:  # a damaged or foreign config.json
        raise TitanliteError(
            f"cannot read '{path / 'config.json'}' ({str(err)[:160]}); re-download the checkpoint"
        ) from None
