"""The variant registry: each variant registers itself; core code names none.

A variant is a :class:`Variant` subclass registered with ``@register``: the model side of the
variant, what the model, training and serving need (its hooks are documented on the class, once).
Its config section is a :class:`VariantConfig` dataclass whose fields are flat Megatron-style flags
(``bigmac_ratio`` is ``--bigmac-ratio`` and the YAML key ``bigmac_ratio``; the docstring under a
field is its help). The hooks that check input (``validate``, ``check_runtime``,
``request_scheduler``) run under ``megatron.common.cli.user_input``, so their ``ValueError`` is the
user's one-line ``UserError``. The benchmark tools' hooks are not here: the tools keep their own
protocol and registry (``tools/variants.py``), so the model library owns no benchmark flag.

The builder, the config validation, the argument parser, the converters and the server loop over
``variants()``. Variants come from two places, found on first use:

- the built-ins: the ``moe_variants`` subpackages with a ``variant`` module (a new variant in this
  repository is a new folder);
- plugins: installed packages that declare an entry point in the group ``moe_variants``
  (``PLUGIN_GROUP``), naming a module that registers a variant when imported, a ``Variant``
  subclass, or a callable that registers one (``megatron.common.plugins``; vLLM's convention).

Code elsewhere (a test) may also call ``register`` itself. Torchtitan's model registry and
OLMo-core's ``Config.build()`` are the models for this shape.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Protocol, runtime_checkable

from megatron.common.cli import UserError, user_input
from megatron.common.plugins import load_plugins

if TYPE_CHECKING:
    import torch

__all__ = [
    "Variant",
    "VariantConfig",
    "PLUGIN_GROUP",
    "register",
    "unregister",
    "variants",
    "get",
    "enabled",
    "config_sections",
    "stored_defaults",
    "moe_layer_choices",
    "moe_layer_owner",
    "STANDARD",
    "bench_presets",
    "preset_overrides",
    "Application",
    "add_runtime_arguments",
    "check_runtime",
    "request_scheduler",
    "serving_model",
    "ServingModel",
    "variant_names",
]

# the entry-point group of variants from installed packages
PLUGIN_GROUP = "moe_variants"


class VariantConfig:
    """Base of a variant's config section (subclasses are dataclasses).

    ``SECTION`` names the section in config dumps and checkpoint manifests. ``of(model)`` returns the
    section a ``ModelConfig`` carries, or the defaults (the variant off) when it carries none.
    """

    SECTION: ClassVar[str] = ""

    @classmethod
    def of(cls, model):
        section = model.variants.get(cls.SECTION)
        return section if section is not None else cls()

    @classmethod
    def stored_defaults(cls, values: dict) -> dict:
        """Values for this section's fields that ``values`` (a stored config's flat fields, e.g. a
        checkpoint manifest's) lacks because it was written before they existed, chosen so that it
        keeps the meaning it was written with. Default: none (a new field's default keeps it)."""
        return {}


class Application(str, enum.Enum):
    """The inference-side application a run-time hook is asked from: what it can host."""

    EVALUATE_LM = "evaluate_lm"  # request schedulers only: it does not serve a changed model
    SERVE = "serve"  # request schedulers and serving-model changes


@runtime_checkable
class ServingModel(Protocol):
    """What a variant's ``serving_model`` hook returns: the change it made to a served model, as the
    server reads it. ``name`` is reported as the server's token scheduler; ``local_rows`` says which
    rows of an MoE layer's last forward on this rank are real tokens where a rank's rows are not
    the step's tokens in order (the engine counts local activations with it)."""

    name: str

    def local_rows(self, layer: int, num_real: int) -> torch.Tensor:
        """[rows] bool of MoE layer ``layer``'s last forward on this rank, ``num_real`` real tokens
        in the step (the engine packs them first, then pads)."""
        ...


class Variant:
    """One architecture variant, its model side: what the model, training and serving need.
    Subclasses override what they change; the defaults change nothing. Each hook is documented
    here; the module's functions of the same name run it over every variant."""

    name: ClassVar[str] = ""
    config: ClassVar[Optional[type]] = None  # a VariantConfig dataclass
    # the --moe-variant value that selects this variant's MoE layer class (None: it does not replace
    # it); a value has one owner (``moe_layer_owner``)
    moe_layer: ClassVar[Optional[str]] = None
    # presets: name -> flat config overrides, the variants the benchmarks run and the server's
    # ``--variant`` loads with (``+`` combines presets on the command line)
    bench_presets: ClassVar[dict] = {}
    # flat config overrides that turn this variant off (the ``standard`` preset is their union)
    off: ClassVar[dict] = {}

    def section(self, model):
        """This variant's config section of ``model`` (defaults when absent)."""
        return self.config.of(model) if self.config is not None else None

    def enabled(self, model) -> bool:
        """Whether ``model`` uses this variant (only enabled variants are validated and applied);
        by default: whether it owns ``model``'s MoE layer."""
        return self.moe_layer is not None and moe_layer_owner(model.moe_variant) is self

    def validate(self, model, parallel) -> None:
        """Raise ``ValueError`` naming the flag when the variant cannot run with these settings."""

    def moe_layer_spec(self, spec, model):
        """The MoE layer's ``ModuleSpec`` with this variant's changes (called for every MoE layer)."""
        return spec

    def apply(self, gpt, model) -> None:
        """Change the built ``GPTModel`` in place (after every spec change, before it moves to GPU)."""

    def export_refusal(self, model, target: str) -> Optional[str]:
        """Why a model with this variant cannot be exported to ``target`` (e.g. a Hugging Face
        architecture), or None."""
        return None

    # -- inference-side applications (evaluate_lm, the server) ------------------------------------
    def add_runtime_arguments(self, parser) -> None:
        """Add this variant's options to an inference application's argparse parser."""

    def check_runtime(self, args, application: Application) -> None:
        """Refuse (``ValueError`` naming the flag) options ``application`` cannot run with."""

    def request_scheduler(self, args, manifest: dict, world_size: int):
        """A request scheduler (``assign(requests) -> rank per request``) for data-parallel
        inference from the application's parsed ``args``, or None. Raise ``ValueError`` on bad input."""
        return None

    def serving_model(self, args, manifest: dict, model, pg_collection) -> Optional[ServingModel]:
        """Change a model the server has built its engine on (``args``: the server's) and return
        the change (:class:`ServingModel`), or return None. Bad input is a ``UserError`` (this hook
        also changes the model: a ``ValueError`` from it is a bug and keeps its traceback)."""
        return None


# the name of every variant off: the project's own MoE layer, and the benchmark preset without variants
STANDARD = "standard"

_REGISTRY: dict[str, Variant] = {}
_DISCOVERED = False


def register(cls: type) -> type:
    """Class decorator: register a ``Variant`` subclass (one instance) under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}: a variant needs a name")
    existing = _REGISTRY.get(cls.name)
    if type(existing) is cls:
        return cls  # registered already (a plugin's entry point naming a decorated class)
    if existing is not None and type(existing).__qualname__ != cls.__qualname__:
        raise ValueError(f"variant {cls.name!r} is registered twice ({type(existing).__name__}, {cls.__name__})")
    if cls.moe_layer is not None:
        if cls.moe_layer == STANDARD:
            raise ValueError(f"{cls.__name__}.moe_layer: {STANDARD!r} is the project's own MoE layer")
        owner = next((v for v in _REGISTRY.values() if v.moe_layer == cls.moe_layer and v.name != cls.name), None)
        if owner is not None:
            raise ValueError(f"{cls.__name__}.moe_layer {cls.moe_layer!r} is already the {owner.name} variant's")
    if cls.config is not None:
        if not (dataclasses.is_dataclass(cls.config) and issubclass(cls.config, VariantConfig)):
            raise TypeError(f"{cls.__name__}.config must be a VariantConfig dataclass")
        if cls.config.SECTION != cls.name:
            raise ValueError(f"{cls.config.__name__}.SECTION must be {cls.name!r}")
    _REGISTRY[cls.name] = cls()
    return cls


def unregister(name: str) -> None:
    """Remove a variant (tests that register a temporary one)."""
    _REGISTRY.pop(name, None)


def _discover() -> None:
    """Import the built-in variants' ``variant`` modules (folder order), then load the plugins."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    try:
        import moe_variants

        for info in sorted(pkgutil.iter_modules(moe_variants.__path__), key=lambda i: i.name):
            if info.ispkg and importlib.util.find_spec(f"moe_variants.{info.name}.variant") is not None:
                importlib.import_module(f"moe_variants.{info.name}.variant")
        load_plugins(PLUGIN_GROUP, Variant, register)
    except BaseException:
        _DISCOVERED = False  # the next call reports the same error instead of a partial registry
        raise


def variants() -> list[Variant]:
    """Every registered variant: built-ins first (in folder order), then plugins (in entry-point name
    order), then the others as registered."""
    _discover()
    return list(_REGISTRY.values())


def get(name: str) -> Variant:
    _discover()
    if name not in _REGISTRY:
        raise ValueError(f"unknown variant {name!r} (known: {', '.join(_REGISTRY)})")
    return _REGISTRY[name]


def enabled(model) -> list[Variant]:
    """The variants ``model`` uses (``Variant.enabled``), in registry order."""
    return [v for v in variants() if v.enabled(model)]


def add_runtime_arguments(parser) -> None:
    """``Variant.add_runtime_arguments`` of every variant."""
    for v in variants():
        v.add_runtime_arguments(parser)


@user_input()
def check_runtime(args, application: Application) -> None:
    """``Variant.check_runtime`` of every variant (``UserError``)."""
    for v in variants():
        v.check_runtime(args, application)


def serving_model(args, manifest: dict, model, pg_collection) -> Optional[ServingModel]:
    """The one ``Variant.serving_model`` change for these arguments, or None; ``UserError`` when two
    variants would change the served model."""
    found = [(v.name, c) for v in variants() for c in [v.serving_model(args, manifest, model, pg_collection)]
             if c is not None]
    for name, change in found:
        if not isinstance(change, ServingModel):
            raise TypeError(f"variant {name}: serving_model returned a {type(change).__name__}, not a "
                            "registry.ServingModel (name, local_rows)")
    if len(found) > 1:
        raise UserError(f"two variants change the served model ({found[0][0]} and {found[1][0]}): choose one")
    return found[0][1] if found else None


@user_input()
def request_scheduler(args, manifest: dict, world_size: int):
    """The one ``Variant.request_scheduler`` for these arguments, or None (round-robin); ``UserError``
    on bad input, or when two variants would both schedule."""
    found = [(v.name, s) for v in variants() for s in [v.request_scheduler(args, manifest, world_size)] if s is not None]
    if len(found) > 1:
        raise UserError(f"two request schedulers asked for ({found[0][0]} and {found[1][0]}): choose one")
    return found[0][1] if found else None


def variant_names() -> list[str]:
    """Every name this registry gives a variant: the variants' and their presets' (``standard``,
    every variant off, is not one; the tools add theirs, ``tools.variants.variant_names``)."""
    names: list[str] = []
    for v in variants():
        for name in (v.name, *v.bench_presets):
            if name not in names:
                names.append(name)
    return names


def config_sections() -> dict[str, type]:
    """Section name -> config dataclass of every variant that has one."""
    return {v.name: v.config for v in variants() if v.config is not None}


def stored_defaults(values: dict) -> dict:
    """Every variant section's ``VariantConfig.stored_defaults`` for a stored config's flat
    ``values``: what a loader adds before building the configs from it."""
    out = {}
    for cls in config_sections().values():
        out.update(cls.stored_defaults(values))
    return out


def moe_layer_choices() -> list[str]:
    """Values of ``--moe-variant``: ``standard`` and each variant's MoE layer."""
    return [STANDARD] + [v.moe_layer for v in variants() if v.moe_layer is not None]


def moe_layer_owner(choice: str) -> Optional[Variant]:
    """The variant whose MoE layer ``--moe-variant choice`` selects, or None for ``standard``;
    ``ValueError`` for a value no variant registers."""
    if choice == STANDARD:
        return None
    owner = next((v for v in variants() if v.moe_layer is not None and v.moe_layer == choice), None)
    if owner is None:
        raise ValueError(f"--moe-variant {choice!r} is not one of: {', '.join(moe_layer_choices())}")
    return owner


def bench_presets() -> dict[str, dict]:
    """Benchmark preset name -> flat overrides: ``standard`` (every variant off) and each variant's."""
    out: dict[str, dict] = {STANDARD: {}}
    for v in variants():
        out[STANDARD].update(v.off)
        for name, overrides in v.bench_presets.items():
            if name in out:
                raise ValueError(f"benchmark preset {name!r} is defined twice")
            out[name] = dict(overrides)
    return out


@user_input()
def preset_overrides(name: str, extra: tuple = ()) -> dict[str, Any]:
    """Flat overrides of a ``+``-combined preset name (``bigmac+farskip``); ``extra`` lists names
    that are valid but handled by the caller (they add nothing). ``UserError`` names an unknown part."""
    presets = bench_presets()
    out: dict[str, Any] = {}
    for part in name.split("+"):
        if part in extra:
            continue
        if part not in presets:
            known = ", ".join([*presets, *extra])
            raise ValueError(f"--variants: unknown variant {part!r} (known: {known})")
        out.update(presets[part])
    return out
