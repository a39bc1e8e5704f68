"""Fault tolerance per step (torchft): replica groups that lose a member and go on.

    replicas = apply_ft(trainer)     # [fault_tolerance] enable = true, TORCHFT_LIGHTHOUSE=http://host:port

Each replica group is an ordinary titanlite job (one process, or several with FSDP or TP inside);
the groups form one more data-parallel axis outside the mesh, which torchft manages. As each step
begins the groups agree on a quorum through the lighthouse (`start_quorum`); a group that joins
behind the others - a worker torchrun restarted - first copies a live peer's weights, optimizer,
schedule and data position into itself: it heals from the peer, not from a checkpoint. After the
backward the gradients are averaged over the groups in the quorum (`average_gradients`: one
all-reduce through torchft's process group), and the step is kept only if every exchange in it
succeeded (`should_commit`); otherwise its gradients are dropped and the optimizer skips it (it
still counts as a step, as in torchtitan's loop; its record says it did not commit). A group that
died is simply missing from the next quorum: the others step on without it.

Neither torchft's DistributedDataParallel nor its FSDP all-reduce hook is used. Its DDP replaces the
group's own (one process per group) and searches the graph for unused parameters every step; FSDP's
hook fires once per micro-batch under accumulation, and torchft's gloo group has no reduce-scatter
to shard over. One all-reduce of each rank's local gradients (its shard, under FSDP or TP) after
the group's own backward works for every layout inside a group, once per step, and can be read.

With `semi_sync_method` diloco or local_sgd the groups meet only every `sync_steps` (H) steps:
torchft's DiLoCo (an outer Nesterov step on the pseudo-gradient) or LocalSGD (weights averaged)."""

import os
import socket
import time
from datetime import timedelta

import torch
from torch.distributed.tensor import DTensor

from ..errors import TitanliteError
from ..watchers import Watcher
from .faults import attempt

# DiLoCo's outer optimizer: SGD with Nesterov momentum 0.9 at learning rate 0.7, the values of
# Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023,
# arXiv:2311.08105, section 3), which torchtitan's fault tolerance uses too.
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own name for the lighthouse's address
CONNECT_TIMEOUT_ENV = "TORCHFT_CONNECT_TIMEOUT_SEC"  # torchft's too; 10 s unless set
START_LIGHTHOUSE = "start one with `torchft_lighthouse --min_replicas 1` (the torchft package)"


def apply_ft(trainer) -> "ReplicaGroup":
    """`trainer` as replica group `replica_id` of [fault_tolerance]: torchft's Manager joined to the
    lighthouse at $TORCHFT_LIGHTHOUSE (one line after `TORCHFT_CONNECT_TIMEOUT_SEC` if none
    answers), and with a semi-synchronous method its DiLoCo or LocalSGD around the optimizer."""
    ft, address = trainer.cfg.fault_tolerance, os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise TitanliteError(
            f"fault_tolerance.enable needs torchft's lighthouse, and {LIGHTHOUSE_ENV} is not set: "
            f"set it to a running one's address (http://host:29510), or {START_LIGHTHOUSE}"
        )
    try:
        import torchft  # the `ft` extra: fault-tolerant runs only
    except ImportError:
        raise TitanliteError(
            "fault_tolerance.enable needs torchft (0.2 or newer), which is not installed: "
            "pip install -e '.[ft]' (make lab and make test install it)"
        ) from None
    replicas = ReplicaGroup(trainer)
    gloo = ft.process_group == "gloo" or trainer.device.type != "cuda"
    group = (torchft.ProcessGroupGloo if gloo else torchft.ProcessGroupNCCL)(
        timeout=timedelta(milliseconds=ft.process_group_timeout_ms)
    )
    store, host, port = group_store(trainer.dist.world_size)
    wait_s = float(os.environ.get(CONNECT_TIMEOUT_ENV, "10"))
    try:
        manager = torchft.Manager(
            pg=group,
            load_state_dict=replicas.load_state_dict,
            state_dict=replicas.state_dict,
            min_replica_size=ft.min_replica_size,
            # The quorum waits as each step begins: a group that heals does so before it reads
            # its batch, and the peer it copies is between steps (nothing in it is changing).
            use_async_quorum=False,
            init_sync=False,  # every group draws the same weights from the same seed
            replica_id=f"titanlite_{ft.replica_id}",
            store_addr=host,
            store_port=port,
            rank=trainer.dist.rank,
            world_size=trainer.dist.world_size,
            lighthouse_addr=address,
            timeout=timedelta(milliseconds=ft.process_group_timeout_ms),
            quorum_timeout=timedelta(seconds=trainer.cfg.parallel.timeout_s),
            connect_timeout=timedelta(seconds=wait_s),
        )
    except RuntimeError as e:  # only rank 0 of a group calls the lighthouse
        if "failed to connect" not in str(e):
            raise
        raise TitanliteError(
            f"no torchft lighthouse answered at {address} ({LIGHTHOUSE_ENV}) within {wait_s:g} s: "
            f"{START_LIGHTHOUSE}, or set {LIGHTHOUSE_ENV} to a running one's address"
        ) from None
    replicas.join(manager, store, semi_sync(ft, manager, trainer))
    return replicas


class ReplicaGroup:
    """This job's part in the fault-tolerant job: the quorum each step, the gradients averaged over
    it, the state a rejoining group copies, and what each step's record says about it."""

    def __init__(self, trainer):
        self.trainer, self.ft = trainer, trainer.cfg.fault_tolerance
        self.per_step = self.ft.semi_sync_method == "none"
        self.reduced_bytes = 0  # everything all-reduced across the groups so far (counted)
        self.record: dict = {}  # this step's facts, for its train record
        self.first_quorum = attempt() == 0  # torchrun's first attempt: a fresh start

    def join(self, manager, store, method) -> None:
        self.manager, self.store, self.method = manager, store, method
        # Every tensor torchft all-reduces across the groups passes here and is counted: this
        # module's gradients, DiLoCo's pseudo-gradients, LocalSGD's weights.
        allreduce = manager.allreduce

        def counted(tensor, *args, **kwargs):
            self.reduced_bytes += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        manager.allreduce = counted

    def start_quorum(self) -> None:
        """As a step begins: this step's quorum (a group behind the others heals in it). A fresh
        job's first one waits until every group has joined, so a run without failures starts in
        lockstep as DDP does (a group still starting up would be left out, to heal later); a
        restarted worker joins whoever is there."""
        start = time.perf_counter()
        deadline = time.monotonic() + self.trainer.cfg.parallel.timeout_s
        self.manager.start_quorum()
        while self.first_quorum and self.manager.num_participants() < self.ft.group_size:
            if time.monotonic() > deadline:
                break  # go on with the groups there are; the late ones heal when they come
            time.sleep(0.05)
            self.manager.start_quorum()
        self.first_quorum = False
        self.record.update(
            quorum=self.manager.num_participants(), quorum_s=time.perf_counter() - start
        )

    def average_gradients(self, parts) -> None:
        """Per-step fault tolerance, after the group's backward: each rank's local gradients
        averaged over the groups in the quorum, in one flat all-reduce per dtype; then the commit
        vote. A step not committed (a group died during it) keeps no gradient, and the optimizer
        skips the parameters without one (torch's optimizers all do)."""
        if not self.per_step:
            return  # DiLoCo / LocalSGD exchange weights every H steps, from the optimizer's hooks
        grads = [local(p.grad) for part in parts for p in part.parameters() if p.grad is not None]
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            self.manager.allreduce(flat).wait()  # the sum over the quorum ÷ its size
            for g, part in zip(same, flat.split([g.numel() for g in same])):
                g.copy_(part.view_as(g))
        committed = self.manager.should_commit()
        self.record["committed"] = self.record.get("committed", True) and committed  # all, since
        if not committed:
            for p in (p for part in parts for p in part.parameters()):
                p.grad = None

    def state_dict(self) -> dict:
        """What a rejoining group copies from this one: each rank's weights and optimizer state as
        plain local tensors (its own shard under FSDP or TP), the schedule, the data position and
        the step. Served while this group waits in the same quorum, so nothing in it changes."""
        t = self.trainer
        return {
            "model": [
                {k: local(v) for k, v in part.state_dict().items()} for part in t.model_parts
            ],
            "optimizer": local_optimizer_state(t.optimizer.state_dict()),
            "scheduler": t.scheduler.state_dict(),
            "data": t.data.train.sampler.state_dict(),
            "step": t.step,
        }

    def load_state_dict(self, state: dict) -> None:
        """A live peer's `state_dict()`, copied into this group bit for bit: no checkpoint is read."""
        t = self.trainer
        with torch.no_grad():
            for part, saved in zip(t.model_parts, state["model"]):
                for name, tensor in part.state_dict().items():
                    local(tensor).copy_(saved[name])
        load_optimizer_state(t.optimizer, state["optimizer"])
        t.scheduler.load_state_dict(state["scheduler"])
        t.data.train.sampler.load_state_dict(state["data"])
        self.record["healed_from_step"], t.step = state["step"], state["step"]

    def watcher(self, run) -> Watcher:
        return ReplicaWatch(self)

    def close(self) -> None:
        if self.method is not None:
            self.method.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


class ReplicaWatch(Watcher):
    """The fault-tolerant job seen from the loop: the quorum as each step begins (the one watcher
    that may change the state: a heal), and in each train record the quorum's size, whether the
    step committed, and the bytes all-reduced across the groups in it."""

    def __init__(self, replicas: ReplicaGroup):
        self.replicas, self.reduced_before = replicas, 0

    def on_step_start(self, step: int) -> None:
        # DiLoCo / LocalSGD start their own quorum every H steps; a fresh job's first one is still
        # this one, which waits for every group: else a group still starting up leaves the other to
        # sync alone, and each then in a quorum of its own (the lighthouse waits only for the last
        # quorum's members).
        if self.replicas.per_step or self.replicas.first_quorum:
            self.replicas.start_quorum()

    def on_step_end(self, end) -> None:
        """Into each train record (every step on a CPU, every log_every on a GPU): since the
        last one, whether every step committed, a heal if one happened, the bytes all-reduced."""
        r, manager = self.replicas, self.replicas.manager
        if not end.logged:
            return
        end.extra.update(
            {
                "replica_group": r.ft.replica_id,
                "quorum": manager.num_participants(),  # the last quorum's (DiLoCo: its last sync's)
                "committed_steps": manager.current_step(),  # the quorums' committed steps so far
                "reduced_bytes": r.reduced_bytes - self.reduced_before,
                "unix_time": time.time(),  # comparable across the groups' processes
                **r.record,  # this step's quorum, its wait, a heal, the commit
            }
        )
        self.reduced_before, r.record = r.reduced_bytes, {}

    def close(self) -> None:
        self.replicas.close()


def semi_sync(ft, manager, trainer):
    """DiLoCo or LocalSGD around the optimizer (their hooks run after its step, and every H-th
    time exchange across the groups); None for per-step fault tolerance."""
    if ft.semi_sync_method == "none":
        return None
    from torchft.local_sgd import DiLoCo, LocalSGD  # semi-synchronous runs only

    model = torch.nn.ModuleList(trainer.model_parts)  # one fragment: the whole of this rank's model
    if ft.semi_sync_method == "local_sgd":
        method = LocalSGD(manager, model, trainer.optimizer, sync_every=ft.sync_steps)
    else:
        outer = torch.optim.SGD(
            model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True
        )
        method = DiLoCo(manager, [model], trainer.optimizer, outer, sync_every=ft.sync_steps)
    return method.__enter__()


def group_store(world_size: int):
    """(store, host, port) of the TCPStore torchft's Manager meets its group's ranks in: the job's
    own at MASTER_ADDR:MASTER_PORT when it has several processes, else one hosted here on every
    interface (a process alone joins no process group; `store` keeps it alive). The other groups
    reach it at `host`, by this machine's name as torchft's own servers are reached."""
    if world_size > 1:
        return None, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    from torch.distributed import TCPStore

    store = TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
    return store, socket.gethostname(), store.port


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (the same storage), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_optimizer_state(state: dict) -> dict:
    """torch's optimizer state_dict with every tensor in it as this rank's local part."""
    moments = {
        i: {k: local(v) if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in state["state"].items()
    }
    return {"state": moments, "param_groups": state["param_groups"]}


def load_optimizer_state(optimizer, saved: dict) -> None:
    """A peer's `local_optimizer_state`, each local tensor made the DTensor its parameter is (the
    same mesh and placements: the groups share a layout), then torch's own load_state_dict."""
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def like(param, value):
        if isinstance(param, DTensor) and torch.is_tensor(value) and value.dim() > 0:
            return DTensor.from_local(
                value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )
        return value

    state = {i: {k: like(params[i], v) for k, v in s.items()} for i, s in saved["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
