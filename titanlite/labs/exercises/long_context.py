"""Checks for notebook 17: merging two partial attentions by their log-sum-exp, and which
positions of the sequence a rank holds under zig-zag context parallelism; and for notebook 21:
which query-key blocks a document mask keeps, and the fraction of pairs it attends."""

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


# ----- notebook 21: document masks --------------------------------------------------------------


def _real_block_mask(documents: torch.Tensor, block: int) -> torch.Tensor:
    from ..nb21_documents_and_masks import block_layout

    return block_layout(documents[None], block)[0] > 0


def _documents(rng, length: int) -> torch.Tensor:
    """One row's document numbers: nondecreasing from 0, a new document at random positions
    (single-token documents and one starting at position 0 included at times)."""
    starts = [i for i in range(length) if rng.random() < 0.12]
    ids = torch.zeros(length, dtype=torch.int64)
    for s in starts:
        ids[s:] += 1
    return ids


def _block_mistake(kind):
    def block_mask(documents, block):
        T = documents.shape[0]
        n = T // block
        q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
        same = documents[:, None] == documents[None, :]
        pairs = {
            "causal only": q >= k,
            "documents only": same,
            "strictly earlier keys": same & (q > k),
            "transposed": same & (q <= k),
        }.get(kind, same & (q >= k))
        counts = pairs.reshape(n, block, n, block).sum((1, 3))
        if kind == "full blocks only":
            return counts == block * block
        if kind == "first tokens of each block":
            firsts = documents[::block]
            return (firsts[:, None] == firsts[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
        return counts > 0

    return block_mask


BLOCK_MISTAKES = {
    kind: _block_mistake(kind)
    for kind in (
        "causal only",
        "documents only",
        "strictly earlier keys",
        "transposed",
        "full blocks only",
        "first tokens of each block",
    )
}


def _draw_layouts(rng):
    cases = []
    for block in (1, 2, 4, 8):
        for _ in range(2):
            n = rng.randint(3, 8)
            cases.append((_documents(rng, n * block), block))
    return cases


def _as_lists(block_mask):
    return lambda documents, block: block_mask(documents, block).tolist()


@exercise("21_block_mask", "which query-key blocks a block-causal document mask keeps")
def block_mask(c, fn):
    def real(documents, block):
        return _real_block_mask(documents, block).tolist()

    wrong = {kind: _as_lists(mistake) for kind, mistake in BLOCK_MISTAKES.items()}
    cases = c.separating(_draw_layouts, real, wrong)
    for documents, block in cases:
        got = c.call(fn, documents.clone(), block)
        want = _real_block_mask(documents, block)
        what = f"the kept blocks of documents {documents.tolist()} in blocks of {block}"
        if isinstance(got, torch.Tensor):
            got = got.bool()
        c.same_tensor(got, want, what, exact=True)
    c.passed(f"equals the block layout of {len(cases)} batches' documents, blocks of 1 to 8")


def _fractions(lengths: list[int]) -> tuple[float, float]:
    """Exactly, in float64: attended pairs over all T² of them, causal and block-causal."""
    T = sum(lengths)
    return T * (T + 1) / 2 / T**2, sum(n * (n + 1) / 2 for n in lengths) / T**2


ATTENDED_MISTAKES = {
    "diagonal left out": lambda ls: (
        (sum(ls) - 1) / 2 / sum(ls),
        sum(n * (n - 1) / 2 for n in ls) / sum(ls) ** 2,
    ),
    "half the square": lambda ls: (0.5, sum(n * n / 2 for n in ls) / sum(ls) ** 2),
    "no causality within a document": lambda ls: (
        _fractions(ls)[0],
        sum(n * n for n in ls) / sum(ls) ** 2,
    ),
    "block-causal over causal's pairs": lambda ls: (
        _fractions(ls)[0],
        _fractions(ls)[1] / _fractions(ls)[0],
    ),
    "swapped": lambda ls: _fractions(ls)[::-1],
    "integer division": lambda ls: (
        (sum(ls) * (sum(ls) + 1) // 2) // sum(ls) ** 2,
        sum(n * (n + 1) // 2 for n in ls) // sum(ls) ** 2,
    ),
}


def _draw_lengths(rng):
    return [([rng.randint(1, 40) for _ in range(rng.randint(1, 6))],) for _ in range(6)] + [
        ([1] * rng.randint(2, 5),),
        ([rng.randint(2, 9)],),
    ]


@exercise(
    "21_attended_fraction", "the fraction of query-key pairs a causal and a document mask keep"
)
def attended_fraction(c, fn):
    cases = c.separating(_draw_lengths, _fractions, ATTENDED_MISTAKES)
    for (lengths,) in cases:
        got = c.call(fn, list(lengths))
        c.same_value(
            got,
            _fractions(lengths),
            f"(causal, block-causal) for documents of lengths {lengths}",
            rel=1e-6,  # float32's rounding passes; every mistake is off by 1/T or more
        )
    c.passed(f"equals the exact fractions for {len(cases)} packings, one-token documents included")
