"""The requests of every phase of a bench_serve run (the same for every variant): warm-up,
measured rates or prefill bursts, and the rate search's calibration probes."""

from __future__ import annotations

import dataclasses
import math

from . import workload
from .loadgen import load_prompt_pairs
from .options import DEFAULT_NUM_REQUESTS

__all__ = ["phase_requests_for"]


def phase_requests_for(args, tokenizer, context: int) -> dict:
    """The requests of every phase (identical for every variant)."""
    tokenize = tokenizer.tokenize
    info = {"context": context}
    engines = args.ranks // args.tensor_model_parallel_size  # data-parallel engines (TP peers share one)
    if args.mode == "prefill":
        per_step = math.ceil(args.prefill_tokens / args.input_len)
        num = engines * per_step * args.prefill_batches
        probe_num = engines * per_step
        total = num * args.prefill_repeats + probe_num * (args.probe_rounds + 1)
        reqs, info = base_requests(args, tokenize, context, total, output_len=1, info=info)
        chunks = iter([reqs[i:i + num] for i in range(0, num * args.prefill_repeats, num)])
        rest = reqs[num * args.prefill_repeats:]
        phases = {"warmup": workload.phase_requests(rest[:probe_num], [0.0] * probe_num)}
        for k in range(args.prefill_repeats):
            phases[f"prefill-{k}"] = workload.phase_requests(next(chunks), [0.0] * num)
        probes = [workload.phase_requests(rest[probe_num * (k + 1):probe_num * (k + 2)], [0.0] * probe_num)
                  for k in range(args.probe_rounds)]
        info.update(requests_per_step=per_step, measured_requests=num)
        return {"phases": phases, "probes": probes, "info": info}
    arrivals = {}
    for k, rate in enumerate(args.request_rates):
        num = None if args.duration is not None else (args.num_requests or DEFAULT_NUM_REQUESTS)
        arrivals[rate] = workload.arrivals_for(rate, args.seed + 1 + k, num=num, duration_s=args.duration)
    longest = max([len(a) for a in arrivals.values()] + [args.warmup_requests, engines * 4])
    reqs, info = base_requests(args, tokenize, context, longest, output_len=args.output_len, info=info)
    phases = {}
    if args.warmup_requests:
        warm = [dataclasses.replace(r, max_tokens=min(r.max_tokens, 8)) for r in reqs[:args.warmup_requests]]
        phases["warmup"] = workload.phase_requests(warm, [0.0] * len(warm))
    for rate, times in arrivals.items():
        phases[f"rate-{rate:g}"] = workload.phase_requests(reqs, times)
    probe = [dataclasses.replace(r, max_tokens=min(r.max_tokens, 32)) for r in reqs[:engines * 4]]
    probes = [workload.phase_requests(probe, [0.0] * len(probe)) for _ in range(args.probe_rounds)]
    info["output_tokens_mean"] = sum(r.max_tokens for r in reqs) / len(reqs)
    info["prompt_tokens_mean"] = sum(len(r.prompt) for r in reqs) / len(reqs)
    return {"phases": phases, "probes": probes, "info": info}


def base_requests(args, tokenize, context, num, *, output_len, info):
    from megatron.components.tokenizer import DEFAULT_CORPUS

    if args.prompts:
        reqs, stats = workload.from_prompts(load_prompt_pairs(args.prompts), tokenize, num=num, context=context,
                                            seed=args.seed, input_len=args.input_len, output_len=output_len,
                                            max_output_len=min(args.max_output_len, context - 1))
        info.update(source=args.prompts, **stats)
        return reqs, info
    with open(DEFAULT_CORPUS, encoding="utf-8") as f:
        text = f.read(200_000)
    out_len = output_len or min(args.max_output_len, context - args.input_len)
    reqs = workload.from_corpus(text, tokenize, num=num, input_len=args.input_len, output_len=out_len,
                                context=context, seed=args.seed)
    info.update(source="embedded corpus (tiny-shakespeare) windows")
    return reqs, info
