"""Hyperparameter search with Optuna over the trainer's Python API, with pruning.

    study = open_study("lr-batch", storage_dir="runs/hpo")          # SQLite: survives restarts
    study.optimize(Objective(base_cfg, token_budget=65_536), n_trials=20)

Every trial trains on the same number of tokens (a bigger batch takes fewer steps), is
validated at the same token counts, and reports each validation loss to Optuna; the pruner
stops a trial that is doing worse than the others were at that point (Optuna's MedianPruner:
below the median of earlier trials at the same step).
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from pathlib import Path

import optuna

from ...errors import TitanliteError

ACCUM_CHOICES = (1, 2, 4)  # global batch = micro-batch × these; the same token budget for all


def open_study(
    name: str,
    storage_dir: str | Path = "runs/hpo",
    *,
    seed: int | None = 0,
    startup_trials: int = 4,
    warmup_reports: int = 1,
) -> optuna.Study:
    """Create the study, or open it if it exists: its trials live in <storage_dir>/<name>.db."""
    Path(storage_dir).mkdir(parents=True, exist_ok=True)
    # Several processes write one SQLite file: wait for the lock rather than fail at once.
    storage = optuna.storages.RDBStorage(
        f"sqlite:///{Path(storage_dir) / name}.db", engine_kwargs={"connect_args": {"timeout": 60}}
    )
    pruner = optuna.pruners.MedianPruner(
        n_startup_trials=startup_trials, n_warmup_steps=warmup_reports
    )
    return optuna.create_study(
        study_name=name,
        storage=storage,
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=pruner,
        load_if_exists=True,
    )


def suggest(trial: optuna.Trial, base, token_budget: int):
    """A copy of `base` (a Config) with this trial's hyperparameters and the fixed token budget."""
    cfg = copy.deepcopy(base)
    t = cfg.training
    cfg.optimizer.lr = trial.suggest_float("lr", 1e-4, 3e-2, log=True)
    cfg.optimizer.weight_decay = trial.suggest_float("weight_decay", 0.0, 0.2)
    t.grad_accum_steps = trial.suggest_categorical("grad_accum_steps", ACCUM_CHOICES)
    tokens_per_step = t.batch_size * t.grad_accum_steps * t.seq_len
    if token_budget % (t.batch_size * max(ACCUM_CHOICES) * t.seq_len):
        raise TitanliteError(
            f"token_budget {token_budget} must be a multiple of batch_size × "
            f"{max(ACCUM_CHOICES)} × seq_len = {t.batch_size * max(ACCUM_CHOICES) * t.seq_len}"
            " so every batch size trains on exactly the same tokens"
        )
    t.steps = token_budget // tokens_per_step
    # Warm-up as a fraction of the run, so it means the same at every batch size.
    cfg.scheduler.warmup_steps = round(t.steps * trial.suggest_float("warmup_fraction", 0.0, 0.3))
    study = getattr(trial, "study", None)  # a FixedTrial (replaying chosen values) has none
    cfg.metrics.run_name = f"{study.study_name if study else 'fixed'}-trial{trial.number}"
    # a trial's folder is scratch: a study started afresh reuses its names
    cfg.metrics.overwrite = True
    return cfg


class PruningCallback:
    """A trainer callback: each validation loss goes to Optuna at its token count; when the
    pruner says so, it raises optuna.TrialPruned out of Trainer.fit (which closes its logs)."""

    def __init__(self, trial: optuna.Trial, tokens_per_step: int, forward=None):
        self.trial, self.tokens_per_step, self.forward = trial, tokens_per_step, forward
        self.curve: list[tuple[int, float]] = []  # (tokens seen, validation loss)

    def __call__(self, record: dict) -> None:
        tokens = record["step"] * self.tokens_per_step
        if self.forward is not None:  # e.g. a LivePlot, with tokens as its x axis
            self.forward({**record, "tokens": tokens, "run": f"trial {self.trial.number}"})
        if record["kind"] != "val":
            return
        self.curve.append((tokens, record["val_loss"]))
        self.trial.set_user_attr("curve", self.curve)
        self.trial.set_user_attr("tokens_trained", tokens)
        self.trial.report(record["val_loss"], tokens)
        if self.trial.should_prune():
            raise optuna.TrialPruned(f"val loss {record['val_loss']:.3f} at {tokens:,} tokens")


class Objective:
    """Validation loss after `token_budget` tokens of `base` with the trial's hyperparameters.
    `evals` validations at the same token counts in every trial feed the pruner."""

    def __init__(self, base, token_budget: int, evals: int = 4, forward=None):
        self.base, self.token_budget, self.evals, self.forward = base, token_budget, evals, forward

    def __call__(self, trial: optuna.Trial) -> float:
        from ...train import Trainer

        cfg = suggest(trial, self.base, self.token_budget)
        t = cfg.training
        biggest_step = t.batch_size * max(ACCUM_CHOICES) * t.seq_len
        # Evaluate every token_budget/evals tokens: a whole number of steps at every batch size.
        every_tokens = max(
            biggest_step, self.token_budget // self.evals // biggest_step * biggest_step
        )
        tokens_per_step = t.batch_size * t.grad_accum_steps * t.seq_len
        cfg.eval.every = every_tokens // tokens_per_step
        trial.set_user_attr("steps", t.steps)
        trial.set_user_attr("token_budget", self.token_budget)
        callback = PruningCallback(trial, tokens_per_step, self.forward)
        Trainer(cfg).fit(callbacks=[callback])
        return callback.curve[-1][1]


def compute_saved(study: optuna.Study) -> dict:
    """Trials pruned and the tokens they did not train (budget minus tokens trained)."""
    pruned = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.PRUNED,))
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    budget = sum(t.user_attrs["token_budget"] for t in pruned + done)
    trained = sum(t.user_attrs.get("tokens_trained", 0) for t in pruned + done)
    return {
        "complete": len(done),
        "pruned": len(pruned),
        "tokens_budgeted": budget,
        "tokens_trained": trained,
        "tokens_saved": budget - trained,
    }


def best_lr_per_accum(study: optuna.Study) -> dict[int, tuple[float, float]]:
    """Per grad_accum_steps (batch size), the completed trial with the lowest loss: (lr, loss)."""
    best: dict[int, tuple[float, float]] = {}
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        accum = t.params["grad_accum_steps"]
        if accum not in best or t.value < best[accum][1]:
            best[accum] = (t.params["lr"], t.value)
    return dict(sorted(best.items()))


def optimize_in_processes(
    name: str,
    storage_dir: str | Path,
    base,
    token_budget: int,
    *,
    processes: int = 2,
    trials_each: int = 2,
    timeout_s: float = 600,
) -> list[str]:
    """Run `processes` Python processes at once, each adding `trials_each` trials to the same
    SQLite study: how a search spreads over the cores (or machines, with a database server)."""
    cfg_file = Path(storage_dir) / f"{name}.base.toml"
    from .launcher import to_toml

    cfg_file.parent.mkdir(parents=True, exist_ok=True)
    cfg_file.write_text(to_toml(dataclasses.asdict(base)))
    cmd = [
        sys.executable,
        "-m",
        "titanlite.tools.jobs.hpo",
        name,
        str(storage_dir),
        str(cfg_file),
        str(token_budget),
        str(trials_each),
    ]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(processes)
    ]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise TitanliteError(
                f"a search process failed (exit {p.returncode}): "
                f"{out.strip().splitlines()[-1:] if out else 'no output'}"
            )
        outputs.append(out)
    return outputs


if (
    __name__ == "__main__"
):  # python -m titanlite.tools.jobs.hpo NAME STORAGE_DIR CONFIG.toml BUDGET TRIALS
    from ...config import load_config

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name, storage_dir, cfg_path, budget, trials = sys.argv[1:6]
    import os

    study = open_study(name, storage_dir, seed=os.getpid())  # its own seed: not the others' trials
    study.optimize(Objective(load_config(cfg_path), int(budget)), n_trials=int(trials))
    print(f"process done: {len(study.trials)} trials in the study")
