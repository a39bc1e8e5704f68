import os
from pathlib import Path

import pytest

# Keep tests away from the user's caches and make them quiet and repeatable.
os.environ.setdefault("MPLBACKEND", "Agg")
# torchft's Rust side logs every quorum at INFO to stderr, as set when it is first imported; the CLI
# and notebooks quiet it (quiet_third_party), and a test may import it before either does.
os.environ.setdefault("RUST_LOG", "warn")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """One data cache (corpus tokens, tokenizer) shared by the tests of a session."""
    return tmp_path_factory.mktemp("titanlite-data")


@pytest.fixture(scope="session", autouse=True)
def _isolated_peak_cache(tmp_path_factory):
    """Tests never read or write the user's ~/.cache/titanlite. The float32 peak is measured
    once, first, while the machine is quiet: measured later, under the load of a notebook
    kernel plus JupyterLab plus Chromium on 2 cores, a peak can come out so low that an
    honest step exceeds it (MFU > 100%), which the notebooks rightly refuse."""
    cache = tmp_path_factory.mktemp("titanlite-cache")
    old = os.environ.get("TITANLITE_CACHE_DIR")
    os.environ["TITANLITE_CACHE_DIR"] = str(cache)  # inherited by notebook kernels too
    import torch

    from titanlite.tools.probe import matmul_peak

    # A measurement too noisy to keep (two workers starting at once, say) is measured again,
    # a few times, so that the session starts with a cached peak if the machine allows one.
    for _ in range(4):
        peak = matmul_peak.matmul_peak(torch.device("cpu"), torch.float32, refresh=True)
        if "too noisy" not in peak.label:
            break
    yield cache
    if old is None:
        os.environ.pop("TITANLITE_CACHE_DIR", None)
    else:
        os.environ["TITANLITE_CACHE_DIR"] = old


def tiny_overrides(data_dir: Path, tmp_path: Path, **extra) -> dict:
    """A seconds-long debug run: small tokenizer, short sequences, logs in tmp_path."""
    o = {
        "data.data_dir": str(data_dir),
        "data.vocab_size": 512,
        "training.steps": 12,
        "training.batch_size": 4,
        "training.seq_len": 32,
        "scheduler.warmup_steps": 2,
        "eval.every": 6,
        "eval.batches": 2,
        "eval.sample_tokens": 8,
        "metrics.log_dir": str(tmp_path / "runs"),
        "metrics.run_name": "t",
        "metrics.progress": False,
    }
    o.update(extra)
    return o


def parity_overrides(data_dir: Path, tmp_path: Path, **extra) -> dict:
    """A deterministic tiny run to compare a layout with one process on the same global batch of 8,
    validating every 2 steps; no run name, so each launch gets a folder of its own."""
    o = tiny_overrides(
        data_dir,
        tmp_path,
        **{"eval.every": 2, "training.deterministic": True, "training.batch_size": 8, **extra},
    )
    o.pop("metrics.run_name")
    return o


def run_torchrun(script, *args, nproc: int = 2, timeout: float = 120, torchrun: bool = False):
    """Run `script` on `nproc` ranks of this machine (1 thread each), as `torchrun script args`
    would, through the launcher's warm path (ranks forked from a server with torch imported:
    seconds, not a torchrun start-up each); `torchrun=True` runs torchrun itself, for the tests
    of its own entry. The test fails with the ranks' output if the job does."""
    import subprocess
    import sys
    import tempfile

    from titanlite import TitanliteError
    from titanlite.tools.jobs.launcher import launch_script, rank_output

    if not torchrun:
        run_dir = Path(tempfile.mkdtemp(prefix="ranks-"))
        try:
            return launch_script(
                [script, *args], nproc, run_dir=run_dir, threads=1, timeout_s=timeout
            )
        except TitanliteError as e:
            out, err = rank_output(run_dir, "stdout"), rank_output(run_dir)
            pytest.fail(f"{e}\n{out[-3000:]}{err[-3000:]}")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # its agent binds a port the kernel picks: none to race for
        "--nproc-per-node",
        str(nproc),
        str(script),
        *map(str, args),
    ]
    proc = subprocess.run(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def torchrun_environment(monkeypatch, rank: int, local_rank: int, world: int, local_world: int):
    """The variables torchrun gives rank `rank` of a `world`-rank job (`local_world` per machine)."""
    for name, value in {
        "RANK": rank,
        "LOCAL_RANK": local_rank,
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": local_world,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": 29500,
    }.items():
        monkeypatch.setenv(name, str(value))


def join_as_rank(
    monkeypatch, rank, local_rank, world, local_world, others: dict, fake_group: bool = False
) -> dict:
    """This process as rank `rank` of a torchrun job whose other ranks already wrote their GPUs to
    the rendezvous store (`others`: rank -> "HOST/uuid", HOST for this machine's name). NCCL never
    starts: init_process_group records its arguments (returned, filled once it is called) and,
    with `fake_group`, starts torch's fake process group in NCCL's place."""
    import socket

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlite.distributed import env

    store = dist.HashStore()
    for r, gpu in others.items():
        gpu = gpu.replace("HOST", socket.gethostname())
        dist.PrefixStore("titanlite-gpus", store).set(str(r), gpu)
    started = {}
    init = dist.init_process_group

    def init_process_group(backend, **kwargs):
        started.update(kwargs, backend=backend)
        if fake_group:
            init("fake", store=FakeStore(), rank=kwargs["rank"], world_size=kwargs["world_size"])

    monkeypatch.setattr(env, "die_with_parent", lambda: None)
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: iter([(store, rank, world)]))
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    if not fake_group:  # no group starts: the job must not look joined already
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
    torchrun_environment(monkeypatch, rank, local_rank, world, local_world)
    return started
