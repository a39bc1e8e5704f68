"""Small display helpers: the trainer's progress bar in terminals; in notebooks the live plot
shows progress itself (`Progress` below), since a tqdm widget would be saved as a dead placeholder."""
from __future__ import annotations

import sys

import torch


def eager():
    """Run compiled code eagerly (torch >= 2.6 has set_stance; older: nothing to do)."""
    import contextlib
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance else contextlib.nullcontext()


def in_notebook() -> bool:
    return "ipykernel" in sys.modules


def progress_bar(total: int, enabled: bool, initial: int = 0):
    # In notebooks the live plot is the progress display; a bar there would only add noise.
    if not enabled or in_notebook():
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


def say(text: str, bar) -> None:
    if bar is not None:
        bar.write(text)
    else:
        print(text)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds >= 60 else f"{seconds} s"


class Progress:
    """Steps done, elapsed and remaining time, for a notebook's status line (LivePlot's).

    The rate is measured from the first step seen, not from step 0: a resumed run starts at
    its checkpoint's step, and its first records carry no start-up cost of the skipped steps."""

    def __init__(self, total: int | None = None):
        self.total = total
        self.step = self.elapsed_s = None
        self._first = None  # (step, elapsed_s) of the first record

    def update(self, step: float, elapsed_s: float) -> None:
        if self._first is None:
            self._first = (step, elapsed_s)
        self.step, self.elapsed_s = step, elapsed_s

    @property
    def fraction(self) -> float | None:
        if not self.total or self.step is None:
            return None
        return min(1.0, self.step / self.total)

    @property
    def remaining_s(self) -> float | None:
        if not self.total or self._first is None or self.step <= self._first[0]:
            return None
        rate = (self.elapsed_s - self._first[1]) / (self.step - self._first[0])  # s per step
        return max(0.0, (self.total - self.step) * rate)

    def text(self) -> str:
        if self.step is None:
            return ""
        parts = [f"step {self.step:.0f}" + (f"/{self.total} ({self.fraction:.0%})" if self.total else "")]
        parts.append(f"{_clock(self.elapsed_s)} elapsed")
        if self.remaining_s is not None:
            parts.append("done" if self.step >= self.total else f"~{_clock(self.remaining_s)} left")
        return " · ".join(parts)
