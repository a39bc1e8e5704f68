"""Where generated data lives, and how to write it safely while other processes race us.

Files are written under a temporary name, then `os.replace`d (never seen half-written); builds take a lock."""

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

from ..errors import TitanliteError

LOCK_TIMEOUT_S = 900  # longer than any build we do; a dead holder's flock is freed by the OS


def default_data_dir() -> Path:
    """$TITANLITE_DATA_DIR, else <repo>/data in a source checkout, else ~/.cache/titanlite/data."""
    if env := os.environ.get("TITANLITE_DATA_DIR", "").strip():
        return Path(env).expanduser()
    checkout_data = Path(__file__).resolve().parents[2] / "data"
    return (
        checkout_data if checkout_data.is_dir() else Path.home() / ".cache" / "titanlite" / "data"
    )


def cache_subdir(data_dir: str | os.PathLike | None, name: str) -> Path:
    """<data_dir>/cache/<name>, created if needed; an unwritable place is a clear error."""
    folder = (
        (Path(data_dir).expanduser() if data_dir is not None else default_data_dir())
        / "cache"
        / name
    )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()  # can we write there? (it deletes itself)
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
        # length first, so ("ab","c") != ("a","bc")
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:length]


@contextlib.contextmanager
def atomic_file(path: Path, *, is_dir: bool = False):
    """Yield a temporary path (an empty folder if is_dir); on success it becomes `path` in one step,
    on error it vanishes. A folder another process published first (no lock) wins over ours."""
    # A scratch folder beside the target, so os.replace is a rename on one filesystem (atomic);
    # leaving the `with` deletes the scratch folder and whatever was not moved out of it.
    with tempfile.TemporaryDirectory(
        prefix=f".{path.name}.", dir=path.parent, ignore_cleanup_errors=True
    ) as scratch:
        tmp = Path(scratch) / path.name
        if is_dir:
            tmp.mkdir()
        yield tmp
        try:
            os.replace(tmp, path)
        except OSError:  # a folder can't replace a non-empty one
            if not (is_dir and path.is_dir()):
                raise


@contextlib.contextmanager
def build_lock(target: Path):
    """Hold <target>.lock while building `target`, so parallel ranks build it once."""
    from filelock import FileLock, Timeout  # ships with transformers/huggingface_hub

    try:
        with FileLock(str(target) + ".lock", timeout=LOCK_TIMEOUT_S):
            yield
    except Timeout:
        raise TitanliteError(
            f"waited {LOCK_TIMEOUT_S}s for another process building {target.name}; if no "
            f"other titanlite process is running, delete {target}.lock and retry"
        ) from None
