"""Deterministic, rank-aware, resumable batches of token windows.

Windows of seq_len+1 tokens are visited once per epoch e, in a `torch.randperm` order seeded from (seed, e)
alone; each global micro-step takes the next batch_size * world_size windows (rank r: the r-th slice), and
a step that no longer fits starts the next epoch. Any rank's (epoch, position) resumes every rank exactly."""

import hashlib

import torch

from ..errors import TitanliteError

STATE_VERSION = 1  # bumped if the saved state's meaning ever changes
EVAL_ORDER_SEED = 1234  # val batches must not depend on the training seed, to compare runs


def _positive_int(label: str, value, example: int = 8) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TitanliteError(
            f"{label} must be a positive integer, got {value!r}; pass e.g. {label}={example}"
        )
    return value


def check_rank(rank, world_size) -> None:
    _positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise TitanliteError(
            f"rank must be an integer in [0, world_size={world_size}), got "
            f"{rank!r}; ranks are numbered 0..{world_size - 1}"
        )


def _seeded_permutation(num: int, seed: int, epoch: int, purpose: str = "train") -> torch.Tensor:
    # Hash (seed, epoch) into one 63-bit seed: neighbouring seeds/epochs give unrelated orders.
    key = hashlib.sha256(f"titanlite:{purpose}:{seed}:{epoch}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
    return torch.randperm(num, generator=gen)


class StatefulBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's window indices for one micro-step at a time, forever."""

    _STATE_KEYS = ("seed", "epoch", "position", "steps", "num_windows", "batch_size", "world_size")

    def __init__(
        self,
        num_windows: int,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ):
        self.num_windows = _positive_int("num_windows", num_windows)
        self.batch_size = _positive_int("batch_size", batch_size)
        check_rank(rank, world_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TitanliteError(f"seed must be an integer, got {seed!r}; pass e.g. seed=0")
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.global_batch = batch_size * world_size  # windows per global micro-step, all ranks
        self.epoch, self.position, self.steps = 0, 0, 0
        self._orders: dict[int, torch.Tensor] = {}  # epoch -> window order

    def order(self, epoch: int) -> torch.Tensor:
        """The window order of one epoch (computed once, kept while that epoch lasts). A corpus
        smaller than one step repeats its order to fill the step: every window, in each."""
        if epoch not in self._orders:
            order = _seeded_permutation(self.num_windows, self.seed, epoch)
            # ceil(global_batch / num_windows) copies: 1 unless the corpus is that small
            self._orders = {epoch: order.repeat(-(-self.global_batch // self.num_windows))}
        return self._orders[epoch]

    def next_indices(self) -> list[int]:
        """Advance one global micro-step; return this rank's batch_size window indices."""
        step = self.order(self.epoch)[self.position : self.position + self.global_batch]
        self.position += self.global_batch
        if self.position + self.global_batch > self.num_windows:  # no full step left
            self.epoch, self.position = self.epoch + 1, 0
        self.steps += 1
        return step[self.rank * self.batch_size : (self.rank + 1) * self.batch_size].tolist()

    def __iter__(self):
        return iter(self.next_indices, None)  # forever: next_indices never returns None

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, **{k: getattr(self, k) for k in self._STATE_KEYS}}

    def load_state_dict(self, state: dict) -> None:
        """Resume from any rank's `state_dict()`; seed, num_windows and the global batch must match."""
        missing = [k for k in self._STATE_KEYS if k not in (state or {})]
        if not isinstance(state, dict) or missing:
            raise TitanliteError(
                f"not a batch-sampler state (missing {missing}); pass "
                "what StatefulBatchSampler.state_dict() returned"
            )
        if state["seed"] != self.seed:
            raise TitanliteError(
                f"the checkpoint's data order used seed={state['seed']} but "
                f"this run has seed={self.seed}; rerun with seed={state['seed']}"
            )
        if state["num_windows"] != self.num_windows:
            raise TitanliteError(
                f"the checkpoint's data had {state['num_windows']} windows, this run has "
                f"{self.num_windows}: the corpus, tokenizer, seq_len or val_fraction "
                "changed; resume with the settings the checkpoint was trained with"
            )
        if (saved_global := state["batch_size"] * state["world_size"]) != self.global_batch:
            raise TitanliteError(
                f"the checkpoint used batch_size*world_size = {state['batch_size']}*"
                f"{state['world_size']} = {saved_global}, this run {self.batch_size}*"
                f"{self.world_size} = {self.global_batch}; keep the global batch the same "
                "to resume exactly"
            )
        steps_per_epoch = max(1, self.num_windows // self.global_batch)
        if (  # a position between steps, or past an epoch's last full step
            state["position"] % self.global_batch
            or state["position"] >= steps_per_epoch * self.global_batch
            or state["epoch"] < 0
        ):
            raise TitanliteError(
                f"corrupt sampler state (epoch={state['epoch']}, position="
                f"{state['position']}); load an intact checkpoint"
            )
        self.epoch, self.position, self.steps = (
            int(state["epoch"]),
            int(state["position"]),
            int(state["steps"]),
        )


class TokenBatches:
    """(x, y) batches of one split: random windows for training, fixed ones for evaluation. With
    `eos_id` (a document mask), (x, y, documents): which document each input token belongs to."""

    part = None  # what this rank keeps of each sequence (context parallelism); None: all of it

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        eos_id: int | None = None,
    ):
        self.seq_len, self.eos_id = _positive_int("seq_len", seq_len, 128), eos_id
        # batch_size before the windows: the first line a bad call gets
        _positive_int("batch_size", batch_size)
        self.num_windows = len(tokens) // (seq_len + 1)
        if self.num_windows == 0:
            raise TitanliteError(
                f"{len(tokens)} tokens do not fill one window of seq_len+1 = "
                f"{seq_len + 1}; use seq_len <= {max(len(tokens) - 1, 1)}"
            )
        # The whole windows as [num_windows, seq_len + 1], in int32: half the memory; batch_of widens
        # it to int64. A tail shorter than a window is dropped.
        self.windows = (
            torch.as_tensor(tokens)[: self.num_windows * (seq_len + 1)]
            .to(torch.int32)
            .view(-1, seq_len + 1)
        )
        self.sampler = StatefulBatchSampler(  # checks batch_size, rank, world_size and seed
            self.num_windows, batch_size, rank=rank, world_size=world_size, seed=seed
        )

    def batch_of(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        rows = self.windows[torch.as_tensor(indices, dtype=torch.long)].long()
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        # A document starts at each end-of-document token: it opens the next one, as a BOS would.
        # Numbered over the whole sequence, before context parallelism keeps this rank's part.
        documents = (
            () if self.eos_id is None else ((x == self.eos_id).cumsum(1, dtype=torch.int32),)
        )
        return (x, y, *documents) if self.part is None else (self.part(x), self.part(y), *documents)

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """The next training batch: x and y are int64 [batch_size, seq_len], y = x shifted."""
        return self.batch_of(self.sampler.next_indices())

    def __iter__(self):
        return iter(self.next_batch, None)  # forever

    def eval_batches(self, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same batches on every call, for any training seed (val losses compare); training untouched."""
        _positive_int("num_batches", num_batches)
        order = _seeded_permutation(self.num_windows, EVAL_ORDER_SEED, 0, purpose="eval")
        s = self.sampler
        firsts = torch.arange(num_batches)[:, None] * s.global_batch + s.rank * s.batch_size
        picks = order[(firsts + torch.arange(s.batch_size)) % self.num_windows]
        return [self.batch_of(row.tolist()) for row in picks]

    def state_dict(self) -> dict:
        return {"seq_len": self.seq_len, **self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if isinstance(state, dict) and state.get("seq_len", self.seq_len) != self.seq_len:
            raise TitanliteError(
                f"the checkpoint used seq_len={state['seq_len']}, this run "
                f"seq_len={self.seq_len}; resume with seq_len={state['seq_len']}"
            )
        self.sampler.load_state_dict(state)
