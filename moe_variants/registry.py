"""The variant registry: each variant is one folder that registers itself; core code names none.

A variant is a :class:`Variant` subclass in ``moe_variants/<name>/variant.py``, registered there with
``@register``. It owns:

- its **config section**: a dataclass subclassing :class:`VariantConfig`, whose fields are flat
  Megatron-style flags (``bigmac_ratio`` is ``--bigmac-ratio`` and the YAML key ``bigmac_ratio``);
  typed values are parsed once, in the dataclass (e.g. FarSkip's layer selection); what a stored
  config written before a field existed meant (``VariantConfig.stored_defaults``);
- **validation** (``validate``: ``ValueError`` naming the flag; the hooks that check input,
  ``validate``, ``check_runtime``, ``request_scheduler``, ``check_serve_bench``, run under
  ``megatron.common.cli.user_input``, so their ``ValueError`` is the user's one-line ``UserError``);
- how it changes the **MoE layer's spec** (``moe_layer_spec``) or the **built model** (``apply``);
- what it **refuses** (``export_refusal``: e.g. no Hugging Face equivalent);
- its **benchmark presets** (``bench_presets``: name -> flat config overrides; ``off``: the overrides
  that turn it off, which together make the ``standard`` preset);
- hooks for the **inference-side applications** (evaluate_lm, the server): extra command-line
  options, a request scheduler (Sem-MoE's Algorithm 2) and a change to the served model
  (:class:`ServingModel`: Sem-MoE's Algorithm 3);
- hooks for the **benchmark tools**, so that they name no variant: run-time bench variants of the
  EP benchmark (``bench_runtimes``/``bench_runtime``: placement before DDP wraps the model, a
  per-step schedule), placed variants of the serving benchmark (``serve_placements``/
  ``serve_placement``: a checkpoint pass, the server's arguments), their options, and
  megatron-core's own equivalent of the variant's MoE layer (``upstream_moe_config``, the
  upstream peer's shape).

The builder, the config validation, the argument parser, the converters and the benchmark loop over
``variants()``. Built-in variants are the ``moe_variants`` subpackages with a ``variant`` module,
found and imported on first use (so a new variant is a new folder); code elsewhere (a plugin package,
a test) calls ``register`` itself. Torchtitan's model registry and OLMo-core's ``Config.build()``
are the models for this shape.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Protocol, runtime_checkable

from megatron.common.cli import UserError, user_input

if TYPE_CHECKING:
    import torch

__all__ = [
    "Variant",
    "VariantConfig",
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
    "BenchContext",
    "BenchRuntime",
    "ServePlacement",
    "runtime_names",
    "add_bench_arguments",
    "bench_options",
    "bench_runtimes",
    "serve_placement_names",
    "add_serve_bench_arguments",
    "check_serve_bench",
    "serve_placement",
    "serve_bench_record",
    "upstream_moe_configs",
    "variant_names",
]


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


@dataclasses.dataclass
class BenchContext:
    """What the EP benchmark's model worker hands a run-time bench variant (``Variant.bench_runtime``).

    ``configs``: the run's configs (``megatron.training``'s ``Configs``: ``model``, ``parallel``,
    ``training``, ...); ``tokenizer``; ``pg_collection``: the layout's process groups; ``options``:
    the worker spec's options (``Variant.bench_options`` put the variant's there);
    ``validation_split(num_samples)``: a dataset of at least that many samples of the run's
    validation split (the documents training never reads), built by the training data pipeline
    with the torch RNG state restored afterwards (the model's initialisation does not move).
    """

    configs: Any
    tokenizer: Any
    pg_collection: Any
    options: dict
    validation_split: Callable[[int], Any]


class BenchRuntime:
    """One run of a run-time bench variant in the EP benchmark's model worker: what it does beyond
    config overrides. The defaults change nothing. The worker records ``info`` in every rank's
    result under the variant's name and, when ``schedules``, the seconds each ``schedule`` took
    under ``<name>_schedule_s``."""

    schedules: ClassVar[bool] = False  # True: ``schedule`` re-orders the steps' data

    @property
    def info(self) -> dict:
        return {}

    def place(self, model) -> None:
        """Change the freshly built model (every rank, collectively) before DDP and the optimizer
        copy it, e.g. permute its experts."""

    def schedule(self, data_iterator, num_microbatches: int):
        """This rank's ``num_microbatches`` micro-batches of the next step (called before each
        step, outside its timing)."""
        return data_iterator


@dataclasses.dataclass(frozen=True)
class ServePlacement:
    """How the serving benchmark serves one placed variant: ``--load`` with its experts re-placed
    by a checkpoint pass, then served with ``server_arguments``.

    ``command(load, out)``: the arguments after ``python`` of the pass that writes the placed
    checkpoint of ``load`` to ``out``; ``key``: what the placement depends on besides ``load``
    (a placed checkpoint in the work directory with the same key is reused); ``request_scheduler``:
    the name of how its server assigns requests to ranks (recorded in the results);
    ``routing_stats_at_tp``: its server defines the local activation rate with tensor parallelism
    too (it re-batches every MoE layer's tokens), so routing statistics are asked for at TP > 1.
    """

    command: Callable[[str, str], list]
    key: dict
    server_arguments: tuple = ()
    request_scheduler: str = "round-robin"
    routing_stats_at_tp: bool = False


class Variant:
    """One architecture variant. Subclasses override what they change; the defaults change nothing."""

    name: ClassVar[str] = ""
    config: ClassVar[Optional[type]] = None  # a VariantConfig dataclass
    # the --moe-variant value that selects this variant's MoE layer class (None: it does not replace
    # it); a value has one owner (``moe_layer_owner``)
    moe_layer: ClassVar[Optional[str]] = None
    # benchmark presets: name -> flat config overrides (``+`` combines presets on the command line)
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

    # -- the benchmark tools (bench_ep, bench_serve) ----------------------------------------------
    # bench_ep variant names this variant sets up at run time (``bench_runtime``): they change no
    # config, so they combine with any preset through ``+`` (``semmoe+bigmac``)
    bench_runtimes: ClassVar[tuple] = ()
    # bench_serve variant names that serve ``--load`` with its experts re-placed (``serve_placement``);
    # they combine with nothing
    serve_placements: ClassVar[tuple] = ()

    def add_bench_arguments(self, group) -> None:
        """Add this variant's options to the EP benchmark's (bench_ep) argparse group."""

    def bench_options(self, args) -> dict:
        """Worker options (``WorkerSpec.options``) from bench_ep's parsed ``args`` for a run that
        uses one of ``bench_runtimes``."""
        return {}

    def bench_runtime(self, name: str, context: BenchContext) -> BenchRuntime:
        """The set-up of run-time bench variant ``name`` (one of ``bench_runtimes``) for one run of
        the model worker. ``ValueError`` on a layout or input it cannot run."""
        raise NotImplementedError(f"{type(self).__name__} declares bench_runtimes but no bench_runtime")

    def add_serve_bench_arguments(self, group) -> None:
        """Add this variant's options to the serving benchmark's (bench_serve) argparse group."""

    def check_serve_bench(self, args, variants: list, manifest: Optional[dict]) -> None:
        """Check bench_serve's parsed ``args`` before anything starts (``ValueError`` naming the
        flag): ``variants`` are the requested names, ``manifest`` the checkpoint manifest of
        ``--load`` (None without it); ``args.serve_ep`` is the servers' expert parallelism."""

    def serve_placement(self, name: str, args) -> ServePlacement:
        """How bench_serve serves placed variant ``name`` (one of ``serve_placements``) with its
        parsed ``args``; ``ValueError`` naming what is missing."""
        raise NotImplementedError(f"{type(self).__name__} declares serve_placements but no serve_placement")

    def serve_bench_record(self, args) -> dict:
        """This variant's entries in bench_serve's recorded configuration (its options' values)."""
        return {}

    def upstream_moe_config(self, model) -> Optional[dict]:
        """megatron-core's own ``TransformerConfig`` fields that build upstream's equivalent of this
        variant's MoE layer at ``model``'s shape (with this variant's section of ``model``), or None
        when megatron-core has none (the EP benchmark's upstream peers run it)."""
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
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    import moe_variants

    for info in sorted(pkgutil.iter_modules(moe_variants.__path__), key=lambda i: i.name):
        if info.ispkg and importlib.util.find_spec(f"moe_variants.{info.name}.variant") is not None:
            importlib.import_module(f"moe_variants.{info.name}.variant")


def variants() -> list[Variant]:
    """Every registered variant, built-ins first (in folder order), then the others as registered."""
    _discover()
    return list(_REGISTRY.values())


def get(name: str) -> Variant:
    _discover()
    if name not in _REGISTRY:
        raise ValueError(f"unknown variant {name!r} (known: {', '.join(_REGISTRY)})")
    return _REGISTRY[name]


def enabled(model) -> list[Variant]:
    """The variants ``model`` uses, in registry order."""
    return [v for v in variants() if v.enabled(model)]


def add_runtime_arguments(parser) -> None:
    """Every variant's options for an inference application (evaluate_lm, the server)."""
    for v in variants():
        v.add_runtime_arguments(parser)


@user_input()
def check_runtime(args, application: Application) -> None:
    """Every variant's refusals of its run-time options in ``application`` (``UserError``)."""
    for v in variants():
        v.check_runtime(args, application)


def serving_model(args, manifest: dict, model, pg_collection) -> Optional[ServingModel]:
    """The change a variant makes to a served model for these arguments, or None (at most one)."""
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
    """The request scheduler a variant offers for these arguments, or None (round-robin).
    ``UserError`` on bad input, or when two variants would both schedule."""
    found = [(v.name, s) for v in variants() for s in [v.request_scheduler(args, manifest, world_size)] if s is not None]
    if len(found) > 1:
        raise UserError(f"two request schedulers asked for ({found[0][0]} and {found[1][0]}): choose one")
    return found[0][1] if found else None


def variant_names() -> list[str]:
    """Every name the registry gives a variant: the variants', their benchmark presets', run-time
    bench variants' and placed serving variants' (``standard``, every variant off, is not one)."""
    names: list[str] = []
    for v in variants():
        for name in (v.name, *v.bench_presets, *v.bench_runtimes, *v.serve_placements):
            if name not in names:
                names.append(name)
    return names


def _owners(attribute: str) -> dict[str, Variant]:
    out: dict[str, Variant] = {}
    for v in variants():
        for name in getattr(v, attribute):
            if name in out:
                raise ValueError(f"{attribute} name {name!r} is declared twice ({out[name].name}, {v.name})")
            out[name] = v
    return out


def runtime_names() -> tuple[str, ...]:
    """The EP benchmark's run-time bench variants (every variant's ``bench_runtimes``)."""
    return tuple(_owners("bench_runtimes"))


def add_bench_arguments(group) -> None:
    """Every variant's options of the EP benchmark (bench_ep)."""
    for v in variants():
        v.add_bench_arguments(group)


def bench_options(args, variant: str) -> dict:
    """Worker options for bench_ep variant ``variant`` (``+``-combined): those of the variants that
    set up one of its parts at run time."""
    owners = _owners("bench_runtimes")
    out: dict = {}
    for owner in {id(owners[p]): owners[p] for p in variant.split("+") if p in owners}.values():
        out.update(owner.bench_options(args))
    return out


def bench_runtimes(variant: str, context: BenchContext) -> dict[str, BenchRuntime]:
    """Name -> set-up of each run-time part of bench_ep variant ``variant`` (``+``-combined), in
    the order named; the other parts are presets (``preset_overrides``)."""
    owners = _owners("bench_runtimes")
    return {p: owners[p].bench_runtime(p, context) for p in variant.split("+") if p in owners}


def serve_placement_names() -> tuple[str, ...]:
    """The serving benchmark's placed variants (every variant's ``serve_placements``)."""
    return tuple(_owners("serve_placements"))


def add_serve_bench_arguments(group) -> None:
    """Every variant's options of the serving benchmark (bench_serve)."""
    for v in variants():
        v.add_serve_bench_arguments(group)


@user_input()
def check_serve_bench(args, variants_: list, manifest: Optional[dict]) -> None:
    """Every variant's checks of bench_serve's arguments (``Variant.check_serve_bench``; ``UserError``)."""
    for v in variants():
        v.check_serve_bench(args, variants_, manifest)


@user_input()
def serve_placement(name: str, args) -> ServePlacement:
    """How bench_serve serves placed variant ``name``; ``UserError`` naming what is missing."""
    owners = _owners("serve_placements")
    if name not in owners:
        raise ValueError(f"{name!r} is not a placed variant (known: {', '.join(owners)})")
    return owners[name].serve_placement(name, args)


def serve_bench_record(args) -> dict:
    """The variants' entries in bench_serve's recorded configuration."""
    out: dict = {}
    for v in variants():
        out.update(v.serve_bench_record(args))
    return out


def upstream_moe_configs(model) -> dict[str, dict]:
    """Variant name -> megatron-core ``TransformerConfig`` fields of upstream's equivalent of its
    MoE layer at ``model``'s shape, for every variant that has one."""
    return {v.name: c for v in variants() for c in [v.upstream_moe_config(model)] if c is not None}


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
