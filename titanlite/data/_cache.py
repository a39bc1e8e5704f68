"""Where generated data lives, and how to write it safely while other processes race us.

Several ranks may start at once and all find the cache empty. Two rules keep that safe:
every file is written to a temporary name and then `os.replace`d into place (readers see
the old file or the new one, never half of one), and the expensive builds (tokenizer
training, corpus tokenization) run under a lock file so only one process does the work.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from pathlib import Path

from ..errors import TitanliteError

LOCK_TIMEOUT_S = 900  # longer than any build we do; a dead holder's flock is freed by the OS


def default_data_dir() -> Path:
    """$TITANLITE_DATA_DIR, else <repo>/data in a source checkout, else ~/.cache/titanlite/data."""
    env = os.environ.get("TITANLITE_DATA_DIR", "").strip()
    if env:
        return Path(env).expanduser()
    checkout_data = Path(__file__).resolve().parents[2] / "data"
    if checkout_data.is_dir():
        return checkout_data
    return Path.home() / ".cache" / "titanlite" / "data"


def cache_subdir(data_dir: str | os.PathLike | None, name: str) -> Path:
    """<data_dir>/cache/<name>, created if needed; an unwritable place is a clear error."""
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    folder = root / "cache" / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise TitanliteError(
            f"cannot write the data cache at {folder} ({err.strerror or err}); "
            "set TITANLITE_DATA_DIR (or pass data_dir=) to a writable folder"
        ) from None
    return folder


def fingerprint(*parts: str | bytes, length: int = 12) -> str:
    """Short sha256 hex digest of the parts; the cache keys are built from these."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))  # so ("ab","c") != ("a","bc")
        digest.update(data)
    return digest.hexdigest()[:length]


def _temp_sibling(path: Path) -> Path:
    # Same folder as the target, so os.replace is a rename on one filesystem (atomic).
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


@contextlib.contextmanager
def atomic_file(path: Path):
    """Yield a temporary path; on success it becomes `path` in one step, on error it vanishes."""
    tmp = _temp_sibling(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(path: Path):
    """Like `atomic_file` for a folder of files. If another process already published
    `path` (possible only when locking is unavailable), theirs wins and ours is dropped."""
    tmp = _temp_sibling(path)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        try:
            os.replace(tmp, path)
        except OSError:
            if not path.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def build_lock(target: Path):
    """Hold <target>.lock while building `target`, so parallel ranks build it once."""
    from filelock import FileLock, Timeout  # ships with transformers/huggingface_hub

    lock = FileLock(str(target) + ".lock", timeout=LOCK_TIMEOUT_S)
    try:
        with lock:
            yield
    except Timeout:
        raise TitanliteError(
            f"waited {LOCK_TIMEOUT_S}s for another process building {target.name}; "
            f"if no other titanlite process is running, delete {target}.lock and retry"
        ) from None
