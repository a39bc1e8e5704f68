"""Checks for notebooks 12-13: an atomic checkpoint commit, finding the newest complete
checkpoint, and the checkpoint-interval arithmetic of fault tolerance."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .grading import exercise


def _shards(folder: Path, rng) -> None:
    folder.mkdir(parents=True)
    for i in range(rng.randint(1, 3)):
        (folder / f"__{i}_0.distcp").write_bytes(rng.randbytes(rng.randint(10, 4000)))
    (folder / ".metadata").write_bytes(rng.randbytes(rng.randint(10, 200)))


@contextlib.contextmanager
def _watch(renames: list, fsyncs: list):
    """Note every os.rename (Path.rename and shutil.move use it): whether its source already held
    its commit record (written after the rename, a crash in between leaves a checkpoint nobody
    trusts); and every os.fsync: which file (inode) it flushed, and when."""
    from ...resilience.checkpoint_files import COMMIT_FILE

    real_rename, real_fsync = os.rename, os.fsync

    def rename(src, dst, *args, **kwargs):
        renames.append((Path(src), Path(dst), (Path(src) / COMMIT_FILE).is_file(), len(fsyncs)))
        return real_rename(src, dst, *args, **kwargs)

    def fsync(fd):
        fd = fd if isinstance(fd, int) else fd.fileno()
        fsyncs.append(os.fstat(fd).st_ino)
        return real_fsync(fd)

    os.rename, os.fsync = rename, fsync
    try:
        yield
    finally:
        os.rename, os.fsync = real_rename, real_fsync


@exercise("12_atomic_commit", "write the commit record, then rename the folder into place")
def atomic_commit(c, fn):
    from ...resilience.checkpoint_files import COMMIT_FILE, committed, crc32, step_dir, verify

    root = Path(tempfile.mkdtemp(prefix="titanlite-exercise-"))
    try:
        for step in sorted(c.rng.sample(range(1, 500), 2)):
            final = step_dir(root, step)
            tmp = final.with_name(final.name + ".partial")
            _shards(tmp, c.rng)
            shards = {f.name: [f.stat().st_size, crc32(f)] for f in sorted(tmp.iterdir())}
            renames, fsyncs = [], []
            with _watch(renames, fsyncs):
                c.call(fn, tmp, final, step)
            if tmp.exists():
                c.fail(f"the temporary folder {tmp.name} is still there: rename it to {final.name}")
            if not final.is_dir():
                c.fail(f"{final.name} does not exist after the commit: rename {tmp.name} to it")
            if not renames:
                c.fail(
                    "no rename happened: copying files one by one is not atomic, os.rename of the folder is"
                )
            _, _, had_record, fsyncs_before = renames[-1]
            if not had_record:
                c.fail(
                    f"{COMMIT_FILE} was not in the folder when it was renamed: write it first, or a "
                    f"crash between the two leaves a folder nobody can trust"
                )
            record_inode = (final / COMMIT_FILE).stat().st_ino
            if record_inode not in fsyncs[:fsyncs_before]:
                c.fail(
                    f"{COMMIT_FILE} was not flushed to disk (os.fsync of the file) before the rename: "
                    f"after a power cut the folder could exist with an empty record"
                )
            try:
                info = json.loads((final / COMMIT_FILE).read_text())
            except (ValueError, UnicodeDecodeError) as e:
                c.fail(f"{COMMIT_FILE} is not JSON: {e}")
            if not isinstance(info, dict):
                c.fail(f"{COMMIT_FILE} should hold a JSON object, got {type(info).__name__}")
            c.same_value(info.get("format"), 1, f"the 'format' in {COMMIT_FILE}")
            c.same_value(info.get("step"), step, f"the 'step' in {COMMIT_FILE}")
            c.same_value(
                info.get("files"),
                shards,
                f"the 'files' in {COMMIT_FILE} ({{name: [size, crc32]}} "
                f"of every shard the folder held)",
            )
            try:
                verify(final)
            except Exception as e:  # whatever verify says is the answer
                c.fail(f"verify() rejects the result: {e}")
        c.same_value(
            [p.name for p in committed(root)],
            sorted(p.name for p in root.iterdir()),
            "the committed checkpoints",
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    c.passed(
        "the record lists every shard, was flushed before the rename, and verify() accepts both commits"
    )


def _make(folder: Path, step: int, kind: str) -> None:
    """A step folder: done (committed), unfinished (no record), partial (a .partial folder, no
    record) or partial+record (crashed between writing the record and the rename)."""
    from ...resilience.checkpoint_files import COMMIT_FILE, step_dir

    d = step_dir(folder, step)
    if kind.startswith("partial"):
        d = d.with_name(d.name + ".partial")
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"x")
    if kind in ("done", "partial+record"):
        (d / COMMIT_FILE).write_text("{}")


@exercise("12_latest_committed", "the newest checkpoint whose save finished")
def latest_committed(c, fn):
    from ...resilience.checkpoint_files import COMMIT_FILE, committed

    rng = c.rng
    root = Path(tempfile.mkdtemp(prefix="titanlite-exercise-"))
    kinds = ["done", "done", "unfinished", "partial", "partial+record"]
    try:
        folders = [  # each list: (kind of the newest save, ...older ones), newest first
            ["unfinished", "done", rng.choice(kinds)],  # ignoring the record picks the newest
            [
                "partial+record",
                "done",
                rng.choice(kinds),
            ],  # a .partial with a record is not committed
            ["done", "done", rng.choice(kinds)],  # the newest of several, not the oldest
            [
                rng.choice(["unfinished", "partial", "partial+record"])
                for _ in range(rng.randint(1, 3))
            ],  # none
            [],  # an empty folder
            [rng.choice(kinds) for _ in range(rng.randint(2, 5))],
        ]
        rng.shuffle(folders)
        for i, plan in enumerate(folders):
            folder = root / f"run{i}" / "checkpoints"
            folder.mkdir(parents=True)
            for step, kind in zip(
                sorted(rng.sample(range(1, 10_000), len(plan)), reverse=True), plan
            ):
                _make(folder, step, kind)
            want = committed(folder)
            got = c.call(fn, folder)
            listing = (
                ", ".join(
                    f"{p.name} ({'committed' if p in want else 'has ' + COMMIT_FILE if (p / COMMIT_FILE).is_file() else 'no ' + COMMIT_FILE})"
                    for p in sorted(folder.iterdir())
                )
                or "nothing"
            )
            if got is not None and not isinstance(got, (str, os.PathLike)):
                c.fail(
                    f"return a path (or None), got {type(got).__name__} for a folder holding {listing}"
                )
            got_path = (
                None
                if got is None
                else (folder / got if not Path(got).is_absolute() else Path(got)).resolve()
            )
            want_path = want[-1].resolve() if want else None
            if got_path != want_path:
                shown = (
                    "None"
                    if got_path is None
                    else got_path.name
                    if got_path.parent == folder.resolve()
                    else str(got)
                )
                c.fail(
                    f"the latest committed checkpoint is {shown}, expected {want_path.name if want_path else None} "
                    f"in a folder holding {listing}"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    c.passed(
        "the same choice as titanlite.resilience.checkpoint_files.committed in 6 folders, "
        "crashed saves of every kind included"
    )


@exercise("13_young", "Young's optimal checkpoint interval")
def young(c, fn):
    from ...tools.predict.goodput_model import young_interval

    for _ in range(10):
        cost, mtbf = c.rng.uniform(0.1, 300), c.rng.uniform(60, 86400 * 30)
        c.same_value(
            c.call(fn, cost, mtbf),
            young_interval(cost, mtbf),
            f"the interval for a {cost:.6g} s checkpoint and a {mtbf:.6g} s MTBF",
        )
    c.passed("equals titanlite.tools.predict.goodput_model.young_interval")


@exercise("13_cluster_mtbf", "a job's MTBF from its instances' failure rate")
def cluster_mtbf(c, fn):
    from ...tools.predict.goodput_model import cluster_mtbf_s

    for _ in range(10):
        n, rate = c.rng.randint(1, 20000), c.rng.uniform(1e-6, 1e-2)
        c.same_value(
            c.call(fn, n, rate),
            cluster_mtbf_s(n, rate),
            f"the MTBF in seconds of {n:,} instances failing {rate:.6g} times an hour each",
        )
    c.passed("equals titanlite.tools.predict.goodput_model.cluster_mtbf_s")
