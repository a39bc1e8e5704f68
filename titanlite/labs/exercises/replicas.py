"""Checks for notebook 22: the gradient the replica groups in a quorum step with when some group is
missing, and the bytes a replica group sends per step, every step or DiLoCo's every H."""

from __future__ import annotations

import torch

from ..nb22_training_that_does_not_stop import bytes_sent_per_step, quorum_gradient
from .grading import exercise


def _grads_of(rng, groups: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    n, scale = rng.randint(3, 10), 10 ** rng.uniform(-3, 1)
    return [torch.randn(n, generator=g) * scale for _ in range(groups)]


def _draw_quorums(rng):
    """One of 3 groups missing (notebook 22's drill), every group there, and a random quorum of
    more groups with at least one missing and one there."""
    cases = []
    missing = rng.randrange(3)
    cases.append((_grads_of(rng, 3), [g != missing for g in range(3)]))
    groups = rng.randint(2, 6)
    cases.append((_grads_of(rng, groups), [True] * groups))
    groups = rng.randint(4, 8)
    alive = [rng.random() < 0.6 for _ in range(groups)]
    alive[rng.randrange(groups)], alive[rng.randrange(groups)] = True, False
    if all(alive[1:]) or not any(alive):  # keep both kinds
        alive[0] = not alive[0]
    cases.append((_grads_of(rng, groups), alive))
    return cases


def _rounded(fn):
    return lambda grads, alive: [round(x, 6) for x in fn(grads, alive).double().tolist()]


QUORUM_MISTAKES = {
    "÷ every group": lambda gs, a: sum(g for g, x in zip(gs, a) if x) / len(gs),
    "the dead group's gradient kept": lambda gs, a: sum(gs) / sum(a),
    "the sum, not the mean": lambda gs, a: sum(g for g, x in zip(gs, a) if x),
    "÷ (groups - 1)": lambda gs, a: sum(g for g, x in zip(gs, a) if x) / max(1, len(gs) - 1),
    "one live group's": lambda gs, a: next(g for g, x in zip(gs, a) if x),
    "mean of every group": lambda gs, a: torch.stack(gs).mean(0),
}


@exercise("22_quorum_gradient", "the gradient of a step that a replica group missed")
def quorum_gradient_check(c, fn):
    rounded = {name: _rounded(m) for name, m in QUORUM_MISTAKES.items()}
    cases = c.separating(_draw_quorums, _rounded(quorum_gradient), rounded)
    for grads, alive in cases:
        want = quorum_gradient(grads, alive).float()
        got = c.call(fn, [g.clone() for g in grads], list(alive))
        c.same_tensor(
            got,
            want,
            f"the gradient of {sum(alive)} of {len(alive)} groups in the quorum "
            f"(in_quorum={alive})",
            rtol=1e-5,
            atol=2e-6 * float(max(g.abs().max() for g in grads)),  # float32 sums of <= 8
        )
    c.passed("the quorum's sum over its size, as torchft's Manager.allreduce averages")


def _draw_traffic(rng):
    """(n_params, bytes_per_param, groups, sync_steps): every step (H = 1) and DiLoCo's H, two
    groups and many, and a small model whose bytes are no whole number (3 groups, H = 7)."""

    def n():
        return rng.randint(10**5, 10**10)

    return [
        (n(), rng.choice([2, 4]), rng.randint(2, 64), 1),
        (n(), rng.choice([2, 4]), 2, rng.randint(2, 500)),
        # 16·n/21 bytes, no whole number (n is no multiple of 21), small enough to see the fraction
        (21 * rng.randint(1, 40) + rng.randint(1, 20), 4, 3, 7),
        (n(), rng.choice([2, 4]), rng.randint(3, 64), rng.randint(2, 500)),
    ]


TRAFFIC_MISTAKES = {
    "the tensor's size, no ring": lambda n, b, g, h: n * b / h,
    "2·S, not 2·(G-1)/G·S": lambda n, b, g, h: 2 * n * b / h,
    "(G-1)/G·S: no factor 2": lambda n, b, g, h: (g - 1) / g * n * b / h,
    "× H, not ÷ H": lambda n, b, g, h: 2 * (g - 1) / g * n * b * h,
    "H ignored": lambda n, b, g, h: 2 * (g - 1) / g * n * b,
    "in bits": lambda n, b, g, h: 8 * 2 * (g - 1) / g * n * b / h,
    "whole bytes (//)": lambda n, b, g, h: 2 * (g - 1) * n * b // (g * h),
    "÷ (H + 1)": lambda n, b, g, h: 2 * (g - 1) / g * n * b / (h + 1),
}


@exercise("22_bytes_per_step", "what a replica group sends per step, every step or every $H$")
def bytes_per_step_check(c, fn):
    cases = c.separating(_draw_traffic, bytes_sent_per_step, TRAFFIC_MISTAKES)
    for n, b, g, h in cases:
        c.same_value(
            c.call(fn, n, b, g, h),
            bytes_sent_per_step(n, b, g, h),
            f"bytes_sent_per_step({n:,}, {b}, groups={g}, sync_steps={h})",
        )
    c.passed("2·(G-1)/G × N·b ÷ H, the ring all-reduce's bytes per member and step")
