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


def full_state_dict(model: torch.nn.Module, sharded: bool) -> dict:
    """The whole model's weights on CPU, by their plain names. Under FSDP (`sharded`) every
    rank must call this (the shards are gathered); rank 0 gets the tensors."""
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}


def save_weights(trainer, run_dir: str | Path) -> Path:
    from safetensors.torch import save_model
    run_dir = Path(run_dir)
    state = full_state_dict(trainer.model, sharded=trainer.dims.strategy in ("fsdp", "hsdp"))
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
