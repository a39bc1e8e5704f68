"""Count the collectives a piece of code issues, and the bytes they move.

    with CommCounter() as cc:
        loss = model(x).sum(); loss.backward()
    print(cc.table())          # all_reduce: 3 calls, 1.2 MB, ...
    cc.summary()["all_reduce"] # {"calls": 3, "bytes": ..., "bus_bytes": ...}

Every torch.distributed collective — `dist.all_reduce`, DDP's all-reduce issued from its C++
reducer, FSDP2's all-gather and reduce-scatter, DTensor redistributions, functional
collectives (`torch.distributed._functional_collectives`) — ends up as one operator call in
PyTorch's dispatcher (`c10d::allreduce_`, `c10d::_allgather_base_`, `_c10d_functional::
all_reduce`, ...). A `TorchDispatchMode` sees every such call made on this thread (and in the
backward pass, which inherits the mode), so counting there catches them all without patching
DDP or FSDP. It is the mechanism of torch's own `CommDebugMode`, with byte counts added.

Bytes, per rank and per call (the nccl-tests convention):
- `bytes` is S, the size of the whole tensor the collective is about: the tensor all-reduced
  or broadcast, the *full* (gathered) output of an all-gather = n × the local shard, the *full*
  input of a reduce-scatter = n × the local output, the whole input of an all-to-all, the
  tensor sent or received. Measured from the input tensors, so FSDP's padding counts.
- `bus_bytes` is what one rank must send (and receive) over its links with the best (ring)
  algorithm, S × factor: all_reduce 2(n−1)/n (a reduce-scatter then an all-gather), all_gather,
  reduce_scatter and all_to_all (n−1)/n, broadcast, reduce, send and recv 1. Divide by the time
  and you get nccl-tests' "bus bandwidth", comparable to the link's speed whatever n is.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ..._compat.torch_tools import FakeTensor, TorchDispatchMode, process_group_named

# dispatcher op -> (the name a learner knows, the argument whose size is S, S = size × n?)
# Inputs everywhere (an all-gather's input × n, not its output) because the functional ops
# return their output instead of taking it as an argument.
_COLLECTIVES: dict[str, tuple[str, str | None, bool]] = {
    "c10d::allreduce_": ("all_reduce", "tensors", False),
    "c10d::allreduce_coalesced_": ("all_reduce", "tensors", False),
    "c10d::_allgather_base_": ("all_gather", "input_tensor", True),
    "c10d::allgather_": ("all_gather", "input_tensors", True),
    "c10d::allgather_coalesced_": ("all_gather", "input_list", True),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", "inputs", True),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "input_tensor", False),
    "c10d::reduce_scatter_": ("reduce_scatter", "input_tensors", False),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", False),
    "c10d::broadcast_": ("broadcast", "tensors", False),
    "c10d::alltoall_": ("all_to_all", "input_tensors", False),
    "c10d::alltoall_base_": ("all_to_all", "input", False),
    "c10d::reduce_": ("reduce", "tensors", False),
    "c10d::gather_": ("gather", "input_tensors", True),
    "c10d::scatter_": ("scatter", "output_tensors", True),
    "c10d::send": ("send", "tensors", False),
    "c10d::recv_": ("recv", "tensors", False),
    "c10d::recv_any_source_": ("recv", "tensors", False),
    "c10d::barrier": ("barrier", None, False),
    "_c10d_functional::all_reduce": ("all_reduce", "input", False),
    "_c10d_functional::all_reduce_": ("all_reduce", "input", False),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", "inputs", False),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", "inputs", False),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "input", True),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "input", True),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "inputs", True),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "input", False),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", "input", False),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", False),
    "_c10d_functional::all_to_all_single": ("all_to_all", "input", False),
    "_c10d_functional::broadcast": ("broadcast", "input", False),
    "_c10d_functional::broadcast_": ("broadcast", "input", False),
}


def bus_factor(op: str, n: int) -> float:
    """How many times S one rank sends with a ring algorithm (nccl-tests' busbw factor)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 0.0 if op == "barrier" else 1.0


@dataclass(frozen=True)
class Collective:
    op: str  # all_reduce, all_gather, reduce_scatter, broadcast, ...
    bytes: int  # S, see the module docstring
    group_size: int  # n, the ranks taking part
    bus_bytes: float  # S × bus_factor(op, n)


def _nbytes(value) -> int:
    """Bytes of a tensor or of the tensors in (nested) lists of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group_size(group) -> int:
    # Functional ops name their group; c10d ops carry it, boxed (a ScriptObject) when the
    # call comes from C++ (DDP's reducer) rather than from Python.
    from torch.distributed import ProcessGroup

    if isinstance(group, str):
        group = process_group_named(group)
    elif isinstance(group, torch.ScriptObject):
        group = ProcessGroup.unbox(group)
    return group.size()


class CommCounter(TorchDispatchMode):
    """Records every collective issued inside `with CommCounter() as cc:` (on this rank).

    `cc.events` lists them in order; `summary()`, `total_bytes` and `table()` add them up.
    """

    def __init__(self):
        super().__init__()
        self.events: list[Collective] = []

    def __enter__(self):
        self.events = []  # a counter can be reused: each `with` starts from zero
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A tensor subclass with its own dispatch (DTensor, Float8 tensors, ...) must first
        # turn itself into plain tensors, issuing the collectives it needs; returning
        # NotImplemented lets it, and the ops it issues then come back to this mode.
        # Fake tensors are the exception: DTensor propagates shapes with them, they issue
        # no collectives, and they have no plain form to return to.
        if any(
            t.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
            and not issubclass(t, FakeTensor)
            for t in types
        ):
            return NotImplemented
        out = func(*args, **kwargs)
        spec = _COLLECTIVES.get(func._schema.name)
        if spec is not None:
            self.events.append(self._describe(func, args, kwargs, *spec))
        return out

    @staticmethod
    def _describe(func, args, kwargs, op, tensor_arg, times_n) -> Collective:
        named = dict(kwargs)
        named.update((a.name, v) for a, v in zip(func._schema.arguments, args))
        if "group_size" in named:
            n = int(named["group_size"])
        else:
            n = _group_size(named.get("process_group", named.get("group_name")))
        size = _nbytes(named.get(tensor_arg)) * (n if times_n else 1) if tensor_arg else 0
        return Collective(op, size, n, size * bus_factor(op, n))

    def summary(self) -> dict[str, dict[str, float]]:
        """op -> {"calls", "bytes", "bus_bytes"}, in the order the ops were first seen."""
        out: dict[str, dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "bytes": 0, "bus_bytes": 0.0}
        )
        for e in self.events:
            row = out[e.op]
            row["calls"] += 1
            row["bytes"] += e.bytes
            row["bus_bytes"] += e.bus_bytes
        return dict(out)

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.events)

    @property
    def total_bus_bytes(self) -> float:
        return sum(e.bus_bytes for e in self.events)

    def table(self) -> str:
        """The summary as an aligned text table, for printing in a notebook."""
        lines = [f"{'collective':<16}{'calls':>7}{'bytes (S)':>14}{'bus bytes':>14}{'ranks':>7}"]
        for op, row in self.summary().items():
            sizes = sorted({e.group_size for e in self.events if e.op == op})
            lines.append(
                f"{op:<16}{row['calls']:>7}{_human(row['bytes']):>14}"
                f"{_human(row['bus_bytes']):>14}{','.join(map(str, sizes)):>7}"
            )
        lines.append(
            f"{'total':<16}{len(self.events):>7}{_human(self.total_bytes):>14}"
            f"{_human(self.total_bus_bytes):>14}"
        )
        return "\n".join(lines)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
