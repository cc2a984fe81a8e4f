"""Where each all-to-all of a served prefill step finds its window (megatron-core's engine, in process).

    python -m tools.profile.overlap_windows --load CKPT [--variant farskip] [--ranks 2] \
        [--prompt-len 256] [--prompts-per-rank 2] [--repeats 3] [--json out.json]

Loads CKPT on ``--ranks`` gloo ranks over loopback (EP = ranks), builds the server's engine
(megatron.inference.engine) and runs full prefill steps of ``--prompts-per-rank`` prompts of
``--prompt-len`` random tokens on every rank, recording every expert all-to-all (launch to
completion), every wait of the compute thread for one, and FarSkip's forward phases (the
project's comm timeline, as ``bench_ep --trace``). For each collective of the step it prints the
*window*: the compute the thread ran between the launch and the wait; and, per collective
kind and layer, the median over ``--repeats`` steps. On loopback the collectives themselves take
almost nothing; the windows are what a shaped link's all-to-all can hide behind (paper Eq. 9):
compare them with the all-to-all time per collective that bench_serve measures on the link.
"""

import argparse
import os
import statistics
import sys


def _rank(rank, world, ckpt, variant, prompt_len, per_rank, repeats, seed):
    import torch

    from megatron.inference.engine import EngineConfig, RankEngine, build_engine
    from megatron.inference.observability import AllToAllCounters
    from megatron.inference.sampling import RequestSampling
    from megatron.inference.options import variant_load_overrides
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants.common.comm import TimelineRecorder
    from moe_variants.config import ParallelConfig
    from tools.bench.overlap import collectives, events_from_timeline

    parallel = ParallelConfig(expert_model_parallel_size=world)
    pgc = initialize_parallel(parallel, seed=seed)
    model, configs, tokenizer, _ = load_model(ckpt, parallel=parallel, overrides=variant_load_overrides(variant),
                                              pg_collection=pgc)
    cfg = EngineConfig(max_batch_tokens=prompt_len * per_rank, max_requests=per_rank + 1, kv_cache_gb=0.05)
    engine = RankEngine(*build_engine(model, configs, tokenizer, pgc, cfg), model)
    counters = AllToAllCounters(model)  # reads (on a GPU: resolves into the timeline) and resets them each step
    engine.subscribe(counters)
    gen = torch.Generator().manual_seed(seed + rank)
    ids = iter(range(10**9))
    steps = []
    for r in range(repeats + 1):  # the first step warms up
        for _ in range(per_rank):
            prompt = torch.randint(1, tokenizer.vocab_size, (prompt_len,), generator=gen).tolist()
            engine.add(next(ids), prompt, max_tokens=1, sampling=RequestSampling(), termination_id=-1)
        timeline = TimelineRecorder()
        for layer in counters.layers:
            layer.timeline = timeline
        engine.step()
        for layer in counters.layers:
            layer.timeline = None
        while engine.local_work():
            engine.step()
        if r:
            steps.append(collectives(events_from_timeline(timeline)))
    return steps


def main(argv=None) -> int:
    from tools.spawn import run_distributed
    from megatron.common.cli import UserError, positive_int, run_cli
    from megatron.common.files import write_json

    def body():
        p = argparse.ArgumentParser(prog="serve_overlap_windows.py", description=__doc__.split("\n\n")[0])
        p.add_argument("--load", required=True, metavar="CKPT")
        p.add_argument("--variant", default=None, help="a connectivity-only bench preset applied on load")
        p.add_argument("--ranks", type=positive_int, default=2)
        p.add_argument("--prompt-len", type=positive_int, default=256)
        p.add_argument("--prompts-per-rank", type=positive_int, default=2)
        p.add_argument("--repeats", type=positive_int, default=3)
        p.add_argument("--seed", type=int, default=1234)
        p.add_argument("--json", metavar="PATH")
        args = p.parse_args(argv)
        if not os.path.isdir(args.load):
            raise UserError(f"--load {args.load}: no such directory")
        steps = run_distributed(_rank, args.ranks, os.path.abspath(args.load), args.variant, args.prompt_len,
                                args.prompts_per_rank, args.repeats, args.seed, timeout_s=1800)[0]
        by_name: dict = {}
        for step in steps:
            seen: dict = {}
            for c in step:  # in launch order: the k-th collective of a name is MoE layer k's
                seen[c["name"]] = seen.get(c["name"], 0) + 1
                by_name.setdefault(f"{c['name']} (MoE layer {seen[c['name']]})", []).append(c)
        rows = []
        print(f"{'collective':28} {'window ms':>10} {'in flight ms':>13} {'exposed ms':>11}   (rank 0, median of "
              f"{args.repeats} prefill steps of {args.prompts_per_rank} x {args.prompt_len} tokens)")
        for name, cs in sorted(by_name.items(), key=lambda kv: (int(kv[0].split()[-1][:-1]), kv[0])):
            row = {"name": name, **{k: statistics.median(c[k] for c in cs)
                                    for k in ("window_ms", "in_flight_ms", "exposed_ms")}}
            rows.append(row)
            print(f"{name:28} {row['window_ms']:10.2f} {row['in_flight_ms']:13.2f} {row['exposed_ms']:11.2f}")
        total = {k: sum(r[k] for r in rows) for k in ("window_ms", "in_flight_ms", "exposed_ms")}
        print(f"{'all':28} {total['window_ms']:10.2f} {total['in_flight_ms']:13.2f} {total['exposed_ms']:11.2f}")
        if args.json:
            write_json(args.json, {"command": ["scripts/serve_overlap_windows.py", *(argv or sys.argv[1:])],
                                   "collectives": rows, "steps": steps})
        return 0

    return run_cli("serve_overlap_windows.py", body)


if __name__ == "__main__":
    sys.exit(main())
