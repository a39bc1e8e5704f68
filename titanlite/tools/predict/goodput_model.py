"""Goodput: the fraction of wall time that turns into training progress, when things fail.

Checkpoint every τ seconds of work at a blocking cost δ; failures arrive at rate 1/M. Each
failure costs the restart R plus the work since the last *durable* checkpoint. Checkpoint too
often and δ eats the run; too rarely and the lost work does. The best τ is near √(2δM)
(Young 1974), a little less with Daly's (2006) higher-order correction. Three tools:

- `expected_goodput`: the first-order formula (fast, smooth, for curves and intuition);
- `simulate`: a Monte-Carlo cluster (Poisson failures, failures during checkpoints and restarts,
  async checkpoints, hot spares), vectorised over trials with numpy;
- `replay_run`: the exact wall time of a run whose failures hit at known points, to compare
  with runs where we injected failures ourselves.
- `ft_expected_goodput`, `replay_ft_run`: the same two questions for per-step fault tolerance
  (torchft's replica groups, notebook 22), where a failure stops one group and nobody restarts.
All times are seconds; failure rates are failures per hour per instance (or per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import TitanliteError

# ----- failure rates, each with where it comes from ----------------------------------------------

# Llama 3 (Meta, "The Llama 3 Herd of Models", 2024): 419 unexpected interruptions during a
# 54-day snapshot of pre-training on 16,384 H100 GPUs. The per-GPU rate is derived, not typed.
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
LLAMA3_RATE_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)
# Two per-instance (8-GPU) hourly rates from AWS's post "Reduce ML training costs with Amazon
# SageMaker HyperPod" (2025), each derived there from a published run:
# - 0.0588%/h: OPT-175B, ~105 restarts (35 manual, 70+ automatic) in 2 months on 124 instances (992 A100);
# - 0.0161%/h: Llama 3.1, 417 failures in 54 days on 16,000 H100 (2,000 instances). That is the
#   Llama 3 run above counted per instance (Meta's paper: 419 on 16,384 GPUs), not a second source,
#   so FAILURE_SOURCES carries it once, per GPU.
OPT175B_RATE_PER_INSTANCE_HOUR = 0.0588 / 100
LLAMA31_HYPERPOD_RATE_PER_INSTANCE_HOUR = 0.0161 / 100


@dataclass(frozen=True)
class FailureSource:
    label: str
    rate_per_hour: float  # failures per hour of one unit
    unit: str  # "GPU" or "instance": what one rate counts

    def units(self, gpus: int, gpus_per_instance: int = 8) -> int:
        return gpus if self.unit == "GPU" else max(1, gpus // gpus_per_instance)


FAILURE_SOURCES = (  # independent runs only: the 0.0161%/h figure is Llama 3's, per instance
    FailureSource("Llama 3 (419 in 54 days, 16,384 H100)", LLAMA3_RATE_PER_GPU_HOUR, "GPU"),
    FailureSource(
        "OPT-175B (0.0588%/h per 8-GPU instance)", OPT175B_RATE_PER_INSTANCE_HOUR, "instance"
    ),
)


def _require(zero_ok: bool = False, **values) -> None:
    """Times and rates must be finite and positive (or, with zero_ok, non-negative)."""
    for name, value in values.items():
        v = np.asarray(value, dtype=float)
        if not np.all(np.isfinite(v)) or np.any(v < 0) or (not zero_ok and np.any(v == 0)):
            need = "zero or more" if zero_ok else "more than zero"
            raise TitanliteError(
                f"{name}={value!r} must be a finite number {need} (seconds; "
                f"rates in failures per hour): pass a valid value"
            )


def _require_whole(minimum: int, **values) -> None:
    for name, v in values.items():
        if int(v) != v or v < minimum:
            raise TitanliteError(f"{name}={v!r} must be a whole number ≥ {minimum}")


# ----- the analytic model ---------------------------------------------------------------------


def young_interval(ckpt_cost_s: float, mtbf_s: float) -> float:
    """τ = √(2δM): J. W. Young, "A first order approximation to the optimum checkpoint interval",
    Communications of the ACM 17(9), 1974."""
    _require(ckpt_cost_s=ckpt_cost_s, mtbf_s=mtbf_s)
    return float(np.sqrt(2 * ckpt_cost_s * mtbf_s))


def daly_interval(ckpt_cost_s: float, mtbf_s: float) -> float:
    """J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
    Future Generation Computer Systems 22(3), 2006: for δ < 2M,
    τ = √(2δM)·[1 + ⅓·√(δ/2M) + ⅑·(δ/2M)] − δ, else τ = M."""
    _require(ckpt_cost_s=ckpt_cost_s, mtbf_s=mtbf_s)
    d, m = ckpt_cost_s, mtbf_s
    if d >= 2 * m:
        return float(m)
    x = d / (2 * m)
    return float(np.sqrt(2 * d * m) * (1 + np.sqrt(x) / 3 + x / 9) - d)


def cluster_mtbf_s(n_instances: int, failure_rate_per_hour: float) -> float:
    """A job stops when any of its instances fails, so the rates add: M = 1 / (N·rate)."""
    _require_whole(1, n_instances=n_instances)
    _require(failure_rate_per_hour=failure_rate_per_hour)
    return 3600.0 / (n_instances * failure_rate_per_hour)


def expected_goodput(
    interval_s,
    ckpt_cost_s: float,
    restart_s: float,
    mtbf_s: float,
    *,
    async_ckpt: bool = False,
    persist_s: float = 0.0,
):
    """First-order goodput (useful work / wall time); `interval_s` may be an array.

    A segment of τ work plus its checkpoint lasts s = τ + δ (async: s = max(τ, p) + δ, where δ
    is the blocking staging time and p the background write). Failures hit at rate 1/M of wall
    time; each costs the restart R plus the time since the last durable checkpoint: s/2 on
    average, plus p with async, since the newest checkpoint is not durable until written. With
    W₀ = work·s/τ the failure-free wall time, W = W₀ + (W/M)·(R + s/2 + p), so

        goodput = (τ / s) · (1 − (R + s/2 + p) / M)      (clipped at 0)

    It ignores failures during restarts and second-order terms in s/M; its optimum is
    τ ≈ √(2δ(M − R)) − δ for sync, within a few % of Young's and Daly's for small δ/M.
    """
    _require(interval_s=interval_s, mtbf_s=mtbf_s)
    _require(True, ckpt_cost_s=ckpt_cost_s, restart_s=restart_s)
    persist_s = _check_async(async_ckpt, persist_s)
    tau = np.asarray(interval_s, dtype=float)
    s = np.maximum(tau, persist_s) + ckpt_cost_s  # a save first waits for the previous write
    g = np.clip(tau / s * (1 - (restart_s + s / 2 + persist_s) / mtbf_s), 0.0, 1.0)
    return float(g) if g.ndim == 0 else g


def _check_async(async_ckpt: bool, persist_s: float) -> float:
    _require(True, persist_s=persist_s)
    if persist_s and not async_ckpt:
        raise TitanliteError(
            f"persist_s={persist_s} only applies to async checkpoints: pass "
            f"async_ckpt=True, or fold the write into ckpt_cost_s for a sync save"
        )
    return float(persist_s)


# ----- Monte-Carlo cluster --------------------------------------------------------------------


@dataclass
class SimulationResult:
    goodput: np.ndarray  # per trial: work_s / wall_s
    wall_s: np.ndarray  # per trial
    failures: np.ndarray  # per trial: failures that hit before the job finished

    mean_goodput = property(lambda self: float(self.goodput.mean()))
    std_goodput = property(lambda self: float(self.goodput.std()))


def simulate(
    work_s: float,
    interval_s: float,
    ckpt_cost_s: float,
    restart_s: float,
    n_instances: int,
    failure_rate_per_hour: float,
    *,
    trials: int = 200,
    seed: int = 0,
    async_ckpt: bool = False,
    persist_s: float = 0.0,
    spares: int = 0,
    replace_s: float = 0.0,
    swap_s: float = 0.0,
) -> SimulationResult:
    """Monte-Carlo wall time of a job needing `work_s` of compute, over `trials` runs.

    It checkpoints after every `interval_s` of work (none once the work is done), blocking
    `ckpt_cost_s`; with `async_ckpt`, ckpt_cost_s is the staging time and a checkpoint becomes
    durable `persist_s` later (the next save waits for that write). Failures are a Poisson process
    of rate n_instances·rate over wall time, during work, checkpoints and restarts alike. A
    failure loses the work since the last durable checkpoint, then the job is down for
    restart_s plus `swap_s` if a hot spare is free (the broken node is repaired or replaced and
    rejoins the spare pool replace_s later), else plus `replace_s` waiting for a new node. A
    failure while down starts the downtime again. A trial still running after 100× its
    failure-free time (goodput < 1%) stops there and reports goodput 0 and wall_s inf.
    Failure times do not depend on τ, so one seed gives common random numbers across intervals.
    """
    _require(work_s=work_s, interval_s=interval_s)
    _require(
        True,
        ckpt_cost_s=ckpt_cost_s,
        restart_s=restart_s,
        replace_s=replace_s,
        swap_s=swap_s,
        failure_rate_per_hour=failure_rate_per_hour,
    )
    _require_whole(1, trials=trials, n_instances=n_instances)
    _require_whole(0, spares=spares)
    spares = int(spares)
    p = _check_async(async_ckpt, persist_s)
    tau, d, n = float(interval_s), float(ckpt_cost_s), int(trials)
    rate_s = n_instances * failure_rate_per_hour / 3600.0
    total = int(np.ceil(work_s / tau - 1e-9)) - 1  # checkpoints a failure-free run takes
    # time to the first durable checkpoint after a (re)start, then to each next one: an async
    # save first waits for the previous write to finish, as torchtitan's does
    first, seg = tau + d + p, max(tau, p) + d
    wait = max(p - tau, 0.0)

    def time_to_finish(done_ckpts):  # from a restart, if nothing fails
        m = np.maximum(total - done_ckpts, 0)
        return work_s - done_ckpts * tau + m * d + np.maximum(m - 1, 0) * wait

    rng = np.random.default_rng(seed)
    k = 1 if rate_s == 0 else min(int(1.5 * rate_s * work_s) + 32, 2048)  # failures per chunk
    returns = np.full((n, spares), -np.inf)  # when each spare is back in the pool
    t_fail, down, ckpts, failures = np.zeros(n), np.zeros(n), np.zeros(n, int), np.zeros(n, int)
    wall, live = np.full(n, np.nan), np.arange(n)  # live: trials still running
    while live.size:
        m, ar = live.size, np.arange(live.size)
        # drawn for every trial, live or not, so the stream (and the failures) do not depend on τ
        gaps = rng.exponential(1 / rate_s, (n, k))[live] if rate_s else np.full((m, k), np.inf)
        f = t_fail[live, None] + np.cumsum(gaps, axis=1)  # the next k failure times
        downs = np.full((m, k), restart_s + replace_s)
        if spares:
            r = returns[live]
            for j in range(k):
                slot = r.argmin(axis=1)
                free = r[ar, slot] <= f[:, j]
                r[ar[free], slot[free]] = f[free, j] + replace_s
                downs[free, j] = restart_s + swap_s
            returns[live] = r
        starts = np.concatenate([(t_fail + down)[live, None], f[:, :-1] + downs[:, :-1]], axis=1)
        up = f - starts  # running time before each failure
        gained = np.where(up >= first, 1 + np.floor((np.maximum(up, first) - first) / seg), 0)
        gained = np.minimum(gained, total + 1).astype(int)  # durable checkpoints per up-time
        before = ckpts[live, None] + np.cumsum(gained, axis=1) - gained
        need = time_to_finish(before)
        done = up >= need  # this up-time reaches the end of the job
        hit, j = done.any(axis=1), done.argmax(axis=1)
        wall[live[hit]] = starts[ar[hit], j[hit]] + need[ar[hit], j[hit]]
        failures[live[hit]] += j[hit]
        go, live = ~hit, live[~hit]
        t_fail[live], down[live], failures[live] = f[go, -1], downs[go, -1], failures[live] + k
        ckpts[live] = before[go, -1] + gained[go, -1]
        hopeless = t_fail[live] > 100 * time_to_finish(0)  # goodput < 1%: reported as 0
        wall[live[hopeless]] = np.inf
        live = live[~hopeless]
    return SimulationResult(work_s / wall, wall, failures)


# ----- deterministic replay -------------------------------------------------------------------


@dataclass
class ReplayResult:
    wall_s: float
    goodput: float
    lost_work_s: float  # work redone after failures
    checkpoints: int  # checkpoints taken, including those lost with their attempt's later work


def replay_run(
    work_s: float, interval_s: float, ckpt_cost_s: float, restart_s: float, failure_at_work_s=()
) -> ReplayResult:
    """Exact wall time of a sync-checkpointed run whose failures hit when the job's work progress
    was `failure_at_work_s` (in order; e.g. killed as step 7 began with 2 s steps → 12.0).
    A checkpoint is taken after each multiple of interval_s of work, except at the very end; a
    failure exactly at a multiple hits before that checkpoint. Each failure costs restart_s."""
    _require(work_s=work_s, interval_s=interval_s)
    _require(True, ckpt_cost_s=ckpt_cost_s, restart_s=restart_s)
    tau, resume, wall, lost, ckpts = float(interval_s), 0.0, 0.0, 0.0, 0

    def run_until(x):  # work from `resume` up to x, with the checkpoints strictly between
        k = max(int(np.ceil(x / tau - 1e-9)) - 1 - int(round(resume / tau)), 0)
        return x - resume + k * ckpt_cost_s, k

    for i, x in enumerate(failure_at_work_s):
        if not resume <= x < work_s:
            raise TitanliteError(
                f"failure_at_work_s[{i}]={x} is outside [{resume}, {work_s}): the run "
                f"resumed from work {resume} and ends at {work_s}; list failures in order"
            )
        t, k = run_until(x)
        wall, ckpts = wall + t + restart_s, ckpts + k
        new_resume = resume + k * tau
        lost, resume = lost + x - new_resume, new_resume
    t, k = run_until(work_s)
    wall, ckpts = wall + t, ckpts + k
    return ReplayResult(wall, work_s / wall, lost, ckpts)


# ----- per-step fault tolerance (torchft: replica groups, notebook 22) ------------------------


def ft_expected_goodput(mtbf_s, step_s: float, detect_s: float, rejoin_s: float, groups: int):
    """First-order goodput of per-step fault tolerance, the counterpart of `expected_goodput`
    (notebook 13's restart-everyone model) for failures at rate 1/M of the job (`mtbf_s`, which
    may be an array): the job is G replica groups, and a failure kills one of them.

    Nobody restarts and no checkpoint is read, so no work since one is lost. A failure costs
    every group the step in flight (its exchange fails; no group commits it) and the wait until
    the lighthouse stops counting the dead group (`detect_s`: its heartbeat timeout); then the
    G − 1 others step on, and only the dead group's share of the work is missing until it is
    back (`rejoin_s`, from the failure to its heal). Lost resource-seconds per failure:
    G·(t + D) + (R − D), over G·M of them between failures:

        goodput = 1 − (t + D)/M − (R − D)/(G·M)        (clipped at 0)

    Failures during a rejoin and checkpoints (still taken for a failure of the whole job) are
    left out, as in `expected_goodput`'s first order."""
    _require(mtbf_s=mtbf_s, step_s=step_s)
    _require(True, detect_s=detect_s, rejoin_s=rejoin_s)
    _require_whole(1, groups=groups)
    if rejoin_s < detect_s:
        raise TitanliteError(
            f"rejoin_s={rejoin_s} is shorter than detect_s={detect_s}: a group is back only "
            f"after it was declared gone; measure rejoin_s from the failure to the heal"
        )
    m = np.asarray(mtbf_s, dtype=float)
    g = np.clip(1 - (step_s + detect_s) / m - (rejoin_s - detect_s) / (groups * m), 0.0, 1.0)
    return float(g) if g.ndim == 0 else g


@dataclass
class FTReplayResult:
    wall_s: float
    goodput: float  # committed group-steps × step_s / (groups × wall_s)
    steps_alone: int  # steps the others committed while the dead group was away
    lost_group_steps: int  # group-steps not committed: the failed step's, and the absent group's


def replay_ft_run(
    steps: int, step_s: float, groups: int, detect_s: float, rejoin_s: float, failures: int = 1
) -> FTReplayResult:
    """The exact wall time and goodput of a run of `steps` lockstep steps of `step_s` by `groups`
    replica groups, in which `failures` times one group dies as a step begins (each apart from
    the others): that step commits nowhere, the others wait `detect_s`, then step alone until
    the dead group is back `rejoin_s` after its failure (it heals and steps with them again).
    Goodput counts the group-steps that committed against all groups' wall time."""
    _require(step_s=step_s)
    _require(True, detect_s=detect_s, rejoin_s=rejoin_s)
    _require_whole(1, steps=steps, groups=groups)
    _require_whole(0, failures=failures)
    alone = max(0, int(np.ceil((rejoin_s - detect_s) / step_s)))  # steps the others take alone
    wall = steps * step_s + failures * detect_s
    lost = failures * (groups + alone)
    committed = steps * groups - lost
    return FTReplayResult(wall, committed * step_s / (groups * wall), alone, lost)


# ----- pictures -------------------------------------------------------------------------------


def _figure(size=(8, 4.5)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=90)
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def plot_goodput_vs_interval(
    work_s: float,
    ckpt_cost_s: float,
    restart_s: float,
    n_instances: int,
    failure_rate_per_hour: float,
    intervals_s=None,
    *,
    trials: int = 200,
    seed: int = 0,
    title: str = "",
):
    """Simulated goodput (mean, ±1 std band over trials) and the analytic curve against the
    checkpoint interval, with Young's and Daly's intervals as vertical lines. Returns the Figure."""
    mtbf = cluster_mtbf_s(n_instances, failure_rate_per_hour)
    young, daly = young_interval(ckpt_cost_s, mtbf), daly_interval(ckpt_cost_s, mtbf)
    taus = (
        np.geomspace(young / 8, young * 8, 20)
        if intervals_s is None
        else np.asarray(intervals_s, float)
    )
    sims = [
        simulate(
            work_s,
            t,
            ckpt_cost_s,
            restart_s,
            n_instances,
            failure_rate_per_hour,
            trials=trials,
            seed=seed,
        )
        for t in taus
    ]
    mean, std = np.array([s.mean_goodput for s in sims]), np.array([s.std_goodput for s in sims])
    fig, ax = _figure()
    mins = taus / 60
    ax.plot(mins, mean, "o-", color="tab:blue", label=f"simulated mean ({trials} trials)")
    ax.fill_between(
        mins, mean - std, mean + std, color="tab:blue", alpha=0.2, label="±1 std over trials"
    )
    ax.plot(
        mins,
        expected_goodput(taus, ckpt_cost_s, restart_s, mtbf),
        "k--",
        label="analytic (first order)",
    )
    ax.axvline(young / 60, color="tab:green", ls=":", label=f"Young 1974: {young / 60:.1f} min")
    ax.axvline(daly / 60, color="tab:red", ls="-.", label=f"Daly 2006: {daly / 60:.1f} min")
    ax.set(
        xscale="log",
        xlabel="checkpoint interval (minutes of work)",
        ylabel="goodput (useful work / wall time)",
    )
    ax.set_title(
        title
        or f"{n_instances:,} units failing at {100 * failure_rate_per_hour:.4f}%/h "
        f"each: MTBF {mtbf / 3600:.2f} h, checkpoint "
        f"{ckpt_cost_s:.0f} s, restart {restart_s:.0f} s",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return fig


def plot_goodput_vs_cluster_size(
    work_s: float,
    ckpt_cost_s: float,
    restart_s: float,
    *,
    gpus=(1024, 2048, 4096, 8192, 16384, 32768),
    sources=FAILURE_SOURCES,
    gpus_per_instance: int = 8,
    spares: int = 0,
    replace_s: float = 0.0,
    swap_s: float = 0.0,
    trials: int = 100,
    seed: int = 0,
    title: str = "",
):
    """Simulated mean goodput against cluster size, one solid curve per failure-rate source
    (failed nodes wait replace_s), plus a dashed one with `spares` hot spares (swap_s) when
    spares > 0. Each size checkpoints at Daly's interval for its own MTBF. Per-instance rates
    count gpus // gpus_per_instance instances. Returns the Figure."""
    gpus = np.asarray(gpus)
    fig, ax = _figure()
    for color, marker, src in zip(
        ("tab:blue", "tab:orange", "tab:green", "tab:purple"), "o^sD", sources
    ):
        for n_spares, ls in ((0, "-"), (spares, "--")) if spares else ((0, "-"),):
            goodput = []
            for g in gpus:
                n = src.units(int(g), gpus_per_instance)
                tau = daly_interval(ckpt_cost_s, cluster_mtbf_s(n, src.rate_per_hour))
                goodput.append(
                    simulate(
                        work_s,
                        tau,
                        ckpt_cost_s,
                        restart_s,
                        n,
                        src.rate_per_hour,
                        trials=trials,
                        seed=seed,
                        spares=n_spares,
                        replace_s=replace_s,
                        swap_s=swap_s,
                    ).mean_goodput
                )
            tag = f", {n_spares} hot spares" if n_spares else ""
            ax.plot(
                gpus, goodput, ls, marker=marker, color=color, alpha=0.8, label=f"{src.label}{tag}"
            )
    ax.set_xscale("log", base=2)
    per = (
        f" ({gpus_per_instance} per instance)" if any(s.unit == "instance" for s in sources) else ""
    )
    ax.set(xlabel="GPUs in the job" + per, ylabel="goodput (useful work / wall time)")
    ax.set_title(
        title
        or f"checkpoint {ckpt_cost_s:.0f} s at Daly's interval, restart "
        f"{restart_s:.0f} s, new node {replace_s / 60:.0f} min"
        + (f", spare swap {swap_s / 60:.0f} min" if spares else ""),
        fontsize=9,
    )
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    return fig
