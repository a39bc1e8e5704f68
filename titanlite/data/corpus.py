"""Corpora: where the training text comes from, as a list of documents in a fixed order.

`load_corpus(name)` is the one entry point. ``"pydoc"`` (default, offline): CPython's reference docs
(the text behind ``help("for")``), then the public stdlib modules' docstrings as ``pydoc`` pages, the same
on every run with the same Python. ``"file:<path>"`` (or a path): a .txt file, or a folder of .txt/.md
files. ``"tinyshakespeare"``, ``"hf:<name>[:<config>]"``: fetched before (tools/formats/corpora.py): no network."""

import ast
import itertools
import json
import os
import re
import sys
import sysconfig
from pathlib import Path

from ..errors import TitanliteError, closest
from ._cache import atomic_file, cache_subdir, fingerprint

DATASETS = ("pydoc", "tinyshakespeare", "file:<path>", "hf:<name>[:<config>]")
TEXT_SUFFIXES = (".txt", ".md")
# Stdlib folders whose docstrings are not prose (tests, demos, codec tables), and pydoc_data, included whole.
_SKIP_STDLIB = {"test", "tests", "idlelib", "turtledemo", "encodings", "lib2to3", "pydoc_data"}


def load_corpus(
    dataset: str = "pydoc",
    path: str | None = None,
    *,
    data_dir=None,
    max_chars: int | None = None,
    max_docs: int | None = None,
    hf_split: str = "train",
    text_column: str | None = None,
) -> list[str]:
    """The documents of a corpus, in a fixed order: the first max_docs, and at most max_chars
    characters (the last document cut)."""
    for label, value in (("max_chars", max_chars), ("max_docs", max_docs)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise TitanliteError(
                f"{label} must be a positive integer, got {value!r}; "
                "pass e.g. 100_000, or None for no limit"
            )
    kind, target = parse_dataset(dataset, path)
    if kind == "pydoc":
        docs = pydoc_corpus(data_dir=data_dir)
    elif kind == "file":
        docs = file_corpus(target)
    else:  # fetched before (tools/formats/corpora.py)
        file = fetched_path(kind, target, data_dir, hf_split, text_column, max_docs, max_chars)
        if not file.is_file():
            raise TitanliteError(
                f"dataset {dataset!r} is fetched once before training and has not been: "
                f"run titanlite.tools.formats.corpora.fetch({dataset!r}) (`titanlite train` "
                f"fetches it itself), or train on a local file:<path>"
            )
        docs = json.loads(file.read_text(encoding="utf-8"))
    docs = [d for d in docs if d.strip()][:max_docs]  # blank documents dropped
    if max_chars is None:
        return docs
    # at most max_chars characters in all: the last document kept is cut
    starts = itertools.accumulate((len(doc) for doc in docs), initial=0)
    return [doc[: max_chars - start] for doc, start in zip(docs, starts) if start < max_chars]


def parse_dataset(dataset: str, path: str | None = None) -> tuple[str, str | None]:
    """('pydoc'|'tinyshakespeare'|'file'|'hf', target) for a dataset name, or a clear error."""
    if not isinstance(dataset, str) or not dataset.strip():
        raise TitanliteError(
            f"dataset must be a name such as 'pydoc', got {dataset!r}; "
            f"choose one of: {', '.join(DATASETS)}"
        )
    name = dataset.strip()
    if name in ("pydoc", "tinyshakespeare"):
        if path is not None:
            raise TitanliteError(
                f"--data.path is not used by --data.dataset {name}: drop it, or add "
                "--data.dataset file (a local text file or folder) or hf "
                "(data.dataset = 'file' in Python)"
            )
        return name, None
    if name in ("file", "hf"):
        if path is None:
            raise TitanliteError(
                f"--data.dataset {name} needs --data.path <local file or folder>, or write "
                f"it as --data.dataset {name}:<path> (data.path = ... in Python)"
            )
        return name, str(path)
    if name.startswith("file:") or (name.startswith("hf:") and len(name) > 3):
        return name.partition(":")[::2]  # (kind, target)
    if (  # looks like a path, or is one
        "/" in name
        or "\\" in name
        or name.lower().endswith(TEXT_SUFFIXES)
        or Path(name).expanduser().exists()
    ):
        return "file", name
    raise TitanliteError(
        f"unknown dataset {name!r}{closest(name, DATASETS[:2])}; "
        f"choose one of: {', '.join(DATASETS)}"
    )


def fetched_path(
    kind: str,
    target: str | None,
    data_dir=None,
    hf_split: str = "train",
    text_column: str | None = None,
    max_docs: int | None = None,
    max_chars: int | None = None,
) -> Path:
    """Where a fetched corpus's documents are kept (a JSON list), keyed by what changes them."""
    key = fingerprint(kind, str(target), hf_split, str(text_column), str(max_docs), str(max_chars))
    return cache_subdir(data_dir, "corpora") / f"{kind}-{key if kind == 'hf' else 'v1'}.json"


def corpus_id(dataset: str, documents: list[str]) -> str:
    """'<readable-name>-<content hash>': changes whenever any document changes."""
    slug = re.sub(r"[^a-z0-9]+", "-", dataset.lower()).strip("-")[-40:] or "corpus"
    return f"{slug}-{fingerprint(*documents)}"


def file_corpus(path: str | Path) -> list[str]:
    """One document per file: `path` itself, or every .txt/.md under it sorted by name."""
    root = Path(path).expanduser()
    if not (root.is_file() or root.is_dir()):
        raise TitanliteError(
            f"data file {root} does not exist; "
            "check the path (relative paths start from the current folder)"
        )
    files = (
        [root]
        if root.is_file()
        else sorted(
            (p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES),
            key=lambda p: p.relative_to(root).as_posix(),
        )
    )
    if not files:
        raise TitanliteError(
            f"no .txt or .md files in folder {root}; "
            "add some text files or point to a different folder"
        )
    return [read_text_file(f) for f in files]


def read_text_file(path: Path) -> str:
    try:  # utf-8-sig drops a Windows BOM; universal newlines make \r\n files hash the same
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise TitanliteError(
            f"data file {path} is not UTF-8 text (byte {err.start}); "
            "convert it, e.g. `iconv -t utf-8 in.txt > out.txt`"
        ) from None
    except OSError as err:
        raise TitanliteError(
            f"cannot read data file {path} ({err.strerror or err}); "
            "check that it exists and that you may read it"
        ) from None


def pydoc_corpus(data_dir=None, include_stdlib: bool = True) -> list[str]:
    """CPython's help() topics, then stdlib module docstrings, each sorted: offline, fixed on a machine."""
    from pydoc_data.topics import topics

    docs = [f"{key}\n\n{topics[key].strip()}\n" for key in sorted(topics)]
    return docs + _stdlib_docstrings(data_dir) if include_stdlib else docs


def _stdlib_sources() -> list[tuple[str, Path]]:
    """(module name, file) for the public pure-Python stdlib modules, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subdirs, files in os.walk(root):
        # Prune in place: never into tests, private packages or site-packages (not an importable name).
        subdirs[:] = [d for d in subdirs if d not in _SKIP_STDLIB and _is_public(d)]
        package = Path(folder).relative_to(root).parts
        for stem in (name[:-3] for name in files if name.endswith(".py")):
            parts = package if stem == "__init__" else package + (stem,)
            if parts and (stem == "__init__" or _is_public(stem)):
                found.append((".".join(parts), Path(folder) / f"{stem}.py"))
    return sorted(found)


def _is_public(name: str) -> bool:
    # Private modules and files that are not importable names (e.g. "test-data") are skipped.
    return not name.startswith("_") and name.isidentifier()


def _stdlib_docstrings(data_dir) -> list[str]:
    # Parsing ~500 files takes seconds, so the rendered pages are cached; the key covers the Python
    # version and every source file's size and mtime, so an upgrade rebuilds it.
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
    """A plain-text page like `pydoc` prints (docstrings with signatures); None if nothing is documented."""
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return None
    lines: list[str] = [doc, ""] if (doc := ast.get_docstring(tree)) else []
    for node in tree.body:
        _render_definition(node, "", lines)
    return "\n".join([f"Module {module}", ""] + lines).rstrip() + "\n" if lines else None


def _render_definition(node: ast.AST, indent: str, out: list[str]) -> None:
    if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or (
        node.name.startswith("_") and node.name != "__init__"
    ):
        return
    body: list[str] = []  # a class's documented methods
    if isinstance(node, ast.ClassDef):
        for child in node.body:
            _render_definition(child, indent + "    ", body)
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        header = f"{indent}class {node.name}" + (f"({bases})" if bases else "")
    else:
        header = f"{indent}def {node.name}({ast.unparse(node.args)})"
    if not (doc := ast.get_docstring(node)) and not body:
        return
    out += (
        [header]
        + [f"{indent}    {line}".rstrip() for line in (doc or "").splitlines()]
        + [""]
        + body
    )
