"""Fetching corpora that live elsewhere: TinyShakespeare (a checked download) and Hugging Face
datasets (streamed). A tool, run once before training: it leaves the documents where the core's
`load_corpus` reads them (titanlite/data/corpus.py, `fetched_path`), so a training run never
touches the network. `titanlite train` fetches what its config names by itself.

    fetch("tinyshakespeare")           # then: dataset = "tinyshakespeare" trains offline
    fetch("hf:roneneldan/TinyStories", max_chars=2_000_000)

Both also work on local files, which is how the tests exercise them: the download takes any URL
urllib understands (a ``file://`` URL included), and ``hf:`` accepts a local file or folder.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from pathlib import Path

from ...data._cache import atomic_file, build_lock, cache_subdir
from ...data.corpus import fetched_path, parse_dataset
from ...errors import TitanliteError, closest

TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
# Streaming a Hub dataset with no limit could mean terabytes; this is already more than a laptop-sized
# model can learn from in a session. Pass max_chars to change it.
HF_DEFAULT_MAX_CHARS = 10_000_000
_HF_BUILDERS = {
    ".txt": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}  # the local files `datasets` has a builder for


def fetch(
    dataset: str,
    path: str | None = None,
    *,
    data_dir=None,
    max_chars: int | None = None,
    max_docs: int | None = None,
    hf_split: str = "train",
    text_column: str | None = None,
) -> Path:
    """Fetch a remote corpus (once: a fetched one is kept) to where `load_corpus` reads it."""
    kind, target = parse_dataset(dataset, path)
    if kind not in ("tinyshakespeare", "hf"):
        raise TitanliteError(f"dataset {dataset!r} is local: there is nothing to fetch")
    file = fetched_path(kind, target, data_dir, hf_split, text_column, max_docs, max_chars)
    with build_lock(file):  # the ranks of a job fetch it once
        if not file.is_file():
            docs = (
                tinyshakespeare(data_dir)
                if kind == "tinyshakespeare"
                else hf_corpus(
                    target,
                    split=hf_split,
                    text_column=text_column,
                    max_docs=max_docs,
                    max_chars=max_chars,
                )
            )
            with atomic_file(file) as tmp:
                tmp.write_text(json.dumps(docs), encoding="utf-8")
    return file


def fetch_for(cfg) -> Path | None:
    """What a run's [data] names, fetched if it is remote (`titanlite train` calls this)."""
    if parse_dataset(cfg.data.dataset, cfg.data.path)[0] not in ("tinyshakespeare", "hf"):
        return None
    return fetch(
        cfg.data.dataset, cfg.data.path, data_dir=cfg.data.data_dir, max_chars=cfg.data.max_chars
    )


def tinyshakespeare(
    data_dir=None, url: str = TINYSHAKESPEARE_URL, sha256: str = TINYSHAKESPEARE_SHA256
) -> list[str]:
    """The whole TinyShakespeare file as one document (it is one continuous text)."""
    file = download(
        url, sha256, cache_subdir(data_dir, "downloads") / f"tinyshakespeare-{sha256[:12]}.txt"
    )
    return [file.read_text(encoding="utf-8")]


def download(url: str, sha256: str, dest: Path) -> Path:
    """Fetch `url` to `dest` unless a copy with the right sha256 is already there; a download whose
    checksum does not match is deleted, never kept."""
    if _sha256_of(dest) == sha256:
        return dest
    with build_lock(dest):
        if _sha256_of(dest) == sha256:  # another process finished it while we waited
            return dest
        digest = hashlib.sha256()
        with atomic_file(dest) as tmp:  # raising inside discards the partial/bad file
            try:
                with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as out:
                    while chunk := response.read(1 << 16):
                        digest.update(chunk)
                        out.write(chunk)
            except (urllib.error.URLError, OSError, ValueError) as err:
                raise TitanliteError(
                    f"could not download {url} ({getattr(err, 'reason', None) or err}); "
                    "check your network, or fetch the file yourself and use "
                    "dataset='file:<path to it>'"
                ) from None
            if digest.hexdigest() != sha256:
                raise TitanliteError(
                    f"checksum mismatch for {url}: expected sha256 {sha256[:16]}..., got "
                    f"{digest.hexdigest()[:16]}...; the file was discarded. Retry, or pass "
                    "the new sha256 if the file changed upstream"
                )
    return dest


def _sha256_of(path: Path) -> str | None:
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def hf_corpus(
    target: str,
    *,
    split: str = "train",
    text_column: str | None = None,
    max_docs: int | None = None,
    max_chars: int | None = None,
) -> list[str]:
    """Documents from a Hugging Face dataset ('name', 'name:config' or a local path), streamed until max_docs
    rows or max_chars (default HF_DEFAULT_MAX_CHARS); text column: 'text', else the first string column."""
    try:
        import datasets
    except ImportError:
        raise TitanliteError(
            "the 'hf:' datasets need the `datasets` package; run: pip install datasets"
        ) from None
    datasets.disable_progress_bars()
    max_chars = HF_DEFAULT_MAX_CHARS if max_chars is None else max_chars
    rows = _open_hf(datasets, target, split)
    docs: list[str] = []
    total = 0
    try:
        for row in rows:
            if text_column is None:
                text_column = _pick_text_column(row, target)
            elif text_column not in row:
                raise TitanliteError(
                    f"dataset {target!r} has no column {text_column!r}"
                    f"{closest(text_column, row)}; columns are: {', '.join(row)}"
                )
            text = row[text_column]
            if isinstance(text, str) and text.strip():
                docs.append(text)
                total += len(text)
                if (max_docs and len(docs) >= max_docs) or total >= max_chars:
                    break
    except TitanliteError:
        raise
    except Exception as err:  # network drop mid-stream, corrupt shard, ...
        raise TitanliteError(
            f"reading dataset {target!r} failed ({_first_line(err)}); check your network and retry"
        ) from None
    if not docs:
        raise TitanliteError(
            f"dataset {target!r} split {split!r} has no text rows; "
            "pick another split= or text_column="
        )
    return docs


def _open_hf(datasets, target: str, split: str):
    local = Path(target).expanduser()
    try:
        if local.is_file():
            builder = _HF_BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise TitanliteError(
                    f"cannot load {local} as a dataset: unknown file type {local.suffix!r}; "
                    f"use one of {', '.join(sorted(_HF_BUILDERS))}"
                )
            if split != "train":
                raise TitanliteError(
                    f"a single local file has only the 'train' split, not "
                    f"{split!r}; drop hf_split= or pass a dataset folder"
                )
            return datasets.load_dataset(
                builder, data_files=str(local), split="train", streaming=True
            )
        if local.is_dir():
            if any(
                (local / f).exists()
                for f in ("dataset_dict.json", "dataset_info.json", "state.json")
            ):
                saved = datasets.load_from_disk(str(local))  # made by Dataset.save_to_disk
                return saved[split] if isinstance(saved, datasets.DatasetDict) else saved
            return datasets.load_dataset(str(local), split=split, streaming=True)
        name, _, config = target.partition(":")
        return datasets.load_dataset(name, config or None, split=split, streaming=True)
    except TitanliteError:
        raise
    except Exception as err:
        raise TitanliteError(
            f"could not open Hugging Face dataset {target!r} split {split!r} "
            f"({_first_line(err)}); check the name, config and split on "
            "huggingface.co/datasets (and your network)"
        ) from None


def _pick_text_column(row: dict, target: str) -> str:
    column = (
        "text" if "text" in row else next((c for c, v in row.items() if isinstance(v, str)), None)
    )
    if column is None:
        raise TitanliteError(
            f"dataset {target!r} has no text column (columns: "
            f"{', '.join(row)}); pass text_column=<name of the text column>"
        )
    return column


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]
