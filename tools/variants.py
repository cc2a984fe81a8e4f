"""The tools' side of a variant: what the benchmark harnesses (``tools/bench``, ``tools/serve_bench``)
need from it, registered by the tools so that the model library owns no benchmark flag.

A variant's model side is a ``moe_variants.registry.Variant`` (its config, presets, model changes,
serving hooks). What the benchmarks need beyond its presets is a :class:`VariantTools` subclass,
registered with ``@register`` under the name of the registered ``Variant`` it belongs to; its hooks
are documented on the class, once. The functions of this module run a hook over every variant's
tools; the EP benchmark, time to quality, the upstream peers and the serving benchmark call them and
name no variant. A variant with nothing beyond its presets registers none.

The variants' tools come from two places, found on first use:

- the built-ins: a ``variant_tools`` module in a variant's own tool folder (``tools/<variant>/``);
- plugins: installed packages that declare an entry point in the group ``moe_variants.tools``
  (``PLUGIN_GROUP``), naming a module that registers a ``VariantTools`` when imported, a
  ``VariantTools`` subclass, or a callable that registers one (``megatron.common.plugins``).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any, Callable, ClassVar, Optional

from megatron.common.cli import user_input
from megatron.common.plugins import load_plugins
from moe_variants import registry

__all__ = [
    "VariantTools",
    "BenchContext",
    "BenchRuntime",
    "ServePlacement",
    "PLUGIN_GROUP",
    "register",
    "unregister",
    "variant_tools",
    "variant_names",
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
]

# the entry-point group of variants' tools from installed packages
PLUGIN_GROUP = "moe_variants.tools"
_MODULE = "variant_tools"  # the module of a built-in variant's tools in its tool folder


@dataclasses.dataclass
class BenchContext:
    """What the EP benchmark's model worker hands a run-time bench variant (``VariantTools.bench_runtime``).

    ``configs``: the run's configs (``megatron.training``'s ``Configs``: ``model``, ``parallel``,
    ``training``, ...); ``tokenizer``; ``pg_collection``: the layout's process groups; ``options``:
    the worker spec's options (``VariantTools.bench_options`` put the variant's there);
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


class VariantTools:
    """One variant's hooks for the benchmark tools. Subclasses override what they offer; the
    defaults offer nothing. ``name`` is the registered ``Variant``'s."""

    name: ClassVar[str] = ""
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


_TOOLS: dict[str, VariantTools] = {}
_DISCOVERED = False


def register(cls: type) -> type:
    """Class decorator: register a ``VariantTools`` subclass (one instance) under ``cls.name``, the
    name of a registered ``Variant``."""
    if not (isinstance(cls, type) and issubclass(cls, VariantTools)):
        raise TypeError(f"{cls!r} is not a VariantTools subclass")
    registry.get(cls.name)  # ValueError naming the known variants
    existing = _TOOLS.get(cls.name)
    if type(existing) is cls:
        return cls  # registered already
    if existing is not None and type(existing).__qualname__ != cls.__qualname__:
        raise ValueError(f"the {cls.name} variant's tools are registered twice ({type(existing).__name__}, "
                         f"{cls.__name__})")
    _TOOLS[cls.name] = cls()
    return cls


def unregister(name: str) -> None:
    """Remove a variant's tools (tests that register temporary ones)."""
    _TOOLS.pop(name, None)


def _discover() -> None:
    """Import the ``variant_tools`` module of every tool folder that has one, then load the plugins."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    try:
        import tools

        for root in tools.__path__:
            for folder in sorted(os.listdir(root)):
                if os.path.isfile(os.path.join(root, folder, f"{_MODULE}.py")):
                    importlib.import_module(f"tools.{folder}.{_MODULE}")
        load_plugins(PLUGIN_GROUP, VariantTools, register)
    except BaseException:
        _DISCOVERED = False
        raise


def variant_tools() -> list[VariantTools]:
    """Every registered variant's tools, in the registry's order of the variants."""
    _discover()
    order = {v.name: i for i, v in enumerate(registry.variants())}
    return sorted(_TOOLS.values(), key=lambda t: order.get(t.name, len(order)))


def variant_names() -> list[str]:
    """Every name a variant has anywhere: the registry's (``registry.variant_names``: variants and
    presets) and the tools' run-time bench variants and placed serving variants."""
    names = registry.variant_names()
    for t in variant_tools():
        names += [n for n in (*t.bench_runtimes, *t.serve_placements) if n not in names]
    return names


def _owners(attribute: str) -> dict[str, VariantTools]:
    out: dict[str, VariantTools] = {}
    for t in variant_tools():
        for name in getattr(t, attribute):
            if name in out:
                raise ValueError(f"{attribute} name {name!r} is declared twice ({out[name].name}, {t.name})")
            out[name] = t
    return out


def runtime_names() -> tuple[str, ...]:
    """The EP benchmark's run-time bench variants (every variant's ``VariantTools.bench_runtimes``)."""
    return tuple(_owners("bench_runtimes"))


def add_bench_arguments(group) -> None:
    """``VariantTools.add_bench_arguments`` of every variant."""
    for t in variant_tools():
        t.add_bench_arguments(group)


def bench_options(args, variant: str) -> dict:
    """``VariantTools.bench_options`` of the variants that set up a part of bench_ep variant
    ``variant`` (``+``-combined) at run time."""
    owners = _owners("bench_runtimes")
    out: dict = {}
    for owner in {id(owners[p]): owners[p] for p in variant.split("+") if p in owners}.values():
        out.update(owner.bench_options(args))
    return out


def bench_runtimes(variant: str, context: BenchContext) -> dict[str, BenchRuntime]:
    """Name -> ``VariantTools.bench_runtime`` of each run-time part of bench_ep variant ``variant``
    (``+``-combined), in the order named; the other parts are presets (``registry.preset_overrides``)."""
    owners = _owners("bench_runtimes")
    return {p: owners[p].bench_runtime(p, context) for p in variant.split("+") if p in owners}


def serve_placement_names() -> tuple[str, ...]:
    """The serving benchmark's placed variants (every variant's ``VariantTools.serve_placements``)."""
    return tuple(_owners("serve_placements"))


def add_serve_bench_arguments(group) -> None:
    """``VariantTools.add_serve_bench_arguments`` of every variant."""
    for t in variant_tools():
        t.add_serve_bench_arguments(group)


@user_input()
def check_serve_bench(args, variants: list, manifest: Optional[dict]) -> None:
    """``VariantTools.check_serve_bench`` of every variant (``UserError``)."""
    for t in variant_tools():
        t.check_serve_bench(args, variants, manifest)


@user_input()
def serve_placement(name: str, args) -> ServePlacement:
    """``VariantTools.serve_placement`` of placed variant ``name``'s owner (``UserError``)."""
    owners = _owners("serve_placements")
    if name not in owners:
        raise ValueError(f"{name!r} is not a placed variant (known: {', '.join(owners)})")
    return owners[name].serve_placement(name, args)


def serve_bench_record(args) -> dict:
    """``VariantTools.serve_bench_record`` of every variant, merged."""
    out: dict = {}
    for t in variant_tools():
        out.update(t.serve_bench_record(args))
    return out


def upstream_moe_configs(model) -> dict[str, dict]:
    """Variant name -> ``VariantTools.upstream_moe_config`` of every variant that has one."""
    return {t.name: c for t in variant_tools() for c in [t.upstream_moe_config(model)] if c is not None}
