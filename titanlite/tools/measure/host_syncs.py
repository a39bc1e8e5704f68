"""Where would a GPU wait? Host syncs counted on any device, CPU included.

On CUDA the host queues kernels and runs ahead; anything that needs a number back (`.item()`,
`float(t)`, `.tolist()`, `.cpu()`) or builds a device tensor from a Python value waits for the
queue to drain. A training step should do that only when it logs. On a CPU nothing waits, but the
same calls happen, so they can be counted here and the count holds for a GPU:

    with HostSyncs() as syncs:
        trainer.train_step(batches, read=False)
    syncs.sites    # ["titanlite/x.py:12 item", "titanlite/y.py:40 scalar read (in torch)", ...]

`aten._local_scalar_dense` is what every tensor-to-Python-number conversion dispatches to (a
dispatch mode sees it); a function mode also catches `torch.tensor(..., device=)`, `.tolist()`,
`.cpu()` and `.numpy()`. Every such read made while titanlite's code is on the stack counts,
whether titanlite makes it or torch does for it (GradScaler.get_scale() reads the scale with
.item()), in every titanlite package; the site is titanlite's innermost frame. The only reads not
counted are the ones that stay on the host on a GPU too, named one by one in HOST_BY_DESIGN (the
sampler's window indices). Count with the optimizer as CUDA builds it (fused AdamW: a non-fused
AdamW reads its step counters, which live on the host, and `train_and_count` does so).
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from ..._compat.torch_tools import TorchDispatchMode
from ...watchers import Run, StepEnd, Watcher

PACKAGE = Path(__file__).resolve().parents[2]  # titanlite/
_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
}
# (file under titanlite/, function, read): reads of tensors that live on the host on every
# device, by design. The sampler draws window indices on the CPU and hands Python ints to the
# batcher; data/transfer.py counts the target tokens on the batches' host copies, then copies
# them to the device (non-blocking on CUDA).
HOST_BY_DESIGN = {
    ("data/sampler.py", "next_indices", "tolist"),
    ("data/sampler.py", "eval_batches", "tolist"),
    ("data/transfer.py", "host_target_count", "scalar read"),
}

_MACHINERY = (
    "overrides.py",
    "_python_dispatch.py",
    "_ops.py",
    "_tensor.py",
    "_compile.py",
    "eval_frame.py",
)  # the modes' frames


def _site(what: str) -> str | None:
    """file:line of titanlite's innermost frame on the stack (' (in torch)' when torch made the
    read for it), or None when no titanlite code is on the stack or the read is host by design."""
    inside_torch = False
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path.name in _MACHINERY or (
            path.name == "host_syncs.py" and frame.name != "_every_kind_of_sync"
        ):
            continue
        if PACKAGE not in path.parents:
            inside_torch = True  # torch (or another library) made the read on titanlite's behalf
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        if not inside_torch and (rel, frame.name, what) in HOST_BY_DESIGN:
            return None
        return f"{path.relative_to(PACKAGE.parent)}:{frame.lineno} {what}" + (
            " (in torch)" if inside_torch else ""
        )
    return None


class _Calls(TorchFunctionMode):
    def __init__(self, sites: list):
        super().__init__()
        self.sites = sites

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            site = _site(_READS[func])
        elif func is torch.tensor and kwargs.get("device") is not None:
            site = _site("torch.tensor(..., device=)")
        else:
            site = None
        if site:
            self.sites.append(site)
        return func(*args, **kwargs)


class _Scalars(TorchDispatchMode):
    def __init__(self, sites: list):
        super().__init__()
        self.sites = sites

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and (site := _site("scalar read")):
            self.sites.append(site)
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """Counts would-be host syncs while active (see the module docstring)."""

    def __init__(self):
        self.sites: list[str] = []
        self._modes = (_Calls(self.sites), _Scalars(self.sites))

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class StepSyncs(Watcher):
    """A watcher that counts each step's would-be syncs, from the step's start to the next one's
    (so every other watcher's end-of-step work is in it): `per_step[step] = (logged, sites)`."""

    def __init__(self, run: Run):
        self.per_step: dict[int, tuple[bool, list[str]]] = {}
        self._open, self._step, self._logged = None, None, False

    def _close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self.per_step[self._step] = (self._logged, self._open.sites)
            self._open = None

    def on_step_start(self, step: int) -> None:
        self._close()
        self._open, self._step = HostSyncs().__enter__(), step

    def on_step_end(self, end: StepEnd) -> None:
        self._logged = end.logged

    def on_train_end(self) -> None:
        self._close()

    def close(self) -> None:
        self._close()


class CudaSyncDebug(Watcher):
    """On a GPU, torch's own detector: `torch.cuda.set_sync_debug_mode("error")` for each unlogged
    step, so any host sync there raises with the call that made it; off for logged steps, which
    read the loss on purpose. `checked`: how many steps ran under it."""

    def __init__(self, run: Run):
        self.log_every, self.steps, self.checked = (
            run.cfg.metrics.log_every,
            run.cfg.training.steps,
            0,
        )

    def on_step_start(self, step: int) -> None:
        if step % self.log_every and step != self.steps:
            torch.cuda.set_sync_debug_mode("error")
            self.checked += 1

    def on_step_end(self, end: StepEnd) -> None:
        torch.cuda.set_sync_debug_mode(0)

    def close(self) -> None:
        torch.cuda.set_sync_debug_mode(0)


def train_and_count(overrides: dict, as_on_cuda: bool = True) -> dict[int, tuple[bool, list[str]]]:
    """Train with `overrides` (in each rank of a `launch_function` job, or alone) with the tools
    `titanlite train` hands in, counting every step's would-be host syncs. `as_on_cuda`: the
    optimizer as CUDA builds it (fused AdamW, which keeps its step counters on the device)."""
    from ... import optimizer, train
    from ...config import load_config
    from .goodput import Goodput
    from .stragglers import Stragglers

    counter, policy = [], optimizer.use_fused_adamw
    if as_on_cuda:
        optimizer.use_fused_adamw = lambda device_type: True
    try:
        trainer = train.Trainer(load_config(None, overrides))
    finally:
        optimizer.use_fused_adamw = policy
    extra = [Goodput] + ([Stragglers] if trainer.dist.distributed else [])
    # First in the chain: its window opens before every other watcher's step work, closes after.
    trainer.fit(watchers=[lambda run: counter.append(StepSyncs(run)) or counter[-1], *extra])
    trainer.close(barrier=True)
    return counter[0].per_step


def _every_kind_of_sync(t: torch.Tensor) -> None:
    """Each way of waiting for the device once (the counter's own test calls it from here)."""
    t.sum().item(), float(t[0]), t.tolist(), t.cpu(), torch.tensor(1.0, device=t.device)
