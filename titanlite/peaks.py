"""The peak FLOP/s that MFU divides by, and MFU itself: achieved / peak.

MFU is only as honest as the peak. The trainer is handed a peak finder, a tool (`titanlite train`
hands in tools/probe/matmul_peak.py's `MatmulPeaks`: the best square-matmul rate this device
reaches in the run's dtype, measured and cached, re-measured once when a run beats it); vendor
datasheet peaks (tools/probe/datasheet.py), upper bounds, are labelled so. Without one, a run
reports no MFU."""

import warnings
from dataclasses import dataclass

from .errors import TitanliteError

_WARNED: set[str] = set()  # peaks mfu has warned about


@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s
    source: str  # "measured" or "datasheet"
    label: str  # says where the number came from, for plots and logs


def mfu(achieved_flops_per_s: float, peak: Peak) -> float:
    """achieved / peak. Above 1 the peak is wrong (stale, measured while busy): said once per
    peak, and the true ratio returned rather than clamped out of sight."""
    if peak.flops <= 0:
        raise TitanliteError(
            f"peak of {peak.flops} FLOP/s ({peak.label}) is not positive: "
            "re-measure with tools.probe.matmul_peak.matmul_peak(device, dtype, refresh=True)"
        )
    ratio = achieved_flops_per_s / peak.flops
    key = peak.label.split(" [cached")[0]  # the same peak, whether measured now or read back
    if ratio > 1 and key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(
            f"MFU {ratio:.2f} > 1 against '{peak.label}': the peak is too low - re-measure: "
            "matmul_peak(..., refresh=True), or get_peak(..., source='datasheet') (tools.probe.matmul_peak)",
            RuntimeWarning,
            stacklevel=2,
        )
    return ratio
