"""How fast this device can multiply matrices: the peak FLOP/s that MFU divides by.

MFU = achieved / peak FLOP/s is only as honest as the peak. The default peak is *measured*: the best
square-matmul rate this device reaches in this dtype (`matmul_peak`: cached a week at most, measured
again once if a run beats it). Vendor datasheet peaks (tools/probe/datasheet.py), upper bounds, are labelled so."""

import contextlib
import json
import os
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from ... import hardware
from ...errors import TitanliteError, closest
from ...peaks import Peak


def time_fn(fn, device, budget_s: float = 0.2) -> float:
    """Best seconds per call of fn(), spending about budget_s (at least two calls). The minimum,
    not the mean: noise only ever adds time."""

    def per_call(n: int) -> float:  # seconds per call of n calls between two syncs
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        hardware.synchronize(device)
        return (time.perf_counter() - t0) / n

    start = time.perf_counter()
    per_call(1)  # warm-up: pays for first-touch allocation, kernel selection, cuBLAS handles
    best = max(per_call(1), 1e-9)
    # Several calls between syncs, so launch + sync overhead does not swamp a microsecond kernel.
    iters = max(1, int(budget_s / 5 / best))
    while time.perf_counter() - start + iters * best <= budget_s:
        best = min(best, per_call(iters))
    return best


def _tf32_enabled() -> bool:
    """Whether float32 CUDA matmuls may use TF32 tensor cores (several times the FP32 rate)."""
    # "none" inherits torch.backends.fp32_precision: then the legacy getter says what is in force
    mode = torch.backends.cuda.matmul.fp32_precision
    if mode in ("tf32", "ieee"):
        return mode == "tf32"
    with contextlib.suppress(RuntimeError):  # raised when the legacy and new APIs were mixed
        return bool(torch.backends.cuda.matmul.allow_tf32)
    return False


def _matmul_label(device, dtype) -> str:
    tf32 = torch.device(device).type == "cuda" and dtype == torch.float32 and _tf32_enabled()
    return str(dtype).removeprefix("torch.") + (" (TF32 allowed)" if tf32 else "")


def measure_matmul_peak(device, dtype, budget_s: float = 2.0, matmul=None) -> Peak:
    """Best FLOP/s of square matmuls, n = 128 upwards, within about budget_s seconds. Sizes climb until
    the next one, predicted from the last one's rate, would not fit its share of the time left (an emulated
    bf16 matmul at n=4096 takes minutes on a CPU). `matmul(n)`: a no-argument n x n matmul to time instead."""
    device = torch.device(device)
    if matmul is None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TitanliteError(
            f"cannot measure a matmul peak in {dtype}: use float32, bfloat16 or "
            "float16 (float8_e4m3fn: tools.probe.datasheet.measure_matmul_peak)"
        )
    # Small sizes keep the peak honest on a busy CPU (a one-thread matmul can beat a big one).
    sizes = [128, 256, 512, 1024, 2048, 4096] + ([8192] if device.type == "cuda" else [])
    deadline, best, best_n, last = time.perf_counter() + budget_s, 0.0, 0, 0.0
    for i, n in enumerate(sizes):
        share = (deadline - time.perf_counter()) / (len(sizes) - i)
        # warm-up + one timed call must fit this size's share (emulated dtypes slow as n grows)
        if last and 2 * (2 * n**3 / last) > share:
            break
        run = matmul(n) if matmul else _square_matmul(n, device, dtype)
        last = 2 * n**3 / time_fn(run, device, share)
        if last > best:
            best, best_n = last, n
    return Peak(
        best,
        "measured",
        f"measured {_matmul_label(device, dtype)} matmul peak, "
        f"{hardware.device_name(device)} (best at n={best_n})",
    )


def _square_matmul(n: int, device, dtype):
    a, b = torch.randn(2, n, n, device=device, dtype=dtype)  # two n x n matrices
    out = torch.empty(n, n, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def cache_dir() -> Path:
    return Path(os.environ.get("TITANLITE_CACHE_DIR") or Path.home() / ".cache" / "titanlite")


PEAK_MAX_AGE_S = 7 * 24 * 3600  # long enough to save the seconds, short enough to forget a busy day
_RECHECKED: set[str] = set()  # "device | dtype" keys recheck_peak has measured again


def peak_is_stale(
    entry, now: float, threads: int, torch_version: str, device_name: str
) -> str | None:
    """Why a cached peak must be measured again, or None: a peak changes with the thread count,
    the torch build and the device, and one measured on a busy day inflates every later MFU."""
    if not isinstance(entry, dict) or not {"flops", "label", "measured_at"} <= entry.keys():
        return "no usable cache entry"
    age = now - float(entry["measured_at"])
    if not 0 <= age <= PEAK_MAX_AGE_S:  # negative: a clock change; do not trust it either
        return f"measured {age / 86400:.1f} days ago (more than {PEAK_MAX_AGE_S / 86400:.0f})"
    for fact, value in (("threads", threads), ("torch", torch_version), ("device", device_name)):
        if entry.get(fact) != value:
            return f"measured with {fact}={entry.get(fact)!r}, now {value!r}"
    return None


def matmul_peak(device, dtype, refresh: bool = False) -> Peak:
    """Measured matmul peak, cached on disk (measuring costs seconds, every run needs it); measured
    again when asked (refresh) or when `peak_is_stale` says so, and then kept only if it beats the
    cached one by more than that one's spread (`record_peak`): a later, lower figure means a busier
    machine, not a slower one."""
    entry = _read_cache().get(_cache_key(device, dtype))
    if not refresh and not peak_is_stale(entry, time.time(), *_facts(device).values()):
        return _cached(entry)
    ((peak, spread),) = measure_peaks(device, [dtype]).values()
    return record_peak(device, dtype, peak, spread)


def measure_peaks(device, dtypes, rounds: int = 3, budget_s: float = 2.0) -> dict:
    """{dtype: (best Peak, spread)}: `rounds` rounds, each measuring every dtype in turn (so a busy
    moment hits them alike), each round a third of `budget_s` per dtype. spread: (best - worst) /
    best over the rounds, the noise this machine showed meanwhile."""
    runs = [
        [measure_matmul_peak(device, d, budget_s / rounds) for d in dtypes] for _ in range(rounds)
    ]
    out = {}
    for dtype, peaks in zip(dtypes, zip(*runs)):  # zip(*runs): per dtype, its peak of each round
        best = max(peaks, key=lambda p: p.flops)
        out[dtype] = (best, (best.flops - min(p.flops for p in peaks)) / best.flops)
    return out


# A measurement whose rounds differ by more than this is the machine's business that moment, not
# its peak: it is used for the run at hand, never cached (an MFU against it would pass 100%).
MAX_SPREAD = 0.25


def record_peak(device, dtype, peak: Peak, spread: float, beaten: bool = False) -> Peak:
    """Cache a measured peak for this device and dtype, unless the cached one (still valid) is
    within its spread of it or above it: one trustworthy peak per device and dtype, whoever
    measured it (notebook 00, the trainer, the doctor). `beaten`: a run went faster than the
    cached peak, so any higher measurement replaces it. A measurement noisier than MAX_SPREAD is
    never cached. Returns the peak in force, labelled with when it was measured, the machine's
    load then and its spread."""
    key, facts, now = _cache_key(device, dtype), _facts(device), time.time()
    table = _read_cache()
    entry = table.get(key)
    usable = not peak_is_stale(entry, now, *facts.values())
    if spread > MAX_SPREAD:
        if usable:
            return _cached(entry)
        return replace(peak, label=f"{peak.label} [spread {spread:.0%}: too noisy to keep]")
    margin = 0.0 if beaten else (entry.get("spread", 0.0) if usable else 0.0)
    if not usable or peak.flops > entry["flops"] * (1 + margin):
        entry = table[key] = {
            "flops": peak.flops,
            "label": peak.label,
            "when": time.strftime("%Y-%m-%d %H:%M"),
            "measured_at": now,
            "spread": spread,
            "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            **facts,
        }
        _write_cache(table)
    return _cached(entry)


def _facts(device) -> dict:
    return {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": hardware.device_name(device),
    }


def _cache_key(device, dtype) -> str:
    f = _facts(device)
    return f"{f['device']} | {_matmul_label(device, dtype)} | threads={f['threads']} | torch={f['torch']}"


def _cached(entry: dict) -> Peak:
    """The Peak of a cache entry, its label saying when, at what load and spread it was measured."""
    load = entry.get("load")
    how = f", load {load:.1f}" if load is not None else ""
    how += f", spread {entry['spread']:.0%}" if "spread" in entry else ""
    return Peak(entry["flops"], "measured", f"{entry['label']} [cached {entry['when']}{how}]")


def _read_cache() -> dict:
    with contextlib.suppress(OSError, ValueError):  # missing or corrupt: start afresh, not fail
        return json.loads((cache_dir() / "matmul_peaks.json").read_text())
    return {}


def _write_cache(table: dict) -> None:
    path = cache_dir() / "matmul_peaks.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # write, then rename: never half a file
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, prefix=".matmul_peaks.", suffix=".tmp", delete=False
        ) as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError as e:  # a read-only home must not stop training; it only costs a re-measure
        warnings.warn(
            f"could not cache the matmul peak in {path} ({e}): set TITANLITE_CACHE_DIR "
            "to a writable folder",
            RuntimeWarning,
            stacklevel=3,
        )


def recheck_peak(
    achieved_flops_per_s: float, peak: Peak, device, dtype, say=print, sheet: Peak | None = None
) -> Peak:
    """The peak to keep using: one a run beat was measured on a busy machine, so measure it again (once
    per device and dtype) and say so; never a datasheet peak (beating that is a FLOP-count bug)."""
    key = f"{hardware.device_name(device)} | {_matmul_label(device, dtype)}"
    if peak.source != "measured" or achieved_flops_per_s <= peak.flops or key in _RECHECKED:
        return peak
    _RECHECKED.add(key)
    ((now, spread),) = measure_peaks(device, [dtype]).values()
    # the run is the evidence: a higher measurement replaces the cached one, whatever its spread
    fresh = _with_datasheet(record_peak(device, dtype, now, spread, beaten=True), sheet)
    kept = "in force now" if fresh.flops > peak.flops else "lower: the run's own rate says more"
    say(
        f"titanlite: this run reached {achieved_flops_per_s / 1e12:.4g} TFLOP/s, above the peak of "
        f"{peak.flops / 1e12:.4g} ({peak.label}); re-measured it: {now.flops / 1e12:.4g} TFLOP/s "
        f"(spread {spread:.0%}; {kept})"
    )
    return fresh


def mfu_within_noise(achieved_flops_per_s: float, peak: Peak, device, dtype) -> tuple:
    """(mfu, spread, label): the MFU of `achieved_flops_per_s` FLOP/s against `peak`, a fraction
    when the peak and the run saw the same machine. A run that beats a measured peak saw a quieter
    machine than the peak did (on a shared one the load comes and goes): then the peak in force
    now (the cache, which the run's own re-check may have raised) is used, and if the run beats
    that too, the peak is measured again - until its rounds agree within MAX_SPREAD, three tries
    at most - and the MFU taken against the best of them. `spread` is that measurement's
    (best - worst) / best over its rounds, at most MAX_SPREAD: `mfu <= 1 + spread` is what can
    honestly be claimed (spread 0 when nothing was measured again)."""
    if peak.source != "measured" or achieved_flops_per_s <= peak.flops:
        return achieved_flops_per_s / peak.flops, 0.0, peak.label
    cached = matmul_peak(device, dtype)
    if achieved_flops_per_s <= cached.flops:
        return achieved_flops_per_s / cached.flops, 0.0, cached.label
    for _ in range(3):
        ((now, spread),) = measure_peaks(device, [dtype]).values()
        if spread <= MAX_SPREAD:
            break
    best = max(now.flops, cached.flops)
    which = "measured again now" if now.flops >= cached.flops else "cached, above the new one"
    label = (
        f"{best / 1e12:.4g} TFLOP/s ({which}; the run beat {peak.flops / 1e12:.4g}, the new "
        f"measurement's rounds {spread:.0%} apart)"
    )
    return achieved_flops_per_s / best, min(spread, MAX_SPREAD), label


def _with_datasheet(peak: Peak, sheet: Peak | None) -> Peak:
    if sheet is None:
        return peak
    return replace(
        peak, label=f"{peak.label}; {sheet.label} ({peak.flops / sheet.flops:.0%} of it)"
    )


def get_peak(device, dtype, source: str = "auto", datasheet=None) -> Peak:
    """The MFU denominator: "measured", "datasheet", or "auto" (measured, the datasheet figure
    quoted beside it). `datasheet(device, dtype) -> Peak | None` looks vendor figures up: a tool
    (titanlite.tools.probe.datasheet.datasheet_peak) the caller hands in, as `titanlite train` does."""
    sources = ("auto", "measured", "datasheet")
    if source not in sources:
        raise TitanliteError(
            f"unknown peak source {source!r}{closest(source, sources)}: use one of them"
        )
    sheet = datasheet(device, dtype) if datasheet is not None else None
    if source == "datasheet":
        if sheet is None:
            how = (
                ""
                if datasheet
                else " (or hand in tools.probe.datasheet.datasheet_peak, as the CLI does)"
            )
            raise TitanliteError(
                f"no datasheet peak for {hardware.device_name(device)} in "
                f"{str(dtype).removeprefix('torch.')}: use source='measured'{how}"
            )
        return sheet
    return _with_datasheet(matmul_peak(device, dtype), sheet if source == "auto" else None)


def peak_for(device, dtype, source: str, dist_env, datasheet=None) -> Peak:
    """`get_peak` in a job: local rank 0 measures (and caches) first, the others read the cache
    after a barrier (ranks measuring at once would disturb each other)."""
    waits = dist_env.distributed and dist_env.local_rank != 0
    if waits:
        torch.distributed.barrier()
    peak = get_peak(device, dtype, source, datasheet)
    if dist_env.distributed and not waits:
        torch.distributed.barrier()
    return peak


class MatmulPeaks:
    """The peak finder `titanlite train` hands the trainer (`Trainer(cfg, peaks=MatmulPeaks())`):
    `find` gives the peak in force for the run's device, dtype and [metrics] peak source; `beaten`
    the one to use once a run has beaten it (measured again, once, and said)."""

    def find(self, device, dtype, source: str, sheet: Peak | None, dist_env) -> Peak:
        return peak_for(device, dtype, source, dist_env, lambda *_: sheet)

    def beaten(self, achieved: float, peak: Peak, device, dtype, say, sheet: Peak | None) -> Peak:
        return recheck_peak(achieved, peak, device, dtype, say, sheet)
