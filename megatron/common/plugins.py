"""Plugins from installed packages: Python entry points of a named group.

A package outside this repository extends it by declaring an entry point in a group (its
``pyproject.toml``: ``[project.entry-points.moe_variants] name = "package.module"``);
``load_plugins(group, use)`` loads each one installed (``importlib.metadata``, in name order) and
hands what it names, a module or an object in it, to ``use``. This is vLLM's convention
(``vllm/plugins/__init__.py``, ``load_plugins_by_group``). A plugin that fails to load or to be
used is one line naming it and its distribution (``UserError``): a broken plugin is the
environment's problem, not a traceback in our code. Standard library only.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any, Callable

from megatron.common.cli import UserError, one_line

__all__ = ["load_plugins", "describe"]


def describe(entry_point: EntryPoint) -> str:
    """``name = value`` of ``entry_point`` and the distribution that declares it."""
    dist = entry_point.dist
    where = f"{dist.metadata['Name']} {dist.version}" if dist is not None else "an unknown distribution"
    return f"{entry_point.name} = {entry_point.value} (from {where})"


def load_plugins(group: str, use: Callable[[Any], None]) -> list[str]:
    """Load every installed entry point of ``group`` and call ``use`` with what it names; the
    plugins' names, in the order loaded. ``UserError`` naming the plugin when one fails."""
    loaded = []
    for entry_point in sorted(entry_points(group=group), key=lambda e: (e.name, e.value)):
        try:
            use(entry_point.load())
        except Exception as err:
            detail = type(err).__name__ + (f": {one_line(err)}" if str(err).strip() else "")
            raise UserError(f"{group} plugin {describe(entry_point)} failed to load: {detail}") from err
        loaded.append(entry_point.name)
    return loaded
