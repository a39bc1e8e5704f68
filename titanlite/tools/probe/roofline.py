"""The roofline model: is an operation limited by arithmetic or by memory traffic?

    attainable FLOP/s = min(peak FLOP/s, arithmetic intensity x memory bandwidth)
    arithmetic intensity = FLOPs / minimum bytes moved (each input read once, output written once)

Left of the *ridge point* (peak / bandwidth, in FLOP/byte) an op is memory-bound: faster
arithmetic would not help, moving fewer bytes would (fusion, smaller dtypes). Right of it the op
is compute-bound and MFU is the right yardstick. A square n x n matmul does 2n^3 FLOPs on 3n^2
elements, so its intensity grows with n - which is why big matmuls can approach peak and an
elementwise add (1 FLOP per 3 elements moved) never can.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import TitanliteError, closest
from ...peaks import Peak, mfu
from .matmul_peak import time_fn


@dataclass(frozen=True)
class OpPoint:
    """One measured operation: what it must do, and how long it took."""

    name: str
    flops: float  # FLOPs per call
    bytes: float  # minimum bytes per call
    seconds: float  # best measured seconds per call

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def achieved(self) -> float:
        return self.flops / self.seconds


def matmul_cost(m: int, n: int, k: int, dtype: torch.dtype) -> tuple[float, float]:
    """(FLOPs, minimum bytes) of (m x k) @ (k x n): m*n*k multiply-adds; read A and B, write C."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2.0 * m * n * k, float(m * k + k * n + m * n) * itemsize


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """FLOP/byte an op needs before compute, not memory, becomes its limit."""
    return peak_flops / bandwidth


def roofline_bound(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """Best FLOP/s any op of this intensity can reach on this machine."""
    return min(peak_flops, intensity * bandwidth)


def is_memory_bound(intensity: float, peak_flops: float, bandwidth: float) -> bool:
    return intensity < ridge_point(peak_flops, bandwidth)


def measure_matmul(
    m: int, n: int, k: int, dtype, device, budget_s: float = 0.2, name: str | None = None
) -> OpPoint:
    """Time (m x k) @ (k x n) on device; the point to place on the roofline."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    seconds = time_fn(lambda: torch.mm(a, b, out=out), device, budget_s)
    flops, nbytes = matmul_cost(m, n, k, dtype)
    return OpPoint(name or f"matmul {m}x{k}@{k}x{n}", flops, nbytes, seconds)


def measure_add(numel: int, dtype, device, budget_s: float = 0.2) -> OpPoint:
    """Time c = a + b: 1 FLOP per element against 3 elements moved - the memory-bound extreme."""
    a = torch.randn(numel, dtype=dtype, device=device)
    b = torch.randn(numel, dtype=dtype, device=device)
    out = torch.empty_like(a)
    seconds = time_fn(lambda: torch.add(a, b, out=out), device, budget_s)
    return OpPoint(f"add {numel:,}", float(numel), 3.0 * numel * a.element_size(), seconds)


def roofline_table(points, peak: Peak, bandwidth: float) -> list[dict]:
    """One row per point: where it sits relative to the roof, and its MFU."""
    rows = []
    for p in points:
        bound = roofline_bound(p.intensity, peak.flops, bandwidth)
        rows.append(
            {
                "name": p.name,
                "intensity": p.intensity,
                "achieved": p.achieved,
                "bound": bound,
                "of_roof": p.achieved / bound,
                "mfu": mfu(p.achieved, peak),
                "memory_bound": is_memory_bound(p.intensity, peak.flops, bandwidth),
            }
        )
    return rows


def plot_roofline(points, peak: Peak, bandwidth: float, ax=None, title: str | None = None):
    """Log-log roofline: the roof, the ridge, and each measured point labelled with its MFU
    (blue: left of the ridge, memory-bound; red: right of it, compute-bound)."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 5))
    ridge = ridge_point(peak.flops, bandwidth)
    xs = [p.intensity for p in points] + [ridge]
    x = np.logspace(np.log10(min(xs) / 3), np.log10(max(xs) * 6), 200)
    ax.loglog(
        x,
        np.minimum(peak.flops, x * bandwidth),
        "k-",
        lw=2,
        label=f"roof: {peak.flops / 1e9:,.1f} GFLOP/s, {bandwidth / 1e9:,.1f} GB/s",
    )
    ax.axvline(ridge, color="grey", ls=":", label=f"ridge point {ridge:.1f} FLOP/byte")
    lowest = min(p.achieved for p in points)
    for p in points:
        color = "tab:blue" if p.intensity < ridge else "tab:red"
        ax.loglog(p.intensity, p.achieved, "o", color=color)
        # One line, slanting down-right from its point: measured points lie under the roof, and
        # neighbours (a sweep of matmul sizes climbs up and right) stay apart when the labels
        # run parallel to each other instead of stacking side by side. The lowest points' labels
        # slant up instead: down, they would run off the bottom of the figure.
        up = p.achieved < lowest * 10
        ax.annotate(
            f"{p.name.replace('^3', '³')}  {mfu(p.achieved, peak):.1%}",
            (p.intensity, p.achieved),
            textcoords="offset points",
            xytext=(4, 5 if up else -5),
            fontsize=7,
            rotation=35 if up else -35,
            rotation_mode="anchor",
            ha="left",
            va="bottom" if up else "top",
            color=color,
        )
    ax.text(0.02, 0.98, "each label: op, MFU", transform=ax.transAxes, fontsize=7, va="top")
    # room for the slanted labels
    ax.set_ylim(min(p.achieved for p in points) / 5, peak.flops * 1.6)
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or f"roofline - {peak.label}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return ax


def measure_memory_bandwidth(
    device,
    nbytes: int = 256 * 2**20,
    budget_s: float = 1.0,
    kind: str = "copy",
    dtype: torch.dtype = torch.float32,
) -> float:
    """Bytes/s the memory system sustains on nbytes (make it dwarf the last-level cache, tens of
    MiB, or you time the cache).

    "copy": dst.copy_(src), counting the read and the write (STREAM's convention).
    "read": stream an nbytes matrix through a matrix-vector product in `dtype` - read-only
    traffic, the pattern of LLM decoding. On CPUs this beats "copy" because each written cache
    line is first read in (write-allocate), a transfer the copy count does not see.
    "best": the larger of the two - the roof to draw on a roofline."""
    if kind not in ("copy", "read", "best"):
        raise TitanliteError(
            f"unknown bandwidth kind {kind!r}{closest(kind, ('copy', 'read', 'best'))}"
            ": use copy, read or best"
        )
    if kind == "best":
        return max(
            measure_memory_bandwidth(device, nbytes, budget_s / 2, "copy", dtype),
            measure_memory_bandwidth(device, nbytes, budget_s / 2, "read", dtype),
        )
    device = torch.device(device)
    size = torch.empty((), dtype=dtype).element_size()
    if kind == "copy":
        src = torch.ones(nbytes // size, dtype=dtype, device=device)
        dst = torch.empty_like(src)
        return 2 * src.numel() * size / time_fn(lambda: dst.copy_(src), device, budget_s)
    n = int((nbytes / size) ** 0.5)
    mat = torch.ones(n, n, dtype=dtype, device=device)
    vec, out = torch.ones(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)
    return n * n * size / time_fn(lambda: torch.mv(mat, vec, out=out), device, budget_s)
