"""Deterministic, rank-aware, resumable batches of token windows.

The token stream is cut into non-overlapping windows of seq_len+1 tokens (inputs are the
first seq_len, targets the last seq_len: the same window shifted by one). Which windows
go into which batch is decided by `StatefulBatchSampler`:

- epoch e visits every window once, in the order `torch.randperm` gives with a generator
  seeded from (seed, e), so the order depends on nothing but the seed;
- each global micro-step takes the next batch_size * world_size windows of that order,
  and rank r keeps its own contiguous slice [r*batch_size, (r+1)*batch_size), so ranks
  never share a window within a step;
- when fewer windows are left than a step needs, the epoch ends (those few windows sit
  this epoch out; the next shuffle puts different ones last) and the next begins, forever.

The whole position is (epoch, position), identical on every rank, so a checkpoint from
any rank resumes every rank exactly where it left off.
"""
from __future__ import annotations

import hashlib

import torch

from ..errors import TitanliteError

STATE_VERSION = 1
EVAL_ORDER_SEED = 1234  # val batches must not depend on the training seed, to compare runs


def _positive_int(label: str, value, example: int = 8) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TitanliteError(f"{label} must be a positive integer, got {value!r}; "
                             f"pass e.g. {label}={example}")
    return value


def check_rank(rank, world_size) -> None:
    _positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise TitanliteError(f"rank must be an integer in [0, world_size={world_size}), got "
                             f"{rank!r}; ranks are numbered 0..{world_size - 1}")


def _seeded_permutation(num: int, seed: int, epoch: int, purpose: str = "train") -> torch.Tensor:
    # Hash (seed, epoch) into one 63-bit seed: neighbouring seeds/epochs give unrelated orders.
    key = hashlib.sha256(f"titanlite:{purpose}:{seed}:{epoch}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
    return torch.randperm(num, generator=gen)


class StatefulBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's window indices for one micro-step at a time, forever."""

    def __init__(self, num_windows: int, batch_size: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0):
        self.num_windows = _positive_int("num_windows", num_windows)
        self.batch_size = _positive_int("batch_size", batch_size)
        check_rank(rank, world_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TitanliteError(f"seed must be an integer, got {seed!r}; pass e.g. seed=0")
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch, self.position, self.steps = 0, 0, 0
        self._orders: dict[int, torch.Tensor] = {}  # epoch -> window order

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def order(self, epoch: int) -> torch.Tensor:
        """The window order of one epoch (computed once, kept while that epoch lasts)."""
        if epoch not in self._orders:
            self._orders.clear()
            self._orders[epoch] = _seeded_permutation(self.num_windows, self.seed, epoch)
        return self._orders[epoch]

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.num_windows // self.global_batch)

    def next_indices(self) -> list[int]:
        """Advance one global micro-step; return this rank's batch_size window indices."""
        order = self.order(self.epoch)
        if self.num_windows >= self.global_batch:
            step = order[self.position:self.position + self.global_batch]
        else:  # a corpus smaller than one step: every window, repeated to fill it
            step = order.repeat(-(-self.global_batch // self.num_windows))[:self.global_batch]
        self.position += self.global_batch
        if self.position + self.global_batch > self.num_windows:  # no full step left
            self.epoch, self.position = self.epoch + 1, 0
        self.steps += 1
        return step[self.rank * self.batch_size:(self.rank + 1) * self.batch_size].tolist()

    def __iter__(self):
        while True:
            yield self.next_indices()

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "seed": self.seed, "epoch": self.epoch,
                "position": self.position, "steps": self.steps,
                "num_windows": self.num_windows, "batch_size": self.batch_size,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()` of any rank. The order depends only on seed,
        num_windows and the global batch, so those must match; world_size may change if
        batch_size * world_size stays the same (e.g. 2 ranks x 4 -> 1 rank x 8)."""
        keys = ("seed", "epoch", "position", "steps", "num_windows", "batch_size", "world_size")
        if not isinstance(state, dict) or any(k not in state for k in keys):
            raise TitanliteError("not a batch-sampler state (missing "
                                 f"{[k for k in keys if k not in (state or {})]}); pass "
                                 "what StatefulBatchSampler.state_dict() returned")
        if state["seed"] != self.seed:
            raise TitanliteError(f"the checkpoint's data order used seed={state['seed']} but "
                                 f"this run has seed={self.seed}; rerun with seed={state['seed']}")
        if state["num_windows"] != self.num_windows:
            raise TitanliteError(
                f"the checkpoint's data had {state['num_windows']} windows, this run has "
                f"{self.num_windows}: the corpus, tokenizer, seq_len or val_fraction changed; "
                "resume with the settings the checkpoint was trained with")
        saved_global = state["batch_size"] * state["world_size"]
        if saved_global != self.global_batch:
            raise TitanliteError(
                f"the checkpoint used batch_size*world_size = {state['batch_size']}*"
                f"{state['world_size']} = {saved_global}, this run {self.batch_size}*"
                f"{self.world_size} = {self.global_batch}; keep the global batch the same "
                "to resume exactly")
        position = state["position"]
        if position % self.global_batch or position >= self.steps_per_epoch * \
                self.global_batch or state["epoch"] < 0:
            raise TitanliteError(f"corrupt sampler state (epoch={state['epoch']}, position="
                                 f"{state['position']}); load an intact checkpoint")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.steps = int(state["steps"])


class TokenBatches:
    """(x, y) batches of one split: random windows for training, fixed ones for evaluation."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, *,
                 rank: int = 0, world_size: int = 1, seed: int = 0):
        self.seq_len = _positive_int("seq_len", seq_len, 128)
        self.batch_size = _positive_int("batch_size", batch_size)
        num_windows = len(tokens) // (seq_len + 1)
        if num_windows == 0:
            raise TitanliteError(f"{len(tokens)} tokens do not fill one window of seq_len+1 = "
                                 f"{seq_len + 1}; use seq_len <= {max(len(tokens) - 1, 1)}")
        # int32 halves the memory of int64; batches are widened to int64 (what nn.Embedding
        # and cross_entropy want) only when handed out.
        flat = torch.as_tensor(tokens).to(torch.int32)
        self.windows = flat[: num_windows * (seq_len + 1)].view(num_windows, seq_len + 1)
        self.sampler = StatefulBatchSampler(num_windows, batch_size, rank=rank,
                                            world_size=world_size, seed=seed)

    @property
    def num_windows(self) -> int:
        return self.windows.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.windows.numel()

    def batch_of(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.windows[torch.as_tensor(indices, dtype=torch.long)].long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next training batch: x and y are int64 [batch_size, seq_len], y = x shifted."""
        return self.batch_of(self.sampler.next_indices())

    def __iter__(self):
        while True:
            yield self.next_batch()

    def eval_batches(self, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same `num_batches` batches on every call (and for every training seed), so
        successive val losses are comparable. They walk one fixed shuffled order of the
        windows (repeating it if asked for more), sliced per rank like training batches,
        and leave the training position untouched."""
        _positive_int("num_batches", num_batches)
        order = _seeded_permutation(self.num_windows, EVAL_ORDER_SEED, 0, purpose="eval")
        s = self.sampler
        out = []
        for step in range(num_batches):
            first = step * s.global_batch + s.rank * s.batch_size
            picks = torch.arange(first, first + s.batch_size) % self.num_windows
            out.append(self.batch_of(order[picks].tolist()))
        return out

    def state_dict(self) -> dict:
        return {"seq_len": self.seq_len, **self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if isinstance(state, dict) and state.get("seq_len", self.seq_len) != self.seq_len:
            raise TitanliteError(f"the checkpoint used seq_len={state['seq_len']}, this run "
                                 f"seq_len={self.seq_len}; resume with seq_len={state['seq_len']}")
        self.sampler.load_state_dict(state)
