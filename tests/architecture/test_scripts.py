"""``scripts/`` holds entry points only; the code behind them is library code in ``tools/`` (or
``distill/``), which tests import as modules.

Two rules, on the AST of every file:

* **Tests import, never load by path.** No file under ``tests/`` loads a Python file by its path
  (``importlib.util.spec_from_file_location``, ``importlib.machinery.SourceFileLoader``,
  ``runpy.run_path``, ``imp.load_source``), imports from a ``scripts`` package, or puts a
  ``scripts`` directory on ``sys.path``. Running a script as a command (``subprocess``) is fine:
  that tests the entry point.
* **Scripts are thin.** A Python file in ``scripts/`` holds a docstring, imports, the
  ``sys.path.insert(...)`` that lets it run from a checkout, and an ``if __name__ == "__main__":``
  block of one statement (``sys.exit(main())``). No function, class, assignment or other statement:
  anything more is logic, and logic belongs in a module a test can import. ``NOT_YET_THIN`` lists
  the fault-injection drivers still to be moved (a listed file that is gone or already thin is
  ignored).

The checkers are tried on snippets first.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
NOT_YET_THIN = {"chaos_run.py", "serve_fault_check.py"}
LOADERS = {"spec_from_file_location", "SourceFileLoader", "run_path", "load_source"}


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _mentions_scripts(node: ast.AST) -> bool:
    """Whether a string constant inside ``node`` names a ``scripts`` directory."""
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "scripts" in n.value.split("/")
               for n in ast.walk(node))


def loads_a_script(source: str) -> list[tuple[int, str]]:
    """(line, what) for each way ``source`` reaches a file by path or the scripts directory."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if name in LOADERS:
                found.append((node.lineno, f"loads a file by path ({name})"))
            elif name in ("insert", "append", "extend") and isinstance(node.func, ast.Attribute) \
                    and ast.unparse(node.func.value) == "sys.path" and _mentions_scripts(node):
                found.append((node.lineno, "puts scripts/ on sys.path"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"imports {a.name}") for a in node.names
                      if a.name == "scripts" or a.name.startswith("scripts.")]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level \
                and (node.module == "scripts" or node.module.startswith("scripts.")):
            found.append((node.lineno, f"imports from {node.module}"))
    return found


def _is_main_guard(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and ast.unparse(node.test) in ('__name__ == "__main__"', "__name__ == '__main__'")
            and len(node.body) == 1 and isinstance(node.body[0], ast.Expr) and not node.orelse)


def _is_path_insert(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "sys.path.insert")


def logic_in_script(source: str) -> list[tuple[int, str]]:
    """(line, statement kind) for each top-level statement of ``source`` that is not entry-point
    wiring (see the module docstring)."""
    tree = ast.parse(source)
    found = []
    for i, node in enumerate(tree.body):
        docstring = i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
            and isinstance(node.value.value, str)
        if docstring or isinstance(node, (ast.Import, ast.ImportFrom)) or _is_path_insert(node) \
                or _is_main_guard(node):
            continue
        found.append((node.lineno, type(node).__name__))
    return found


@pytest.mark.parametrize("source", [
    'spec = importlib.util.spec_from_file_location("x", os.path.join(REPO, "scripts", "x.py"))',
    "from importlib.util import spec_from_file_location\nspec_from_file_location('x', p)",
    "mod = SourceFileLoader('x', path).load_module()",
    "runpy.run_path('scripts/x.py')",
    'sys.path.insert(0, os.path.join(REPO, "scripts"))',
    'sys.path.append(str(ROOT / "scripts"))',
    "import scripts.bench_ep",
    "from scripts.trace_overlap import main",
    "from scripts import ttq_seeds",
])
def test_checker_finds_a_script_loaded_by_path(source):
    assert loads_a_script(source), source


@pytest.mark.parametrize("source", [
    "from tools.bench import ttq_seeds",
    'subprocess.run([sys.executable, "scripts/bench_serve.py", "--help"])',
    'path = os.path.join(REPO, "scripts", "fcsd_demo.sh")',
    "sys.path.insert(0, REPO)",
    "from .conftest import REPO",
    "import tools.scripts_helper",
])
def test_checker_allows_imports_and_commands(source):
    assert loads_a_script(source) == [], source


@pytest.mark.parametrize("source", [
    "def main():\n    return 0",
    "class Tool:\n    pass",
    "ROOT = '.'",
    "import sys\nfrom tools.x import main\nif __name__ == '__main__':\n    print('x')\n    sys.exit(main())",
    "for x in range(3):\n    pass",
    "print('hello')",
])
def test_checker_finds_logic_in_a_script(source):
    assert logic_in_script(source), source


def test_checker_allows_a_thin_script():
    thin = ('#!/usr/bin/env python\n"""Doc."""\n\nimport os\nimport sys\n\n'
            'sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))\n\n'
            'from tools.bench.cli import main  # noqa: E402\n\nif __name__ == "__main__":\n    sys.exit(main())\n')
    assert logic_in_script(thin) == []


def test_the_rules_see_the_tree():
    assert len(list((REPO / "tests").rglob("*.py"))) > 100
    assert len(list((REPO / "scripts").glob("*.py"))) > 10


def test_tests_import_modules_not_scripts():
    offenders = [f"{path.relative_to(REPO)}:{line}: {what}"
                 for path in sorted((REPO / "tests").rglob("*.py"))
                 for line, what in loads_a_script(path.read_text())]
    assert not offenders, "import the module from tools/ instead:\n" + "\n".join(offenders)


def test_scripts_are_thin():
    offenders = [f"{path.relative_to(REPO)}:{line}: {kind}"
                 for path in sorted((REPO / "scripts").glob("*.py")) if path.name not in NOT_YET_THIN
                 for line, kind in logic_in_script(path.read_text())]
    assert not offenders, ("a script is an entry point only; move the code into a module under tools/:\n"
                           + "\n".join(offenders))
