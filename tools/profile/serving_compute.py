"""Profile the compute of served engine steps, per variant, for ``python -m netsim predict``.

    python -m tools.profile.serving_compute --bench-serve serve.json --out runs/serve_profile.json
    python -m netsim validate --bench-serve serve.json --profile runs/serve_profile.json \\
        --link-table runs/link_table/*.csv

For every variant of a ``bench_serve.py`` run (its checkpoints, rank count and engine sizes, read
from the run's JSON) this starts the same number of ranks on loopback (gloo, unshaped: the
all-to-alls cost little and their waits are subtracted), builds the server's engine
(``megatron.inference.engine``) and times engine steps of known shape, all ranks in lockstep:

* prefill steps of 8 to ``max_batch_tokens`` tokens (prompts of up to 64 tokens, ``max_tokens`` 1);
* decode steps of 1 to ``max_requests`` running requests (16-token prompts);
* the dummy forward of an idle rank;
* the real serving loop's overhead per iteration outside the forwards (``iteration_s``).

A step's compute is its wall time minus the time the rank waited on all-to-alls (the dispatchers'
counters, ``megatron.inference.observability.AllToAllCounters``), the slowest rank's per step.

The ranks are launched ``--launches`` times per variant, the variants alternating; each launch
times every shape once per round, in a shuffled order, for ``--repeats`` rounds after a warm-up
round, and times a small reference workload at each round's start and end (``reference_s``: how
fast the machine was then) and reads the VM's steal time over the round. A launch's own speed moves
all of its steps alike, so a profile averages launches as well as rounds; a round whose reference
ran over ``--disturbed`` times the usual is dropped (``serving_fit.undisturbed``).
``tools.profile.serving_fit`` fits each shape's median by least squares as
``fixed + per_token x tokens + per_request x requests`` with the tokens the engine
forwards (padded to a multiple of 64; a decode-only step to ``max_requests``: ``netsim.replay``). The all-to-all bytes a rank
sends off-rank per token it holds, the all-to-alls per step and the LAR of the profiled (random)
tokens come from the same counters. Where the compute lies around a step's collectives comes from
the records the server's ``--a2a-spans`` writes (``observability.SpanRecorder``, kept in memory
here). A tensor-parallel run (TP = EP = the ranks: one engine) is profiled in its layout; its TP
collectives (the records' ``"tp"``: ``megatron.compat.tp_collectives``) are counted per step
(all-reduces and their bytes per token, logit all-gathers and their bytes per request) and their
loopback time is not compute. Each cost gets a 95% interval from a bootstrap over launches and
rounds; a profile whose fixed, per-token or idle cost, or smallest or largest fitted step, is known
only to more than ``--precision`` (default +-5%) is refused: nothing is written to ``--out``, the
measurements go to ``<out>.rejected.json``. Writes ``serving-compute-profile/1`` JSON with every
sample, the per-shape medians, the fit's relative errors and the intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SCHEMA = "serving-compute-profile/1"


def _points(max_batch_tokens: int, max_requests: int, context: int) -> list:
    prefill = [n for n in (8, 16, 32, 64, 128, 256, 512, 1024, 2048) if n <= max_batch_tokens]
    decode = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_requests]
    out = []
    for n in prefill:
        length = min(64, n, context - 2)
        out.append(("prefill", [length] * (n // length) + ([n % length] if n % length else [])))
    for b in decode:
        out.append(("decode", [16] * b))
    return out


def _profile_rank(rank, world, ckpt, preset, engine_sizes, repeats, seed, tp=1):
    import numpy as np
    import torch
    import torch.distributed as dist

    from megatron.inference.engine import EngineConfig, RankEngine, build_engine
    from megatron.inference.observability import AllToAllCounters, SpanRecorder
    from megatron.inference.sampling import RequestSampling
    from megatron.inference.options import variant_load_overrides
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from megatron.common import collectives
    from moe_variants.config import ParallelConfig
    from tools.profile.speed_probe import cpu_ticks

    parallel = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=world)  # TP = 1 or TP = EP
    pgc = initialize_parallel(parallel, seed=seed)
    model, configs, tokenizer, _ = load_model(ckpt, parallel=parallel, overrides=variant_load_overrides(preset),
                                              pg_collection=pgc)
    cfg = EngineConfig(max_batch_tokens=engine_sizes["max_batch_tokens"],
                       max_requests=engine_sizes["max_requests"], kv_cache_gb=engine_sizes["kv_cache_gb"], seed=seed)
    engine, controller, context = build_engine(model, configs, tokenizer, pgc, cfg)
    eng = RankEngine(engine, controller, context, model, ep_rank=dist.get_rank(pgc.ep) if tp == 1 else None,
                     ep_size=dist.get_world_size(pgc.ep), routing_stats=tp == 1)  # TP peers route the same tokens
    counters = AllToAllCounters(model)
    records: list = []  # each step's collectives, as ``serve --a2a-spans`` writes them
    recorder = SpanRecorder(counters, records.append, tp_group=pgc.tp if tp > 1 else None)
    eng.subscribe(counters)
    eng.subscribe(recorder)
    rng = np.random.default_rng(seed + dist.get_rank(pgc.dp))  # TP peers hold the same requests
    vocab = tokenizer.vocab_size
    ids = iter(range(10**9))

    def add(length, max_tokens):
        prompt = [int(t) for t in rng.integers(0, vocab, size=length) if t != tokenizer.eod] or [1]
        eng.add(next(ids), prompt, max_tokens=max_tokens, sampling=RequestSampling(), termination_id=-1)

    def timed(kind):
        tokens, requests = eng.tokens_forwarded, context.get_active_request_count() + len(engine.waiting_request_ids)
        recorded = len(records)
        t0 = time.perf_counter()
        eng.step() if kind != "dummy" else eng.dummy_step()
        wall = time.perf_counter() - t0
        # the step's TP collectives: blocking on loopback, not compute
        tp_ops = [call for record in records[recorded:] for call in record.get("tp", [])]
        exposed = counters.last["a2a_exposed_s"]
        row = torch.tensor([wall - exposed - sum(e - s for _, _, s, e in tp_ops)], dtype=torch.float64)
        collectives.all_reduce(row, op=dist.ReduceOp.MAX)  # the step lasts as long as the slowest rank's compute
        return {"kind": kind, "tokens": eng.tokens_forwarded - tokens, "requests": requests,
                "compute_s": float(row[0]), "a2a_bytes": counters.last["a2a_bytes"],  # this rank's
                **{f"tp_{op}_{what}": sum(b if what == "bytes" else 1 for o, b, _, _ in tp_ops if o == op)
                   for op in ("all_reduce", "all_gather") for what in ("bytes", "calls")}}

    def drain():
        while eng.local_work():
            eng.step()

    rows = []
    points = _points(cfg.max_batch_tokens, cfg.max_requests, context.max_sequence_length)
    for round_ in range(repeats + 1):  # the first round warms up
        speed = torch.tensor(reference_s(), dtype=torch.float64)
        collectives.all_reduce(speed, op=dist.ReduceOp.MAX)  # the slowest rank sets a step's pace
        ticks = cpu_ticks()
        order = np.random.default_rng(seed + round_).permutation(len(points))  # the same on every rank
        round_rows = []
        for kind, lengths in (points[i] for i in order):
            if kind == "prefill":
                for n in lengths:
                    add(n, 1)
                round_rows.append(timed("prefill"))
            else:
                for n in lengths:
                    add(n, 6)
                eng.step()  # their prefill
                for _ in range(4):
                    round_rows.append(timed("decode"))
            drain()
        round_rows.extend(timed("dummy") for _ in range(3))
        after = torch.tensor(reference_s(), dtype=torch.float64)  # and again at the round's end
        collectives.all_reduce(after, op=dist.ReduceOp.MAX)
        now = cpu_ticks()
        steal = (now[0] - ticks[0]) / (now[1] - ticks[1]) if ticks and now and now[1] > ticks[1] else None
        for row in round_rows:
            row.update(round=round_, ref_python_s=float(speed[0]), ref_gemm_s=float(speed[1]),
                       ref_python_end_s=float(after[0]), ref_gemm_end_s=float(after[1]), steal_fraction=steal)
        rows.append(round_rows)
    calls, steps = counters.totals["a2a_calls"], eng.steps + eng.dummy_steps
    eng.unsubscribe(recorder)
    recorder.close()
    layouts = _compute_layout(records, cfg.max_requests)
    stats = eng.stats()
    return {"rows": [r for rr in rows[1:] for r in rr], "calls_per_step": calls / max(1, steps),
            "local": stats["local_activations"], "routed": stats["routed_activations"],
            "layout_decode": layouts.get("decode"), "layout_prefill": layouts.get("prefill"),
            "iteration_s": _iteration_overhead(eng, pgc, world, cfg.max_requests, vocab, tokenizer.eod, seed)}


def reference_s(reps: int = 5) -> tuple:
    """This rank's speed now: the median seconds of a small Python loop (the engine's bookkeeping)
    and of small fp32 GEMMs (the experts' and attention's arithmetic), ``reps`` times each."""
    import torch

    a, b = torch.randn(128, 128), torch.randn(128, 128)

    def python():
        total = 0
        for i in range(20_000):
            total += i & 7
        return total

    def gemm():
        for _ in range(16):
            torch.mm(a, b)

    out = []
    for fn in (python, gemm):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return tuple(out)


def _tp_collectives(rows: list, engine) -> dict:
    """A TP engine's collectives per step, from the profiled prefill steps (``_profile_rank``'s rows):
    the all-reduces per step and each one's bytes per token the engine forwards (padded), the
    all-gathers (the logits) per step and each one's input bytes per request in the step."""
    prefill = [r for r in rows if r["kind"] == "prefill" and r["tokens"]]
    reduces = statistics.median(r["tp_all_reduce_calls"] for r in prefill)
    gathers = statistics.median(r["tp_all_gather_calls"] for r in prefill)
    return {"tp_allreduces": round(reduces), "tp_gathers": round(gathers),
            "tp_allreduce_bytes_per_token": sum(r["tp_all_reduce_bytes"] for r in prefill)
            / max(1, sum(r["tp_all_reduce_calls"] * engine.padded(r["tokens"], decode_only=False) for r in prefill)),
            "tp_gather_bytes_per_request": sum(r["tp_all_gather_bytes"] for r in prefill)
            / max(1, sum(r["tp_all_gather_calls"] * r["requests"] for r in prefill))}


def _compute_layout(records: list, max_requests: int) -> dict:
    """Where a forward's compute lies around its calls, over this rank's profiled steps
    (``observability.SpanRecorder`` records), per kind of step (``decode``: at most ``max_requests``
    tokens, else ``prefill``): the layout ``netsim.replay.StepProfile`` reads, the median share of
    the compute before each collective (all-to-alls and a TP engine's all-reduces and gathers, in
    start order) and after the last, over the steps with the most common number of calls,
    normalised to sum to one."""
    shares = {"decode": {}, "prefill": {}}
    for step in records:
        if not step.get("tokens") or not step["spans"]:
            continue
        calls = sorted([(s, e) for _, s, e in step["spans"]] + [(c[2], c[3]) for c in step.get("tp", [])])
        gaps = [max(0.0, g) for g in [calls[0][0] - step["t"]] + [b[0] - a[1] for a, b in zip(calls, calls[1:])]
                + [step["end"] - calls[-1][1]]]
        if sum(gaps) > 0:
            kind = "decode" if step["tokens"] <= max_requests else "prefill"
            shares[kind].setdefault(len(calls), []).append([g / sum(gaps) for g in gaps])
    layouts = {}
    for kind, by_count in shares.items():
        if by_count:
            medians = [statistics.median(col) for col in zip(*max(by_count.values(), key=len))]
            layouts[kind] = [m / sum(medians) for m in medians]
    return layouts


def _mean_layout(layouts) -> "list | None":
    """The ranks' layouts averaged position by position (None unless every rank has one of one length)."""
    layouts = list(layouts)
    if not layouts or any(x is None or len(x) != len(layouts[0]) for x in layouts):
        return None
    return [sum(col) / len(col) for col in zip(*layouts)]


class _BurstFrontend:
    """Rank 0's side of ``megatron.inference.loop.serve_loop`` without HTTP: hands the loop a burst
    of requests at its first iteration and asks it to stop once all have finished."""

    def __init__(self, submits: list):
        self.submits, self.left = list(submits), len(submits)

    def take_commands(self, wait_s: float):
        from megatron.inference.frontend import Commands

        submits, self.submits = self.submits, []
        return Commands(submits=submits, stop=self.left == 0)

    def assigned(self, placed: dict) -> None:
        pass

    def publish(self, updates: list, stats: list) -> None:
        self.left -= sum(1 for u in updates if u.finished)


def _iteration_overhead(eng, pgc, world, max_requests, vocab, eod, seed, output_tokens: int = 48) -> float:
    """Median seconds per serving-loop iteration outside the engine's forwards: the real
    ``serve_loop`` (its header exchange, command broadcast, token-update gather, request adds,
    engine stats and bookkeeping) runs a burst of ``world x max_requests / 2`` requests to the
    end, on loopback; an iteration's wall time minus its ``step``/``dummy_step`` calls; the slowest
    rank's median. What it leaves out: the HTTP thread and the client's CPU."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from megatron.inference.frontend import Submit
    from megatron.inference.loop import serve_loop
    from megatron.inference.sampling import RequestSampling
    from megatron.common import collectives

    rng = np.random.default_rng(seed + 7)
    submits = [Submit(10**8 + i, [int(t) if t != eod else 1 for t in rng.integers(0, vocab, 16)],
                      output_tokens, RequestSampling(), ignore_eos=True)
               for i in range(max(1, world * max_requests // 2))]
    frontend = _BurstFrontend(submits) if dist.get_rank() == 0 else None
    inside, marks = [0.0], []
    step, dummy = eng.step, eng.dummy_step

    def timed(fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                inside[0] += time.perf_counter() - t0
        return call

    eng.step, eng.dummy_step = timed(step), timed(dummy)
    try:
        serve_loop(eng, pgc, frontend=frontend, idle_wait_s=0.0,
                   on_iteration=lambda busy: marks.append((time.perf_counter(), inside[0], busy)))
    finally:
        eng.step, eng.dummy_step = step, dummy
    gaps = [(t1 - t0) - (in1 - in0) for (t0, in0, _), (t1, in1, busy) in zip(marks, marks[1:]) if busy]
    row = torch.tensor([statistics.median(gaps) if gaps else 0.0], dtype=torch.float64)
    collectives.all_reduce(row, op=dist.ReduceOp.MAX)
    return float(row[0])


def _report(v: str, entry: dict) -> None:
    print(f"{v}: fixed {entry['fixed_s'] * 1e3:.2f} ms + {entry['per_token_s'] * 1e6:.1f} us/token + "
          f"{entry['per_request_s'] * 1e6:.1f} us/request; dummy {entry['dummy_s'] * 1e3:.2f} ms; "
          f"{entry['a2a_bytes_per_token']:.0f} B/token off-rank in {entry['a2a_calls']} all-to-alls; "
          f"fit error mean {entry['fit_mean_abs_rel_error']:.1%}; {entry['disturbed_rounds']} of {entry['rounds']} "
          f"rounds disturbed ({entry['wall_s']:.0f}s)", flush=True)
    print("  95% intervals (bootstrap over launches and rounds): " + ", ".join(
        f"{k} +-{c['half_width']:.1%}" for k, c in entry["precision"]["costs"].items()
        if c["half_width"] is not None), flush=True)


def main(argv=None) -> int:
    from megatron.common.cli import UserError, positive_float, positive_int, run_cli
    from megatron.common.files import write_json

    p = argparse.ArgumentParser(prog="profile_serving_compute.py", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--bench-serve", metavar="JSON", help="a bench_serve.py run's JSON (variants, checkpoints, "
                        "ranks, engine sizes)")
    source.add_argument("--refit", metavar="PROFILE", help="fit a profile (or a .rejected.json) again from its "
                        "samples, with this --precision and --disturbed")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--variants", default=None, help="comma-separated subset of the run's variants")
    p.add_argument("--repeats", type=positive_int, default=5, help="measured rounds per launch (each times every "
                   "shape once, in a shuffled order; default 5)")
    p.add_argument("--launches", type=positive_int, default=4, help="launches of the ranks per variant, the "
                   "variants alternating (default 4): the machine's speed during a launch moves all of "
                   "its steps alike, so a profile averages launches")
    p.add_argument("--precision", type=positive_float, default=0.05, metavar="F",
                   help="refuse a profile whose fixed, per-token or idle cost, or smallest or largest fitted step, "
                   "has a 95%% interval (bootstrap over launches and rounds) wider than +-F of itself (default 0.05)")
    p.add_argument("--disturbed", type=positive_float, default=1.25, metavar="X",
                   help="drop a round whose reference workload ran more than X times slower than the profile's "
                   "25th percentile (the machine was busy with something else; default 1.25)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads per rank (default: the run's)")

    def finish(args, out: dict) -> int:
        """Refuse an imprecise profile (kept aside in ``<out>.rejected.json``), else write it."""
        from tools.profile.serving_fit import imprecise

        wide = [(v, k, w) for v, e in out["variants"].items() for k, w in imprecise(e["precision"], args.precision)]
        if wide:
            rejected = os.path.splitext(args.out)[0] + ".rejected.json"
            write_json(rejected, out)
            v, k, w = max(wide, key=lambda x: x[2])
            raise UserError(f"{v}'s {k} is known only to +-{w:.1%} (95%, {out['launches']} launches of "
                            f"{out['repeats']} rounds), wider than --precision {args.precision:.0%}: profile on a "
                            f"quiet machine or with more --launches (--out not written; the measurements are in "
                            f"{rejected})")
        write_json(args.out, out)
        print(f"wrote {args.out}")
        return 0

    def fit_samples(v: str, rows: list, engine, disturbed: float) -> dict:
        from tools.profile.serving_fit import fitted

        try:
            return fitted(rows, engine, disturbed)
        except ValueError as err:  # too few undisturbed rounds
            raise UserError(f"{v}: {err}: the machine was busy with something else; profile when it is quiet "
                            "or raise --disturbed") from None

    def refit(args) -> int:
        from netsim.replay import Engine
        try:
            with open(args.refit) as f:
                out = json.load(f)
            if out.get("schema") != SCHEMA or any("samples" not in e for e in out["variants"].values()):
                raise ValueError("not a profile with its samples")
            sizes = out["engine"]
            engine = Engine(int(out["ranks"]), int(sizes["max_batch_tokens"]), int(sizes["max_requests"]) // 4 * 4)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"--refit {args.refit}: cannot be fitted again ({err})") from None
        out.update(precision_limit=args.precision, disturbed_limit=args.disturbed)
        for v, entry in out["variants"].items():
            entry.update(fit_samples(v, entry["samples"], engine, args.disturbed))
            _report(v, entry)
        return finish(args, out)

    def body():
        args = p.parse_args(argv)
        if args.disturbed < 1:
            raise UserError(f"--disturbed {args.disturbed}: a factor of the usual speed, at least 1")
        if args.refit:
            return refit(args)
        try:
            with open(args.bench_serve) as f:
                run = json.load(f)
            cfg = run["config"]
            variants, checkpoints, ranks = cfg["variants"], cfg["checkpoints"], int(cfg["ranks"])
            sizes = cfg["server"]
            tp = int(cfg.get("tensor_model_parallel_size") or 1)
            ep = int(cfg.get("expert_model_parallel_size") or ranks // tp)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"--bench-serve {args.bench_serve}: not a readable bench_serve.py JSON ({err})") from None
        if args.variants:
            wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
            unknown = [v for v in wanted if v not in variants]
            if unknown:
                raise UserError(f"--variants {','.join(unknown)}: not in the run (it has {', '.join(variants)})")
            variants = wanted
        for v in variants:
            if not os.path.isdir(checkpoints[v]):
                raise UserError(f"{v}'s checkpoint {checkpoints[v]} is gone (run bench_serve.py with --work-dir "
                                "to keep it)")
        if ep != ranks or tp not in (1, ranks) or cfg.get("expert_comm", "alltoall") != "alltoall":
            raise UserError(f"--bench-serve {args.bench_serve}: TP {tp} x EP {ep} on {ranks} ranks "
                            f"({cfg.get('expert_comm', 'alltoall')}); the profile covers EP = the ranks with "
                            "all-to-all experts, at TP = 1 or TP = EP")
        if args.repeats * args.launches < 2:
            raise UserError(f"--repeats {args.repeats} --launches {args.launches}: a profile's precision needs "
                            "at least 2 rounds")
        if os.path.isdir(args.out):
            raise UserError(f"--out {args.out}: is a directory")
        from megatron import compat
        from tools.spawn import run_distributed
        from netsim.replay import Engine
        compat.quiet_warnings()
        engine = Engine(ranks, int(sizes["max_batch_tokens"]), int(sizes["max_requests"]) // 4 * 4)
        load = cfg.get("model", {}).get("load")  # one checkpoint, variants as load presets (not placed copies)
        threads = args.threads or int(cfg.get("threads", 1))
        out = {"schema": SCHEMA, "bench_serve": os.path.abspath(args.bench_serve), "ranks": ranks, "tp": tp,
               "threads": threads, "engine": sizes, "repeats": args.repeats, "launches": args.launches,
               "precision_limit": args.precision, "disturbed_limit": args.disturbed, "variants": {}}
        launched: dict = {v: [] for v in variants}
        walls = dict.fromkeys(variants, 0.0)
        for launch in range(args.launches):  # variants alternate, so that a slow stretch meets each
            for v in variants:
                t0 = time.monotonic()
                preset = v if load and os.path.abspath(checkpoints[v]) == os.path.abspath(load) else None
                per_rank = run_distributed(_profile_rank, ranks, checkpoints[v], preset, sizes, args.repeats,
                                           1234 + launch, tp, timeout_s=1800, num_threads=threads)
                for row in per_rank[0]["rows"]:
                    row["launch"] = launch
                launched[v].append(per_rank)
                walls[v] += time.monotonic() - t0
                print(f"{v}: launch {launch + 1}/{args.launches} ({time.monotonic() - t0:.0f}s)", flush=True)
        for v in variants:
            launches = launched[v]
            rows = [row for per_rank in launches for row in per_rank[0]["rows"]]
            ranks_ = [r for per_rank in launches for r in per_rank]
            prefill = [r for r in rows if r["kind"] == "prefill" and r["tokens"]]
            entry = fit_samples(v, rows, engine, args.disturbed)
            entry.update(
                a2a_bytes_per_token=sum(r["a2a_bytes"] for r in prefill)
                / sum(engine.padded(r["tokens"], decode_only=False) for r in prefill),
                a2a_calls=round(statistics.median(per_rank[0]["calls_per_step"] for per_rank in launches)),
                lar=sum(r["local"] for r in ranks_) / sum(r["routed"] for r in ranks_)
                if sum(r["routed"] for r in ranks_) else None,  # not counted at TP > 1
                iteration_s=statistics.median(per_rank[0]["iteration_s"] for per_rank in launches),
                layout_decode=_mean_layout(r["layout_decode"] for r in ranks_),
                layout_prefill=_mean_layout(r["layout_prefill"] for r in ranks_),
                checkpoint=checkpoints[v], wall_s=walls[v], tp=tp, samples=rows,
                **(_tp_collectives(rows, engine) if tp > 1 else {}),
            )
            out["variants"][v] = entry
            _report(v, entry)
        return finish(args, out)

    return run_cli("profile_serving_compute.py", body)


if __name__ == "__main__":
    sys.exit(main())
