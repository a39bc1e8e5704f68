"""Checks for notebooks 14-15: a CPU run's memory budget, reading a bf16 measurement against its
noise, and reading an Optuna study (a real one, recorded by titanlite.tools.jobs.hpo's own code)."""

from __future__ import annotations

import contextlib
import statistics

from .grading import exercise


@exercise("14_state_bytes", "fp32 AdamW training memory, without the activations")
def state_bytes(c, fn):
    from ...models.llama import ModelArgs
    from ...tools.probe.cpu import training_memory_formula

    args = ModelArgs()
    for _ in range(8):
        n, batch, seq, vocab = (
            c.rng.randint(10**4, 10**9),
            c.rng.randint(1, 32),
            c.rng.randint(1, 2048),
            c.rng.randint(256, 128_000),
        )
        want = training_memory_formula(n, args, batch, seq, vocab)
        c.same_value(
            c.call(fn, n, batch, seq, vocab),
            want["total"] - want["activations"],
            f"state_bytes({n:,} parameters, batch={batch}, seq_len={seq}, vocab={vocab:,})",
        )
    c.passed("equals titanlite.tools.probe.cpu.training_memory_formula less its activations")


def _bf16_kind(bf16, fp32) -> str:
    """Notebook 14's reading, by the package's functions: fast, slow or same."""
    from ...tools.probe.cpu import CpuFeatures, bf16_verdict, relative_spread

    noise = max(relative_spread(bf16), relative_spread(fp32))
    ratio = statistics.median(bf16) / statistics.median(fp32)
    verdict = bf16_verdict(ratio, CpuFeatures("DEFAULT", None, 1, 1), spread=max(0.2, noise))
    return (
        "fast" if verdict.startswith("fast") else "slow" if verdict.startswith("slow") else "same"
    )


def _kind(ratio, band, symmetric=False):
    return (
        "fast"
        if ratio > 1 + band
        else "slow"
        if ratio < ((1 - band) if symmetric else 1 / (1 + band))
        else "same"
    )


def _spread(xs):
    return (max(xs) - min(xs)) / statistics.median(xs)


def _mean_spread(xs):
    return (max(xs) - min(xs)) / statistics.fmean(xs)


BF16_MISTAKES = {
    "means instead of medians": lambda b, f: _kind(
        statistics.fmean(b) / statistics.fmean(f), max(0.2, _spread(b), _spread(f))
    ),
    "means throughout (the spreads over means too)": lambda b, f: _kind(
        statistics.fmean(b) / statistics.fmean(f), max(0.2, _mean_spread(b), _mean_spread(f))
    ),
    "the spreads over means": lambda b, f: _kind(
        statistics.median(b) / statistics.median(f), max(0.2, _mean_spread(b), _mean_spread(f))
    ),
    "no 0.2 floor": lambda b, f: _kind(
        statistics.median(b) / statistics.median(f), max(_spread(b), _spread(f))
    ),
    "0.2 only": lambda b, f: _kind(statistics.median(b) / statistics.median(f), 0.2),
    "1 - band below": lambda b, f: _kind(
        statistics.median(b) / statistics.median(f),
        max(0.2, _spread(b), _spread(f)),
        symmetric=True,
    ),
    "the bf16 spread only": lambda b, f: _kind(
        statistics.median(b) / statistics.median(f), max(0.2, _spread(b))
    ),
    "the fp32 spread only": lambda b, f: _kind(
        statistics.median(b) / statistics.median(f), max(0.2, _spread(f))
    ),
}


def _draw_measurement(rng):
    """(bf16 rates, fp32 rates): repeated matmul rates around a drawn ratio, each list with its
    own noise and, sometimes, one slow outlier (a burst of load from elsewhere)."""
    base, ratio = (
        rng.uniform(5, 500),
        rng.choice([rng.uniform(0.5, 1.6), rng.uniform(0.7, 1.3)]),
    )
    lists = []
    for centre in (base * ratio, base):
        noise = rng.choice([rng.uniform(0.01, 0.15), rng.uniform(0.2, 0.6)])
        xs = [centre * (1 + rng.uniform(-noise / 2, noise / 2)) for _ in range(rng.randint(3, 7))]
        if rng.random() < 0.3:
            xs[rng.randrange(len(xs))] = centre * rng.uniform(0.3, 0.7)
        lists.append(xs)
    return tuple(lists)


# Readings by means: a mean and a median part only where the rates are skewed (an outlier, uneven
# noise), and the verdicts only where that lands near a verdict's edge: about one measurement in
# 20 (1 in 70 for the spreads), so a dozen random ones often hold none.
_BY_MEANS = (
    "means instead of medians",
    "means throughout (the spreads over means too)",
    "the spreads over means",
)


def _draw_rates(rng):
    cases = [_draw_measurement(rng) for _ in range(12)]
    # For each reading by means, one measurement on which it gives another verdict than the
    # medians' (drawn until it does): one in every run of the check.
    for name in _BY_MEANS:
        for _ in range(2000):
            case = _draw_measurement(rng)
            if BF16_MISTAKES[name](*case) != _bf16_kind(*case):
                break
        cases.append(case)
    return cases


@exercise("14_bf16_verdict", "is bf16 faster than fp32 here, beyond the noise?")
def bf16_verdict_exercise(c, fn):
    cases = c.separating(_draw_rates, _bf16_kind, BF16_MISTAKES)
    for bf16, fp32 in cases:
        c.same_value(
            c.call(fn, list(bf16), list(fp32)),
            _bf16_kind(bf16, fp32),
            f"the verdict for bf16 rates {[round(x, 3) for x in bf16]} and fp32 rates "
            f"{[round(x, 3) for x in fp32]} GFLOP/s",
        )
    c.passed(f"the reading of titanlite.tools.probe.cpu.bf16_verdict on {len(cases)} measurements")


@contextlib.contextmanager
def _quiet_optuna():
    import optuna

    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(level)


def _study(rng):
    """A real Optuna study whose trials were asked for, suggested (titanlite.tools.jobs.hpo.suggest),
    reported (hpo.PruningCallback, which records tokens_trained and each validation loss) and
    told with Optuna's own API, in every state a search leaves: complete; pruned, which carries
    its last reported loss as its value; failed (a crash, before or after a validation); and
    running (never told). Its trials are drawn so that each classic misreading is caught:
    a pruned trial beats every complete trial of its batch size, one batch size has no
    complete trial, another has several."""
    import optuna
    from optuna.trial import TrialState

    from ...config import load_config
    from ...tools.jobs.hpo import ACCUM_CHOICES, PruningCallback, suggest

    base = load_config()
    evals = 4
    every = (
        base.training.batch_size * max(ACCUM_CHOICES) * base.training.seq_len * rng.choice([1, 2])
    )
    budget = every * evals
    study = optuna.create_study(
        direction="minimize",
        sampler=optuna.samplers.RandomSampler(seed=rng.randrange(2**31)),
        pruner=optuna.pruners.NopPruner(),
    )
    accums = list(ACCUM_CHOICES)
    rng.shuffle(accums)
    several, no_complete, mixed = accums[0], accums[1], accums[2]
    plan = (
        [(several, "complete")] * rng.randint(2, 3)
        + [(several, "pruned-best")]
        + [
            (no_complete, rng.choice(["pruned", "failed", "running"]))
            for _ in range(rng.randint(1, 3))
        ]
        + [(mixed, "complete")]
        + [(mixed, rng.choice(["complete", "pruned", "failed"])) for _ in range(rng.randint(0, 2))]
        + [
            (rng.choice(accums), "failed-early"),
            (rng.choice(accums), "failed"),
            (rng.choice(accums), "running"),
        ]
    )
    # Validations each trial reached: all for complete ones; none for a crash at start-up.
    reports = [
        {"complete": evals, "failed-early": 0, "pruned-best": rng.choice([1, evals - 1])}.get(
            kind, rng.randint(1, evals - 1)
        )
        for _, kind in plan
    ]
    pruned = [i for i, (_, kind) in enumerate(plan) if kind.startswith("pruned")]
    if 2 * sum(reports[i] for i in pruned) == len(pruned) * evals:  # trained = saved: not telling
        best = next(i for i in pruned if plan[i][1] == "pruned-best")
        reports[best] = evals - reports[best]
    # Completed trials first: the pruned "best" is told after them, below their best loss.
    order = sorted(range(len(plan)), key=lambda i: plan[i][1] != "complete")
    best_complete = {}
    for (accum, kind), reached in ((plan[i], reports[i]) for i in order):
        study.enqueue_trial({"grad_accum_steps": accum})
        trial = study.ask()
        cfg = suggest(trial, base, budget)
        tokens_per_step = (
            cfg.training.batch_size * cfg.training.grad_accum_steps * cfg.training.seq_len
        )
        trial.set_user_attr("steps", cfg.training.steps)  # as Objective does before training
        trial.set_user_attr("token_budget", budget)
        callback = PruningCallback(trial, tokens_per_step)
        loss = rng.uniform(5.5, 7.0)
        if kind == "pruned-best":
            loss = best_complete[accum] - rng.uniform(0.05, 0.5) + 0.5 * reached  # ends below them
        for k in range(1, reached + 1):
            loss -= rng.uniform(0.1, 0.5) if kind != "pruned-best" else 0.5
            callback({"kind": "val", "step": k * every // tokens_per_step, "val_loss": loss})
        if kind == "complete":
            study.tell(trial, callback.curve[-1][1])  # Objective returns the last validation loss
            best_complete[accum] = min(best_complete.get(accum, loss), loss)
        elif kind.startswith("pruned"):
            study.tell(trial, state=TrialState.PRUNED)  # Optuna keeps the last reported value
        elif kind.startswith("failed"):
            study.tell(trial, state=TrialState.FAIL)
    return study


_STATE = {"FAIL": "failed"}


def _describe(study) -> str:
    from collections import Counter

    states = Counter(_STATE.get(t.state.name, t.state.name.lower()) for t in study.trials)
    return f"a study of {len(study.trials)} trials ({', '.join(f'{n} {s}' for s, n in sorted(states.items()))})"


@exercise("15_best_lr_per_accum", "the best learning rate for each batch size")
def best_lr(c, fn):
    from optuna.trial import TrialState

    from ...tools.jobs.hpo import best_lr_per_accum

    for _ in range(3):
        with _quiet_optuna():
            study = _study(c.rng)
        got, want = c.call(fn, study), best_lr_per_accum(study)
        where = f"in {_describe(study)}"
        if not isinstance(got, dict):
            c.fail(
                f"return a dict {{grad_accum_steps: (lr, loss)}}, got {type(got).__name__} {where}"
            )
        for accum in sorted(set(got) - set(want), key=str):
            states = sorted(
                _STATE.get(t.state.name, t.state.name.lower())
                for t in study.trials
                if t.params.get("grad_accum_steps") == accum
            )
            c.fail(
                f"grad_accum_steps={accum} should not be in the answer: no complete trial tried it "
                f"(its trials: {', '.join(states) or 'none'}) {where}"
            )
        for accum, (lr, loss) in want.items():
            if accum not in got:
                c.fail(
                    f"grad_accum_steps={accum} is missing; its best complete trial has lr {lr:.6g}, "
                    f"loss {loss:.6g} {where}"
                )
            pair = got[accum]
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                c.fail(
                    f"the answer for grad_accum_steps={accum} should be the pair (lr, loss), got {pair!r}"
                )
            c.same_value(
                pair[0],
                lr,
                f"the lr for grad_accum_steps={accum} (of its best complete trial, "
                f"loss {loss:.6g}) {where}",
            )
            c.same_value(pair[1], loss, f"the loss for grad_accum_steps={accum} {where}")
        assert any(t.state == TrialState.PRUNED for t in study.trials)
    c.passed(
        "equals titanlite.tools.jobs.hpo.best_lr_per_accum on 3 real studies with pruned, failed "
        "and running trials"
    )


@exercise("15_compute_saved", "the tokens pruning saved")
def compute_saved(c, fn):
    from ...tools.jobs.hpo import compute_saved as real

    for _ in range(3):
        with _quiet_optuna():
            study = _study(c.rng)
        c.same_value(
            c.call(fn, study),
            real(study)["tokens_saved"],
            f"the tokens saved in {_describe(study)}",
        )
    c.passed(
        "equals titanlite.tools.jobs.hpo.compute_saved on 3 real studies with pruned, failed and "
        "running trials"
    )
