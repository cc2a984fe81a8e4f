"""Sem-MoE's side in the benchmark tools (the variant itself: ``moe_variants/semmoe/variant.py``).

bench_ep's run-time variant ``semmoe`` places a freshly built model's experts by a profile of
validation samples and schedules every step's samples by Algorithm 2 (``tools/semmoe/bench.py``);
bench_serve's placed variants ``eplb``, ``affinity-eplb`` and ``semmoe`` serve ``--load`` placed by
``--semmoe-tables DIR/<name>`` (``semmoe`` also schedules requests by Algorithm 2; with TP > 1 all
run Algorithm 3's layout, the two EPLB baselines on contiguous slices).
"""

from __future__ import annotations

import os

from megatron.common.cli import positive_int
from tools.variants import ServePlacement, VariantTools, register

# bench_serve's placed variants: tables of ``python -m tools.semmoe solve --method <name>``
_PLACED = ("eplb", "affinity-eplb", "semmoe")
_REQUEST_SCHEDULER = "semmoe-algorithm-2"  # scheduling.RequestScheduler.name


@register
class SemMoETools(VariantTools):
    name = "semmoe"
    bench_runtimes = ("semmoe",)
    serve_placements = _PLACED

    def add_bench_arguments(self, group) -> None:
        from tools.semmoe.bench import DEFAULT_PROFILE_SAMPLES

        group.add_argument("--semmoe-profile-samples", type=positive_int, default=DEFAULT_PROFILE_SAMPLES,
                           help="variant semmoe: validation-split samples to profile the fresh model's routing on "
                                "before placing its experts")

    def bench_options(self, args) -> dict:
        return {"semmoe_profile_samples": args.semmoe_profile_samples}

    def bench_runtime(self, name: str, context):
        from tools.semmoe.bench import from_context

        return from_context(context)

    def add_serve_bench_arguments(self, group) -> None:
        group.add_argument("--semmoe-tables", metavar="DIR",
                           help="with --load: DIR/<variant> holds the tables (tools.semmoe solve --method <variant> "
                                "--ep RANKS) of the placed variants eplb, affinity-eplb and semmoe (placed checkpoints; "
                                "semmoe also schedules requests by Algorithm 2)")

    def check_serve_bench(self, args, variants: list, manifest) -> None:
        """``--semmoe-tables DIR``: DIR/<variant> are tables for --load's experts at D = --ranks, and
        Algorithm 3 (TP > 1) needs TP = EP."""
        tables_dir = getattr(args, "semmoe_tables", None)
        if tables_dir is None:
            return
        tp = args.tensor_model_parallel_size
        if tp > 1 and tp != args.serve_ep:
            raise ValueError(f"--semmoe-tables with --tensor-model-parallel-size {tp}: Sem-MoE's Algorithm 3 needs "
                             f"TP = EP (got EP {args.serve_ep})")
        from moe_variants.semmoe.placement import moe_shape
        from moe_variants.semmoe.tables import load_tables

        if manifest is None:
            raise ValueError("--semmoe-tables places the experts of --load CKPT: give --load")
        if not os.path.isdir(tables_dir):
            raise ValueError(f"--semmoe-tables {tables_dir}: no such directory")
        placed = [v for v in variants if v in _PLACED]
        if not placed:
            raise ValueError(f"--semmoe-tables: --variants names neither {' nor '.join(_PLACED)}")
        layers, experts = moe_shape(manifest, args.load)
        for v in placed:
            path = os.path.join(tables_dir, v)
            if not os.path.isdir(path):
                raise ValueError(f"--semmoe-tables {tables_dir}: no {v}/ tables directory in it "
                                 f"(python -m tools.semmoe solve --method {v} --ep {args.ranks} --out {path})")
            try:
                tables = load_tables(path)
            except ValueError as err:
                raise ValueError(f"--semmoe-tables {path}: {str(err).splitlines()[0]}") from None
            if (tables.num_layers, tables.num_experts, tables.num_devices) != (layers, experts, args.ranks):
                raise ValueError(f"--semmoe-tables {path}: tables for {tables.num_layers} MoE layers x "
                                 f"{tables.num_experts} experts on {tables.num_devices} devices; --load has "
                                 f"{layers} x {experts} and --ranks is {args.ranks}")
            if v == "semmoe" and not tables.has_schedule:
                raise ValueError(f"--semmoe-tables {path}: tables of method {tables.method!r} carry no token table "
                                 "(solve with --method semmoe)")

    def serve_placement(self, name: str, args) -> ServePlacement:
        """``--load`` placed by ``DIR/<name>`` (``python -m tools.semmoe apply``); ``semmoe``'s
        server also schedules requests (and with TP > 1 re-batches tokens) by its tables."""
        tables_dir = getattr(args, "semmoe_tables", None)
        if tables_dir is None:
            raise ValueError(f"--variants {name}: give --load CKPT and --semmoe-tables DIR (DIR/{name} holds the "
                             "placement's tables)")
        tables = os.path.abspath(os.path.join(tables_dir, name))
        schedules = name == "semmoe"
        # with TP > 1 the placed baseline is served in Algorithm 3's layout too, on contiguous slices
        # (the sequence-parallel split): the comparison isolates the token scheduling
        attention_tp = getattr(args, "tensor_model_parallel_size", 1) > 1
        return ServePlacement(
            command=lambda load, out: ["-m", "moe_variants.semmoe", "apply", "--load", load, "--tables", tables,
                                       "--out", out],
            key={"tables": tables},
            server_arguments=("--semmoe-tables", tables) if schedules or attention_tp else (),
            request_scheduler=_REQUEST_SCHEDULER if schedules else "round-robin",
            routing_stats_at_tp=schedules or attention_tp,
        )

    def serve_bench_record(self, args) -> dict:
        tables_dir = getattr(args, "semmoe_tables", None)
        return {"semmoe_tables": os.path.abspath(tables_dir) if tables_dir else None}
