"""Checks for notebooks 14-15: a CPU run's memory budget, and reading an Optuna study."""
from __future__ import annotations

import random

from ...exercises import call, fail, fresh_seed, passed, same_value
from . import exercise


@exercise("14_state_bytes", "fp32 AdamW training memory, without the activations")
def state_bytes(fn):
    from ...cpu import training_memory_formula
    from ...models.llama import ModelArgs
    name, seed = "14_state_bytes", fresh_seed()
    rng = random.Random(seed)
    args = ModelArgs()
    for _ in range(8):
        n, batch, seq, vocab = rng.randint(10**4, 10**9), rng.randint(1, 32), rng.randint(1, 2048), rng.randint(256, 128_000)
        want = training_memory_formula(n, args, batch, seq, vocab)
        want = want["total"] - want["activations"]
        same_value(name, call(name, fn, n, batch, seq, vocab), want,
                   f"bytes for {n:,} parameters, batch {batch}, seq {seq}, vocab {vocab:,}", seed=seed)
    return passed(name, "equals titanlite.cpu.training_memory_formula less its activations")


def _random_study(rng: random.Random):
    """An in-memory study of complete and pruned trials, as titanlite.hpo records them."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from optuna.trial import TrialState, create_trial
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize")
    dists = {"lr": FloatDistribution(1e-4, 1e-1, log=True), "grad_accum_steps": CategoricalDistribution([1, 2, 4, 8])}
    for _ in range(rng.randint(6, 14)):
        budget = rng.choice([4096, 8192])
        pruned = rng.random() < 0.4
        attrs = {"token_budget": budget, "tokens_trained": rng.randint(1, budget - 1) if pruned else budget}
        params = {"lr": 10 ** rng.uniform(-4, -1), "grad_accum_steps": rng.choice([1, 2, 4, 8])}
        study.add_trial(create_trial(state=TrialState.PRUNED if pruned else TrialState.COMPLETE,
                                     value=None if pruned else rng.uniform(2, 6), params=params,
                                     distributions=dists, user_attrs=attrs))
    return study


@exercise("15_best_lr_per_accum", "the best learning rate for each batch size")
def best_lr(fn):
    from ...hpo import best_lr_per_accum
    name, seed = "15_best_lr_per_accum", fresh_seed()
    rng = random.Random(seed)
    for _ in range(3):
        study = _random_study(rng)
        got, want = call(name, fn, study), best_lr_per_accum(study)
        if not isinstance(got, dict):
            fail(name, f"return a dict {{grad_accum_steps: (lr, loss)}}, got {type(got).__name__}", seed)
        same_value(name, {k: tuple(v) for k, v in got.items()}, want,
                   f"the best (lr, loss) per grad_accum_steps of {len(study.trials)} trials", seed=seed)
    return passed(name, "equals titanlite.hpo.best_lr_per_accum on 3 random studies")


@exercise("15_compute_saved", "the tokens pruning saved")
def compute_saved(fn):
    from ...hpo import compute_saved as real
    name, seed = "15_compute_saved", fresh_seed()
    rng = random.Random(seed)
    for _ in range(3):
        study = _random_study(rng)
        same_value(name, call(name, fn, study), real(study)["tokens_saved"],
                   f"tokens saved in a study of {len(study.trials)} trials", seed=seed)
    return passed(name, "equals titanlite.hpo.compute_saved on 3 random studies")
