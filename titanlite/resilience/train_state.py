"""Everything a run needs to continue exactly where it stopped, as one DCP state dict.

    state = TrainState(trainer)   # model, optimizer, LR schedule, data position, RNG, step
    dcp.save(state.state_dict(), checkpoint_id=...)

Weights and optimizer moments come from torch's `get_state_dict`, so a FSDP or TP shard is a
DTensor that knows its place in the whole tensor: DCP writes each rank's pieces plus metadata
saying where they belong, and on load every rank reads exactly the pieces *its* layout needs.
That is load-time resharding: save on 4 ranks with FSDP, load on 1, or on 2 with TP, for free.
Names are the plain model's ("layers.0.attention.wq.weight") in every layout: DDP's `module.`,
compile's `_orig_mod.` and pipeline stages disappear.
"""
from __future__ import annotations

import random
import warnings

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

# Flattened optimizer state ("state.<param>.exp_avg", "param_groups.<param>.lr"): every key
# belongs to one parameter, so pipeline stages on different ranks never write the same key.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _parts_module(parts: list[torch.nn.Module]) -> torch.nn.Module:
    """One module over this rank's model parts. A pipeline rank may hold several stages; in a
    ModuleList their names gain an "<i>." prefix that `_strip`/`_prefix` remove and restore."""
    return torch.nn.ModuleList(parts)


def _strip(key: str) -> str:  # "0.layers.3.w" -> "layers.3.w"; also inside optimizer keys
    head, _, rest = key.partition(".")
    if head in ("state", "param_groups"):
        return f"{head}.{_strip(rest)}"
    return rest


def _owner_map(parts) -> dict[str, str]:
    """Plain parameter/buffer name -> the ModuleList name that holds it on this rank."""
    names = {}
    for i, part in enumerate(parts):
        for key in part.state_dict():  # without DDP's "module." and compile's "_orig_mod."
            plain = key.removeprefix("module.").replace("_orig_mod.", "")
            names[plain] = f"{i}.{plain}"
    return names


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class TrainState(Stateful):
    """The trainer's whole state, in the shape DCP saves and loads (a `Stateful`: DCP calls
    `state_dict()` for what to write or fill, then `load_state_dict()` with what it read)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.parts = trainer.model_parts

    def describe(self) -> dict:
        """What was trained, kept in the commit record and checked before a load."""
        import json
        t = self.trainer
        return json.loads(json.dumps({
            "model_args": t.model_args.to_dict(), "layout": t.dims.describe(),
            "world_size": t.dist.world_size, "global_batch": t.global_batch}))

    def state_dict(self) -> dict:
        t = self.trainer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FSDP2 / DTensor notes about state-dict hooks
            model, optim = get_state_dict(_parts_module(self.parts), t.optimizer, options=_OPTIONS)
        return {"model": {_strip(k): v for k, v in model.items()},
                "optimizer": {_strip(k): v for k, v in optim.items()},
                "scheduler": t.scheduler.state_dict(),
                "data": t.data.train.sampler.state_dict(),
                "rng": rng_state(),
                "step": t.step}

    def load_state_dict(self, state: dict) -> None:
        t = self.trainer
        owner = _owner_map(self.parts)

        def prefix(key: str) -> str:
            head, _, rest = key.partition(".")
            if head in ("state", "param_groups"):
                name, _, field = rest.rpartition(".")
                return f"{head}.{owner[name]}.{field}"
            return owner[key]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            set_state_dict(_parts_module(self.parts), t.optimizer,
                           model_state_dict={prefix(k): v for k, v in state["model"].items()},
                           optim_state_dict={prefix(k): v for k, v in state["optimizer"].items()},
                           options=_OPTIONS)
        t.scheduler.load_state_dict(state["scheduler"])
        t.data.train.sampler.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        t.step = int(state["step"])
