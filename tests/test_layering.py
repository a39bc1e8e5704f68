"""Three rooms, one direction: the core (what a training run imports) imports neither the tools
nor the labs; the tools (what measures, probes, plots, teaches, launches) import the core but
no lab; the labs (the notebooks' experiments) may import anything. Checked by walking every
module's imports with `ast`, in every spelling, inside functions too."""

import ast
from pathlib import Path

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
