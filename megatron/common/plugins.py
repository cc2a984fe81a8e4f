"""Plugins from installed packages: Python entry points of a named group.

A package outside this repository extends it by declaring an entry point in a group (its
``pyproject.toml``: ``[project.entry-points.moe_variants] name = "package.module"``);
``load_plugins(group, base, register)`` loads each one installed (``importlib.metadata``, in name
order). An entry point names a module that registers what it defines when imported, a subclass of
``base`` (handed to ``register``), or a callable that registers (called). This is vLLM's convention
(``vllm/plugins/__init__.py``, ``load_plugins_by_group``). A plugin that fails to load or to be
used is one line naming it and its distribution (``UserError``): a broken plugin is the
environment's problem, not a traceback in our code. Standard library only.
"""

from __future__ import annotations

import types
from importlib.metadata import EntryPoint, entry_points
from typing import Callable

from megatron.common.cli import UserError, one_line

__all__ = ["load_plugins", "describe"]


def describe(entry_point: EntryPoint) -> str:
    """``name = value`` of ``entry_point`` and the distribution that declares it."""
    dist = entry_point.dist
    where = f"{dist.metadata['Name']} {dist.version}" if dist is not None else "an unknown distribution"
    return f"{entry_point.name} = {entry_point.value} (from {where})"


def _use(obj, base: type, register: Callable[[type], object]) -> None:
    if isinstance(obj, types.ModuleType):
        return  # importing it registered what it defines
    if isinstance(obj, type) and issubclass(obj, base):
        register(obj)
    elif callable(obj):
        obj()
    else:
        raise TypeError(f"names a {type(obj).__name__}, not a module, a {base.__name__} subclass or a callable")


def load_plugins(group: str, base: type, register: Callable[[type], object]) -> list[str]:
    """Load every installed entry point of ``group`` (see the module docstring); the plugins' names,
    in the order loaded. ``UserError`` naming the plugin when one fails."""
    loaded = []
    for entry_point in sorted(entry_points(group=group), key=lambda e: (e.name, e.value)):
        try:
            _use(entry_point.load(), base, register)
        except Exception as err:
            detail = type(err).__name__ + (f": {one_line(err)}" if str(err).strip() else "")
            raise UserError(f"{group} plugin {describe(entry_point)} failed to load: {detail}") from err
        loaded.append(entry_point.name)
    return loaded
