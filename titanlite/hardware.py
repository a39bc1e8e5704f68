"""What the machine can do: device, dtypes, peak matmul FLOP/s, memory bandwidth, memory use.

MFU (model FLOPs utilisation) = achieved FLOP/s / peak FLOP/s, so it is only as honest as the
peak. Here the default peak is *measured*: the best square-matmul rate this device reaches in
this dtype (`matmul_peak`, cached per device/dtype/threads/torch version for at most a week,
and re-measured once if a run beats it: `recheck_peak`). Vendor datasheet
peaks exist for common GPUs (`datasheet_peak`), always labelled "datasheet": they are upper
bounds that real kernels fall short of, and a CPU has none worth quoting.

Memory: `peak_memory_bytes(device)` reads a different counter per device - the CUDA
allocator's peak of live tensors, the Metal driver's current allocation on MPS, the process's
peak RSS on CPU - so the numbers are not comparable across devices. titanlite/memory.py (and
MEMORY_METRIC_DOC, re-exported here) says exactly what each one counts and why.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from . import datasheet
from .errors import TitanliteError, closest
from .device_policy import matmul_dtype  # noqa: F401 - the trainer's MFU dtype, beside the peaks
from .memory import MEMORY_METRIC_DOC, allocator_readings, peak_memory_bytes, reset_peak_memory  # noqa: F401

_DEVICE_TYPES = ("auto", "cuda", "mps", "cpu")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def detect_device(requested: str = "auto") -> torch.device:
    """The torch.device to use: "auto" picks cuda, then mps, then cpu."""
    text = str(requested).strip().lower()
    kind, _, index = text.partition(":")
    if kind not in _DEVICE_TYPES or (index and not index.isdigit()):
        raise TitanliteError(f"unknown device {requested!r}{closest(kind, _DEVICE_TYPES)}: "
                             "use auto, cpu, cuda, cuda:N or mps")
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "mps" if _mps_available() else "cpu"
        return torch.device(kind)
    fix = "use --training.device auto or cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise TitanliteError(f"device {requested!r} requested but no CUDA GPU is visible to torch "
                                 f"(torch.cuda.is_available() is False): {fix}")
        count = torch.cuda.device_count()
        if index and int(index) >= count:
            raise TitanliteError(f"device {requested!r} requested but torch sees {count} CUDA GPU(s) "
                                 f"(cuda:0..cuda:{count - 1}): use one of those or auto")
    if kind == "mps" and not _mps_available():
        raise TitanliteError(f"device {requested!r} requested but MPS is not available (needs "
                             f"Apple Silicon, macOS >= 12.3 and a torch built with MPS): {fix}")
    return torch.device(text)


def _mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def resolve_dtype(name, device) -> torch.dtype:
    """Map "bf16"/"bfloat16"/... to a torch.dtype, refusing one the device cannot run."""
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    key = str(name).strip().lower()
    if key not in _DTYPES:
        raise TitanliteError(f"unknown dtype {name!r}{closest(key, _DTYPES)}: "
                             "use float32, bfloat16 or float16")
    dtype, device = _DTYPES[key], torch.device(device)
    if device.type == "cuda" and dtype == torch.bfloat16:
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:  # bf16 tensor cores arrived with Ampere (sm_80)
            raise TitanliteError(bf16_refusal(device_name(device), (major, minor)))
    if device.type == "mps" and dtype == torch.bfloat16:
        try:  # Metal gained bf16 in macOS 14; probing is more reliable than parsing versions
            torch.ones(1, dtype=dtype, device=device)
        except (RuntimeError, TypeError):
            raise TitanliteError("bfloat16 is not supported by MPS on this macOS (needs macOS 14+): "
                                 "use --training.dtype float16 or float32") from None
    return dtype


def bf16_refusal(gpu_name: str, capability: tuple[int, int]) -> str:
    """The one line that refuses bf16 before Ampere. The advice is fp32 weights + fp16
    autocast: fp16 *weights* with GradScaler fail ("Attempting to unscale FP16 gradients"),
    because the scaler needs fp32 master weights to unscale into."""
    major, minor = capability
    return (f"bfloat16 needs a CUDA GPU with compute capability >= 8.0, but {gpu_name} is "
            f"sm_{major}{minor}: keep --training.dtype float32 and use --training.mixed_precision "
            f"fp16 (autocast + GradScaler), or auto")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        import subprocess
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip() or platform.machine()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device) -> str:
    """Human name: the GPU's marketing name, "Apple MPS (<chip>)", or "<cpu> (CPU, N threads)"."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        chip = _cpu_model() if sys.platform == "darwin" else ""
        return f"Apple MPS ({chip})" if chip else "Apple MPS"
    return f"{_cpu_model()} (CPU, {torch.get_num_threads()} threads)"


def synchronize(device) -> None:
    """Wait for queued GPU work: CUDA and MPS run asynchronously, so a timer without this
    measures only how fast Python can enqueue kernels."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_fn(fn, device, budget_s: float = 0.2) -> float:
    """Best seconds per call of fn(), spending about budget_s (always at least two calls).

    The minimum, not the mean: noise (other processes, clock ramps) only ever adds time, so the
    fastest run is the best estimate of what the hardware can do."""
    start = time.perf_counter()
    fn()  # warm-up: pays for first-touch allocation, kernel selection, cuBLAS handles
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    best = max(time.perf_counter() - t0, 1e-9)
    # Several calls between syncs, so launch + sync overhead does not swamp a microsecond kernel.
    iters = max(1, int(budget_s / 5 / best))
    while time.perf_counter() - start + iters * best <= budget_s:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        synchronize(device)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s
    source: str   # "measured" or "datasheet"
    label: str    # says where the number came from, for plots and logs


def _tf32_enabled() -> bool:
    """Whether float32 CUDA matmuls may use TF32 tensor cores (several times the FP32 rate)."""
    mode = getattr(torch.backends.cuda.matmul, "fp32_precision", None)  # torch >= 2.9 API
    if mode in ("tf32", "ieee"):
        return mode == "tf32"
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:  # legacy and new precision APIs were mixed
        return False


def _matmul_label(device, dtype) -> str:
    tf32 = " (TF32 allowed)" if torch.device(device).type == "cuda" and dtype == torch.float32 \
        and _tf32_enabled() else ""
    return f"{_dtype_name(dtype)}{tf32}"


def measure_matmul_peak(device, dtype, budget_s: float = 2.0) -> Peak:
    """Best FLOP/s of square matmuls, n = 128 upwards, within about budget_s seconds.

    Small n cannot fill the machine (too little work per launch, data fits in cache) and huge n
    may not fit the budget: on a CPU without bf16 units a bf16 matmul is emulated, tens of times
    slower than float32, and n=4096 would take minutes. So we climb in size and stop when the
    next size, predicted from the last one's rate, would not fit its share of the time left.
    The peak is the best rate seen at any size: noise only ever slows a run down."""
    device = torch.device(device)
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) and not fp8:
        raise TitanliteError(f"cannot measure a matmul peak in {dtype}: use float32, bfloat16, "
                             "float16 or float8_e4m3fn")
    # Small sizes are cheap and keep the peak honest on a busy CPU, where a small matmul that
    # stays on one thread can beat a big one whose threads wait on each other.
    sizes = [128, 256, 512, 1024, 2048, 4096] + ([8192] if device.type == "cuda" else [])
    deadline, best, best_n, last = time.perf_counter() + budget_s, 0.0, 0, 0.0
    for i, n in enumerate(sizes):
        share = (deadline - time.perf_counter()) / (len(sizes) - i)
        # Predict from the previous size's rate (emulated dtypes get *slower* as n grows):
        # warm-up + one timed call must fit this size's share of the time left.
        if last and 2 * (2 * n**3 / last) > share:
            break
        last = 2 * n**3 / time_fn(_square_matmul(n, device, dtype), device, share)
        if last > best:
            best, best_n = last, n
    return Peak(best, "measured", f"measured {_matmul_label(device, dtype)} matmul peak, "
                                  f"{device_name(device)} (best at n={best_n})")


def _square_matmul(n: int, device, dtype):
    """A no-argument n x n matmul in `dtype`. FP8 goes through torch._scaled_mm, the kernel
    FP8 Linear layers use (row-major A, column-major B, fp32 scales, bf16 out)."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        if torch.device(device).type == "cuda":  # MI300-class GPUs compute in the fnuz variant
            dtype = datasheet.fp8_dtypes_for(device_name(device))[0]
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype).t()  # column-major, as cuBLASLt wants
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def cache_dir() -> Path:
    """Where measured peaks are kept: $TITANLITE_CACHE_DIR, else ~/.cache/titanlite."""
    return Path(os.environ.get("TITANLITE_CACHE_DIR") or Path.home() / ".cache" / "titanlite")


PEAK_MAX_AGE_S = 7 * 24 * 3600  # a week: long enough to save the seconds, short enough to
# forget a measurement taken while something else was hogging the machine


def peak_is_stale(entry, now: float, threads: int, torch_version: str, device_name: str) -> str | None:
    """Why a cached peak must be measured again, or None if it can be used.

    A peak is a fact about one machine in one state: it changes with the thread count, the torch
    build (new kernels) and the device, and a measurement taken on a busy machine stays too low
    for as long as it is cached - inflating every later MFU. So entries carry those facts and
    expire after PEAK_MAX_AGE_S. Pure function of its arguments, so it is testable anywhere."""
    if not isinstance(entry, dict) or not {"flops", "label", "measured_at"} <= entry.keys():
        return "no usable cache entry"
    age = now - float(entry["measured_at"])
    if not 0 <= age <= PEAK_MAX_AGE_S:  # negative: a clock change; do not trust it either
        return f"measured {age / 86400:.1f} days ago (more than {PEAK_MAX_AGE_S / 86400:.0f})"
    for fact, value in (("threads", threads), ("torch", torch_version), ("device", device_name)):
        if entry.get(fact) != value:
            return f"measured with {fact}={entry.get(fact)!r}, now {value!r}"
    return None


def _cache_facts(device) -> dict:
    return {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": device_name(device)}


def matmul_peak(device, dtype, refresh: bool = False) -> Peak:
    """Measured matmul peak, cached on disk: measuring costs seconds, every run needs it.
    Re-measured when asked (refresh) or when `peak_is_stale` says the cached one is out of date."""
    device = torch.device(device)
    facts = _cache_facts(device)
    # Everything that changes the answer is in the key: a new torch or thread count re-measures.
    key = (f"{facts['device']} | {_matmul_label(device, dtype)} | "
           f"threads={facts['threads']} | torch={facts['torch']}")
    path = cache_dir() / "matmul_peaks.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):  # missing or corrupt: start afresh rather than fail
        table = {}
    entry = table.get(key)
    if not refresh and not peak_is_stale(entry, time.time(), facts["threads"], facts["torch"],
                                         facts["device"]):
        return Peak(entry["flops"], "measured", f"{entry['label']} [cached {entry['when']}]")
    peak = measure_matmul_peak(device, dtype)
    table[key] = {"flops": peak.flops, "label": peak.label, "when": time.strftime("%Y-%m-%d %H:%M"),
                  "measured_at": time.time(), **facts}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write-then-rename: a reader (or a crash) never sees half a JSON file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".matmul_peaks.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home must not stop training; it only costs a re-measure
        warnings.warn(f"could not cache the matmul peak in {path} ({e}): set TITANLITE_CACHE_DIR "
                      "to a writable folder", RuntimeWarning, stacklevel=2)
    return peak


_RECHECKED: set[str] = set()


def recheck_peak(achieved_flops_per_s: float, peak: Peak, device, dtype, say=print) -> Peak:
    """The peak to keep using after a device achieved `achieved_flops_per_s`.

    Achieving more than the peak means the peak is wrong - most often measured while the machine
    was busy. A measured peak is then re-measured, once per device and dtype in this process, and
    we say so in one line; if the run still beats the new one, `mfu` warns as before. Datasheet
    peaks are never re-measured (exceeding one is a FLOP-count bug, and `mfu` says so)."""
    device = torch.device(device)
    key = f"{device_name(device)} | {_matmul_label(device, dtype)}"
    if peak.source != "measured" or achieved_flops_per_s <= peak.flops or key in _RECHECKED:
        return peak
    _RECHECKED.add(key)
    fresh = _with_datasheet(matmul_peak(device, dtype, refresh=True), datasheet_peak(device, dtype))
    say(f"titanlite: this run reached {achieved_flops_per_s / 1e12:.4g} TFLOP/s, above the peak of "
        f"{peak.flops / 1e12:.4g} ({peak.label}); re-measured it: {fresh.flops / 1e12:.4g} TFLOP/s")
    return fresh


def _with_datasheet(peak: Peak, sheet: Peak | None) -> Peak:
    """A measured peak whose label quotes the datasheet figure beside it, where one exists."""
    if sheet is None:
        return peak
    return Peak(peak.flops, peak.source, f"{peak.label}; {sheet.label} ({peak.flops / sheet.flops:.0%} of it)")


def lookup_datasheet(gpu_name: str, dtype: torch.dtype, tf32: bool = False) -> Peak | None:
    """Datasheet peak for a GPU *name*, so the table is testable without the GPU."""
    hit = datasheet.lookup(gpu_name, dtype, tf32)
    return Peak(hit[0], "datasheet", hit[1]) if hit else None


def datasheet_peak(device, dtype) -> Peak | None:
    """Vendor peak for this GPU and dtype; None on CPU, MPS or an unlisted GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return lookup_datasheet(device_name(device), dtype, tf32=_tf32_enabled())


def get_peak(device, dtype, source: str = "auto") -> Peak:
    """The peak to divide by for MFU: "measured", "datasheet", or "auto" (measured, with the
    datasheet figure quoted beside it where one exists)."""
    if source not in ("auto", "measured", "datasheet"):
        raise TitanliteError(f"unknown peak source {source!r}"
                             f"{closest(source, ('auto', 'measured', 'datasheet'))}: "
                             "use auto, measured or datasheet")
    sheet = datasheet_peak(device, dtype)
    if source == "datasheet":
        if sheet is None:
            raise TitanliteError(f"no datasheet peak for {device_name(device)} in "
                                 f"{_dtype_name(dtype)}: use source='measured'")
        return sheet
    peak = matmul_peak(device, dtype)
    return _with_datasheet(peak, sheet) if source == "auto" else peak


def datasheet_mfu(achieved_flops_per_s: float, device, dtype) -> float | None:
    """MFU against the vendor's datasheet peak - the figure published MFUs (PaLM, nanoGPT,
    torchtitan) divide by, so ours can be compared with theirs. None where no datasheet
    figure exists (CPU, MPS, unlisted GPUs)."""
    sheet = datasheet_peak(device, dtype)
    return None if sheet is None else achieved_flops_per_s / sheet.flops


_WARNED: set[str] = set()


def mfu(achieved_flops_per_s: float, peak: Peak) -> float:
    """achieved / peak. Above 1 means the peak is wrong (stale cache, noisy measurement), so we
    say so once per peak - and return the true ratio rather than clamp it out of sight."""
    if peak.flops <= 0:
        raise TitanliteError(f"peak of {peak.flops} FLOP/s ({peak.label}) is not positive: "
                             "re-measure with matmul_peak(device, dtype, refresh=True)")
    ratio = achieved_flops_per_s / peak.flops
    key = peak.label.split(" [cached")[0]  # the same peak, whether measured now or read back
    if ratio > 1 and key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"MFU {ratio:.2f} > 1 against '{peak.label}': the peak is too low - "
                      "re-measure with matmul_peak(..., refresh=True) or use get_peak(..., "
                      "source='datasheet')", RuntimeWarning, stacklevel=2)
    return ratio


def measure_memory_bandwidth(device, nbytes: int = 256 * 2**20, budget_s: float = 1.0,
                             kind: str = "copy", dtype: torch.dtype = torch.float32) -> float:
    """Bytes/s the memory system sustains on nbytes (make it dwarf the last-level cache, tens of
    MiB, or you time the cache).

    "copy": dst.copy_(src), counting the read and the write (STREAM's convention).
    "read": stream an nbytes matrix through a matrix-vector product in `dtype` - read-only
    traffic, the pattern of LLM decoding. On CPUs this beats "copy" because each written cache
    line is first read in (write-allocate), a transfer the copy count does not see.
    "best": the larger of the two - the roof to draw on a roofline."""
    if kind not in ("copy", "read", "best"):
        raise TitanliteError(f"unknown bandwidth kind {kind!r}{closest(kind, ('copy', 'read', 'best'))}"
                             ": use copy, read or best")
    if kind == "best":
        return max(measure_memory_bandwidth(device, nbytes, budget_s / 2, "copy", dtype),
                   measure_memory_bandwidth(device, nbytes, budget_s / 2, "read", dtype))
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
