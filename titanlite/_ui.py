"""Small display helpers of the trainer: progress bars in terminals, none in notebooks."""
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
