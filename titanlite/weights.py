"""Final weights in, final weights out: safetensors beside run.json, gathered from any layout.

Full training state (optimizer, data position, RNG) is the checkpointing module's job; these
are the weights a finished run hands to `titanlite export-hf` or to transformers.
"""

import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from .distributed.ddp import unwrap
from .errors import TitanliteError, writing
from .models.llama import ModelArgs, build_model


def full_state_dict(model: torch.nn.Module, rank0_only: bool = False) -> dict:
    """The whole model's weights on CPU, by their plain names. When the weights are sharded DTensors
    (FSDP, TP) every rank must call this: the shards are gathered one tensor at a time. rank0_only:
    only global rank 0 keeps them (in CPU memory); the others get {} and never hold the model whole."""
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
        with warnings.catch_warnings():  # FSDP × TP gathers twice (one per mesh dim) and says so
            warnings.filterwarnings("ignore", message=".*sequential all_gather")
            full = get_model_state_dict(model, options=options)
        return {k: v.detach().cpu() for k, v in full.items()}
    return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}


def save_weights(
    parts: list[torch.nn.Module],
    args: ModelArgs,
    dtype: torch.dtype,
    tokenizer,
    run_dir: str | Path,
    *,
    pp: int = 1,
    is_main: bool = True,
) -> Path:
    """Final weights (model.safetensors) and tokenizer beside run.json, for `titanlite export-hf`
    and transformers. Collective when the weights are sharded or staged: every rank calls it, only
    rank 0 ever holds the whole model (in CPU memory), and writes it once every rank is done talking
    (a peer waiting in a barrier while rank 0 writes gigabytes would hit the group's timeout)."""
    from safetensors.torch import save_model  # the run's last act, in `titanlite train` only

    run_dir = Path(run_dir)
    state = {}
    for part in parts:  # a pipeline's stages live on other ranks: those cannot be rank 0's alone
        state.update(full_state_dict(part, rank0_only=pp == 1))
    if pp > 1:  # each pipeline stage holds different layers: rank 0 collects them
        pieces = [None] * dist.get_world_size() if is_main else None
        dist.gather_object(state, pieces, dst=0)
        state = {k: v for piece in pieces or [] for k, v in piece.items()}
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # the last collective: from here on rank 0 writes alone
    if is_main:
        plain = build_model(args, "cpu").to(dtype)
        plain.load_state_dict(state)
        with writing(run_dir, "the final weights into"):
            save_model(plain, str(run_dir / "model.safetensors"))  # dedupes tied weights
            tokenizer.save_pretrained(str(run_dir / "tokenizer"))
    return run_dir


def load_weights(run_dir: str | Path):
    """(model, tokenizer) saved by `save_weights`."""
    from safetensors.torch import load_model
    from transformers import PreTrainedTokenizerFast

    run_dir = Path(run_dir)
    info, weights = run_dir / "run.json", run_dir / "model.safetensors"
    for f in (info, weights):
        if not f.is_file():
            raise TitanliteError(
                f"'{f}' is missing: pass the directory of a finished "
                f"`titanlite train` run (runs/<name>)"
            )
    args = ModelArgs(**json.loads(info.read_text())["model_args"])
    model = build_model(args, "cpu")
    load_model(model, str(weights))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(run_dir / "tokenizer"))
    return model, tokenizer
