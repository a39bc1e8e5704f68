"""Start a multi-process job from a notebook cell, watch it live, and always clean up.

    result = launch(cfg, nproc=2, callbacks=[LivePlot()])            # a training run
    outs = launch_function("titanlite.labs.nb08_fsdp_and_zero:state_memory", nproc=2, strategy="ddp")

`launch` runs exactly what you would type in a shell,

    torchrun --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P -m titanlite train --config <run>/config.toml

and, while it runs, tails every rank's metrics file into your callbacks (the live plot). When a
rank fails, torchrun stops the others; we then show the failing rank's traceback and raise one
clear error. Interrupting the kernel, a timeout or a failure all end in `_stop`, which leaves no
process behind (each worker also asks the kernel to kill it if its torchrun agent dies).

`titanlite train --nproc-per-node N ...` is `launch(cfg, N, echo=True)` from a shell: bad input is
refused here, in one line, before any rank starts; a failed job is one line too (after the failing
rank's traceback), and its `exit_code` is what the command exits with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import TitanliteError
from ...paths import check_output_dir, run_dir_refusal

JOB_ENV = "TITANLITE_JOB_ID"  # set in every process of a job: how we find them to clean up
STOP_GRACE_S = 5.0  # how long stopped processes get to exit before they are killed
_FORKED: dict = {}  # job id -> (the fork server, its ranks' pids): job_processes asks it


class JobFailed(TitanliteError):
    """A job that ended because a rank failed (or hung past the timeout), said in one line.
    `exit_code`: what `titanlite train --nproc-per-node` exits with, as one process would have: 2
    where the ranks refused bad input they alone could see (an empty data file), else 1."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class LaunchResult:
    run_dir: Path
    command: str
    wall_s: float
    job_id: str
    records: list[dict] = field(default_factory=list)  # every rank's records, in arrival order
    warm: bool = (
        False  # ranks forked from the warm server (tools/jobs/forkserver.py), not torchrun's
    )
    first_step_s: float | None = None  # launch -> the last rank's step 1 began (training runs)
    arrivals: dict = field(default_factory=dict, repr=False)  # rank -> its first train record's

    def rank(self, r: int, kind: str = "train") -> list[dict]:
        return [x for x in self.records if x.get("rank", 0) == r and x.get("kind") == kind]

    @property
    def train(self) -> list[dict]:
        return self.rank(0)

    @property
    def losses(self) -> list[float]:
        """Rank 0's loss per step. After a restart the steps since the last checkpoint were
        trained twice: the run's loss for a step is its last (the kept) one."""
        last = {x["step"]: x["loss"] for x in self.train}
        return [last[step] for step in sorted(last)]

    @property
    def attempts(self) -> int:
        return 1 + max((x.get("attempt", 0) for x in self.records), default=0)


# ----- the two entry points ------------------------------------------------------------------


def launch(
    cfg=None,
    nproc: int = 2,
    *,
    overrides: dict | None = None,
    callbacks=(),
    timeout_s: float | None = None,
    port: int | None = None,
    max_restarts: int = 0,
    echo: bool = False,
) -> LaunchResult:
    """Train `cfg` (a Config, a TOML path or None for defaults) with `nproc` processes.
    `echo`: show the ranks' output as it comes (_Echo), progress lines included; without it the
    callbacks (a live plot) are the progress."""
    from ...config import Config, load_config
    from ...preflight import preflight, tokenizer_size
    from ..formats.hf_start import HuggingFaceStart

    _check_nproc(nproc)  # before anything else uses it
    cfg = cfg if isinstance(cfg, Config) else load_config(cfg)
    cfg = cfg.with_overrides(overrides or {}, source="launch overrides")  # a copy we may edit
    # The same one preflight every rank will run, here first: bad input costs no process start-up.
    start_from = HuggingFaceStart.from_config(cfg)
    dims = preflight(cfg, nproc, tokenizer_size(cfg, start_from), start_from).dims
    t = cfg.training
    layout = dims.describe().replace(" × ", "-").replace("=", "")
    name = cfg.metrics.run_name or f"{cfg.model.preset}-{layout}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg.metrics.run_name = name
    cfg.metrics.progress = cfg.metrics.progress and echo  # else the live plot is the progress
    run_dir = check_output_dir(Path(cfg.metrics.log_dir) / name, "run folder (metrics.log_dir)")
    # Another run in that folder: refused (or deleted, with metrics.overwrite) before this job writes there.
    if refusal := run_dir_refusal(
        run_dir, {"config": dataclasses.asdict(cfg)}, cfg.checkpoint, cfg.metrics.overwrite
    ):
        raise TitanliteError(refusal)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(dataclasses.asdict(cfg)))
    result = _run(
        ["-m", "titanlite", "train", "--config", str(run_dir / "config.toml")],
        nproc,
        run_dir,
        device=t.device,
        backend=cfg.parallel.backend,
        threads=t.threads,
        callbacks=callbacks,
        timeout_s=timeout_s,
        port=port,
        max_restarts=max_restarts,
        echo=echo,
    )
    how = "forked from the warm server" if result.warm else "started by torchrun"
    if result.first_step_s is not None:
        print(
            f"launch: {nproc} ranks {how}; step 1 began {result.first_step_s:.1f} s after the launch"
        )
    return result


def launch_function(
    target: str,
    nproc: int = 2,
    *,
    device: str = "cpu",
    backend: str = "auto",
    timeout_s: float | None = 300,
    callbacks=(),
    log_dir: str = "runs",
    echo: bool = False,
    **kwargs,
) -> list:
    """Run `module:function(**kwargs)` in every rank of a fresh job; return each rank's result.
    The process group is initialised before the call (see run_function.py)."""
    import torch

    if ":" not in target:
        raise TitanliteError(f"target '{target}' must look like 'package.module:function'")
    run_dir = (
        Path(log_dir)
        / f"fn-{target.split(':')[1]}-{nproc}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "target": target,
            "kwargs": kwargs,
            "device": device,
            "backend": backend,
            "timeout_s": timeout_s or 300,
        },
        run_dir / "function.pt",
    )
    _run(
        ["-m", "titanlite.tools.jobs.run_function", str(run_dir)],
        nproc,
        run_dir,
        device=device,
        backend=backend,
        threads=None,
        callbacks=callbacks,
        timeout_s=timeout_s,
        port=None,
        max_restarts=0,
        echo=echo,
    )
    return [torch.load(run_dir / f"result.rank{r}.pt", weights_only=False) for r in range(nproc)]


def launch_script(
    argv: list[str],
    nproc: int = 2,
    *,
    run_dir: str | Path,
    threads: int | None = None,
    timeout_s: float | None = 300,
) -> LaunchResult:
    """`torchrun --nproc-per-node nproc <argv>` (a script and its arguments, or "-m", a module
    and its arguments), through the same warm path as `launch`; each rank's output in
    run_dir/logs. Raises TitanliteError, having shown the failing rank's traceback, if a rank fails."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return _run(
        [str(a) for a in argv],
        nproc,
        run_dir,
        device="cpu",
        backend="auto",
        threads=threads,
        callbacks=(),
        timeout_s=timeout_s,
        port=None,
        max_restarts=0,
        echo=False,
    )


def rank_output(run_dir: str | Path, stream: str = "stderr") -> str:
    """Every rank's `stream` (stdout or stderr) of the jobs launched into `run_dir`, rank by rank."""
    logs = sorted(Path(run_dir).glob(f"logs/**/attempt_*/*/{stream}.log"))
    return "".join(f"--- {p.parent.name} ---\n{p.read_text(errors='replace')}" for p in logs)


# ----- the machinery -------------------------------------------------------------------------


def _run(
    module_args,
    nproc,
    run_dir: Path,
    *,
    device,
    backend,
    threads,
    callbacks,
    timeout_s,
    port,
    max_restarts,
    echo,
) -> LaunchResult:
    start = time.perf_counter()  # the launch: a warm server's first start counts in it
    _check_machine(nproc, device, backend)
    port = None if port is None else _check_port(port)  # None: each path binds port 0
    job_id = uuid.uuid4().hex
    env = dict(os.environ, PYTHONUNBUFFERED="1", TITANLITE_JOB_DIR=str(run_dir))
    env[JOB_ENV] = job_id
    # Ranks on one CPU share its cores; torchrun would otherwise default to 1 thread and warn.
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    server = _warm_server() if max_restarts == 0 else None
    if server is not None:
        return _run_forked(
            server,
            module_args,
            nproc,
            run_dir,
            env,
            port,
            job_id,
            timeout_s,
            callbacks,
            echo,
            start,
        )
    return _run_torchrun(
        module_args,
        nproc,
        run_dir,
        env,
        port,
        job_id,
        timeout_s,
        callbacks,
        max_restarts,
        echo,
        start,
    )


LAUNCH_ENV = "TITANLITE_LAUNCH"  # "torchrun" turns the warm start off; set in every forked rank


def launch_path(max_restarts: int = 0) -> str:
    """Which way `launch` starts the next job: "fork" (ranks forked from a warm server that has
    torch and titanlite imported, tools/jobs/forkserver.py) or "torchrun" (the command it shows).
    torchrun for restarts (its agent restarts the job), off Linux, or when TITANLITE_LAUNCH=torchrun."""
    if max_restarts or not sys.platform.startswith("linux"):
        return "torchrun"
    return "torchrun" if os.environ.get(LAUNCH_ENV, "fork") == "torchrun" else "fork"


def _warm_server():
    """The fork server of this process, or None where jobs go through torchrun."""
    if launch_path() != "fork":
        return None
    from .forkserver import ForkServer, ForkServerError

    try:
        return ForkServer.shared()
    except ForkServerError as e:
        warnings.warn(f"launching through torchrun: {e}", stacklevel=4)
        return None


def _run_torchrun(
    module_args, nproc, run_dir, env, port, job_id, timeout_s, callbacks, max_restarts, echo, start
) -> LaunchResult:
    # Restartable rendezvous: c10d (not static --master-addr/--master-port) and workers on a
    # store of their own. With torchrun's shared store a restarted attempt can read the dead
    # attempt's gloo addresses and fail with "Connection refused" or hang (torch 2.13, seen
    # here; pytorch/pytorch#135712), so --max-restarts would never recover.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env[LAUNCH_ENV] = "torchrun"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port or 0}",  # 0: the agent binds a port the kernel picks (as --standalone)
        "--rdzv-id",
        job_id[:12],
        "--max-restarts",
        str(max_restarts),
        "--log-dir",
        str(run_dir / "logs"),
        "--redirects",
        "3",
        *module_args,
    ]
    shown = "torchrun " + shlex.join(cmd[3:])
    log = open(run_dir / "launcher.log", "w")
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: one kill reaches it
        preexec_fn=_dies_with_us(),
    )
    tail = _Tail(run_dir)
    echoes = _Echo(run_dir / "logs", job_id) if echo else None
    result = LaunchResult(run_dir=run_dir, command=shown, wall_s=0.0, job_id=job_id)
    try:
        while proc.poll() is None:
            _deliver(tail.read(), result, callbacks)
            if echoes is not None:
                echoes.show()
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                _stop(proc, job_id)
                raise _timed_out(timeout_s, tail, nproc, run_dir)
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(proc, job_id)
        print(f"interrupted: stopped all {nproc} ranks of {run_dir.name}", file=sys.stderr)
        raise
    finally:
        _stop(proc, job_id)  # a no-op when the job ended by itself
        log.close()
        if echoes is not None:
            echoes.show()
    _finish(result, tail, callbacks, start)
    if proc.returncode != 0:
        raise _failure(run_dir, proc.returncode, tail.last_steps())
    return result


def _run_forked(
    server, module_args, nproc, run_dir, env, port, job_id, timeout_s, callbacks, echo, start
) -> LaunchResult:
    """The job torchrun would run, its ranks forked from `server`: the same environment per rank
    (RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*), logs in the same places
    (logs/<id>/attempt_0/<rank>/), the same teardown when one rank fails (the others are stopped),
    the same error reports. No agent: this loop is the agent."""
    from .forkserver import ForkServerError

    logs = run_dir / "logs" / job_id[:12] / "attempt_0"
    store = _job_store(port)
    port = store.port
    shown = "torchrun " + shlex.join(
        ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        + module_args
    )
    result = LaunchResult(run_dir=run_dir, command=shown, wall_s=0.0, job_id=job_id, warm=True)
    tail, ranks = _Tail(run_dir), {}
    for rank in range(nproc):
        folder = logs / str(rank)
        folder.mkdir(parents=True, exist_ok=True)
        rank_env = dict(env, **_torchrun_env(rank, nproc, port, job_id))
        rank_env[LAUNCH_ENV] = "fork"
        rank_env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # every rank a client of `store`
        rank_env["TORCHELASTIC_ERROR_FILE"] = str(folder / "error.json")
        ranks[rank] = server.spawn(
            module_args,
            rank_env,
            os.getcwd(),
            str(folder / "stdout.log"),
            str(folder / "stderr.log"),
        )
    _FORKED[job_id] = (server, list(ranks.values()))
    echoes = _Echo(run_dir / "logs", job_id) if echo else None
    failed: list[dict] = []  # in the order seen: the first is the root cause
    try:
        while True:
            _deliver(tail.read(), result, callbacks)
            if echoes is not None:
                echoes.show()
            exits = server.exits()  # in the order the ranks ended
            rank_of = {pid: rank for rank, pid in ranks.items()}
            for pid, code in exits.items():
                rank = rank_of.get(pid)
                if code and rank is not None and not any(f["rank"] == rank for f in failed):
                    failed.append(
                        {"rank": rank, "code": code, "error_file": _error_file(logs, rank)}
                    )
            if failed or all(pid in exits for pid in ranks.values()):
                break
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                _stop_forked(server, ranks, job_id)
                raise _timed_out(timeout_s, tail, nproc, run_dir)
            time.sleep(0.05)
        if failed:  # as torchrun's agent does: one rank failed, the job is over
            others = _stop_forked(server, ranks, job_id)
            failed += [
                {"rank": r, "code": c, "error_file": _error_file(logs, r)}
                for r, c in others.items()
                if c and not any(f["rank"] == r for f in failed)
            ]
    except KeyboardInterrupt:
        _stop_forked(server, ranks, job_id)
        print(f"interrupted: stopped all {nproc} ranks of {run_dir.name}", file=sys.stderr)
        raise
    except ForkServerError as e:  # the server died mid-job, and its ranks with it: one line
        raise JobFailed(f"{e} (the job's ranks ended with it; logs in {logs})") from None
    finally:
        _stop_forked(server, ranks, job_id)  # a no-op when every rank has ended
        del store  # its server stops: no rank is left to read it
        if echoes is not None:
            echoes.show()
    _finish(result, tail, callbacks, start)
    if failed:
        raise _failure_of(run_dir, failed, tail.last_steps())
    return result


def _torchrun_env(rank: int, nproc: int, port: int, job_id: str) -> dict:
    """What torchrun's agent sets for local rank `rank` of a one-machine job of `nproc`."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": job_id[:12],
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def _error_file(logs: Path, rank: int) -> Path | None:
    path = logs / str(rank) / "error.json"
    return path if path.exists() else None


def _stop_forked(server, ranks: dict[int, int], job_id: str, grace_s: float = STOP_GRACE_S):
    """Stop every rank still running (SIGTERM to its session, SIGKILL after `grace_s`) and
    whatever they started; return {rank: exit status} of all ranks."""
    pids = list(ranks.values())
    live = [pid for pid in pids if pid not in _exits(server, pids)]
    for pid in live:
        _signal_group(pid, signal.SIGTERM)  # each rank leads its own session (setsid)
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        time.sleep(0.02)
        live = [pid for pid in live if pid not in _exits(server, pids)]
    for pid in live:
        _signal_group(pid, signal.SIGKILL)
    while live:
        time.sleep(0.02)
        live = [pid for pid in live if pid not in _exits(server, pids)]
    _signal_all(job_processes(job_id), signal.SIGKILL)  # a rank's own children: checkpoint writers
    exits = _exits(server, pids)
    return {rank: exits[pid] for rank, pid in ranks.items()}


def _exits(server, pids) -> dict[int, int]:
    """server.exits(), also once the server is gone - a Ctrl-C in a terminal reaches the whole
    foreground process group, the server with this process: its ranks went with it (each asked
    the kernel for a SIGKILL when it dies), so a rank not seen to end counts as killed."""
    from .forkserver import ForkServerError

    try:
        return server.exits()
    except ForkServerError:
        return {pid: -int(signal.SIGKILL) for pid in pids} | server.exited


class _Echo:
    """The ranks' output as it comes (`launch(echo=True)`, `titanlite train --nproc-per-node`):
    rank 0's as it is - the run's own report and progress, what one process prints - and the
    other ranks' prefixed [rank<r>]:, as torchrun's --tee does. Except a traceback (from its first
    line on: a dying rank's last words) and a `titanlite: error:` line: the launcher reports the
    failure itself, once, root cause first, where N ranks' copies and their peers' "connection
    closed" would bury it. Reads the job's own logs (<logs>/<job id>*/attempt_*/<rank>/), every
    attempt's, fork or torchrun."""

    def __init__(self, logs: Path, job_id: str):
        self.pattern = f"{job_id[:12]}*/attempt_*/*/std*.log"
        self.logs, self.offsets, self.withheld = logs, {}, set()

    def show(self) -> None:
        for path in sorted(self.logs.glob(self.pattern)):
            with path.open("rb") as f:
                f.seek(self.offsets.get(path, 0))
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a half-written line waits
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            rank, stream = int(path.parent.name), path.stem
            for line in complete.decode(errors="replace").splitlines():
                if line.startswith("Traceback (most recent call last)"):
                    self.withheld.add(path)
                if path in self.withheld or line.startswith("titanlite: error:"):
                    continue
                out = sys.stdout if stream == "stdout" else sys.stderr
                print(line if rank == 0 else f"[rank{rank}]:{line}", file=out, flush=True)


def _timed_out(timeout_s, tail, nproc, run_dir) -> JobFailed:
    return JobFailed(
        f"the job did not finish within {timeout_s:.0f} s (last step per "
        f"rank: {tail.last_steps() or 'none logged'}); all {nproc} ranks "
        f"were stopped: raise timeout_s, or look for a hung rank in {run_dir / 'logs'}"
    )


def _finish(result: LaunchResult, tail, callbacks, start: float) -> None:
    _deliver(tail.read(), result, callbacks)
    result.wall_s = time.perf_counter() - start
    if result.arrivals:
        result.first_step_s = max(result.arrivals.values()) - start
    for cb in callbacks:
        if hasattr(cb, "on_train_end"):
            cb.on_train_end()


def _deliver(records, result, callbacks) -> None:
    for record in records:
        result.records.append(record)
        if "elapsed_s" in record and record.get("rank", 0) not in result.arrivals:
            # when step 1 began: this record's arrival less the time since then (elapsed_s;
            # the poll's 50-200 ms aside)
            result.arrivals[record.get("rank", 0)] = time.perf_counter() - record["elapsed_s"]
        for cb in callbacks:
            cb(record)


class _Tail:
    """Reads the complete new lines of every metrics*.jsonl in the run directory."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.steps = run_dir, {}
        # A run that resumes appends to its files: deliver only what this launch writes.
        self.offsets = {p: p.stat().st_size for p in run_dir.glob("metrics*.jsonl")}

    def read(self) -> list[dict]:
        out = []
        for path in sorted(self.run_dir.glob("metrics*.jsonl")):
            with path.open() as f:
                f.seek(self.offsets.get(path, 0))
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]  # a half-written line waits for next time
            self.offsets[path] = self.offsets.get(path, 0) + len(complete.encode())
            for line in complete.splitlines():
                record = json.loads(line)
                self.steps[record.get("rank", 0)] = record.get("step")
                out.append(record)
        return out

    def last_steps(self) -> str:
        return ", ".join(f"rank {r}: {s}" for r, s in sorted(self.steps.items()))


def _stop(proc: subprocess.Popen, job_id: str, grace_s: float = STOP_GRACE_S) -> None:
    """Stop the whole job within about grace_s seconds, leaving no process behind.

    SIGTERM goes to torchrun's process group *and* to every process of the job, since torchrun
    starts each worker in a session of its own. Leaving the workers to torchrun's own shutdown
    is slow: it SIGTERMs them one group at a time and waits up to 30 s, and on a busy machine a
    Python process takes seconds just to run its signal handler. Whatever is still alive after
    the grace period is SIGKILLed. (After a normal exit this only sweeps up stragglers.)"""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        _signal_all(job_processes(job_id), signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    _signal_all(job_processes(job_id), signal.SIGKILL)  # stragglers: a rank or checkpoint writer


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _dies_with_us():
    """A preexec_fn asking Linux to SIGTERM torchrun when the process that launched it dies
    (a notebook kernel restarted or killed): no one would be left to stop the job otherwise.
    prctl is looked up here, before the fork, so the child only makes one C call."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    PR_SET_PDEATHSIG = 1
    return lambda: prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def job_processes(job_id: str) -> list[int]:
    """PIDs of live processes started for this job (Linux: read from /proc; else empty): those
    whose environment carries the job's id, and the ranks forked for it that still run (a fork
    keeps its parent's /proc environ, so those are asked of the server that forked them)."""
    marker = f"{JOB_ENV}={job_id}".encode()
    server, ranks = _FORKED.get(job_id, (None, []))
    pids = sorted(set(ranks) & set(server.children())) if server is not None else []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (
                marker in (entry / "environ").read_bytes().split(b"\0")
                and b"Z" not in (entry / "stat").read_bytes().rsplit(b")", 1)[1][:3]
            ):
                pids.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return pids


_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset|Broken pipe|[Tt]imed out|"
    r"ECONNRESET|Socket closed|Read error|Write error"
)


def _failed_ranks(summary: str) -> list[dict]:
    """torchrun's failure summary as [{rank, code, error_file}], root cause first."""
    entries = []
    for block in re.split(r"\n\s*\[\d+\]:\s*\n", summary)[1:]:
        rank, code = (
            re.search(r"rank\s*:\s*(\d+)", block),
            re.search(r"exitcode\s*:\s*(-?\d+)", block),
        )
        if rank and code:
            error_file = re.search(r"error_file\s*:\s*(\S+)", block)
            entries.append(
                {
                    "rank": int(rank.group(1)),
                    "code": int(code.group(1)),
                    "error_file": Path(error_file.group(1)) if error_file else None,
                }
            )
    return entries


def _read_report(error_file: Path | None) -> dict | None:
    """A rank's error report, or None when there is none (or half of one, from a process that was
    not written with tools/jobs/worker_errors.py)."""
    try:
        return json.loads(error_file.read_text())["message"] if error_file is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _failure(run_dir: Path, returncode: int, last_steps: str) -> JobFailed:
    """After torchrun: its summary in launcher.log names the failed ranks, root cause first."""
    log = (run_dir / "launcher.log").read_text()
    parts = log.rsplit("Root Cause (first observed failure):", 1)
    if len(parts) == 2:
        failures = parts[0].rsplit("Failures:", 1)[-1]
        return _failure_of(
            run_dir, _failed_ranks("\n" + parts[1]) + _failed_ranks("\n" + failures), last_steps
        )
    print("\n".join(log.strip().splitlines()[-15:]), file=sys.stderr)
    return JobFailed(
        f"the job failed with exit status {returncode} before any rank reported "
        f"an error (torchrun's output above; all of it in {run_dir / 'launcher.log'})"
    )


def _failure_of(run_dir: Path, failed: list[dict], last_steps: str) -> JobFailed:
    """Show the failing rank's traceback; return the one-line error to raise. `failed`: the
    failed ranks ({rank, code, error_file}), the first observed first.

    The first rank observed to fail is usually the root cause; the other ranks fail *because* of
    it (a closed connection, a timed-out collective). But exits are seen in batches (torchrun's
    clock has one-second resolution, our fast path polls), so a peer's "connection closed" can be
    seen before the rank that caused it. When the first rank's error is a peer's death, the root
    cause is the first rank whose own error is not; failing that, a rank killed by a signal
    (other than the SIGTERM that stops the rest)."""
    where = f"last step per rank: {last_steps or 'none logged'}; logs in {run_dir / 'logs'}"
    reports = {f["rank"]: _read_report(f["error_file"]) for f in failed}
    last_line = {r: info["message"].strip().splitlines()[-1] for r, info in reports.items() if info}
    peer_gone = {r for r, line in last_line.items() if _PEER_GONE.search(line)}
    root = failed[0]
    if root["rank"] in peer_gone:
        own_error = [f for f in failed if f["rank"] in last_line.keys() - peer_gone]
        killed = [f for f in failed if f["code"] < 0 and -f["code"] != signal.SIGTERM]
        root = (own_error or killed or failed)[0]
    message = last_line.get(root["rank"])
    if message is not None:
        print(
            f"--- rank {root['rank']} failed; its traceback: ---\n"
            f"{reports[root['rank']]['extraInfo']['py_callstack']}",
            file=sys.stderr,
        )
    rank, code = root["rank"], root["code"]
    if message is not None:
        hint = " - a peer stopped answering (hung or dead rank?)" if "imed out" in message else ""
        return JobFailed(f"rank {rank} failed: {message}{hint} ({where})")
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else -code
        return JobFailed(f"rank {rank} was killed by signal {name} ({where})")
    errors = _reported_errors(run_dir)
    if errors:
        # One line per distinct error: the ranks print an error they share only once
        # (cli._report), so the root-cause rank may have printed nothing itself.
        for line in errors[1:]:
            print(f"titanlite: error: {line}", file=sys.stderr)
        return JobFailed(errors[0], exit_code=code)  # 2: bad input, as the ranks exited
    return JobFailed(f"rank {rank} exited with status {code} ({where})", exit_code=code)


def _reported_errors(run_dir: Path) -> list[str]:
    """The distinct `titanlite: error:` lines of the last attempt's ranks, lowest rank first."""
    attempts = sorted(
        (run_dir / "logs").glob("**/attempt_*"), key=lambda a: (int(a.name[8:]), a.stat().st_mtime)
    )
    if not attempts:
        return []
    lines = []
    for f in sorted(attempts[-1].glob("*/stderr.log"), key=lambda f: int(f.parent.name)):
        lines += [
            ln[len("titanlite: error: ") :]
            for ln in f.read_text().splitlines()
            if ln.startswith("titanlite: error:")
        ]
    return list(dict.fromkeys(lines))


def _check_nproc(nproc) -> None:
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise TitanliteError(f"nproc must be a positive integer, got {nproc!r}")


def _check_machine(nproc: int, device: str, backend: str) -> None:
    import torch

    from ...distributed.env import pick_backend
    from ...hardware import detect_device

    _check_nproc(nproc)
    dev = detect_device(device)
    pick_backend(backend, dev.type)
    if dev.type == "cuda" and nproc > torch.cuda.device_count():
        raise TitanliteError(
            f"{nproc} processes but {torch.cuda.device_count()} GPUs: each rank needs "
            f"its own GPU, so use nproc <= {torch.cuda.device_count()}"
        )
    cores = os.cpu_count() or 1
    if dev.type != "cuda" and nproc > cores:
        warnings.warn(
            f"{nproc} processes on {cores} CPU cores: they will take turns on the cores, "
            f"which is fine for checking results but makes speed numbers meaningless",
            stacklevel=3,
        )


def _job_store(port: int | None):
    """The job's TCPStore, hosted by the launcher as torchrun's agent hosts its own; each rank a
    client (TORCHELASTIC_USE_AGENT_STORE). Bound as it is made, on port 0 unless one was asked for:
    a port picked free and left for rank 0 to bind could be taken in between by another job on a
    busy machine (EADDRINUSE, seen in CI with tests running side by side)."""
    from torch.distributed import TCPStore

    try:
        return TCPStore("127.0.0.1", port or 0, is_master=True, wait_for_workers=False)
    except RuntimeError:
        if port is None:  # port 0 cannot be taken: something else went wrong, say it as it is
            raise
        raise _port_taken(port) from None  # taken since _check_port looked at it


def _check_port(port: int) -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise _port_taken(port) from None
    return port


def _port_taken(port: int) -> TitanliteError:
    return TitanliteError(
        f"port {port} is already in use (another job, or one still shutting "
        f"down): pass another port, or port=None to pick a free one"
    )


def to_toml(doc: dict) -> str:
    """A Config dict as TOML (sections of scalars; None is written as "none")."""
    lines = []
    for section, values in doc.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                value = "none"
            lines.append(
                f"{key} = {json.dumps(value) if not isinstance(value, bool) else str(value).lower()}"
            )
        lines.append("")
    return "\n".join(lines)
