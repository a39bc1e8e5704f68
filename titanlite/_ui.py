"""What a run shows while it trains: a tqdm bar in a terminal, a plain line now and then in a log
file; nothing in a notebook, where the live plot is the progress display (a tqdm widget would
be saved as a dead placeholder)."""

import sys
import time

from tqdm import tqdm


def in_notebook() -> bool:
    """True inside a Jupyter kernel (not in a script or a test that merely imported ipykernel)."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return get_ipython is not None and type(get_ipython()).__name__ == "ZMQInteractiveShell"


def progress_bar(total: int, enabled: bool, initial: int = 0):
    if not enabled or in_notebook():
        return None
    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        terminal = False
    if not terminal:
        # A bar redraws one line with "\r": in a log file, hundreds of updates glued together.
        return PlainProgress(total, initial)
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


class PlainProgress:
    """A progress bar as whole lines, for a log file: one each ~10% of the run, at least every
    `every_s` seconds, and the last step always; tqdm's update/set_postfix/write/close.

        step 40/200 · loss 5.120 · 1,234 tok/s · 00:12 elapsed, 00:48 left
    """

    def __init__(
        self, total: int, initial: int = 0, every_s: float = 30.0, stream=None, clock=time.monotonic
    ):
        self.total, self.n, self.initial = total, initial, initial
        self.stream, self.clock, self.every_s = stream, clock, every_s
        self.stride = max(1, -(-(total - initial) // 10))  # ceil: ten lines for the steps left
        self.start = self.last_line = clock()
        self.postfix: list[str] = []  # "loss 5.120", "1,234 tok/s"
        self.due = False  # a line is owed, written once this step's postfix has arrived

    def update(self, n: int = 1) -> None:
        self.flush()  # the previous step's line never got its postfix: write it now
        self.n += n
        self.due = (
            (self.n - self.initial) % self.stride == 0
            or self.n >= self.total
            or self.clock() - self.last_line >= self.every_s
        )

    def set_postfix(self, **values) -> None:
        self.postfix = [f"{v} tok/s" if k == "tok_s" else f"{k} {v}" for k, v in values.items()]
        self.flush()

    def write(self, text: str) -> None:
        print(text, file=self.stream or sys.stderr, flush=True)  # looked up late: tests swap it

    def flush(self) -> None:  # write the line owed, if one is
        if not self.due:
            return
        self.due, self.last_line = False, self.clock()
        elapsed, done = self.last_line - self.start, self.n - self.initial
        left = elapsed / done * (self.total - self.n) if done > 0 else 0.0
        self.write(
            " · ".join(
                [
                    f"step {self.n}/{self.total}",
                    *self.postfix,
                    f"{_clock(elapsed)} elapsed, {_clock(left)} left",
                ]
            )
        )

    close = flush  # tqdm's close: the last line, if one is owed


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def say(text: str, bar) -> None:
    """Print a line without breaking the progress bar (tqdm writes above it)."""
    (print if bar is None else bar.write)(text)
