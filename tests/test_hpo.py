"""titanlite.tools.jobs.hpo: the Optuna objective over the trainer, pruning, SQLite storage, processes."""

import optuna
import pytest

import titanlite
from titanlite.config import Config
from titanlite.tools.jobs import hpo


def _base(tmp_path):
    cfg = Config()
    cfg.model.preset = "debug"
    cfg.training.batch_size, cfg.training.seq_len, cfg.training.threads = 2, 16, 1
    cfg.eval.batches, cfg.eval.sample_tokens = 1, 1
    cfg.metrics.progress, cfg.metrics.log_dir = False, str(tmp_path / "runs")
    return cfg


BUDGET = 2 * 4 * 16 * 8  # batch × biggest accumulation × seq × 8 steps


def test_every_batch_size_gets_the_same_tokens(tmp_path):
    base = _base(tmp_path)
    for accum in hpo.ACCUM_CHOICES:
        trial = optuna.trial.FixedTrial(
            {"lr": 1e-3, "weight_decay": 0.0, "grad_accum_steps": accum, "warmup_fraction": 0.25}
        )
        cfg = hpo.suggest(trial, base, BUDGET)
        assert cfg.training.steps * 2 * accum * 16 == BUDGET
        assert cfg.scheduler.warmup_steps == round(cfg.training.steps * 0.25)
    assert base.training.steps == Config().training.steps, "the base config is not modified"
    with pytest.raises(titanlite.TitanliteError, match="must be a multiple"):
        hpo.suggest(trial, base, BUDGET + 16)


def test_pruned_trial_stops_training_and_closes_the_metrics_file(tmp_path):
    study = hpo.open_study("prune", tmp_path / "hpo", startup_trials=0, warmup_reports=0)
    study.enqueue_trial(
        {"lr": 3e-3, "weight_decay": 0.1, "grad_accum_steps": 1, "warmup_fraction": 0.1}
    )
    study.enqueue_trial(
        {"lr": 1e-4, "weight_decay": 0.1, "grad_accum_steps": 1, "warmup_fraction": 0.3}
    )
    study.optimize(hpo.Objective(_base(tmp_path), BUDGET, evals=4), n_trials=2)
    good, bad = study.trials
    assert good.state == optuna.trial.TrialState.COMPLETE
    assert bad.state == optuna.trial.TrialState.PRUNED, (
        "a 30x smaller lr falls behind the median at once"
    )
    assert bad.user_attrs["tokens_trained"] < BUDGET == good.user_attrs["tokens_trained"]
    saved = hpo.compute_saved(study)
    assert saved == {
        "complete": 1,
        "pruned": 1,
        "tokens_budgeted": 2 * BUDGET,
        "tokens_trained": BUDGET + bad.user_attrs["tokens_trained"],
        "tokens_saved": BUDGET - bad.user_attrs["tokens_trained"],
    }
    # The trainer's `finally` ran: the pruned run's metrics file is complete JSON lines.
    lines = (tmp_path / "runs" / "prune-trial1" / "metrics.jsonl").read_text().splitlines()
    assert lines and all(line.startswith("{") and line.endswith("}") for line in lines)
    assert hpo.best_lr_per_accum(study) == {1: (3e-3, good.value)}


@pytest.mark.slow
def test_study_resumes_from_sqlite_and_takes_trials_from_two_processes(tmp_path):
    base = _base(tmp_path)
    study = hpo.open_study("shared", tmp_path / "hpo")
    study.optimize(hpo.Objective(base, BUDGET), n_trials=1)
    hpo.optimize_in_processes("shared", tmp_path / "hpo", base, BUDGET, processes=2, trials_each=1)
    again = hpo.open_study("shared", tmp_path / "hpo")
    assert len(again.trials) == 3 and sorted(t.number for t in again.trials) == [0, 1, 2]
