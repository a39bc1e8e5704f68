"""Continue pretraining a published Llama: `--checkpoint.initial_load_path <hf dir>`.

    titanlite train --checkpoint.initial_load_path ~/models/SmolLM-135M ...

Three things change when a run starts from a Hugging Face directory instead of random weights:
- the model's shape is the checkpoint's (`checkpoint_model_args`): its config.json is translated
  to ModelArgs (GQA, RoPE theta and Llama 3 scaling, tied embeddings, vocabulary), and a
  `[model]` setting that disagrees is refused, naming the field;
- the corpus is encoded with the checkpoint's own tokenizer (the trainer passes the directory
  as the data pipeline's tokenizer unless `data.tokenizer` names another);
- the weights are read into whatever layout this run has (`load_initial_weights`).

The load is DCP's resharding load with torch's `HuggingFaceStorageReader`: every rank asks for
the tensors of *its* model parts (a pipeline stage asks only for its layers) with *its*
placements (an FSDP or TP shard is a DTensor that knows its slice of the whole), and the reader
cuts exactly those slices out of the safetensors files (`safe_open(...).get_slice`). No rank
ever holds a whole copy of the checkpoint. Names are translated both ways by hf_interop.

Optimizer, schedule and data start fresh at step 0. A titanlite checkpoint this run finds on
resume (or is given with `checkpoint.load`) takes precedence, as in torchtitan: after a restart
the run continues from its own checkpoint, not from the published weights again.
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch

from ..errors import TitanliteError
from ..models.hf_interop import from_hf_config, hf_name, read_hf_config
from ..models.llama import ModelArgs

# [model] settings the checkpoint decides; an explicit value must agree with it.
_SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "tie_embeddings")


def tokenizer_for(cfg) -> str | None:
    """The tokenizer the data pipeline encodes the corpus with: `data.tokenizer` if set, else
    the checkpoint's own (its directory is checked first, so a wrong path is named as such)."""
    if cfg.data.tokenizer or not cfg.checkpoint.initial_load_path:
        return cfg.data.tokenizer
    read_hf_config(cfg.checkpoint.initial_load_path)
    return cfg.checkpoint.initial_load_path


def checkpoint_model_args(cfg) -> ModelArgs:
    """ModelArgs of the checkpoint at `cfg.checkpoint.initial_load_path`, checked against the
    run's explicit `[model]` settings. `model.max_seq_len` may shorten the RoPE tables (it is
    no weight), but not exceed what the checkpoint was trained for."""
    path = cfg.checkpoint.initial_load_path
    args = from_hf_config(read_hf_config(path))
    for name in _SHAPE_FIELDS:
        mine = getattr(cfg.model, name)
        if mine is not None and mine != getattr(args, name):
            raise TitanliteError(
                f"model.{name}={mine} but the checkpoint at {path} has {name}="
                f"{getattr(args, name)}: drop --model.{name} (the checkpoint sets the model's "
                f"shape) or point checkpoint.initial_load_path at a matching checkpoint")
    if cfg.model.max_seq_len is not None:
        if cfg.model.max_seq_len > args.max_seq_len:
            raise TitanliteError(
                f"model.max_seq_len={cfg.model.max_seq_len} exceeds the checkpoint's "
                f"max_position_embeddings ({args.max_seq_len}): lower --model.max_seq_len")
        args.max_seq_len = cfg.model.max_seq_len
    return args.validate()


def load_initial_weights(parts: list[torch.nn.Module], path: str | Path,
                         tie_embeddings: bool = False) -> float:
    """Fill this rank's model parts (one, or one per pipeline stage) from the safetensors files
    in `path`, each rank reading only its own slices. Collective: every rank calls it. Returns
    the seconds it took."""
    from torch.distributed.checkpoint import CheckpointException, load
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    try:  # public in every torch titanlite supports (2.11+); torchtitan imports it alike
        from torch.distributed.checkpoint import HuggingFaceStorageReader
    except ImportError:
        raise TitanliteError(f"checkpoint.initial_load_path needs DCP's HuggingFaceStorageReader, "
                             f"missing from torch {torch.__version__}: upgrade torch to >= 2.11") from None

    start = time.perf_counter()
    path = Path(path).expanduser()
    read_hf_config(path)  # the same one-line refusals as at start-up, should it have changed
    # Plain names in every layout (no DDP "module.", compile "_orig_mod.", AC wrappers); FSDP
    # and TP entries are DTensors, so DCP knows which slice each rank's tensor is.
    states = [get_model_state_dict(part) for part in parts]
    wanted = {}
    for state in states:
        for name in state:
            if name == "output.weight" and tie_embeddings:
                continue  # one tensor, stored once (as the embedding) in a tied checkpoint
            wanted[hf_name(name)] = state[name]
    try:
        # Reads into the tensors of `wanted` in place (casting to their dtype), each rank only
        # the chunks its shards cover.
        with warnings.catch_warnings():  # DCP says it assumes one process when it is one
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            load(wanted, storage_reader=HuggingFaceStorageReader(str(path)))
    except (Exception, CheckpointException) as err:  # DCP's exception is a BaseException
        raise TitanliteError(f"cannot load the weights in {path}: {_first_line(err)}; is the "
                             f"download complete and the checkpoint a plain Llama?") from None
    for part, state in zip(parts, states):
        # A no-op where the state dict's tensors are the parameters themselves; a copy where a
        # wrapper handed out copies.
        set_model_state_dict(part, state, options=StateDictOptions(strict=False))
    return time.perf_counter() - start


def _first_line(err: BaseException) -> str:
    """The cause, not the traceback: DCP gathers each rank's exception (wrapped, with its
    traceback) into one CheckpointException."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))
        err = getattr(err, "exception", err)
    return " ".join(str(err).split())[:240]
