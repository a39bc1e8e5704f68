"""Checks for notebook 17: merging two partial attentions by their log-sum-exp, and which
positions of the sequence a rank holds under zig-zag context parallelism."""

from __future__ import annotations

import torch

from .grading import exercise


def _partials(c, rows: int, scale: float):
    """Two partial attentions over the same queries: outputs [rows, 4] and log-sum-exps [rows],
    the second set `scale` apart from the first (large: naive exp() overflows in fp32)."""
    out1, out2 = (torch.randn(rows, 4, generator=c.gen) for _ in range(2))
    lse1 = torch.randn(rows, generator=c.gen) * 3 + scale
    lse2 = torch.randn(rows, generator=c.gen) * 3 + scale + torch.randn(1, generator=c.gen) * 5
    return out1, lse1, out2, lse2


def _real_merge(out1, lse1, out2, lse2):
    from ...distributed.context_parallel import merge

    out, lse = merge(out1, lse1, out2, lse2)
    return out, lse


@exercise("17_lse_merge", "merge two partial attentions by their log-sum-exp")
def lse_merge(c, fn):
    # Small and large log-sum-exps: a merge through exp(lse) overflows at ~88 in fp32.
    for scale in (0.0, 2.0, 95.0, -95.0, 300.0):
        out1, lse1, out2, lse2 = _partials(c, c.rng.randint(3, 9), scale)
        got = c.call(fn, out1.clone(), lse1.clone(), out2.clone(), lse2.clone())
        want_out, want_lse = _real_merge(out1, lse1, out2, lse2)
        if not (isinstance(got, tuple) and len(got) == 2):
            c.fail(f"return (out, lse), a tuple of two tensors; got {type(got).__name__}")
        what = f"the merged {{}} of partial attentions with log-sum-exps near {scale:g}"
        c.same_tensor(got[0], want_out, what.format("output"), rtol=1e-5, atol=1e-5)
        c.same_tensor(got[1], want_lse, what.format("log-sum-exp"), rtol=1e-5, atol=1e-4)
    c.passed("equals the ring's online-softmax merge, also where exp(lse) overflows")


def _real_positions(rank, cp, seq_len):
    from ...distributed.context_parallel import positions_of

    return positions_of(rank, cp, seq_len // cp, "zigzag").tolist()


ZIGZAG_MISTAKES = {
    "contiguous": lambda r, cp, t: list(range(r * t // cp, (r + 1) * t // cp)),
    "tail 2cp-r": lambda r, cp, t: [
        p for i in (r, 2 * cp - r) for p in range(i * t // (2 * cp), (i + 1) * t // (2 * cp))
    ],
    "tail cp+r": lambda r, cp, t: [
        p for i in (r, cp + r) for p in range(i * t // (2 * cp), (i + 1) * t // (2 * cp))
    ],
    "tail first": lambda r, cp, t: [
        p for i in (2 * cp - 1 - r, r) for p in range(i * t // (2 * cp), (i + 1) * t // (2 * cp))
    ],
}


def _draw_zigzag(rng):
    cases = []
    for _ in range(3):
        cp = rng.choice([2, 3, 4, 8])
        seq_len = 2 * cp * rng.randint(1, 6)
        cases += [(rank, cp, seq_len) for rank in range(cp)]
    return cases


@exercise("17_zigzag_positions", "the positions a rank holds under zig-zag context parallelism")
def zigzag_positions(c, fn):
    cases = c.separating(_draw_zigzag, _real_positions, ZIGZAG_MISTAKES)
    for rank, cp, seq_len in cases:
        got = c.call(fn, rank, cp, seq_len)
        if isinstance(got, torch.Tensor):
            got = got.tolist()
        c.same_value(
            got,
            _real_positions(rank, cp, seq_len),
            f"the positions rank {rank} of cp={cp} holds of a sequence of {seq_len}",
        )
    c.passed(f"equals positions_of for every rank of {len({(p, t) for _, p, t in cases})} layouts")
