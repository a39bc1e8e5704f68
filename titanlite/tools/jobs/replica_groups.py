"""A fault-tolerant job from a cell: a lighthouse and several replica groups, each its own titanlite
job, started side by side, watched live in one plot, and always cleaned up.

    with Lighthouse() as lighthouse:
        groups = launch_replica_groups(cfg, 2, lighthouse=lighthouse, max_restarts=1,
                                       per_group={1: {"fault.kind": "kill", "fault.step": 8}},
                                       callbacks=[plot])
    groups[1].records            # group 1's records, both attempts (a record's "attempt": 1)

Each group is what you would start in a shell on its own machine, with the lighthouse's address
in TORCHFT_LIGHTHOUSE:

    torchrun --nproc-per-node N --max-restarts 1 ... -m titanlite train --config <group>/config.toml \\
        --fault_tolerance.enable true --fault_tolerance.group_size G --fault_tolerance.replica_id g

Each group's ranks are forked from the warm server, as `launch` does, and this loop restarts a
group whose worker died (`max_restarts`), as torchrun's agent would; `torchrun=True` puts each
group under torchrun's own agent instead. A group whose ranks fail for good is stopped alone: the others go on without it
(that is the point), and the error is raised once every group has ended."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ...errors import TitanliteError
from ...paths import check_output_dir, run_dir_refusal
from .launcher import (
    JOB_ENV,
    LAUNCH_ENV,
    LaunchResult,
    _deliver,
    _dies_with_us,
    _error_file,
    _failure,
    _failure_of,
    _job_store,
    _stop,
    _stop_forked,
    _Tail,
    _timed_out,
    _torchrun_env,
    _warm_server,
    launch_path,
    to_toml,
)


class Lighthouse:
    """torchft's lighthouse (its Rust server, in this process) on a free port: where the replica
    groups agree on each step's quorum. `min_replicas`: the fewest groups a quorum may have (1: any
    survivor goes on alone); `heartbeat_timeout_ms`: how long a silent group counts as alive (a
    dead group holds the others up this long); `join_timeout_ms`: how long a quorum waits for a
    live group that is late (a slow step, an evaluation) before going on without it."""

    def __init__(
        self, min_replicas: int = 1, heartbeat_timeout_ms: int = 2000, join_timeout_ms: int = 10_000
    ):
        try:
            from torchft.coordination import LighthouseServer
        except ImportError:
            raise TitanliteError(
                "the lighthouse is torchft's, which is not installed: pip install -e '.[ft]' "
                "(make lab and make test install it)"
            ) from None
        self.server = LighthouseServer(
            bind="[::]:0",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        self.address = self.server.address()
        self.heartbeat_timeout_s = heartbeat_timeout_ms / 1000

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.server.shutdown()


@dataclasses.dataclass
class _Group:
    """One replica group's job as it runs: its attempt, its processes, its records."""

    replica: int
    result: LaunchResult
    env: dict
    args: list
    nproc: int
    tail: _Tail
    attempt: int = 0
    proc: subprocess.Popen | None = None  # torchrun's agent
    ranks: dict = dataclasses.field(default_factory=dict)  # forked: rank -> pid
    store: object = None
    failed: list = dataclasses.field(default_factory=list)
    done: bool = False
    error: TitanliteError | None = None
    restart_at: float | None = None  # forked: when the dead group starts again


def launch_replica_groups(
    cfg,
    groups: int,
    nproc: int = 1,
    *,
    lighthouse: Lighthouse | str,
    overrides: dict | None = None,
    per_group: dict | None = None,
    callbacks=(),
    timeout_s: float | None = None,
    max_restarts: int = 0,
    restart_delay_s: float = 0.0,
    torchrun: bool = False,
) -> list[LaunchResult]:
    """Train `cfg` as `groups` replica groups of `nproc` processes each, meeting at `lighthouse`
    (a Lighthouse or its address); `per_group[g]`: overrides for group g only (a fault, say).
    A group whose worker dies is started again up to `max_restarts` times: by torchrun's agent
    with `torchrun=True` (a fresh interpreter, 7-15 s of imports on 2 cores), else forked warm
    again by this loop, which is the agent then (about a second), after `restart_delay_s` (a
    replacement machine's boot, which a restart on the spot does not have). Returns each group's
    LaunchResult; its records carry "replica_group"."""
    from ...config import Config, load_config
    from ...preflight import preflight, tokenizer_size
    from ...resilience.resume import run_name_for

    cfg = cfg if isinstance(cfg, Config) else load_config(cfg)
    address = lighthouse if isinstance(lighthouse, str) else lighthouse.address
    base = cfg.metrics.run_name or f"{cfg.model.preset}-ft-{time.strftime('%Y%m%d-%H%M%S')}"
    jobs = []
    for g in range(groups):
        one = {"fault_tolerance.enable": True, "fault_tolerance.group_size": groups}
        one.update({"fault_tolerance.replica_id": g, "metrics.run_name": base})
        one.update({"metrics.progress": False, **(overrides or {}), **(per_group or {}).get(g, {})})
        group_cfg = cfg.with_overrides(one, source="launch_replica_groups")
        # each group's preflight here first: bad input costs no process start-up
        preflight(group_cfg, nproc, tokenizer_size(group_cfg))
        run_dir = check_output_dir(
            Path(group_cfg.metrics.log_dir) / run_name_for(group_cfg), "run folder"
        )
        record = {"config": dataclasses.asdict(group_cfg)}
        if refusal := run_dir_refusal(
            run_dir, record, group_cfg.checkpoint, group_cfg.metrics.overwrite
        ):
            raise TitanliteError(refusal)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(record["config"]))
        env = dict(os.environ, PYTHONUNBUFFERED="1", TITANLITE_JOB_DIR=str(run_dir))
        env.update(TORCHFT_LIGHTHOUSE=address, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        # the groups share this machine's cores, as their ranks do
        threads = group_cfg.training.threads or max(1, (os.cpu_count() or 1) // (groups * nproc))
        env["OMP_NUM_THREADS"] = str(threads)
        args = ["-m", "titanlite", "train", "--config", str(run_dir / "config.toml")]
        result = LaunchResult(run_dir=run_dir, command="", wall_s=0.0, job_id="")
        jobs.append(_Group(g, result, env, args, nproc, _Tail(run_dir)))
    server = None if torchrun or launch_path() != "fork" else _warm_server()
    start = time.perf_counter()
    try:
        for job in jobs:
            _start(job, server, max_restarts)
        while not all(job.done for job in jobs):
            for job in jobs:
                _deliver(_labelled(job), job.result, callbacks)
                if not job.done:
                    _poll(job, server, max_restarts, restart_delay_s)
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                raise _timed_out(timeout_s, jobs[0].tail, groups * nproc, jobs[0].result.run_dir)
            time.sleep(0.05)
    except KeyboardInterrupt:
        print(f"interrupted: stopped all {groups} replica groups", file=sys.stderr)
        raise
    finally:
        for job in jobs:
            _stop_group(job, server)
    for job in jobs:
        _deliver(_labelled(job), job.result, callbacks)
        job.result.wall_s = time.perf_counter() - start
    for cb in callbacks:
        if hasattr(cb, "on_train_end"):
            cb.on_train_end()
    if failed := [job for job in jobs if job.error is not None]:
        raise TitanliteError(f"replica group {failed[0].replica}: {failed[0].error}")
    return [job.result for job in jobs]


def _labelled(job: _Group) -> list[dict]:
    """The group's new records, each saying which group wrote it (and, after a restart, which
    attempt: the trainer adds that itself)."""
    records = job.tail.read()
    for record in records:
        record.setdefault("replica_group", job.replica)
    return records


def _start(job: _Group, server, max_restarts: int) -> None:
    """Start (or, after a failure, start again) the group's ranks: torchrun's agent, which restarts
    them itself, or ranks forked from the warm server as attempt `job.attempt`."""
    import uuid

    job.result.job_id = job.result.job_id or uuid.uuid4().hex
    job.env[JOB_ENV] = job.result.job_id
    if server is None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
        cmd += ["--nproc-per-node", str(job.nproc), "--rdzv-backend", "c10d"]
        cmd += ["--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", job.result.job_id[:12]]
        cmd += ["--max-restarts", str(max_restarts), "--log-dir", str(job.result.run_dir / "logs")]
        cmd += ["--redirects", "3", *job.args]
        job.result.command = "torchrun " + shlex.join(cmd[3:])
        job.proc = subprocess.Popen(
            cmd,
            env=dict(job.env, **{LAUNCH_ENV: "torchrun"}),
            stdout=open(job.result.run_dir / "launcher.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_dies_with_us(),
        )
        return
    job.store = _job_store(None)  # a fresh store for each attempt: none of the last one's keys
    logs = job.result.run_dir / "logs" / job.result.job_id[:12] / f"attempt_{job.attempt}"
    job.result.command = "torchrun " + shlex.join(["--nproc-per-node", str(job.nproc), *job.args])
    for rank in range(job.nproc):
        folder = logs / str(rank)
        folder.mkdir(parents=True, exist_ok=True)
        env = dict(job.env, **_torchrun_env(rank, job.nproc, job.store.port, job.result.job_id))
        env.update(TORCHELASTIC_RESTART_COUNT=str(job.attempt), TORCHELASTIC_USE_AGENT_STORE="True")
        env.update({LAUNCH_ENV: "fork", "TORCHELASTIC_ERROR_FILE": str(folder / "error.json")})
        job.ranks[rank] = server.spawn(
            job.args, env, os.getcwd(), str(folder / "stdout.log"), str(folder / "stderr.log")
        )


def _poll(job: _Group, server, max_restarts: int, delay_s: float) -> None:
    """Has the group ended? A forked group whose rank failed is stopped, then restarted `delay_s`
    later while it has restarts left (torchrun's agent does both for its own group, at once)."""
    if job.restart_at is not None:
        if time.perf_counter() >= job.restart_at:
            job.restart_at = None
            _start(job, server, max_restarts)
        return
    if server is None:
        if job.proc.poll() is None:
            return
        job.done = True
        if job.proc.returncode != 0:
            job.error = _failure(job.result.run_dir, job.proc.returncode, job.tail.last_steps())
        return
    exits = server.exits()
    logs = job.result.run_dir / "logs" / job.result.job_id[:12] / f"attempt_{job.attempt}"
    failed = [
        {"rank": r, "code": exits[pid], "error_file": _error_file(logs, r)}
        for r, pid in job.ranks.items()
        if exits.get(pid)
    ]
    if not failed and not all(pid in exits for pid in job.ranks.values()):
        return
    _stop_forked(server, job.ranks, job.result.job_id)
    if failed and job.attempt < max_restarts:
        job.attempt += 1
        job.restart_at = time.perf_counter() + delay_s
        return
    job.done = True
    if failed:
        job.error = _failure_of(job.result.run_dir, failed, job.tail.last_steps())


def _stop_group(job: _Group, server) -> None:
    if job.proc is not None:
        _stop(job.proc, job.result.job_id)
    elif job.ranks:
        _stop_forked(server, job.ranks, job.result.job_id)
