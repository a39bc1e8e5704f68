"""Checks for notebook 19: the PartitionSpec of a weight in an SPMD layout, and the bus bandwidth
of an all-reduce from its measured time."""

from __future__ import annotations

from .grading import exercise

LAYOUTS = ("dp", "fsdp", "tp", "2d")
NAMES = (
    "layers.0.attention.q_proj.weight",
    "layers.1.attention.o_proj.weight",
    "layers.0.feed_forward.gate_proj.weight",
    "layers.1.feed_forward.down_proj.weight",
    "layers.0.attention.v_proj.weight",
    "layers.0.attention_norm.weight",
    "tok_embeddings.weight",
    "norm.weight",
    "batch",
)


def _real_spec(layout, name, shape, n):
    from ..nb19_accelerators import spec_of

    return tuple(spec_of(layout, name, tuple(shape), n))


def _draw_specs(rng):
    cases = []
    for layout in LAYOUTS:
        n = rng.choice([2, 4, 8])
        for name in NAMES:
            if name == "batch":
                shape = ()
            elif name.endswith("norm.weight"):
                shape = (n * rng.randint(4, 16),)
            else:  # sometimes a first dimension n does not divide: FSDP leaves it whole
                shape = (n * rng.randint(2, 8) + rng.choice([0, 0, 1]), n * rng.randint(2, 8))
            cases.append((layout, name, shape, n))
    return cases


@exercise("19_partition_spec", "the PartitionSpec of a weight or the batch in an SPMD layout")
def partition_spec(c, fn):
    from ..nb19_accelerators import spec_of

    mistakes = {
        "column and row swapped": lambda lay, nm, s, n: (
            tuple(reversed(spec_of(lay, nm, s, n)))
            if lay in ("tp", "2d")
            else spec_of(lay, nm, s, n)
        ),
        "fsdp splits dim 1": lambda lay, nm, s, n: (
            (None, "data")
            if spec_of(lay, nm, s, n) == ("data", None) and nm != "batch"
            else spec_of(lay, nm, s, n)
        ),
        "tp splits the batch": lambda lay, nm, s, n: (
            ("data", None) if nm == "batch" else spec_of(lay, nm, s, n)
        ),
        "whatever divides": lambda lay, nm, s, n: (
            ("data", None) if lay == "fsdp" and len(s) == 2 else spec_of(lay, nm, s, n)
        ),
    }
    cases = c.separating(_draw_specs, _real_spec, mistakes)
    for layout, name, shape, n in cases:
        got = c.call(fn, layout, name, shape, n)
        got = tuple(got) if isinstance(got, (list, tuple)) else got
        c.same_value(
            got,
            _real_spec(layout, name, shape, n),
            f"the spec of {name} {shape} in {layout} on {n}",
        )
    c.passed("every weight and the batch, in dp, fsdp, tp and 2d, as the lab's layouts write them")


def _real_busbw(nbytes, seconds, n):
    from ..nb19_accelerators import bus_bandwidth

    return bus_bandwidth(nbytes, seconds, n)


def _draw_busbw(rng):
    return [
        (rng.choice([4096, 2**20, 3 * 2**20, 64 * 2**20]), rng.uniform(1e-5, 0.5), n)
        for n in (2, 3, 4, 8, rng.choice([16, 64]))
    ]


@exercise("19_busbw", "the bus bandwidth of an all-reduce from its measured time")
def busbw(c, fn):
    mistakes = {
        "algbw": lambda s, t, n: s / t,
        "(n-1)/n": lambda s, t, n: s / t * (n - 1) / n,
        "2(n-1)": lambda s, t, n: s / t * 2 * (n - 1),
        "n/(n-1)": lambda s, t, n: s / t * n / (n - 1),
        "bits": lambda s, t, n: 8 * s / t * 2 * (n - 1) / n,
    }
    cases = c.separating(_draw_busbw, _real_busbw, mistakes)
    for nbytes, seconds, n in cases:
        got = c.call(fn, nbytes, seconds, n)
        c.same_value(
            got,
            _real_busbw(nbytes, seconds, n),
            f"busbw of an all-reduce of {nbytes:,} bytes in {seconds:.3g} s on {n} ranks",
            rel=1e-6,
        )
    c.passed("nccl-tests' busbw = S/t · 2(n−1)/n, on 2 to 64 ranks")
