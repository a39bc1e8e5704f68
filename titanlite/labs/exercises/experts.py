"""Checks for notebook 18: a router's top-k choice and weights, and how many token choices an
expert-parallel rank sends to each rank."""

from __future__ import annotations

import torch

from .grading import exercise


def _real_route(scores, bias, k):
    """The package's router on given scores: choose by scores + bias, weigh by the scores alone,
    normalised over the k chosen (models/moe.py, Router.forward)."""
    chosen = (scores + bias).topk(k, dim=-1).indices
    weights = scores.gather(-1, chosen)
    return weights / weights.sum(-1, keepdim=True), chosen


def _by_token(weights, chosen):
    """Each token's {expert: weight}, in expert order: the same answer whatever order the k
    choices come in."""
    return [
        sorted(zip(row_c.tolist(), row_w.tolist()))
        for row_w, row_c in zip(torch.as_tensor(weights), torch.as_tensor(chosen))
    ]


def _rounded(answer):
    return [[(e, round(w, 6)) for e, w in token] for token in _by_token(*answer)]


def _rounded_answer(route):
    return lambda s, b, k: _rounded(route(s, b, k))


def _normalised(w):
    return w / w.sum(-1, keepdim=True)


ROUTE_MISTAKES = {
    "weights from the biased scores": lambda s, b, k: (
        _normalised((s + b).gather(-1, (s + b).topk(k, -1).indices)),
        (s + b).topk(k, -1).indices,
    ),
    "the bias ignored": lambda s, b, k: (
        _normalised(s.gather(-1, s.topk(k, -1).indices)),
        s.topk(k, -1).indices,
    ),
    "weights not normalised": lambda s, b, k: (
        s.gather(-1, (s + b).topk(k, -1).indices),
        (s + b).topk(k, -1).indices,
    ),
    "a softmax over the chosen scores": lambda s, b, k: (
        s.gather(-1, (s + b).topk(k, -1).indices).softmax(-1),
        (s + b).topk(k, -1).indices,
    ),
    "the k smallest": lambda s, b, k: (
        _normalised(s.gather(-1, (s + b).topk(k, -1, largest=False).indices)),
        (s + b).topk(k, -1, largest=False).indices,
    ),
}


def _draw_routes(rng):
    cases = []
    for _ in range(4):
        n, e = rng.randint(3, 12), rng.choice([4, 6, 8])
        k = rng.randint(1, min(e - 1, 4))
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        scores = (torch.randn(n, e, generator=g) * 2).softmax(-1)
        # A bias as large as the gaps between scores: it changes some choices, as training's does.
        bias = torch.randn(e, generator=g) * scores.std()
        cases.append((scores, bias, k))
    return cases


@exercise("18_topk_route", "top-k routing: choose with the bias, weigh without it, normalised")
def topk_route(c, fn):
    rounded = {name: _rounded_answer(m) for name, m in ROUTE_MISTAKES.items()}
    cases = c.separating(_draw_routes, _rounded_answer(_real_route), rounded)
    for scores, bias, k in cases:
        got = c.call(fn, scores.clone(), bias.clone(), k)
        if not (isinstance(got, tuple) and len(got) == 2):
            c.fail(
                f"return (weights, chosen), two tensors of shape [N, k]; got {type(got).__name__}"
            )
        weights, chosen = got
        want_w, want_c = _real_route(scores, bias, k)
        shape = tuple(want_c.shape)
        for name, t in (("weights", weights), ("chosen", chosen)):
            if not isinstance(t, torch.Tensor):
                c.fail(
                    f"{name} should be a tensor of shape {shape} (tokens, k); got {type(t).__name__}"
                )
            if tuple(t.shape) != shape:
                c.fail(f"{name} should have shape {shape} (tokens, k); got {tuple(t.shape)}")
        what = f"each token's chosen experts and their weights (N={shape[0]}, k={k}, E={scores.shape[1]})"
        c.same_value(_by_token(weights, chosen), _by_token(want_w, want_c), what, rel=1e-5)
    c.passed(f"the same experts and weights as Router.forward on {len(cases)} random routings")


def _real_splits(chosen, n_experts, ep):
    """How many of this rank's token choices go to each ep rank: rank g holds experts
    [g·E/ep, (g+1)·E/ep) (distributed/expert_parallel.py)."""
    counts = torch.bincount(chosen.flatten(), minlength=n_experts)
    return counts.view(ep, n_experts // ep).sum(1).tolist()


SPLIT_MISTAKES = {
    "tokens, not choices": lambda ch, e, ep: [
        int(((ch // (e // ep)) == g).any(-1).sum()) for g in range(ep)
    ],
    "experts dealt round-robin": lambda ch, e, ep: torch.bincount(
        (ch % ep).flatten(), minlength=ep
    ).tolist(),
    "counts per expert, not per rank": lambda ch, e, ep: torch.bincount(
        ch.flatten(), minlength=e
    ).tolist(),
    "expert e on rank e // ep": lambda ch, e, ep: torch.bincount(
        (ch // ep).flatten().clamp(max=ep - 1), minlength=ep
    ).tolist(),
    "only the first choice": lambda ch, e, ep: torch.bincount(
        (ch[:, 0] // (e // ep)), minlength=ep
    ).tolist(),
    "no minlength: ranks past the last one chosen dropped": lambda ch, e, ep: torch.bincount(
        (ch // (e // ep)).flatten()
    ).tolist(),
}


def _draw_splits(rng):
    cases = []
    for i in range(4):
        ep = rng.choice([2, 4])
        per_rank = rng.choice([1, 2, 3])
        e = ep * per_rank
        # The first routing sends nothing to the last ranks (this rank's tokens all chose experts
        # of the first ones, as a skewed router does): their zeros are part of the answer, and a
        # count that stops at the highest rank chosen is short of them.
        receiving = ep if i else rng.randint(1, ep - 1)
        allowed = receiving * per_rank  # experts 0 … allowed-1 live on the receiving ranks
        k = rng.randint(min(2, allowed), allowed)
        n = rng.randint(4, 20)
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        scores = torch.rand(n, e, generator=g)
        scores[:, allowed:] = -1.0  # never among a token's top k
        chosen = scores.topk(k, -1).indices  # k distinct experts a token
        cases.append((chosen, e, ep))
    return cases


@exercise("18_dispatch_splits", "how many token choices a rank sends to each expert-parallel rank")
def dispatch_splits(c, fn):
    cases = c.separating(_draw_splits, _real_splits, SPLIT_MISTAKES)
    for chosen, e, ep in cases:
        got = c.call(fn, chosen.clone(), e, ep)
        if isinstance(got, torch.Tensor):
            got = got.tolist()
        c.same_value(
            got,
            _real_splits(chosen, e, ep),
            f"the rows sent to each of ep={ep} ranks for {tuple(chosen.shape)} choices of E={e} experts",
        )
    c.passed(f"the split sizes ExpertDispatch sends, for {len(cases)} random routings")
