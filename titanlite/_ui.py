"""Small display helpers: the trainer's progress bar in terminals, plain periodic lines in
log files; in notebooks the live plot shows progress itself (`Progress` below), since a tqdm
widget would be saved as a dead placeholder."""
from __future__ import annotations

import sys
import time

import torch


def eager():
    """Run compiled code eagerly (torch >= 2.6 has set_stance; older: nothing to do)."""
    import contextlib
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance else contextlib.nullcontext()


def in_notebook() -> bool:
    """True inside a Jupyter kernel; False in a terminal, a script or a test run that merely
    imported ipykernel (nbclient, an IPython shell)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def progress_bar(total: int, enabled: bool, initial: int = 0):
    # In notebooks the live plot is the progress display; a bar there would only add noise.
    if not enabled or in_notebook():
        return None
    if not _is_terminal(sys.stderr):
        # A bar redraws one line with "\r": in a log file that is hundreds of updates glued
        # into one unreadable line. Files get a plain line now and then instead.
        return PlainProgress(total, initial)
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


class PlainProgress:
    """What a progress bar says, as whole lines, for a log file: one line each ~10% of the run
    and at least every `every_s` seconds, and the last step always:

        step 40/200 · loss 5.120 · 1,234 tok/s · 00:12 elapsed, 00:48 left

    It has the few tqdm methods the trainer calls (update, set_postfix, write, close)."""

    def __init__(self, total: int, initial: int = 0, every_s: float = 30.0, stream=None,
                 clock=time.monotonic):
        self.total, self.n, self.initial = total, initial, initial
        self.stream, self.clock, self.every_s = stream, clock, every_s
        self.stride = max(1, -(-(total - initial) // 10))  # ceil: ten lines for the steps left
        self.start = self.last_line = clock()
        self.postfix: dict[str, str] = {}
        self.due = False  # a line is owed, written once this step's postfix has arrived

    def update(self, n: int = 1) -> None:
        if self.due:  # the previous step's line never got its postfix: write it now
            self._line()
        self.n += n
        self.due = ((self.n - self.initial) % self.stride == 0 or self.n >= self.total
                    or self.clock() - self.last_line >= self.every_s)

    def set_postfix(self, **values) -> None:
        self.postfix = {k: str(v) for k, v in values.items()}
        if self.due:
            self._line()

    def write(self, text: str) -> None:
        print(text, file=self._out(), flush=True)

    def close(self) -> None:
        if self.due:
            self._line()

    def _out(self):
        return self.stream or sys.stderr  # looked up late: tests and notebooks swap sys.stderr

    def _line(self) -> None:
        self.due, now = False, self.clock()
        self.last_line = now
        elapsed, done = now - self.start, self.n - self.initial
        left = elapsed / done * (self.total - self.n) if done > 0 else 0.0
        parts = [f"step {self.n}/{self.total}"]
        parts += [f"{v} tok/s" if k == "tok_s" else f"{k} {v}" for k, v in self.postfix.items()]
        parts.append(f"{_clock(elapsed)} elapsed, {_clock(left)} left")
        print(" · ".join(parts), file=self._out(), flush=True)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def say(text: str, bar) -> None:
    if bar is not None:
        bar.write(text)
    else:
        print(text)


def _short_clock(seconds: float) -> str:  # "7 s", "1:05": a notebook status line
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
        parts.append(f"{_short_clock(self.elapsed_s)} elapsed")
        if self.remaining_s is not None:
            parts.append("done" if self.step >= self.total else f"~{_short_clock(self.remaining_s)} left")
        return " · ".join(parts)
