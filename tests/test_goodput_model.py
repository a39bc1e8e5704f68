"""The goodput model (notebook 13): analytic formula, Monte-Carlo cluster, deterministic replay."""

import math

import numpy as np
import pytest

from titanlite.errors import TitanliteError
from titanlite.tools.predict import goodput_model as gm

HOUR = 3600.0


def exact_sync_wall_s(work_s, interval_s, ckpt_cost_s, restart_s, mtbf_s):
    """E[wall] with Poisson failures, failures during restarts included (Daly 2006, eq. for one
    segment: M·e^{R/M}·(e^{s/M} − 1)); every segment but the last ends with a checkpoint."""
    segments = work_s / interval_s
    seg = lambda s: mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1(s / mtbf_s)  # noqa: E731
    return (segments - 1) * seg(interval_s + ckpt_cost_s) + seg(interval_s)


def test_without_failures_goodput_is_work_over_work_plus_checkpoints():
    for work, tau in ((1000.0, 100.0), (1050.0, 100.0)):
        n_ckpt = math.ceil(work / tau) - 1  # no checkpoint once the work is done
        r = gm.simulate(work, tau, 5.0, 30.0, 64, 0.0, trials=3)
        assert np.all(r.goodput == work / (work + n_ckpt * 5.0))
        assert np.all(r.failures == 0)
    # async: each save after the first waits for the previous 150 s write, 50 s longer than τ
    r = gm.simulate(1000.0, 100.0, 2.0, 30.0, 1, 0.0, trials=2, async_ckpt=True, persist_s=150.0)
    assert np.all(r.wall_s == 1000.0 + 9 * 2.0 + 8 * 50.0)


def test_monte_carlo_matches_exact_poisson_result_and_first_order_model():
    mtbf, ckpt, restart, work, trials = 10 * HOUR, 60.0, 120.0, 200 * 10 * HOUR, 200
    for tau in (600.0, 1800.0, 3600.0):
        r = gm.simulate(work, tau, ckpt, restart, 1, HOUR / mtbf, trials=trials, seed=1)
        # the simulator is exact, so its mean wall time agrees with the closed form to 4 std errors
        exact = exact_sync_wall_s(work, tau, ckpt, restart, mtbf)
        assert abs(r.wall_s.mean() - exact) < 4 * r.wall_s.std() / math.sqrt(trials)
        # the first-order model drops terms of order x² with x = (τ + δ + R)/M (≤ 0.105 here:
        # e^{s/M} and e^{R/M} expanded to first order), plus 4 std errors of Monte-Carlo noise
        x = (tau + ckpt + restart) / mtbf
        first_order = gm.expected_goodput(tau, ckpt, restart, mtbf)
        assert abs(r.mean_goodput - first_order) < x**2 + 4 * r.std_goodput / math.sqrt(trials)
    # async: δ is the staging time, and a failure also loses the not-yet-written checkpoint
    tau, stage, persist = 1800.0, 5.0, 300.0
    r = gm.simulate(
        work,
        tau,
        stage,
        restart,
        1,
        HOUR / mtbf,
        trials=trials,
        seed=2,
        async_ckpt=True,
        persist_s=persist,
    )
    x = (tau + stage + persist + restart) / mtbf
    model = gm.expected_goodput(tau, stage, restart, mtbf, async_ckpt=True, persist_s=persist)
    assert abs(r.mean_goodput - model) < x**2 + 4 * r.std_goodput / math.sqrt(trials)


def test_simulated_optimum_interval_is_near_young_and_daly():
    mtbf, ckpt, restart = 4 * HOUR, 60.0, 120.0
    young, daly = gm.young_interval(ckpt, mtbf), gm.daly_interval(ckpt, mtbf)
    assert young == pytest.approx(math.sqrt(2 * ckpt * mtbf))
    assert 0.9 * young < daly < young
    taus = np.geomspace(young / 4, young * 4, 21)  # ratio 1.15 between neighbours
    # one seed: the same failure times at every τ (common random numbers) keep the curve smooth
    goodput = [
        gm.simulate(100 * mtbf, t, ckpt, restart, 1, HOUR / mtbf, trials=200, seed=3).mean_goodput
        for t in taus
    ]
    best = taus[int(np.argmax(goodput))]
    assert best / daly == pytest.approx(1, abs=0.25) and best / young == pytest.approx(1, abs=0.25)
    assert max(goodput) > goodput[0] + 0.02 and max(goodput) > goodput[-1] + 0.02


def test_hot_spares_raise_goodput_when_replacement_is_slow():
    args = (30 * 24 * HOUR, 3600.0, 60.0, 600.0, 16_384, gm.LLAMA3_RATE_PER_GPU_HOUR)
    kw = dict(trials=100, seed=0, replace_s=2 * HOUR, swap_s=300.0)
    none, one, four = (gm.simulate(*args, spares=s, **kw) for s in (0, 1, 4))
    assert none.mean_goodput + 0.1 < one.mean_goodput < four.mean_goodput
    # with spares always at hand the downtime is restart + swap: the first-order model agrees
    mtbf = gm.cluster_mtbf_s(16_384, gm.LLAMA3_RATE_PER_GPU_HOUR)
    model = gm.expected_goodput(3600.0, 60.0, 600.0 + 300.0, mtbf)
    assert four.mean_goodput == pytest.approx(model, abs=0.04)


def test_async_beats_sync_when_the_write_is_slow():
    mtbf, tau, write, stage = 10 * HOUR, 1800.0, 600.0, 10.0
    sync = gm.simulate(100 * mtbf, tau, write, 120.0, 1, HOUR / mtbf, trials=100, seed=0)
    asyn = gm.simulate(
        100 * mtbf,
        tau,
        stage,
        120.0,
        1,
        HOUR / mtbf,
        trials=100,
        seed=0,
        async_ckpt=True,
        persist_s=write,
    )
    assert asyn.mean_goodput > sync.mean_goodput + 0.1
    assert (
        gm.expected_goodput(tau, stage, 120.0, mtbf, async_ckpt=True, persist_s=write)
        > gm.expected_goodput(tau, write, 120.0, mtbf) + 0.1
    )


def test_replay_run_gives_the_hand_computed_wall_time():
    # 100 s of work, checkpoint every 10 s (1 s each), restart 5 s, failures at work 25 and 31:
    # 0→25 with ckpts at 10, 20: 27 s + 5; resume 20→31, ckpt at 30: 12 s + 5; 30→100, 6 ckpts: 76 s
    r = gm.replay_run(100.0, 10.0, 1.0, 5.0, [25.0, 31.0])
    assert (r.wall_s, r.goodput, r.lost_work_s, r.checkpoints) == (125.0, 0.8, 6.0, 9)
    assert gm.replay_run(100.0, 10.0, 1.0, 5.0).wall_s == 109.0
    # a failure exactly at 20 hits before the checkpoint at 20: resume from 10, 10 s lost
    r = gm.replay_run(100.0, 10.0, 1.0, 5.0, [20.0])
    assert (r.wall_s, r.lost_work_s) == (21 + 5 + 90 + 8, 10.0)
    with pytest.raises(TitanliteError, match="outside"):
        gm.replay_run(100.0, 10.0, 1.0, 5.0, [35.0, 12.0])


def test_replay_ft_run_gives_the_hand_computed_wall_time_and_goodput():
    # 10 steps of 1 s by 2 groups; one dies: its step commits nowhere (2 group-steps), the other
    # waits 2 s, then steps alone for 5 - 2 = 3 steps before the dead one is back (3 more lost)
    r = gm.replay_ft_run(10, 1.0, 2, detect_s=2.0, rejoin_s=5.0)
    assert (r.wall_s, r.steps_alone, r.lost_group_steps) == (12.0, 3, 5)
    assert r.goodput == (20 - 5) / (2 * 12.0)
    assert gm.replay_ft_run(10, 1.0, 2, 2.0, 5.0, failures=0).goodput == 1.0


def test_ft_first_order_model_is_the_replay_spread_over_the_failures():
    """With M the wall time between failures, the replay's goodput is 1 - (t+D)/M - (R-D)/(G·M)
    exactly when (R - D) is a whole number of steps: the first-order model has no other term."""
    for groups, t, d, r, n in ((2, 0.5, 2.0, 12.0, 3), (8, 2.0, 5.0, 65.0, 10)):
        replay = gm.replay_ft_run(10_000, t, groups, d, r, failures=n)
        mtbf = replay.wall_s / n
        assert gm.ft_expected_goodput(mtbf, t, d, r, groups) == pytest.approx(replay.goodput)
    # more groups, less of the job waits for a rejoin; restart-everyone's cost does not shrink
    g = [gm.ft_expected_goodput(3600.0, 1.0, 5.0, 600.0, k) for k in (2, 8, 64)]
    assert g[0] < g[1] < g[2] < 1 - 6.0 / 3600 + 1e-12
    with pytest.raises(TitanliteError, match="rejoin_s"):
        gm.ft_expected_goodput(3600.0, 1.0, 5.0, 2.0, 2)


def test_cluster_mtbf_scales_as_one_over_n():
    one = gm.cluster_mtbf_s(1, 0.01)
    assert one == pytest.approx(100 * HOUR)
    for n in (2, 8, 1000):
        assert gm.cluster_mtbf_s(n, 0.01) == pytest.approx(one / n)


@pytest.mark.parametrize(
    "call",
    [
        lambda: gm.young_interval(0, 3600),
        lambda: gm.daly_interval(60, -1),
        lambda: gm.expected_goodput(600, 60, 120, float("nan")),
        lambda: gm.expected_goodput(600, 60, 120, 3600, persist_s=30),
        lambda: gm.cluster_mtbf_s(0, 0.01),
        lambda: gm.cluster_mtbf_s(2.5, 0.01),
        lambda: gm.simulate(1000, 100, 5, 10, 8, -0.1),
        lambda: gm.simulate(1000, 100, 5, 10, 8, 0.1, spares=-1),
        lambda: gm.replay_run(100, 0, 1, 5),
        lambda: gm.replay_ft_run(10, 1.0, 0, 1.0, 2.0),
        lambda: gm.ft_expected_goodput(3600, 1.0, -1.0, 2.0, 2),
    ],
)
def test_bad_inputs_raise_one_clear_line(call):
    with pytest.raises(TitanliteError) as e:
        call()
    assert "\n" not in str(e.value) and len(str(e.value)) > 20


def test_a_job_that_never_finishes_reports_zero_goodput():
    r = gm.simulate(100.0, 10.0, 1.0, 1.0, 1, 36_000.0, trials=4)  # MTBF 0.1 s, restart 1 s
    assert np.all(r.goodput == 0) and np.all(np.isinf(r.wall_s)) and np.all(r.failures > 1000)


def test_llama3_rate_reproduces_419_failures_in_54_days():
    assert gm.LLAMA3_RATE_PER_GPU_HOUR == 419 / (54 * 24 * 16_384)
    days54 = 54 * 24 * HOUR
    trials = 64
    r = gm.simulate(
        days54, 60.0, 0.0, 0.0, 16_384, gm.LLAMA3_RATE_PER_GPU_HOUR, trials=trials, seed=0
    )
    expected = 419 * r.wall_s.mean() / days54  # the wall is a few minutes over 54 days
    assert abs(r.failures.mean() - expected) < 4 * math.sqrt(419 / trials)
    assert abs(expected - 419) < 0.01 * 419


def test_plots_return_labelled_figures():
    from matplotlib.figure import Figure

    fig = gm.plot_goodput_vs_interval(50 * HOUR, 60.0, 120.0, 1, 0.2, trials=20)
    ax = fig.axes[0]
    assert isinstance(fig, Figure) and len(ax.lines) == 4  # simulated, analytic, Young, Daly
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert (
        any("Young" in s for s in labels) and any("Daly" in s for s in labels) and len(labels) == 5
    )
    assert "interval" in ax.get_xlabel() and "goodput" in ax.get_ylabel()

    fig = gm.plot_goodput_vs_cluster_size(
        7 * 24 * HOUR,
        60.0,
        300.0,
        gpus=(1024, 4096, 16384),
        spares=2,
        replace_s=HOUR,
        swap_s=120.0,
        trials=10,
    )
    ax = fig.axes[0]
    assert len(ax.lines) == 2 * len(gm.FAILURE_SOURCES)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("Llama 3" in s for s in labels) and sum("hot spares" in s for s in labels) == len(
        gm.FAILURE_SOURCES
    )
    for line in ax.lines:  # bigger clusters fail more often: goodput falls with size
        y = line.get_ydata()
        assert y[0] > y[-1] and np.all((0 < y) & (y <= 1))
