"""A variant's two protocols stay apart: the model side (``moe_variants.registry.Variant``: what the
model, training and serving need) imports no tool, and the tools' side (``tools.variants.VariantTools``:
what ``tools/bench`` and ``tools/serve_bench`` need) is registered by the tools, so the model
library holds no benchmark hook or flag. Each hook is documented once, on its protocol: the
functions that run a hook over every variant name it instead of describing it again.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys

from moe_variants import registry
from tools import variants as variant_hooks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ABOVE_THE_MODEL = ("tools", "distill", "scripts", "megatron.components", "megatron.training", "megatron.inference")


def _public(cls) -> dict:
    return {name: value for name, value in vars(cls).items() if not name.startswith("_")}


def _hooks(cls) -> dict:
    """The hook methods a protocol declares (its public functions)."""
    return {name: value for name, value in _public(cls).items() if inspect.isfunction(value)}


def test_the_protocols_share_only_the_name():
    assert set(_public(registry.Variant)) & set(_public(variant_hooks.VariantTools)) == {"name"}
    assert {"validate", "apply", "serving_model"} <= set(_hooks(registry.Variant))
    assert {"bench_runtime", "serve_placement", "upstream_moe_config"} <= set(_hooks(variant_hooks.VariantTools))


def test_the_model_protocol_imports_no_tool():
    """Not in its source (imports inside functions included) and not when every registered variant
    is loaded: the registry and the built-in variants reach nothing above the model library."""
    sources = [os.path.join(REPO, "moe_variants", "registry.py")]
    sources += [os.path.join(REPO, "moe_variants", d, "variant.py") for d in sorted(os.listdir(os.path.join(REPO, "moe_variants")))
                if os.path.isfile(os.path.join(REPO, "moe_variants", d, "variant.py"))]
    assert len(sources) >= 4
    found = []
    for path in sources:
        for node in ast.walk(ast.parse(open(path).read())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{os.path.relpath(path, REPO)}:{node.lineno}: {n}" for n in names
                      if n == "tools" or n.startswith(tuple(p + "." for p in ABOVE_THE_MODEL)) or n in ABOVE_THE_MODEL]
    assert found == []
    code = ("import sys; from moe_variants import registry; registry.variants(); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tools', 'distill', 'scripts') "
            "or m.startswith(('megatron.components', 'megatron.training', 'megatron.inference'))); assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_model_library_defines_no_tool_hook():
    """No class in ``moe_variants`` implements a tools' hook or declares the tools' variant names:
    those live in a variant's own tool folder (``tools/<variant>/variant_tools.py``)."""
    tool_members = set(_public(variant_hooks.VariantTools)) - {"name"}
    found = []
    for root, _, files in os.walk(os.path.join(REPO, "moe_variants")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            for cls in (n for n in ast.walk(ast.parse(open(path).read())) if isinstance(n, ast.ClassDef)):
                for node in cls.body:
                    members = [node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
                        [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
                    found += [f"{os.path.relpath(path, REPO)}:{node.lineno}: {cls.name}.{m}"
                              for m in members if m in tool_members]
    assert found == [], "tools' hooks in the model library:\n" + "\n".join(found)


def test_every_hook_is_documented_on_its_protocol_and_named_by_its_runner():
    for module, protocol in ((registry, registry.Variant), (variant_hooks, variant_hooks.VariantTools)):
        for name, hook in _hooks(protocol).items():
            assert inspect.getdoc(hook), f"{protocol.__name__}.{name} has no docstring"
            runner = getattr(module, name, None)
            if inspect.isfunction(runner):
                assert f"{protocol.__name__}.{name}" in inspect.getdoc(runner), \
                    f"{module.__name__}.{name} describes the hook again instead of naming {protocol.__name__}.{name}"


def test_the_tools_register_their_side_of_the_built_in_variants():
    tools = {t.name: t for t in variant_hooks.variant_tools()}
    assert all(type(t).__module__ == f"tools.{name}.variant_tools" for name, t in tools.items())
    assert {"bigmac", "semmoe"} <= set(tools) <= {v.name for v in registry.variants()}
