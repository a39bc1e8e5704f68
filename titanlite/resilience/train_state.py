"""Everything a run needs to continue exactly where it stopped, as one DCP state dict.

    state = TrainState(parts, optimizer, scheduler, sampler, step)   # + data position, RNG
    dcp.save(state.state_dict(), checkpoint_id=...)

Weights and optimizer moments are torch's `get_state_dict` (under FSDP or TP, DTensors that know their
place in the whole tensor), so a load reshards to any layout; names are the plain model's in all."""

import json
import random
import warnings

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

# Flattened optimizer state ("state.<param>.exp_avg"): each key is one parameter's, so no two
# pipeline stages on different ranks write the same key.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class TrainState(Stateful):
    """The trainer's whole state as DCP saves and loads it; `describe`: what was trained (checked on load)."""

    def __init__(
        self,
        parts: list[torch.nn.Module],
        optimizer,
        scheduler,
        sampler,
        step: int = 0,
        describe: dict | None = None,
    ):
        self.parts, self.optimizer, self.scheduler, self.sampler, self.step = (
            parts,
            optimizer,
            scheduler,
            sampler,
            step,
        )
        # plain JSON, as the record holds it
        self._describe = json.loads(json.dumps(describe or {}))

    @classmethod
    def of(cls, trainer) -> "TrainState":
        """A trainer's state as of now, described by what a load must match: the model's shape and
        the optimizer, and (informative) the layout, world size and global batch it was trained with."""
        return cls(
            trainer.model_parts,
            trainer.optimizer,
            trainer.scheduler,
            trainer.data.train.sampler,
            step=trainer.step,
            describe={
                "model_args": trainer.model_args.to_dict(),
                "optimizer": trainer.cfg.optimizer.name,  # its state's shape: checked on load
                "layout": trainer.dims.describe(),
                "world_size": trainer.dist.world_size,
                "global_batch": trainer.global_batch,
            },
        )

    def describe(self) -> dict:
        return self._describe

    def state_dict(self) -> dict:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FSDP2 / DTensor notes about state-dict hooks
            # One module over this rank's parts (a pipeline rank may hold several): `_strip` drops "<i>.".
            model, optim = get_state_dict(
                torch.nn.ModuleList(self.parts), self.optimizer, options=_OPTIONS
            )
        # The random generators too, so that a resumed run draws the same numbers (bit-exact).
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {
            "model": {_strip(k): v for k, v in model.items()},
            "optimizer": {_strip(k): v for k, v in optim.items()},
            "scheduler": self.scheduler.state_dict(),
            "data": self.sampler.state_dict(),
            "rng": rng,
            "step": self.step,
        }

    def load_state_dict(self, state: dict) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # This rank's own keys ("<i>.<name>" in its parts), by the plain names `state_dict`
            # gave them: `_strip` inverted. get_state_dict already drops DDP's "module." and
            # compile's "_orig_mod.".
            model, optim = get_state_dict(
                torch.nn.ModuleList(self.parts), self.optimizer, options=_OPTIONS
            )
            ours = {_strip(key): key for key in (*model, *optim)}
            set_state_dict(
                torch.nn.ModuleList(self.parts),
                self.optimizer,
                options=_OPTIONS,
                model_state_dict={ours[k]: v for k, v in state["model"].items()},
                optim_state_dict={ours[k]: v for k, v in state["optimizer"].items()},
            )
        # LambdaLR keeps its peak and last lr once per parameter group, and the groups differ with
        # the layout (optimizer.py: expert parallel gives the experts, on a mesh of their own, groups
        # of their own) but never in lr: each group of another layout takes the saved one. The
        # optimizer's own state (moments, step, each group's settings) is saved by parameter name
        # (DCP's flattened form), so it reshards as it is.
        n, schedule = len(self.optimizer.param_groups), state["scheduler"]
        self.scheduler.load_state_dict(
            {
                k: v[:1] * n if isinstance(v, list) and len(v) != n else v
                for k, v in schedule.items()
            }
        )
        self.sampler.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"]["cuda"])
        self.step = int(state["step"])


def _strip(key: str) -> str:  # "0.layers.3.w" -> "layers.3.w"; also inside optimizer keys
    head, _, rest = key.partition(".")
    return f"{head}.{_strip(rest)}" if head in ("state", "param_groups") else rest
