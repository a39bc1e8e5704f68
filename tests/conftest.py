import os
from pathlib import Path

import pytest

# Keep tests away from the user's caches and make them quiet and repeatable.
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """One data cache (corpus tokens, tokenizer) shared by the tests of a session."""
    return tmp_path_factory.mktemp("titanlite-data")


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path_factory, monkeypatch, request):
    cache = tmp_path_factory.getbasetemp() / "titanlite-cache"
    monkeypatch.setenv("TITANLITE_CACHE_DIR", str(cache))


def tiny_overrides(data_dir: Path, tmp_path: Path, **extra) -> dict:
    """A seconds-long debug run: small tokenizer, short sequences, logs in tmp_path."""
    o = {"data.data_dir": str(data_dir), "data.vocab_size": 512, "training.steps": 12,
         "training.batch_size": 4, "training.seq_len": 32, "scheduler.warmup_steps": 2,
         "eval.every": 6, "eval.batches": 2, "eval.sample_tokens": 8,
         "metrics.log_dir": str(tmp_path / "runs"), "metrics.run_name": "t",
         "metrics.progress": False}
    o.update(extra)
    return o
