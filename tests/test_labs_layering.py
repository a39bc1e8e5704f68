"""Labs are the notebooks' experiments: they import the library, never the other way round.
Walk every module of the package outside titanlite/labs/ and fail on any import of a lab."""
import ast
from pathlib import Path

import titanlite

PACKAGE = Path(titanlite.__file__).parent


def _within(target: str):
    return lambda module: module == target or module.startswith(target + ".")


_is_lab = _within("titanlite.labs")


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
                base = ["titanlite", *parts[:depth - (node.level - 1)]]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
            if any(wanted(t) for t in targets):
                names = ", ".join(a.name for a in node.names)
                found.append(f"from {'.' * node.level}{node.module or ''} import {names}")
    return found


def test_no_library_module_imports_a_lab():
    modules = [p for p in PACKAGE.rglob("*.py") if "labs" not in p.relative_to(PACKAGE).parts[:1]]
    assert len(modules) > 40  # the walk really covers the package
    offenders = {str(p.relative_to(PACKAGE)): found for p in modules if (found := _imports_of(p))}
    assert offenders == {}, f"library modules import labs (move the code into the library): {offenders}"


def test_the_walk_catches_every_spelling(tmp_path):
    """The check can fail: absolute, relative and from-package imports of a lab are all seen."""
    spellings = {"distributed/x.py": "from ..labs import nb07_data_parallel",
                 "distributed/y.py": "from ..labs.nb09_tensor_parallel import tp_lab",
                 "z.py": "from .labs import _common",
                 "w.py": "import titanlite.labs.nb08_fsdp_and_zero",
                 "v.py": "from titanlite import labs"}
    for rel, line in spellings.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(line + "\n")
        assert _imports_of(path, tmp_path), line
    clean = tmp_path / "distributed" / "ok.py"
    clean.write_text("from ..distributed import fsdp\nfrom .labsy import x\nimport titanlite.labsy\n")
    assert _imports_of(clean, tmp_path) == []


def test_the_parallelism_package_does_not_import_the_trainer():
    """The trainer composes distributed/; the planner and the launcher only describe and start
    jobs, so importing them must not pull in the whole trainer (nor can an import cycle form)."""
    modules = sorted((PACKAGE / "distributed").glob("*.py"))
    offenders = {p.name: found for p in modules
                 if (found := _imports_of(p, wanted=_within("titanlite.train")))}
    assert offenders == {}
