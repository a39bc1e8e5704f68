"""Corpora: where the training text comes from, as a list of documents in a fixed order.

`load_corpus(name)` is the one entry point. Names:

- ``"pydoc"`` (default, offline): the English reference documentation that ships inside
  CPython (`pydoc_data.topics`, the text behind ``help("for")``), followed by the
  docstrings of the public standard-library modules rendered like ``pydoc`` pages. No
  network, and identical on every run with the same Python.
- ``"tinyshakespeare"``: Karpathy's 1 MB Shakespeare file, downloaded once and checked.
- ``"file:<path>"`` (or just a path): a .txt file, or a folder of .txt/.md files.
- ``"hf:<name>"`` / ``"hf:<name>:<config>"``: any Hugging Face `datasets` text dataset.
"""
from __future__ import annotations

import ast
import json
import os
import re
import sys
import sysconfig
from pathlib import Path

from ..errors import TitanliteError, closest
from . import remote
from ._cache import atomic_file, cache_subdir, fingerprint

DATASETS = ("pydoc", "tinyshakespeare", "file:<path>", "hf:<name>[:<config>]")
TEXT_SUFFIXES = (".txt", ".md")

# Stdlib folders whose docstrings are not prose worth learning from (test suites, demos,
# generated codec tables), plus pydoc_data itself, which we already include whole.
_SKIP_STDLIB = {"test", "tests", "idlelib", "turtledemo", "encodings", "lib2to3",
                "pydoc_data", "site-packages", "dist-packages", "__pycache__"}


def load_corpus(dataset: str = "pydoc", path: str | None = None, *, data_dir=None,
                max_chars: int | None = None, max_docs: int | None = None,
                hf_split: str = "train", text_column: str | None = None) -> list[str]:
    """The documents of a corpus, in a fixed order, truncated to max_docs / max_chars."""
    for label, value in (("max_chars", max_chars), ("max_docs", max_docs)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise TitanliteError(f"{label} must be a positive integer, got {value!r}; "
                                 "pass e.g. 100_000, or None for no limit")
    kind, target = parse_dataset(dataset, path)
    if kind == "pydoc":
        docs = pydoc_corpus(data_dir=data_dir)
    elif kind == "tinyshakespeare":
        docs = remote.tinyshakespeare(data_dir=data_dir)
    elif kind == "file":
        docs = file_corpus(target)
    else:
        docs = remote.hf_corpus(target, split=hf_split, text_column=text_column,
                                max_docs=max_docs, max_chars=max_chars)
    return limit_documents(docs, max_chars=max_chars, max_docs=max_docs)


def parse_dataset(dataset: str, path: str | None = None) -> tuple[str, str | None]:
    """('pydoc'|'tinyshakespeare'|'file'|'hf', target) for a dataset name, or a clear error."""
    if not isinstance(dataset, str) or not dataset.strip():
        raise TitanliteError(f"dataset must be a name such as 'pydoc', got {dataset!r}; "
                             f"choose one of: {', '.join(DATASETS)}")
    name = dataset.strip()
    if name in ("pydoc", "tinyshakespeare"):
        if path is not None:
            raise TitanliteError(f"path= is not used by dataset {name!r}; drop it, or use "
                                 "dataset='file' (a local text file/folder) or 'hf' with path=")
        return name, None
    if name in ("file", "hf"):
        if path is None:
            raise TitanliteError(f"dataset={name!r} needs path=<local file or folder>; "
                                 f"or write it as '{name}:<path>'")
        return name, str(path)
    if name.startswith("file:"):
        return "file", name[len("file:"):]
    if name.startswith("hf:") and len(name) > 3:
        return "hf", name[len("hf:"):]
    looks_like_path = "/" in name or "\\" in name or name.lower().endswith(TEXT_SUFFIXES)
    if looks_like_path or Path(name).expanduser().exists():
        return "file", name
    raise TitanliteError(f"unknown dataset {name!r}{closest(name, DATASETS[:2])}; "
                         f"choose one of: {', '.join(DATASETS)}")


def corpus_id(dataset: str, documents: list[str]) -> str:
    """'<readable-name>-<content hash>': changes whenever any document changes."""
    slug = re.sub(r"[^a-z0-9]+", "-", dataset.lower()).strip("-")[-40:] or "corpus"
    return f"{slug}-{fingerprint(*documents)}"


def limit_documents(docs: list[str], *, max_chars: int | None = None,
                    max_docs: int | None = None) -> list[str]:
    """The first max_docs documents, and at most max_chars characters (the last one cut)."""
    docs = [d for d in docs if d.strip()][:max_docs]
    if max_chars is None:
        return docs
    kept, total = [], 0
    for doc in docs:
        if total >= max_chars:
            break
        kept.append(doc[: max_chars - total])
        total += len(kept[-1])
    return kept


# --- local files -----------------------------------------------------------------------

def file_corpus(path: str | Path) -> list[str]:
    """One document per file: `path` itself, or every .txt/.md under it sorted by name."""
    root = Path(path).expanduser()
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted((p for p in root.rglob("*") if p.is_file()
                        and p.suffix.lower() in TEXT_SUFFIXES),
                       key=lambda p: p.relative_to(root).as_posix())
        if not files:
            raise TitanliteError(f"no .txt or .md files in folder {root}; "
                                 "add some text files or point to a different folder")
    else:
        raise TitanliteError(f"data file {root} does not exist; "
                             "check the path (relative paths start from the current folder)")
    return [read_text_file(f) for f in files]


def read_text_file(path: Path) -> str:
    try:
        # utf-8-sig drops a Windows BOM; universal newlines make \r\n files hash the same.
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise TitanliteError(f"data file {path} is not UTF-8 text (byte {err.start}); "
                             "convert it, e.g. `iconv -t utf-8 in.txt > out.txt`") from None
    except OSError as err:
        raise TitanliteError(f"cannot read data file {path} ({err.strerror or err}); "
                             "check that it exists and that you may read it") from None


# --- the offline default: CPython's own documentation -----------------------------------

def pydoc_corpus(data_dir=None, include_stdlib: bool = True) -> list[str]:
    """CPython's help() topics (sorted by topic), then stdlib module docstrings (sorted by
    module). Both ship with Python, so this needs no network and never changes on a machine."""
    from pydoc_data.topics import topics

    docs = [f"{key}\n\n{topics[key].strip()}\n" for key in sorted(topics)]
    if include_stdlib:
        docs += _stdlib_docstrings(data_dir)
    return docs


def _stdlib_sources() -> list[tuple[str, Path]]:
    """(module name, file) for the public pure-Python stdlib modules, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subdirs, files in os.walk(root):
        # Prune in place so we never descend into site-packages, tests or private packages.
        subdirs[:] = [d for d in subdirs if d not in _SKIP_STDLIB and _is_public(d)]
        package = Path(folder).relative_to(root).parts
        for name in files:
            stem = name[:-3]
            if name.endswith(".py") and (stem == "__init__" or _is_public(stem)):
                parts = package if stem == "__init__" else package + (stem,)
                if parts:
                    found.append((".".join(parts), Path(folder) / name))
    return sorted(found)


def _is_public(name: str) -> bool:
    # Private modules and files that are not importable names (e.g. "test-data") are skipped.
    return not name.startswith("_") and name.isidentifier()


def _stdlib_docstrings(data_dir) -> list[str]:
    # Parsing ~500 files takes seconds, so the rendered pages are cached; the key covers the
    # Python version and every source file's size and mtime, so an upgrade rebuilds it.
    sources = _stdlib_sources()
    stamp = [sys.version] + [f"{m}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for m, f in sources]
    try:
        cache = cache_subdir(data_dir, "corpus") / f"pydoc-stdlib-{fingerprint(*stamp)}.json"
    except TitanliteError:
        cache = None  # read-only data dir: just rebuild each time
    if cache is not None and cache.exists():
        return json.loads(cache.read_text(encoding="utf-8"))
    pages = [page for module, file in sources if (page := _render_module(module, file))]
    if cache is not None:
        with atomic_file(cache) as tmp:
            tmp.write_text(json.dumps(pages), encoding="utf-8")
    return pages


def _render_module(module: str, file: Path) -> str | None:
    """A plain-text page like `pydoc` prints: module docstring, then documented classes and
    functions with their signatures. None when the module documents nothing."""
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return None
    lines: list[str] = []
    doc = ast.get_docstring(tree)
    if doc:
        lines += [doc, ""]
    for node in tree.body:
        _render_definition(node, "", lines)
    if not lines:
        return None
    return "\n".join([f"Module {module}", ""] + lines).rstrip() + "\n"


def _render_definition(node: ast.AST, indent: str, out: list[str]) -> None:
    if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return
    if node.name.startswith("_") and node.name != "__init__":
        return
    doc = ast.get_docstring(node)
    if isinstance(node, ast.ClassDef):
        body: list[str] = []
        for child in node.body:
            _render_definition(child, indent + "    ", body)
        if not doc and not body:
            return
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        out.append(f"{indent}class {node.name}" + (f"({bases})" if bases else ""))
    else:
        if not doc:
            return
        body = []
        out.append(f"{indent}def {node.name}({ast.unparse(node.args)})")
    if doc:
        out += [f"{indent}    {line}".rstrip() for line in doc.splitlines()]
    out.append("")
    out += body
