"""Staging: the copy of the state an async save makes before training may change the weights. The
copy runs in the background too: the trainer waits for it only before its next optimizer step."""

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


def tensor_device_types(state) -> set[str]:
    """The device types ("cuda", "cpu", ...) of every tensor in a (nested) state dict."""
    if isinstance(state, torch.Tensor):  # for a DTensor, its local shard's
        return {(state.to_local() if hasattr(state, "to_local") else state).device.type}
    if isinstance(state, dict):
        state = list(state.values())
    return (
        set().union(*map(tensor_device_types, state)) if isinstance(state, (list, tuple)) else set()
    )


def staging_options(tensor_device_types) -> dict[str, bool]:
    """Pinned memory and a side stream (the copy overlaps training's kernels) for CUDA tensors only: a
    CPU rank on a GPU host would make a CUDA context (hundreds of MiB on GPU 0 per rank) for nothing."""
    return dict.fromkeys(
        ("use_pinned_memory", "use_non_blocking_copy", "use_staging_stream"),
        "cuda" in tensor_device_types,
    )


def make_stager(options: dict[str, bool], shared_memory: bool = False) -> DefaultStager:
    """DCP's stager for these options; the caller closes it when the write is done."""
    return (DefaultStager if options["use_staging_stream"] else HostStager)(
        StagingOptions(
            use_pinned_memory=options["use_pinned_memory"],
            use_shared_memory=shared_memory,
            use_async_staging=True,
            use_non_blocking_copy=options["use_non_blocking_copy"],
        )
    )


class HostStager(DefaultStager):
    """DefaultStager's copy in a background thread, without the accelerator stream torch's own
    async mode makes whenever the machine has an accelerator, whatever device the tensors are on."""

    def __init__(self, options: StagingOptions):
        super().__init__(dataclasses.replace(options, use_async_staging=False))
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="titanlite-staging")

    # Returns a future (so DCP never calls synchronize_staging: it waits on the future instead).
    def stage(self, state_dict, **kwargs):
        return self._copier.submit(super().stage, state_dict, **kwargs)

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        super().close()


class WriteAfter:
    """`stager`'s copy, handed to DCP's writer only once the previous save's write is done: DCP
    starts each write on a new thread, so two saves' writes would otherwise interleave their
    collectives on the one background group."""

    def __init__(self, stager, previous_write: Future | None):
        self.stager, self.previous, self.copy = stager, previous_write, None

    def stage(self, state_dict) -> Future:
        """What DCP calls: the copy starts now; the future it gets completes after both."""
        self.copy = self.stager.stage(state_dict)
        released = Future()

        def release(_):  # the copy and the previous write are done: DCP may write the copy
            if error := self.copy.exception():
                released.set_exception(error)
            else:
                released.set_result(self.copy.result())

        def after_copy(_):  # the copy is done: wait for the previous write, if any
            (self.previous or self.copy).add_done_callback(release)

        self.copy.add_done_callback(after_copy)
        return released
