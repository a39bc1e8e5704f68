"""Checks for notebook 17: merging two partial attentions by their log-sum-exp, and which
positions of the sequence a rank holds under zig-zag context parallelism."""

from __future__ import annotations

import torch

from .grading import exercise


def _partials(c, rows: int, scale: float):
    """Two partial attentions over the same queries: outputs [rows, 4] and log-sum-exps [rows],
    the second set a few units apart from the first, both near `scale`."""
    out1, out2 = (torch.randn(rows, 4, generator=c.gen) for _ in range(2))
    lse1 = torch.randn(rows, generator=c.gen) * 3 + scale
    lse2 = torch.randn(rows, generator=c.gen) * 3 + scale + torch.randn(1, generator=c.gen) * 5
    return out1, lse1, out2, lse2


def _real_merge64(out1, lse1, out2, lse2):
    """The package's merge in float64, of the float32 inputs as they are: the exact answer to
    compare with (merge's block_out.float() is exact here, its values being float32 ones)."""
    from ...distributed.context_parallel import merge

    return merge(out1.double(), lse1.double(), out2.double(), lse2.double())


# Log-sum-exps small and large: exp(lse) overflows past ~88 in float32 and past ~709 in float64
# (and below -87 and -708 loses its digits in denormals, then is 0), so a merge through exp(lse)
# fails at ±95 in float32 and at ±800 even in float64; the markdown asks for one that stays finite.
SCALES = (0.0, 2.0, 95.0, -95.0, 300.0, 800.0, -800.0)


@exercise("17_lse_merge", "merge two partial attentions by their log-sum-exp")
def lse_merge(c, fn):
    eps = torch.finfo(torch.float32).eps
    for scale in SCALES:
        out1, lse1, out2, lse2 = _partials(c, c.rng.randint(3, 9), scale)
        got = c.call(fn, out1.clone(), lse1.clone(), out2.clone(), lse2.clone())
        want_out, want_lse = _real_merge64(out1, lse1, out2, lse2)
        if not (isinstance(got, tuple) and len(got) == 2):
            c.fail(f"return (out, lse), a tuple of two tensors; got {type(got).__name__}")
        # What float32 arithmetic cannot avoid, with a margin of 4: the merged lse rounded to
        # float32 is off by up to an ulp of |lse| (<= eps·|lse|), and every weight exp(lse_i -
        # lse) carries that error into the output as a relative one; each product and the sum
        # round by an ulp of the outputs. A float32 step near lse = 300 is 3e-5, near 800 6e-5.
        lse_ulps = eps * max(1.0, float(torch.maximum(lse1.abs(), lse2.abs()).max()))
        out_ulps = eps * float(torch.maximum(out1.abs(), out2.abs()).max())
        what = f"the merged {{}} of partial attentions with log-sum-exps near {scale:g}"
        c.same_tensor(got[0], want_out, what.format("output"), rtol=4 * lse_ulps, atol=4 * out_ulps)
        c.same_tensor(got[1], want_lse, what.format("log-sum-exp"), rtol=0.0, atol=4 * lse_ulps)
    c.passed(
        "equals the ring's online-softmax merge (in float64, to float32's rounding), also where "
        "exp(lse) overflows float64"
    )


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
