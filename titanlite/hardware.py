"""Which device, which dtypes, and its name: detect_device (cuda → mps → cpu), resolve_dtype
(refusing one the device cannot run), device_name, synchronize. How fast it is lives in peaks.py;
how much memory a step used in memory.py (MEMORY_METRIC_DOC says what each device's counter counts)."""

import contextlib
import os
import platform
import random
import subprocess
import sys
from pathlib import Path

import torch

from ._compat.torch_internals import set_cuda_allocator_settings
from .errors import TitanliteError, closest

_DEVICE_TYPES = ("auto", "cuda", "mps", "cpu")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def detect_device(requested: str = "auto") -> torch.device:
    """The torch.device to use: "auto" picks cuda, then mps, then cpu."""
    text = str(requested).strip().lower()
    kind, _, index = text.partition(":")
    if kind not in _DEVICE_TYPES or (index and not index.isdigit()):
        raise TitanliteError(
            f"unknown device {requested!r}{closest(kind, _DEVICE_TYPES)}: "
            "use auto, cpu, cuda, cuda:N or mps"
        )
    if kind == "auto":
        return torch.device(
            "cuda"
            if torch.cuda.is_available()
            else "mps"
            if torch.backends.mps.is_available()
            else "cpu"
        )
    fix = "use --training.device auto or cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise TitanliteError(
                f"device {requested!r} requested but no CUDA GPU is visible to torch "
                f"(torch.cuda.is_available() is False): {fix}"
            )
        count = torch.cuda.device_count()
        if index and int(index) >= count:
            raise TitanliteError(
                f"device {requested!r} requested but torch sees {count} CUDA GPU(s) "
                f"(cuda:0..cuda:{count - 1}): use one of those or auto"
            )
    if kind == "mps" and not torch.backends.mps.is_available():
        raise TitanliteError(
            f"device {requested!r} requested but MPS is not available (needs "
            f"Apple Silicon, macOS >= 12.3 and a torch built with MPS): {fix}"
        )
    return torch.device(text)


def resolve_dtype(name, device) -> torch.dtype:
    """Map "bf16"/"bfloat16"/... to a torch.dtype, refusing one the device cannot run."""
    key = str(name).removeprefix("torch.").strip().lower()  # a torch.dtype too
    if key not in _DTYPES:
        raise TitanliteError(
            f"unknown dtype {name!r}{closest(key, _DTYPES)}: use float32, bfloat16 or float16"
        )
    dtype, device = _DTYPES[key], torch.device(device)
    if device.type == "cuda" and dtype == torch.bfloat16:
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:  # bf16 tensor cores arrived with Ampere (sm_80)
            raise TitanliteError(bf16_refusal(device_name(device), (major, minor)))
    if device.type == "mps" and dtype == torch.bfloat16:
        try:  # Metal gained bf16 in macOS 14; probing is more reliable than parsing versions
            torch.ones(1, dtype=dtype, device=device)
        except (RuntimeError, TypeError):
            raise TitanliteError(
                "bfloat16 is not supported by MPS on this macOS (needs macOS 14+): "
                "use --training.dtype float16 or float32"
            ) from None
    return dtype


def bf16_refusal(gpu_name: str, capability: tuple[int, int]) -> str:
    """The one line that refuses bf16 before Ampere, advising fp32 weights + fp16 autocast: GradScaler needs
    fp32 master weights to unscale into (fp16 weights fail: "Attempting to unscale FP16 gradients")."""
    return (
        f"bfloat16 needs a CUDA GPU with compute capability >= 8.0, but {gpu_name} is "
        f"sm_{capability[0]}{capability[1]}: keep --training.dtype float32 and use "
        f"--training.mixed_precision fp16 (autocast + GradScaler), or auto"
    )


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    if sys.platform == "darwin":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return (
                subprocess.run(
                    ["sysctl", "-n", "machdep.cpu.brand_string"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout.strip()
                or platform.machine()
            )
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device, threads: int | None = None) -> str:
    """Human name: the GPU's marketing name, "Apple MPS (<chip>)", or "<cpu> (CPU, N threads)":
    the threads torch uses now, or those a run will use (`threads`)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        chip = _cpu_model() if sys.platform == "darwin" else ""
        return f"Apple MPS ({chip})" if chip else "Apple MPS"
    return (
        f"{_cpu_model()} (CPU, {(n := threads or torch.get_num_threads())} thread{'s' * (n != 1)})"
    )


def synchronize(device) -> None:
    """Wait for queued GPU work: CUDA and MPS run asynchronously, so a timer without this
    measures only how fast Python can enqueue kernels. The CPU (and meta, xla) need nothing."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def seed_everything(seed: int, deterministic: bool) -> None:
    """The same random numbers on every run with this seed (and, if asked, deterministic kernels)."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds CUDA and MPS generators
    if deterministic:
        # deterministic cuBLAS, before first use
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def use_allocator_settings(settings: str | None) -> None:
    """Apply CUDA allocator settings (device_policy.allocator_settings): through the environment
    before CUDA's first allocation, directly once it has started."""
    if settings is not None and torch.cuda.is_initialized():
        set_cuda_allocator_settings(settings)
    elif settings is not None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = settings
