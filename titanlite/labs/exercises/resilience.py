"""Checks for notebooks 12-13: an atomic checkpoint commit, finding the newest complete
checkpoint, and the checkpoint-interval arithmetic of fault tolerance."""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
from pathlib import Path

from ...exercises import ExerciseError, call, fail, fresh_seed, passed, same_value
from . import exercise


def _shards(folder: Path, rng: random.Random) -> None:
    folder.mkdir(parents=True)
    for i in range(rng.randint(1, 3)):
        (folder / f"__{i}_0.distcp").write_bytes(os.urandom(rng.randint(10, 4000)))
    (folder / ".metadata").write_bytes(os.urandom(rng.randint(10, 200)))


@contextlib.contextmanager
def _watch_renames(seen: list):
    """Note, for every os.rename (Path.rename and shutil.move use it), whether the source
    already held its commit record: written after the rename, a crash in between would leave
    a checkpoint that looks complete to nobody - or, worse, a record for missing shards."""
    from ...resilience.checkpoint import COMMIT_FILE
    real = os.rename

    def rename(src, dst, *args, **kwargs):
        seen.append((Path(src), Path(dst), (Path(src) / COMMIT_FILE).is_file()))
        return real(src, dst, *args, **kwargs)

    os.rename = rename
    try:
        yield
    finally:
        os.rename = real


@exercise("12_atomic_commit", "write the commit record, then rename the folder into place")
def atomic_commit(fn):
    from ...resilience.checkpoint import COMMIT_FILE, committed, step_dir, verify
    name, seed = "12_atomic_commit", fresh_seed()
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="titanlite-exercise-"))
    try:
        for step in sorted(rng.sample(range(1, 500), 2)):
            final = step_dir(root, step)
            tmp = final.with_name(final.name + ".partial")
            _shards(tmp, rng)
            seen = []
            with _watch_renames(seen):
                call(name, fn, tmp, final, step)
            if tmp.exists():
                fail(name, f"the temporary folder {tmp.name} is still there: rename it to {final.name}", seed)
            if not final.is_dir():
                fail(name, f"{final.name} does not exist after the commit: rename {tmp.name} to it", seed)
            if not seen:
                fail(name, "no rename happened: copying files one by one is not atomic, os.rename of "
                           "the folder is", seed)
            if not seen[-1][2]:
                fail(name, f"{COMMIT_FILE} was not in the folder when it was renamed: write it first, "
                           f"or a crash between the two leaves a folder nobody can trust", seed)
            try:
                info = verify(final)
            except ExerciseError:
                raise
            except Exception as e:
                fail(name, f"verify() rejects the result: {e}", seed)
            same_value(name, int(info["step"]), step, f"the step in {COMMIT_FILE}", seed=seed)
        same_value(name, [p.name for p in committed(root)], sorted(p.name for p in root.iterdir()),
                   "the committed checkpoints", seed=seed)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return passed(name, "verify() accepts both commits and the record was written before the rename")


@exercise("12_latest_committed", "the newest checkpoint whose save finished")
def latest_committed(fn):
    from ...resilience.checkpoint import COMMIT_FILE, committed, step_dir
    name, seed = "12_latest_committed", fresh_seed()
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="titanlite-exercise-"))
    try:
        for trial in range(3):
            folder = root / f"run{trial}"
            folder.mkdir()
            steps = sorted(rng.sample(range(1, 10_000), rng.randint(2 if trial == 0 else 0, 5)))
            for step in steps:
                d = step_dir(folder, step)
                kind = rng.choice(["done", "done", "partial", "unfinished"])
                if trial == 0:  # one folder whose newest save never finished, over an older good one
                    kind = rng.choice(["partial", "unfinished"]) if step == steps[-1] else \
                        "done" if step == steps[0] else kind
                if kind == "partial":
                    d = d.with_name(d.name + ".partial")
                d.mkdir()
                if kind != "unfinished":
                    (d / COMMIT_FILE).write_text("{}")
            want = committed(folder)
            got = call(name, fn, folder)
            same_value(name, None if got is None else Path(got).name, want[-1].name if want else None,
                       f"the latest committed checkpoint among {sorted(p.name for p in folder.iterdir())}",
                       seed=seed)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return passed(name, "the same choice as titanlite.resilience.checkpoint.committed in 3 random folders")


@exercise("13_young", "Young's optimal checkpoint interval")
def young(fn):
    from ...resilience.goodput_model import young_interval
    name, seed = "13_young", fresh_seed()
    rng = random.Random(seed)
    for _ in range(10):
        cost, mtbf = rng.uniform(0.1, 300), rng.uniform(60, 86400 * 30)
        same_value(name, call(name, fn, cost, mtbf), young_interval(cost, mtbf),
                   f"the interval for a {cost:.3g} s checkpoint and a {mtbf:.3g} s MTBF", seed=seed, rel=1e-9)
    return passed(name, "equals titanlite.resilience.goodput_model.young_interval")


@exercise("13_cluster_mtbf", "a job's MTBF from its instances' failure rate")
def cluster_mtbf(fn):
    from ...resilience.goodput_model import cluster_mtbf_s
    name, seed = "13_cluster_mtbf", fresh_seed()
    rng = random.Random(seed)
    for _ in range(10):
        n, rate = rng.randint(1, 20000), rng.uniform(1e-6, 1e-2)
        same_value(name, call(name, fn, n, rate), cluster_mtbf_s(n, rate),
                   f"the MTBF in seconds of {n} instances failing {rate:.3g} times an hour each",
                   seed=seed, rel=1e-9)
    return passed(name, "equals titanlite.resilience.goodput_model.cluster_mtbf_s")
