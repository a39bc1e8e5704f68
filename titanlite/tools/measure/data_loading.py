"""Feeding the model from the host: DataLoader worker processes and pinned memory, measured.

    rate = loader_rate(dataset, num_workers=2, batch_size=8)      # batches/s, first batch apart
    gbps = host_to_device_gbps(torch.device("cuda"), pinned=True)  # None without an accelerator

Workers help when building a batch costs CPU time (decoding, tokenizing, augmenting) that can
overlap the training step; pinned (page-locked) host memory only matters for copies to a CUDA
GPU, which can then run asynchronously by DMA.
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, Dataset

from ...errors import TitanliteError


class TokenizingDataset(Dataset):
    """Raw text chunks tokenized on demand, the work a loader worker would do: item i is the
    first `seq_len` token ids of chunk i, padded with 0."""

    def __init__(self, texts: list[str], tokenizer, seq_len: int):
        if not texts:
            raise TitanliteError("TokenizingDataset needs at least one text")
        self.texts, self.tokenizer, self.seq_len = texts, tokenizer, seq_len

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> torch.Tensor:
        ids = self.tokenizer.encode(self.texts[i])[: self.seq_len]
        return torch.tensor(ids + [0] * (self.seq_len - len(ids)), dtype=torch.long)


def loader_rate(dataset, num_workers: int, batch_size: int, pin_memory: bool = False) -> dict:
    """Read one epoch; time to the first batch (worker start-up) apart from the steady rate."""
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=False,
    )
    start = time.perf_counter()
    batches = iter(loader)
    first = next(batches)
    first_s = time.perf_counter() - start
    rest_start, count, checksum = time.perf_counter(), 0, int(first.sum())
    for batch in batches:
        count += 1
        checksum += int(batch.sum())
    rest_s = time.perf_counter() - rest_start
    return {
        "num_workers": num_workers,
        "first_batch_s": first_s,
        "batches_per_s": count / rest_s if count else float("nan"),
        "checksum": checksum,
        "pinned": bool(first.is_pinned()) if pin_memory else False,
    }


def host_to_device_gbps(
    device: torch.device, pinned: bool, nbytes: int = 64 * 2**20, repeats: int = 5
) -> float | None:
    """Median host → `device` copy rate in GB/s from pinned or pageable memory; None on a CPU
    (nothing to copy to) or where pinning is not available."""
    device = torch.device(device)
    if device.type == "cpu" or (pinned and not torch.cuda.is_available()):
        return None
    from ...hardware import synchronize

    host = torch.empty(nbytes // 4, dtype=torch.float32)
    if pinned:
        host = host.pin_memory()
    dst = torch.empty_like(host, device=device)
    dst.copy_(host)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(host, non_blocking=pinned)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return nbytes / sorted(times)[len(times) // 2] / 1e9
