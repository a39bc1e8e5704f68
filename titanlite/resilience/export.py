"""From a distributed checkpoint to files anyone can load: one torch file, or Hugging Face.

A DCP checkpoint is many files (one per rank) plus an index; `dcp.load` in one process reads
the pieces back into whole tensors, whatever layout wrote them. That is all an export is:

    model = load_model(ckpt)                   # a plain Transformer on CPU
    export_torch(ckpt, "model.pt")             # its weights, one torch.save file
    export_torch(ckpt, "state.pt", full=True)  # the whole training state (torch's dcp_to_torch_save)
    export_hf(ckpt, "hf-model/")               # LlamaForCausalLM + tokenizer, for transformers
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..models.llama import ModelArgs, Transformer, build_model
from ..paths import check_new_output, check_output_dir
from .checkpoint import dcp_load, verify

TOKENIZER_DIR = "tokenizer"  # the trainer keeps a copy beside its checkpoints


def load_model(path: str | Path, crc: bool = True) -> Transformer:
    """The model of a committed checkpoint, whole, in this process (no process group)."""
    info = verify(path, crc=crc)
    model = build_model(ModelArgs(**info["model_args"]), "cpu")
    state = {"model": model.state_dict()}
    dcp_load(state, Path(path), crc_checked=crc, no_dist=True)  # quiet; one line if it fails
    model.load_state_dict(state["model"])
    return model


def export_torch(path: str | Path, out_file: str | Path, full: bool = False) -> Path:
    out_file = check_new_output(out_file, "export target")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    if full:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        verify(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(Path(path), out_file)
    else:
        torch.save(load_model(path).state_dict(), out_file)
    return out_file


def export_hf(path: str | Path, out_dir: str | Path, tokenizer=None) -> Path:
    """A Hugging Face directory (config, safetensors, tokenizer when one is known)."""
    from ..models.hf_interop import to_hf
    check_output_dir(out_dir, "export folder")  # before the (long) load, not after
    if tokenizer is None and (Path(path).parent / TOKENIZER_DIR).is_dir():
        from transformers import PreTrainedTokenizerFast
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(Path(path).parent / TOKENIZER_DIR))
    return to_hf(load_model(path), out_dir, tokenizer=tokenizer)
