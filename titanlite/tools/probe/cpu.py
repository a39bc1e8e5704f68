"""Training on CPUs: what this CPU has, how its threads scale, what oversubscription costs,
what torchrun does to thread counts, and where a CPU run's memory goes.

    features = cpu_features()                     # SIMD level, bf16 units, cores, threads
    samples = thread_scaling(matmul_task(512), [1, 2], rounds=3)
    verdict = bf16_verdict(bf16_flops / fp32_flops, features)

Timings here are lists of repeated samples, never one number: on a shared machine the spread
says how much of a difference is noise.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...errors import TitanliteError
from .precision_support import FAST_CPU_FLAGS, cpu_flags

# ----- what this CPU has ----------------------------------------------------------------------


@dataclass(frozen=True)
class CpuFeatures:
    capability: str  # the SIMD level torch dispatches its kernels to: DEFAULT, AVX2, AVX512, ...
    # x86 flags (/proc/cpuinfo); None on ARM (Apple Silicon)
    flags: frozenset[str] | None = field(repr=False)
    cores: int  # cores this process may run on (the affinity mask, not the whole machine)
    threads: int  # torch's intra-op threads now

    @property
    def native_bf16(self) -> bool | None:
        """AVX-512-BF16 or AMX: units that multiply bf16 natively. None: flags unreadable."""
        if self.flags is None:
            return None
        return any(f in self.flags for f in FAST_CPU_FLAGS["bf16"])

    @property
    def amx(self) -> bool:
        """Intel AMX tiles (Sapphire Rapids and later): bf16 matmuls on a matrix unit."""
        return self.flags is not None and "amx_bf16" in self.flags


def usable_cores() -> int:
    """Cores this process may use: a container or `taskset` can allow fewer than the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity masks
        return os.cpu_count() or 1


def cpu_features() -> CpuFeatures:
    flags = cpu_flags()
    return CpuFeatures(
        capability=torch.backends.cpu.get_cpu_capability(),
        flags=frozenset(flags) if flags is not None else None,
        cores=usable_cores(),
        threads=torch.get_num_threads(),
    )


def bf16_verdict(ratio: float, features: CpuFeatures, spread: float = 0.2) -> str:
    """What a measured bf16/fp32 matmul-rate `ratio` means on a CPU with `features`.
    `spread` is the relative noise of the measurement: closer than that is "about the same"."""
    units = {
        True: "has bf16 units (AVX-512-BF16/AMX)",
        False: "has no bf16 units",
        None: "bf16 units unknown (flags unreadable)",
    }[features.native_bf16]
    if ratio > 1 + spread:
        kind = "fast native bf16"
    elif ratio < 1 / (1 + spread):
        kind = "slow bf16 (emulated or converted around fp32 math)"
    else:
        kind = "bf16 about as fast as fp32 (no gain, no loss)"
    return f"{kind}: bf16 ran at {ratio:.2f}x the fp32 rate; this CPU {units}"


# ----- threads ---------------------------------------------------------------------------------


@contextlib.contextmanager
def num_threads(n: int):
    """torch.set_num_threads(n) for a block, restored afterwards."""
    if n < 1:
        raise TitanliteError(f"threads must be >= 1, got {n}")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def matmul_task(n: int = 512, dtype: torch.dtype = torch.float32, seconds: float = 0.2):
    """A timing task: square matmuls for about `seconds`; returns GFLOP/s."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)

    def run() -> float:
        a @ b  # warm-up: first call allocates and may pick a kernel
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            a @ b
            count += 1
        return 2 * n**3 * count / elapsed / 1e9

    return run


def thread_scaling(task, thread_counts, rounds: int = 3) -> dict[int, list[float]]:
    """`task()` (a rate) at each thread count, `rounds` times. The counts take turns round by
    round, so a burst of load from elsewhere hits all of them rather than one."""
    samples: dict[int, list[float]] = {n: [] for n in thread_counts}
    for _ in range(rounds):
        for n in thread_counts:
            with num_threads(n):
                samples[n].append(task())
    return samples


def relative_spread(samples: list[float]) -> float:
    """(max - min) / median: how far apart repeated measurements of one thing landed."""
    return (max(samples) - min(samples)) / statistics.median(samples) if len(samples) > 1 else 0.0


def _matmul_worker(jobs, out, n: int) -> None:
    matmul_task(n, seconds=0.02)()  # imports, first kernels: before any timed window
    out.put("ready")
    while (job := jobs.get()) is not None:
        threads, seconds, start_at = job
        torch.set_num_threads(threads)
        time.sleep(max(0.0, start_at - time.time()))  # all workers of a layout start together
        out.put(matmul_task(n, seconds=seconds)())


def oversubscription(layouts, seconds: float = 1.0, n: int = 384) -> dict[tuple[int, int], float]:
    """Total GFLOP/s of P processes × T threads each, all multiplying at once, per (P, T) in
    `layouts`. More threads than cores makes OpenMP threads wait for each other (each parallel
    region ends at a barrier, and a descheduled thread holds everyone up)."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: a forked OpenMP runtime can hang
    out = ctx.Queue()
    workers = [
        (ctx.Process(target=_matmul_worker, args=(jobs, out, n)), jobs)
        for jobs in (ctx.Queue() for _ in range(max(p for p, _ in layouts)))
    ]
    totals = {}
    try:
        for w, _ in workers:
            w.start()
        for _ in workers:
            out.get(timeout=300)
        for procs, threads in layouts:
            start_at = time.time() + 0.2
            for _, jobs in workers[:procs]:
                jobs.put((threads, seconds, start_at))
            totals[(procs, threads)] = sum(out.get(timeout=300) for _ in range(procs))
    finally:
        for _, jobs in workers:
            jobs.put(None)
        for w, _ in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.terminate()
    return totals


def torchrun_threads(
    nproc: int = 2, omp_num_threads: str | None = None, timeout_s: float = 180
) -> list[dict]:
    """Start `torchrun --nproc-per-node nproc` on a job that only reports, per rank, its
    OMP_NUM_THREADS and torch.get_num_threads(). omp_num_threads None: unset, torchrun's default."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp_num_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_num_threads)
    with tempfile.TemporaryDirectory(prefix="titanlite-threads-") as out:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "-m",
            "titanlite.tools.probe.cpu",
            out,
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise TitanliteError(
                f"torchrun exited with {proc.returncode}: "
                f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
            )
        reports = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    return sorted(reports, key=lambda r: r["rank"])


def _report_threads(out: str) -> None:  # what each torchrun worker above runs
    rank = int(os.environ.get("RANK", 0))
    (Path(out) / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


# ----- memory ----------------------------------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set size now (Linux: VmRSS; elsewhere the lifetime peak)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    from ...memory import peak_memory_bytes

    return peak_memory_bytes("cpu")


def training_memory_formula(
    num_params: int, args, batch: int, seq_len: int, vocab: int
) -> dict[str, int]:
    """Predicted bytes of fp32 training with AdamW: weights, gradients and two moments at 4 bytes
    each (16 bytes/parameter, titanlite.tools.predict.zero at stage 0), the activations saved for
    backward (titanlite.efficiency.activation_checkpoint), and the loss's three n × vocab fp32 tensors
    (logits, log-probabilities, their gradient) that the activation count leaves out."""
    from ..predict.activation_memory import activation_memory_estimate
    from ..predict.zero import zero_bytes_per_rank

    state = zero_bytes_per_rank(num_params, 1, 0, precision="fp32")
    out = {
        "weights": state["params"],
        "gradients": state["grads"],
        "adam moments": state["optimizer"],
        "activations": activation_memory_estimate(args, batch, seq_len, 4, "none"),
        "logits and loss": 3 * 4 * batch * seq_len * vocab,
    }
    out["total"] = sum(out.values())
    return out


def _measure_training_memory(cfg, out) -> None:  # runs in a fresh process, see below
    import gc

    from ...train import Trainer

    warm = Trainer(_tiny_copy(cfg))  # data, tokenizer, kernels, the cached peak: not the model
    warm.fit()  # one step
    del warm
    gc.collect()
    before = rss_bytes()
    trainer = Trainer(cfg)
    history = trainer.fit()
    out.put(
        {
            "before": before,
            "peak": max(r["peak_memory_bytes"] for r in history.train[1:]),
            "num_params": trainer.num_params,
            "model_args": trainer.model_args,
            "vocab": trainer.data.vocab_size,
            "batch": trainer.micro_batch,
        }
    )


def _tiny_copy(cfg):
    import copy

    tiny = copy.deepcopy(cfg)
    tiny.model.preset, tiny.model.dim, tiny.model.n_layers = "debug", None, None
    tiny.training.steps, tiny.training.batch_size, tiny.training.seq_len = (
        1,
        1,
        cfg.training.seq_len,
    )
    tiny.training.threads = cfg.training.threads
    tiny.eval.every, tiny.eval.sample_tokens = 0, 1
    return tiny


def training_memory(cfg, timeout_s: float = 300) -> dict:
    """Train `cfg` (a few steps, fp32, no eval) in a fresh process and report its RSS before the
    trainer is built and its peak during steps 2+ (when the Adam moments exist). A fresh process,
    so memory freed by earlier work in this one cannot be reused and hide the increase."""
    if cfg.training.steps < 2:
        raise TitanliteError(
            "training_memory needs cfg.training.steps >= 2: the Adam moments "
            "appear in step 1, so the peak is read from step 2 on"
        )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_measure_training_memory, args=(cfg, out))
    proc.start()
    try:
        result = out.get(timeout=timeout_s)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    result["increase"] = result["peak"] - result["before"]
    return result


if (
    __name__ == "__main__"
):  # torchrun ... -m titanlite.tools.probe.cpu <out dir>: see torchrun_threads
    _report_threads(sys.argv[1])
