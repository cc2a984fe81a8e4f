"""The GPU tier (tests/gpu) cannot run on CPU CI, so a stale import, a renamed rank function or a
moved entry point would only show on a GPU machine, and there as a failure that could be mistaken
for a hardware refusal. Resolved here, on the CPU:

- every module of tests/gpu imports;
- every ``from X import Y``, at module level or inside functions: the module imports and has the name;
- every rank function handed to ``run_distributed`` (by name, ``fn``, or through a module alias,
  ``H.fn``) is a module-level function of an importable module: the GPU tier runs NCCL ranks in
  spawned processes, which import the function by its qualified name (a nested function or a
  lambda cannot be sent);
- every module started with ``-m`` by a torchrun helper (``_torchrun("pkg.mod", ...)``) exists.

Each checker is tried on a stale snippet first.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import pickle
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPU_FILES = sorted((ROOT / "tests" / "gpu").glob("*.py"))
RUNNERS = {"run_distributed"}  # calls whose first argument is a rank function


def unresolved_imports(source: str) -> list[str]:
    """``module.name`` of each ``from module import name`` in ``source`` that does not resolve."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                bad.append(node.module)
                continue
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        bad.append(f"{node.module}.{alias.name}")
    return bad


def _imported_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted target of every import in ``tree`` (any scope): ``import a.b as H`` gives
    ``H -> a.b``, ``from a import b as c`` gives ``c -> a.b`` (a module or an attribute)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _resolve(dotted: str):
    """The object at ``dotted`` (``pkg.mod.attr``, or ``pkg.mod.sub.attr`` where ``sub`` is a module)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            try:
                obj = getattr(obj, part)
            except AttributeError:
                obj = importlib.import_module(f"{obj.__name__}.{part}")  # a submodule not yet imported
        return obj
    raise ImportError(dotted)


def rank_functions(source: str, module: str) -> list[str]:
    """Dotted names of the rank functions handed to a runner (``RUNNERS``) in ``source``, the
    source of ``module``: a plain name is one of the module's own functions or an imported one,
    ``alias.fn`` is ``fn`` of the module imported as ``alias``. Anything else (a lambda, a
    subscript, an unknown name) is returned as ``?<source text>``."""
    tree = ast.parse(source)
    imported = _imported_names(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in RUNNERS):
            continue
        fn = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "fn"), None)
        if isinstance(fn, ast.Name):
            found.append(imported.get(fn.id, f"{module}.{fn.id}"))
        elif isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id in imported:
            found.append(f"{imported[fn.value.id]}.{fn.attr}")
        else:
            found.append("?" + (ast.unparse(fn) if fn is not None else "<no function>"))
    return found


def unresolved_rank_functions(source: str, module: str) -> list[str]:
    """The rank functions of ``rank_functions`` that do not exist, or that a spawned rank could not
    import by name (pickling a function stores its module and qualified name, and fails for a
    nested function or a lambda)."""
    bad = []
    for dotted in rank_functions(source, module):
        try:
            fn = _resolve(dotted) if not dotted.startswith("?") else None
        except (ImportError, AttributeError):
            fn = None
        try:
            spawnable = callable(fn) and pickle.loads(pickle.dumps(fn)) is fn
        except (pickle.PicklingError, AttributeError, TypeError):
            spawnable = False
        if not spawnable:
            bad.append(dotted)
    return bad


def torchrun_modules(source: str) -> list[str]:
    """The ``-m`` modules of torchrun helper calls (a function whose name ends in ``torchrun``,
    first argument a string literal)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and \
                str(getattr(node.func, "id", getattr(node.func, "attr", ""))).endswith("torchrun"):
            found.append(node.args[0].value)
    return found


def missing_modules(names: list[str]) -> list[str]:
    bad = []
    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                bad.append(name)
        except ImportError:  # a parent package is missing
            bad.append(name)
    return bad


def test_checker_finds_a_stale_import():
    stale = "def rank_fn():\n    from megatron.training.step import no_such_name\n"
    assert unresolved_imports(stale) == ["megatron.training.step.no_such_name"]


STALE_RUNS = '''
from tools.spawn import run_distributed
from tests.convert import hf_models as H
from tests.serving.conftest import offline_greedy_rank

def _here(rank, world):
    pass

def test():
    def nested(rank, world):
        pass
    run_distributed(_here, 1)
    run_distributed(offline_greedy_rank, 1, backend="nccl")
    run_distributed(H.cli_rank, 1)
    run_distributed(_renamed_rank, 2)
    run_distributed(H.no_such_rank, 1)
    run_distributed(nested, 1)
    run_distributed(lambda rank, world: None, 1)
    run_distributed(_lambda_rank, 1)
    run_distributed(fn=unresolved_imports)
'''
_lambda_rank = lambda rank, world: None  # noqa: E731 (exists, but a spawned rank cannot import it)


def test_rank_function_checker_finds_stale_and_unspawnable_functions():
    module = "tests.architecture.test_gpu_tier_imports"  # where _here would live: it does not
    assert rank_functions(STALE_RUNS, module) == [
        f"{module}._here", "tests.serving.conftest.offline_greedy_rank", "tests.convert.hf_models.cli_rank",
        f"{module}._renamed_rank", "tests.convert.hf_models.no_such_rank", f"{module}.nested",
        "?lambda rank, world: None", f"{module}._lambda_rank", f"{module}.unresolved_imports"]
    assert unresolved_rank_functions(STALE_RUNS, module) == [
        f"{module}._here", f"{module}._renamed_rank", "tests.convert.hf_models.no_such_rank", f"{module}.nested",
        "?lambda rank, world: None", f"{module}._lambda_rank"]


def test_module_checker_finds_a_moved_entry_point():
    source = '_torchrun("megatron.training.pretrain_gpt", [], 1)\nhelpers.torchrun("megatron.training.no_such", [])\n'
    assert torchrun_modules(source) == ["megatron.training.pretrain_gpt", "megatron.training.no_such"]
    assert missing_modules(torchrun_modules(source)) == ["megatron.training.no_such"]


def test_every_module_of_the_gpu_tier_imports():
    for path in GPU_FILES:
        importlib.import_module(f"tests.gpu.{path.stem}")


def test_every_import_of_the_gpu_tier_resolves():
    for path in GPU_FILES:
        assert unresolved_imports(path.read_text()) == [], path.name


def test_every_rank_function_of_the_gpu_tier_resolves():
    found = []
    for path in GPU_FILES:
        module, source = f"tests.gpu.{path.stem}", path.read_text()
        found += rank_functions(source, module)
        assert unresolved_rank_functions(source, module) == [], path.name
    assert len(found) >= 6  # the checker sees the tier's runs (bigmac, farskip x2, HF x2, offline greedy)


def test_every_torchrun_entry_point_of_the_gpu_tier_exists():
    for path in GPU_FILES:
        modules = torchrun_modules(path.read_text())
        assert missing_modules(modules) == [], path.name
    assert "megatron.training.pretrain_gpt" in torchrun_modules((ROOT / "tests/gpu/test_gpu_tier.py").read_text())


# --- optional extras ---------------------------------------------------------------------------
# A GPU machine may lack an optional extra (the lm-eval one, say): only the check that
# ``importorskip``s it may need it. Found on an H200 without lm-eval: both server checks failed
# because their offline reference was imported through the lm-eval adapter.
OPTIONAL = ("lm_eval",)


def _skips(func: ast.AST) -> set[str]:
    """Packages a function ``pytest.importorskip``s."""
    return {node.args[0].value for node in ast.walk(func)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
            and node.args and isinstance(node.args[0], ast.Constant)}


def imports_outside_skips(source: str) -> list[str]:
    """The modules of the ``from X import`` statements in ``source`` (any scope), leaving out those
    inside a function that ``importorskip``s an optional extra."""
    tree = ast.parse(source)
    guarded = {id(node) for func in ast.walk(tree) if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef))
               and _skips(func) & set(OPTIONAL) for node in ast.walk(func)}
    return sorted({node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and node.module and node.level == 0 and id(node) not in guarded})


def failing_without_extras(modules: list[str]) -> list[str]:
    """The modules that do not import in a fresh interpreter where the ``OPTIONAL`` packages are missing."""
    code = ("import importlib, sys\n"
            f"for name in {OPTIONAL!r}: sys.modules[name] = None\n"
            f"for mod in {modules!r}:\n"
            "    try: importlib.import_module(mod)\n"
            "    except ImportError: print(mod)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


def test_extras_checker_finds_an_unguarded_lm_eval_import():
    stale = ("import pytest\n"
             "def rank_fn():\n    from megatron.training.lm_eval_adapter import MegatronCheckpointLM\n"
             "def test_lm_eval():\n    pytest.importorskip('lm_eval')\n    from lm_eval import simple_evaluate\n")
    assert imports_outside_skips(stale) == ["megatron.training.lm_eval_adapter"]
    assert failing_without_extras(imports_outside_skips(stale)) == ["megatron.training.lm_eval_adapter"]


def test_the_gpu_tier_needs_no_optional_extra_outside_the_check_that_skips_on_it():
    sources = [path.read_text() for path in GPU_FILES]
    helpers = {m for s in sources for m in imports_outside_skips(s) if m.startswith("tests.")}
    for helper in sorted(helpers):  # the test modules the tier borrows from, e.g. the serving conftest
        sources.append(pathlib.Path(importlib.util.find_spec(helper).origin).read_text())
    modules = sorted({m for s in sources for m in imports_outside_skips(s)})
    assert "megatron.training.offline_lm" in modules
    assert failing_without_extras(modules) == []
