"""The registry of model families, keyed by Hugging Face ``model_type``.

Every module in this package that defines ``FAMILY`` (a ``base.Family``) is registered, so adding a
family is adding one module.
"""

from __future__ import annotations

import importlib
import pkgutil

from distill.convert.families.base import Family

__all__ = ["Family", "all_families", "by_name", "for_hf_config"]

_REGISTRY: dict[str, Family] = {}


def all_families() -> dict[str, Family]:
    """{model_type: family} of every family module in this package."""
    if not _REGISTRY:
        for info in pkgutil.iter_modules(__path__):
            module = importlib.import_module(f"{__name__}.{info.name}")
            family = getattr(module, "FAMILY", None)
            if isinstance(family, Family):
                assert family.model_type not in _REGISTRY, f"two families claim {family.model_type}"
                _REGISTRY[family.model_type] = family
    return _REGISTRY


def by_name(name: str) -> Family:
    """The family with this ``model_type`` (``--family``)."""
    families = all_families()
    if name not in families:
        raise ValueError(f"--family {name!r} is not one of: {', '.join(sorted(families))}")
    return families[name]


def for_hf_config(config: dict) -> Family:
    """The family of a Hugging Face ``config.json`` (its ``model_type``, checked against
    ``architectures``)."""
    families = all_families()
    model_type = config.get("model_type")
    if model_type not in families:
        raise ValueError(
            f"config.json: model_type {model_type!r} is not a supported family "
            f"(supported: {', '.join(sorted(families))})"
        )
    family = families[model_type]
    archs = config.get("architectures") or [family.architecture]
    if family.architecture not in archs:
        raise ValueError(
            f"config.json: architectures {archs} is not {family.architecture} (only causal LMs convert)"
        )
    return family
