"""megatron-core's private attributes are touched only in ``megatron/compat``.

A private name (``_x``) of megatron-core can change in any release without notice; ``megatron/compat``
is the one place that depends on them, each site pinned in ``sites.py`` and checked by
``tests/compat/test_staleness.py``. Everywhere else (the model library, the applications, the
tools, distill, scripts) the rule, on the AST of every file:

1. in a class derived from a megatron-core class (its base imported from ``megatron.core``), no
   method overrides, and no ``self._x`` / ``super()._x`` reads or writes, a private name of that
   base: one the base has (``dir``) or assigns as ``self._x`` in megatron-core's source of any
   class of its MRO;
2. anywhere, no ``obj._x`` / ``getattr(obj, "_x")`` (``self`` included: a subclass whose base is
   built at run time is not resolved by 1) of a name that megatron-core uses privately (an
   attribute or function name ``_x`` in its installed source) and that the project does not define
   itself outside ``megatron/compat`` (a method ``_x`` of one of its classes or a
   ``self._x = ...``): a private attribute of an upstream object read from outside.

Rule 2 is a heuristic (types are not known statically): a private name megatron-core shares with
one of the project's own classes is not caught on a foreign object. The checkers are tried on
snippets first.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pathlib
import textwrap
from functools import lru_cache

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ["megatron/components", "megatron/training", "megatron/inference", "moe_variants", "tools", "distill", "scripts"]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@lru_cache(maxsize=None)
def upstream_private_names() -> frozenset:
    """Every private attribute or function name in the installed megatron-core's source."""
    import megatron.core

    names = set()
    for path in pathlib.Path(os.path.dirname(megatron.core.__file__)).rglob("*.py"):
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                names.add(node.name)
    return frozenset(names)


def defined_private_names(tree) -> set:
    """Private names a file defines for its own classes: methods ``_x`` and ``self._x = ...``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            out |= {b.name for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and _private(b.name)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = list(node.targets) if isinstance(node, ast.Assign) else [node.target]
            while targets:  # ``self._x = ...`` binds a name; ``self._x[i] = ...`` only writes into one
                t = targets.pop()
                if isinstance(t, (ast.Tuple, ast.List)):
                    targets.extend(t.elts)
                elif (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                      and t.value.id in ("self", "cls") and _private(t.attr)):
                    out.add(t.attr)
    return out


def _is_self_or_super(expr) -> bool:
    return (isinstance(expr, ast.Name) and expr.id in ("self", "cls")) or (
        isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "super")


def _upstream_bases(tree, node: ast.ClassDef) -> list:
    """The megatron-core classes among ``node``'s bases (``from megatron.core... import X`` or
    ``import megatron.core.x as m`` + ``m.X``, anywhere in the file)."""
    names, modules = {}, {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("megatron.core") and not n.level:
            for a in n.names:
                names[a.asname or a.name] = (n.module, a.name)
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith("megatron.core") and a.asname:
                    modules[a.asname] = a.name
    out = []
    for base in node.bases:
        where = None
        if isinstance(base, ast.Name) and base.id in names:
            where = names[base.id]
        elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id in modules:
            where = (modules[base.value.id], base.attr)
        if where is not None:
            out.append(getattr(importlib.import_module(where[0]), where[1]))
    return out


@lru_cache(maxsize=None)
def _class_private_names(cls) -> frozenset:
    names = {n for n in dir(cls) if _private(n)}
    for klass in cls.__mro__:
        if not (klass.__module__ or "").startswith("megatron.core"):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        for n in ast.walk(ast.parse(source)):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" and _private(n.attr):
                names.add(n.attr)
    return frozenset(names)


def subclass_privates(source: str) -> list[tuple[int, str]]:
    """Rule 1: (line, what) for each private name of a megatron-core base used by its subclass."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = _upstream_bases(tree, node)
        if not bases:
            continue
        private = frozenset().union(*(_class_private_names(b) for b in bases))
        for n in ast.walk(node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in private:
                found.append((n.lineno, f"{node.name} overrides {n.name}"))
            elif isinstance(n, ast.Attribute) and n.attr in private and _is_self_or_super(n.value):
                found.append((n.lineno, f"{node.name} uses {n.attr}"))
    return sorted(set(found))


def foreign_privates(source: str, own: set) -> list[tuple[int, str]]:
    """Rule 2: (line, what) for each access of an upstream private name the project does not own."""
    upstream = upstream_private_names()
    found = []
    for n in ast.walk(ast.parse(source)):
        name = None
        if isinstance(n, ast.Attribute) and _private(n.attr):
            name = n.attr
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "setattr", "hasattr")
              and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
              and _private(n.args[1].value)):
            name = n.args[1].value
        if name is not None and name in upstream and name not in own:
            found.append((n.lineno, name))
    return sorted(set(found))


CONTROLLER = "from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController\n"


@pytest.mark.parametrize("source", [
    CONTROLLER + "class C(TextGenerationController):\n    def _dynamic_step_sample_logits(self, logits):\n        pass",
    CONTROLLER + "class C(TextGenerationController):\n    def f(self):\n        self._sampled_tokens_cuda[:2] = 0",
    CONTROLLER + "class C(TextGenerationController):\n    def f(self):\n        return super()._dynamic_step_context_init()",
    "import megatron.core.transformer.moe.token_dispatcher as td\nclass D(td.MoEAlltoAllTokenDispatcher):\n"
    "    def _maybe_dtoh_and_synchronize(self, point, t=None):\n        return t",
])
def test_subclass_checker_finds_upstream_privates(source):
    assert subclass_privates(source), source


def test_subclass_checker_allows_own_and_public_names():
    source = CONTROLLER + ("class C(TextGenerationController):\n    def sample_step(self, logits):\n"
                           "        self.specs = {}\n        return self.inference_wrapped_model\n")
    assert subclass_privates(source) == []


@pytest.mark.parametrize("source", [
    "def f(layer):\n    return layer._forward_mlp",
    "def f(layer, g):\n    layer._forward_mlp = g",
    "def f(c):\n    return getattr(c, '_sampled_tokens_cuda')",
    "def f(self):\n    return self._sampled_tokens_cuda",
])
def test_foreign_checker_finds_upstream_privates(source):
    assert foreign_privates(source, own=set()), source


@pytest.mark.parametrize("source", [
    "import os\nos._exit(0)",  # not megatron-core's
    "def f(layer):\n    return layer._forward_mlp",  # owned below
    "def f(self):\n    return self._not_an_upstream_name_at_all",
])
def test_foreign_checker_allows_the_rest(source):
    assert foreign_privates(source, own={"_forward_mlp"}) == []


def test_only_a_binding_defines_a_name():
    tree = ast.parse("class A:\n    def _m(self):\n        self._a, self._b = 1, 2\n        self._c[0] = 1\n")
    assert defined_private_names(tree) == {"_m", "_a", "_b"}


def _project_files():
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_the_scan_sees_the_project_and_upstream():
    files = _project_files()
    assert len(files) > 100 and not any("megatron/compat" in str(p) for p in files)
    assert {"_forward_mlp", "_sampled_tokens_cuda", "_maybe_dtoh_and_synchronize"} <= upstream_private_names()


def test_no_upstream_private_outside_compat():
    files = _project_files()
    trees = {path: ast.parse(path.read_text()) for path in files}
    own = set().union(*(defined_private_names(t) for t in trees.values()))
    offenders = []
    for path in files:
        source = path.read_text()
        for line, what in subclass_privates(source):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {what}")
        for line, name in foreign_privates(source, own):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not offenders, ("megatron-core's private names belong behind megatron/compat (pinned in sites.py):\n"
                           + "\n".join(offenders))
