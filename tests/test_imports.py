"""Importing titanlite configures nothing; notebook_setup() and quiet_third_party() opt in; torch
and torchao internals are touched only from titanlite/_compat."""

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from titanlite.errors import TitanliteError
from titanlite.tools.display.notebook import chain_lines

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "titanlite"

# What a program's configuration is, as far as an imported library could change it.
SNAPSHOT = """
import json, logging, os, sys, warnings
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()

def snapshot():
    loggers = {name: lg.level for name, lg in logging.root.manager.loggerDict.items()
               if isinstance(lg, logging.Logger)}
    return {"loggers": {**loggers, "<root>": logging.root.level}, "env": dict(os.environ),
            "excepthook": repr(sys.excepthook), "custom_exc": repr(shell.custom_exceptions),
            "filters": [repr(f) for f in warnings.filters]}
"""


def run_python(code: str, prelude: str = "") -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-c", SNAPSHOT + prelude + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def last_json(r: subprocess.CompletedProcess):
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_importing_every_titanlite_module_changes_no_setting():
    # torch (and what titanlite's modules import from it) first: only titanlite's own changes count.
    r = run_python("""
        import importlib, pkgutil
        import torch, torch.distributed.checkpoint, torch.distributed.pipelining, torch.distributed.fsdp
        import torch.distributed.tensor.parallel, torch.distributed.elastic.multiprocessing.errors
        import torch.utils.checkpoint, torch.multiprocessing.reductions, torch._dynamo
        import matplotlib.pyplot, transformers, torchao.float8, optuna
        before = snapshot()
        import titanlite, titanlite.tools.display.notebook
        names = [m.name for m in pkgutil.walk_packages(titanlite.__path__, "titanlite.")
                 if not m.name.endswith("__main__")]  # __main__ runs the CLI
        for name in names:
            importlib.import_module(name)
        print(json.dumps({"before": before, "after": snapshot(), "modules": len(names)}))
    """)
    out = last_json(r)
    before, after = out["before"], out["after"]
    assert out["modules"] > 40  # the whole package was imported, not just __init__
    changed = {
        n: (before["loggers"].get(n), lvl)
        for n, lvl in after["loggers"].items()
        if lvl != before["loggers"].get(n, 0)
    }
    assert changed == {}, f"logger levels set at import: {changed}"
    assert {k: v for k, v in after["env"].items() if before["env"].get(k) != v} == {}
    assert after["excepthook"] == before["excepthook"]
    assert after["custom_exc"] == before["custom_exc"] == "()"
    assert after["filters"] == before["filters"]


def test_notebook_setup_quiets_and_installs_the_handler_once():
    r = run_python("""
        import titanlite, titanlite.tools.display.notebook
        before = snapshot()
        titanlite.tools.display.notebook.notebook_setup()
        once = snapshot()
        titanlite.tools.display.notebook.notebook_setup()
        print(json.dumps({"before": before, "once": once, "twice": snapshot()}))
    """)
    out = last_json(r)
    before, once = out["before"], out["once"]
    assert out["twice"] == once  # idempotent
    assert before["loggers"].get("torchao", 0) == 0 and once["loggers"]["torchao"] == 40  # ERROR
    assert once["loggers"]["torch.utils._pytree"] == 40
    assert once["env"]["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "1"
    assert once["custom_exc"] == "(<class 'titanlite.errors.TitanliteError'>,)"
    assert once["excepthook"] == before["excepthook"]  # IPython's own hook is left alone
    assert once["filters"] == before["filters"]


def test_quiet_third_party_hides_torchao_import_noise_and_keeps_user_settings():
    r = run_python("""
        import os
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "0"   # the user's choice wins
        import titanlite, titanlite.tools.display.notebook
        titanlite.tools.display.notebook.quiet_third_party()
        import torchao.float8
        print(json.dumps(snapshot()["env"]["TRANSFORMERS_NO_ADVISORY_WARNINGS"]))
    """)
    assert "Failed to load" not in r.stderr and "register_constant" not in r.stderr, r.stderr
    assert last_json(r) == "0"


CELL = """
from titanlite import TitanliteError
def read(path):
    return {}["no such key"]
try:
    read("x")
except KeyError as e:
    raise TitanliteError("config x is missing its model section: add [model]") from e
"""


def test_notebook_handler_shows_every_link_of_the_chain_and_no_traceback():
    r = run_python(
        prelude=f"CELL = {CELL!r}\n",
        code="""
        import titanlite, titanlite.tools.display.notebook
        titanlite.tools.display.notebook.notebook_setup()
        shell.run_cell(CELL)
        shell.run_cell("raise ValueError('plain error')")
    """,
    )
    lines = r.stderr.splitlines()
    assert "TitanliteError: config x is missing its model section: add [model]" in lines
    cause = [ln for ln in lines if ln.startswith("  caused by KeyError: 'no such key'")]
    raised_at = CELL.strip().splitlines().index('    return {}["no such key"]') + 1
    assert len(cause) == 1 and cause[0].endswith(f":{raised_at})")  # where the cause was raised
    # A TitanliteError shows no traceback; an ordinary error keeps IPython's full one (stdout).
    assert "TitanliteError" not in r.stdout and 'read("x")' not in r.stdout + r.stderr
    assert "ValueError" in r.stdout and "plain error" in r.stdout


def test_chain_lines_follow_cause_and_context_like_python():
    try:
        try:
            raise OSError("disk full")
        except OSError:
            try:
                raise KeyError("k")
            except KeyError as inner:
                raise TitanliteError("save failed: free some disk space") from inner
    except TitanliteError as e:
        lines = chain_lines(e)
    assert lines[0] == "TitanliteError: save failed: free some disk space"
    assert lines[1].startswith("  caused by KeyError: 'k'  (")
    assert lines[2].startswith("  while handling OSError: disk full  (")
    assert len(lines) == 3
    try:
        try:
            raise OSError("hidden")
        except OSError:
            raise TitanliteError("one line only") from None
    except TitanliteError as e:
        assert chain_lines(e) == ["TitanliteError: one line only"]


# ----- torch / torchao internals live only in titanlite/_compat --------------------------------

# Underscore modules that are the documented way to configure torch.compile: allowed anywhere.
DOCUMENTED = ("torch._dynamo", "torch._inductor.config")
PRIVATE_NAMES = {
    "_compiled_call_impl",
    "_CHECKPOINT_PROCESS",
    "_async_process_executor",
    "__del__",
    "_checkpoint_wrapped_module",
}


def _private_module(name: str) -> bool:
    parts = name.split(".")
    if parts[0] == "torch":
        return any(p.startswith("_") for p in parts[1:]) and not name.startswith(DOCUMENTED)
    return parts[0] == "torchao" and any(p.startswith(("_", "float8_")) for p in parts[1:])


def private_uses(source: str) -> list[str]:
    """torch/torchao internals this source reaches: private module imports, private attributes
    (also as getattr strings), and methods set on a pipeline stage. Docstrings don't count."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        modules = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        private = [m for m in modules if _private_module(m)]
        if private:
            found.append(f"line {node.lineno}: imports {private[-1]}")
        names = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            names = [node.value]
        found += [f"line {node.lineno}: {n}" for n in names if n in PRIVATE_NAMES]
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and node.args
            and isinstance(node.args[0], ast.Name)
            and "stage" in node.args[0].id
        ):
            found.append(f"line {node.lineno}: sets a method on a pipeline stage")
    return found


def test_the_private_use_check_catches_each_kind():
    old = """
from torch.utils._pytree import tree_leaves
import torch._inductor.cpp_builder
from torchao.float8.float8_linear import Float8Linear
from torch.distributed.checkpoint import _async_process_executor as executor
import torch._dynamo, torch._inductor.config
def f(m, stage, name, fn, proc):
    "mentions _compiled_call_impl in a docstring: fine"
    executor._CHECKPOINT_PROCESS = None
    proc.__del__()
    setattr(stage, name, fn)
    return getattr(m, "_compiled_call_impl", None)
"""
    found = private_uses(old)
    assert len(found) == 8, found
    assert not any("torch._dynamo" in f or "config" in f for f in found)


def test_no_module_outside_compat_touches_torch_or_torchao_internals():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_compat" in path.relative_to(PACKAGE).parts:
            continue
        found = private_uses(path.read_text())
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}, f"move these into titanlite/_compat: {offenders}"


def test_compat_fallbacks_and_messages():
    from torch import nn

    from titanlite._compat import torch_internals, torch_tools, torchao_internals

    block = nn.Linear(2, 2)
    assert not torch_internals.is_compiled_in_place(block)
    torch_internals.set_compiled_call(block, lambda *a: "compiled")
    assert torch_internals.is_compiled_in_place(nn.Sequential(block))
    torch_internals.set_compiled_call(block, None)
    assert not torch_internals.is_compiled_in_place(block)
    with pytest.raises(TitanliteError, match="PipelineStage has no forward_one_chunk"):
        torch_tools.replace_stage_method(object(), "forward_one_chunk", lambda f: f)
    torch_internals.stop_dcp_writer_process()  # none running: nothing to do, no error
    assert isinstance(torch_internals.has_triton(), bool)
    assert torchao_internals.float8_linear_class().__name__ == "Float8Linear"


def test_notebook_setup_shows_a_warning_as_one_line_without_its_source():
    """Issue 25: `RuntimeWarning: MFU 1.08 > 1 ...` came with the file, line number and the
    Python source line that raised it; in a notebook that is one clean line."""
    r = run_python("""
        import titanlite, titanlite.tools.display.notebook
        titanlite.tools.display.notebook.notebook_setup()
        shell.run_cell("import warnings\\nwarnings.warn('MFU 1.08 > 1 against a peak', RuntimeWarning)")
    """)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == ["RuntimeWarning: MFU 1.08 > 1 against a peak"], r.stderr
