"""Final weights in, final weights out: safetensors beside run.json, gathered from any layout.

Full training state (optimizer, data position, RNG) is the checkpointing module's job; these
are the weights a finished run hands to `titanlite export-hf` or to transformers.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .distributed.ddp import unwrap
from .errors import TitanliteError
from .models.llama import ModelArgs, build_model


def full_state_dict(model: torch.nn.Module) -> dict:
    """The whole model's weights on CPU, by their plain names. When the weights are sharded
    DTensors (FSDP, TP) every rank must call this (the shards are gathered)."""
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        # (Not cpu_offload=True: that leaves every rank but global rank 0 empty-handed, and a
        # pipeline stage on another rank would lose its layers.)
        import warnings
        with warnings.catch_warnings():  # FSDP × TP gathers twice (one per mesh dim) and says so
            warnings.filterwarnings("ignore", message=".*sequential all_gather")
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu() for k, v in full.items()}
    return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}


def save_weights(trainer, run_dir: str | Path) -> Path:
    from safetensors.torch import save_model
    run_dir = Path(run_dir)
    state = {}
    for part in trainer.model_parts:
        state.update(full_state_dict(part))
    if trainer.dims.pp > 1:  # each pipeline stage holds different layers: collect them all
        import torch.distributed as dist
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, state)
        state = {k: v for piece in pieces for k, v in piece.items()}
    if trainer.dist.is_main:
        plain = build_model(trainer.model_args, "cpu").to(trainer.dtype)
        plain.load_state_dict(state)
        save_model(plain, str(run_dir / "model.safetensors"))  # dedupes tied weights
        trainer.tokenizer.save_pretrained(str(run_dir / "tokenizer"))
    return run_dir


def load_weights(run_dir: str | Path):
    """(model, tokenizer) saved by `Trainer.save_weights`."""
    from safetensors.torch import load_model
    from transformers import PreTrainedTokenizerFast

    run_dir = Path(run_dir)
    info, weights = run_dir / "run.json", run_dir / "model.safetensors"
    for f in (info, weights):
        if not f.is_file():
            raise TitanliteError(f"'{f}' is missing: pass the directory of a finished "
                                 f"`titanlite train` run (runs/<name>)")
    args = ModelArgs(**json.loads(info.read_text())["model_args"])
    model = build_model(args, "cpu")
    load_model(model, str(weights))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(run_dir / "tokenizer"))
    return model, tokenizer
