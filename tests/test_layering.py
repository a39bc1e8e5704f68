"""Three rooms, one direction: the core (what a training run imports) imports neither the tools
nor the labs; the tools (what measures, probes, plots, teaches, launches) import the core but
no lab, and each of their sub-packages only the rooms `MAY_IMPORT` lists; the labs (the
notebooks' experiments) may import anything. And no circles: no module imports, through any
chain, a module that imports it. Checked by walking every module's imports with `ast`, in every
spelling, inside functions and `if TYPE_CHECKING:` too."""

import ast
from pathlib import Path

import pytest

import titanlite

PACKAGE = Path(titanlite.__file__).parent
ENTRY = ("__main__.py",)  # the program's front door: it hands the command line (a tool) control


def _within(target: str):
    return lambda module: module == target or module.startswith(target + ".")


_is_lab = _within("titanlite.labs")
_is_tool = _within("titanlite.tools")


def room(path: Path, package: Path = PACKAGE) -> str:
    """ "labs", "tools" or "core", by folder (the layout shows which is which)."""
    first = path.relative_to(package).parts[0]
    return first if first in ("labs", "tools") else "core"


def _imports_of(path: Path, package: Path = PACKAGE, wanted=_is_lab) -> list[str]:
    """Each import in `path` (a file of `package`) of a module `wanted` accepts (by default:
    titanlite.labs and its modules), absolute or relative, as written."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parts = path.relative_to(package).parts
    depth = len(parts) - 1  # folders below titanlite/
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if wanted(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve it against this module's package
                if node.level - 1 > depth:
                    continue
                base = ["titanlite", *parts[: depth - (node.level - 1)]]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
            if any(wanted(t) for t in targets):
                names = ", ".join(a.name for a in node.names)
                found.append(f"from {'.' * node.level}{node.module or ''} import {names}")
    return found


def _modules(kind: str) -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if room(p) == kind and p.name not in ENTRY)


def test_the_core_imports_no_tool_and_no_lab():
    core = _modules("core")
    assert len(core) > 40  # the walk really covers the core
    offenders = {
        str(p.relative_to(PACKAGE)): found
        for p in core
        if (found := _imports_of(p, wanted=lambda m: _is_lab(m) or _is_tool(m)))
    }
    assert offenders == {}, (
        "core modules import tools or labs (hand the tool to the loop instead, "
        f"e.g. Trainer.fit(watchers=...)): {offenders}"
    )


def test_no_tool_imports_a_lab():
    tools = _modules("tools")
    assert len(tools) > 20
    offenders = {str(p.relative_to(PACKAGE)): found for p in tools if (found := _imports_of(p))}
    assert offenders == {}, (
        f"tools import labs (move the code into the tool or the core): {offenders}"
    )


def test_the_walk_catches_every_spelling(tmp_path):
    """The check can fail: absolute, relative and from-package imports are all seen, in a
    function body too."""
    spellings = {
        "distributed/x.py": "from ..labs import nb07_data_parallel",
        "distributed/y.py": "from ..labs.nb09_tensor_parallel import tp_lab",
        "z.py": "from .labs import _common",
        "w.py": "import titanlite.labs.nb08_fsdp_and_zero",
        "v.py": "from titanlite import labs",
        "u.py": "def f():\n    from .tools.live_plot import LivePlot\n",
        "resilience/t.py": "from ..tools import goodput",
    }
    either = lambda m: _is_lab(m) or _is_tool(m)  # noqa: E731
    for rel, line in spellings.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(line + "\n")
        assert _imports_of(path, tmp_path, wanted=either), line
    clean = tmp_path / "distributed" / "ok.py"
    clean.write_text(
        "from ..distributed import fsdp\nfrom .labsy import x\nimport titanlite.labsy\n"
        "import titanlite.toolsy\n"
    )
    assert _imports_of(clean, tmp_path, wanted=either) == []


def test_a_planted_import_in_the_core_fails_the_check(tmp_path, monkeypatch):
    """Plant `from ..tools.live_plot import LivePlot` in a copy of a core module: the core check
    finds it (so the real check above can fail)."""
    planted = tmp_path / "titanlite"
    (planted / "resilience").mkdir(parents=True)
    source = (PACKAGE / "resilience" / "resume.py").read_text()
    (planted / "resilience" / "resume.py").write_text(
        source
        + "\n\ndef _planted():\n    from ..tools.live_plot import LivePlot\n    return LivePlot\n"
    )
    found = _imports_of(
        planted / "resilience" / "resume.py", planted, wanted=lambda m: _is_lab(m) or _is_tool(m)
    )
    assert found == ["from ..tools.live_plot import LivePlot"]


def test_the_parallelism_package_does_not_import_the_trainer():
    """The trainer composes distributed/; nothing in it reaches back up to the trainer (no
    import cycle can form)."""
    modules = sorted((PACKAGE / "distributed").glob("*.py"))
    offenders = {
        p.name: found
        for p in modules
        if (found := _imports_of(p, wanted=_within("titanlite.train")))
    }
    assert offenders == {}


# ----- the tools' sub-packages: which may import which ------------------------------------------
# A room may import itself and the rooms listed (titanlite/__main__.py, the front door, excepted).
# "tools" is titanlite/tools/__init__.py alone: the map of the sub-packages and the moved names.
TOOLS = ("display", "formats", "predict", "measure", "probe", "jobs", "course", "cli")
MAY_IMPORT = {
    "core": set(),  # a training run needs no tool and no lab
    "tools": set(),
    "tools.display": {"core"},  # what a learner sees: live plots, a notebook's first cell
    "tools.formats": {"core"},  # other projects' formats in and out
    "tools.predict": {"core"},  # formulas and fake tensors, before a run
    "tools.measure": {"core"},  # what a run cost (its watchers are the core's)
    "tools.probe": {"core", "tools.predict"},  # cpu: measured memory against the prediction
    "tools.jobs": {"core", "tools.display", "tools.formats"},  # quiet imports; a HF start's check
    "tools.course": {"core", "tools"},  # `make lab` names the moved modules a workbook imports
    "tools.cli": {"core", "tools"} | {f"tools.{t}" for t in TOOLS},  # the top of the house
    "labs": {"core", "tools", "labs"} | {f"tools.{t}" for t in TOOLS},
}


def module_of(path: Path, package: Path = PACKAGE) -> str:
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    """The room of a module by its folder: core, tools (the package's __init__), tools.<sub>, labs."""
    parts = module.split(".")
    if parts[1:2] == ["labs"]:
        return "labs"
    if parts[1:2] == ["tools"]:
        return "tools" if len(parts) == 2 else f"tools.{parts[2]}"
    return "core"


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (each import resolved to the deepest module
    that exists: `from .a import b` is a.b when b is a module, else a), anywhere in the file."""
    files = {module_of(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets |= {module} | {f"{module}.{a.name}" for a in node.names}
        found = set()
        for t in targets:
            parts = t.split(".")
            deepest = next(
                (
                    ".".join(parts[:i])
                    for i in range(len(parts), 0, -1)
                    if ".".join(parts[:i]) in files
                ),
                None,
            )
            if deepest and deepest != name:
                found.add(deepest)
        graph[name] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other through some chain (Tarjan's strongly
    connected components of more than one module, or one that imports itself)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_anywhere_in_the_package():
    graph = import_graph()
    assert len(graph) > 120  # the walk covers the whole package
    assert circles(graph) == [], "modules that import each other (cut one arrow)"


def test_a_planted_circle_is_found(tmp_path):
    """The check can fail: a three-module circle, one arrow only under TYPE_CHECKING and one
    inside a function, is found; the same modules without the closing arrow are not."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import x\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    assert circles(import_graph(package)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (package / "c.py").write_text("x = 1\n")
    assert circles(import_graph(package)) == []


def test_each_room_imports_only_what_the_table_allows():
    graph = import_graph()
    rooms = {room_of(m) for m in graph}
    assert rooms == set(MAY_IMPORT), "a sub-package of tools/ missing from the table, or gone"
    for sub in TOOLS:  # each opens with what belongs there and what it may import
        doc = ast.get_docstring(ast.parse((PACKAGE / "tools" / sub / "__init__.py").read_text()))
        assert doc and "may import" in doc.lower(), sub
    offenders = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m != "titanlite.__main__"  # the front door hands control to the command line
        for t in targets
        if room_of(t) != room_of(m) and room_of(t) not in MAY_IMPORT[room_of(m)]
    )
    assert offenders == [], "imports the layering table does not allow (tests/test_layering.py)"


def test_the_table_check_catches_a_planted_upward_import(tmp_path):
    """A predicting tool that imports the command line is caught (so the check above can fail)."""
    package = tmp_path / "titanlite"
    for folder in ("tools/predict", "tools/cli"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "tools" / "__init__.py").write_text("")
    (package / "tools" / "cli" / "commands.py").write_text("")
    (package / "tools" / "predict" / "zero.py").write_text("from ..cli import commands\n")
    graph = import_graph(package)
    bad = [
        (m, t)
        for m, ts in graph.items()
        for t in ts
        if room_of(t) != room_of(m) and room_of(t) not in MAY_IMPORT[room_of(m)]
    ]
    assert sorted(bad) == [
        ("titanlite.tools.predict.zero", "titanlite.tools.cli"),
        ("titanlite.tools.predict.zero", "titanlite.tools.cli.commands"),
    ]


def test_tools_has_no_module_at_its_top_but_its_map():
    top = sorted(p.name for p in (PACKAGE / "tools").iterdir() if p.suffix == ".py")
    assert top == ["__init__.py"]
    subs = sorted(p.name for p in (PACKAGE / "tools").iterdir() if (p / "__init__.py").is_file())
    assert subs == sorted(TOOLS)


@pytest.mark.parametrize(
    "old",
    [
        "titanlite.tools.live_plot",
        "titanlite.tools.scratch_ddp",
        "titanlite.tools.profiling",
    ],
)
def test_an_old_tools_name_fails_in_one_line_naming_the_new_one(old):
    import subprocess
    import sys

    from titanlite.tools import moved_to

    new = moved_to(old)
    for code in (f"import {old}", f"from {old.rsplit('.', 1)[0]} import {old.rsplit('.', 1)[1]}"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        last = out.stderr.strip().splitlines()[-1]
        assert out.returncode == 1 and last.startswith("ModuleNotFoundError:"), (code, last)
        assert f"{old} moved to {new}: import it from there" in last, (code, last)
    __import__(new)  # and the new name imports
    # a module inside a moved package: its new place too (the import fails at the package first)
    assert (
        moved_to("titanlite.tools.profiling.reading") == "titanlite.tools.measure.profiling.reading"
    )
