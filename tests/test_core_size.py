"""The core stays small enough to read in an afternoon: what `import titanlite.train` loads, and
everything titanlite/train.py can reach through any import (a lazy one inside a function
counts: hiding an import saves nothing), both within a line budget; no core module over 300
lines; each technique's module opens with the technique. Sizes, not timings: no noise."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import titanlite

PACKAGE = Path(titanlite.__file__).parent
LOADED_BUDGET, REACHABLE_BUDGET, MODULE_BUDGET = 4_000, 5_500, 300

# A technique's module opens with the technique: its first public function or class is this.
OPENS_WITH = {
    "efficiency/accumulation.py": "resolve_batch",
    "efficiency/mixed_precision.py": "Precision",
    "efficiency/activation_checkpoint.py": "apply_ac",
    "efficiency/compile.py": "apply_compile",
    "efficiency/fp8.py": "apply_fp8",
    "distributed/ddp.py": "apply_ddp",
    "distributed/fsdp.py": "apply_fsdp",
    "distributed/tensor_parallel.py": "apply_tp",
    "distributed/pipeline.py": "pipeline_split",
    "distributed/parallelize.py": "parallelize",
    "resilience/checkpoint.py": "Checkpointer",
    "resilience/train_state.py": "TrainState",
    "resilience/faults.py": "inject_fault",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def imports_of(name: str) -> set[str]:
    """Every titanlite module `name` imports, anywhere in the file (functions included); importing
    a.b.c imports a and a.b too."""
    path = FILES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = (
                package.split(".")[: len(package.split(".")) - (node.level - 1)]
                if node.level
                else []
            )
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names}
    out = set()
    for module in found:
        parts = module.split(".")
        out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(FILES)
    return out


def reachable(start=("titanlite.train", "titanlite")) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        name = todo.pop()
        if name not in seen and name in FILES:
            seen.add(name)
            todo += imports_of(name)
    return seen


def loaded() -> dict[str, int]:
    code = (
        "import json, sys, titanlite.train\n"
        "print(json.dumps({n: m.__file__ for n, m in sys.modules.items() "
        "if n.split('.')[0] == 'titanlite' and getattr(m, '__file__', None)}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {
        name: lines(Path(file)) for name, file in json.loads(out.stdout.splitlines()[-1]).items()
    }


def core_modules() -> list[Path]:
    return [
        p
        for p in PACKAGE.rglob("*.py")
        if p.relative_to(PACKAGE).parts[0] not in ("tools", "labs") and p.name != "__main__.py"
    ]


def test_the_training_path_fits_the_budget():
    reach = reachable()
    total = sum(lines(FILES[m]) for m in reach)
    assert not any(m.startswith(("titanlite.tools", "titanlite.labs")) for m in reach), sorted(
        reach
    )
    assert total <= REACHABLE_BUDGET, (
        f"titanlite/train.py reaches {total} lines (budget {REACHABLE_BUDGET}): "
        + ", ".join(
            f"{m} {lines(FILES[m])}" for m in sorted(reach, key=lambda m: -lines(FILES[m]))[:8]
        )
    )
    imported = loaded()
    assert sum(imported.values()) <= LOADED_BUDGET, (
        f"import titanlite.train loads {sum(imported.values())} lines (budget {LOADED_BUDGET}): "
        + ", ".join(f"{m} {n}" for m, n in sorted(imported.items(), key=lambda kv: -kv[1])[:8])
    )
    assert set(imported) <= reach  # what is loaded is reachable: the walk misses no import


def test_no_core_module_is_over_300_lines():
    over = {
        str(p.relative_to(PACKAGE)): lines(p) for p in core_modules() if lines(p) > MODULE_BUDGET
    }
    assert over == {}, f"split these (one technique per module, ~300 lines): {over}"


def test_each_technique_module_opens_with_the_technique():
    for rel, entry in OPENS_WITH.items():
        tree = ast.parse((PACKAGE / rel).read_text())
        first = next(
            node.name
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))
            and not node.name.startswith("_")
            and not (isinstance(node, ast.ClassDef) and _is_small_record(node))
        )
        assert first == entry, f"{rel} opens with {first}, not with its technique {entry}"


def _is_small_record(node: ast.ClassDef) -> bool:
    """A dataclass or exception of a few lines (a result type the technique returns) may come first."""
    return node.end_lineno - node.lineno < 10


def test_the_budget_check_counts_lazy_imports(tmp_path):
    """A module imported only inside a function is still reachable (so hiding an import saves
    nothing), and a module nobody imports is not."""
    assert "titanlite.efficiency.fp8" in reachable()  # imported inside apply_efficiency only
    assert "titanlite.tools.live_plot" not in reachable()


def test_readme_reading_order_lists_every_core_file_once_with_todays_line_counts():
    from collections import Counter

    from titanlite.tools.reading_order import (
        READING_ORDER,
        core_files,
        readme_block,
        table,
        with_table,
    )

    listed = Counter(f for *_, files in READING_ORDER for f in files)
    assert set(listed) == core_files() and max(listed.values()) == 1, (
        sorted(core_files() - set(listed)),
        sorted(set(listed) - core_files()),
    )
    readme = (PACKAGE.parent / "README.md").read_text()
    assert readme_block(readme) == table(), (
        "stale: run python -m titanlite.tools.reading_order --readme"
    )
    assert with_table(readme) == readme  # rewriting it in place changes nothing else


def test_the_core_imports_nothing_only_the_tools_use():
    # _compat/torch_tools.py holds the tools' torch internals: it is not in the core's reading order
    reach = reachable()
    assert (
        "titanlite._compat.torch_tools" not in reach
        and "titanlite._compat.torchao_tools" not in reach
    )
