"""Side-by-side compute of the standard fine-grained MoE model and its BigMac twin (one process, EP=1).

Builds both models from a bench YAML (default ``examples/bench_bigmac_top8_cpu.yaml``), runs
forward + backward on the same tokens, interleaving the two models for ``--repeats`` rounds so
that host speed drifts hit both alike, and reports median forward / backward times, their ratio,
and a CPU profile of one step split into matrix products (mm/bmm/baddbmm) and everything else
(elementwise activations, permutations, ...). No communication happens at EP=1: this isolates the
compute BigMac adds (its projections, and its experts' r-times wider intermediate activations).
Prints a table and writes JSON.

    python scripts/profile_bigmac_layer.py --json runs/bigmac_compute.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_MATMUL = {"aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm", "aten::matmul"}


def _model_config(config_path: str, variant: str):
    from megatron.training.arguments import configs_from_dict, load_yaml

    values = load_yaml(config_path)
    values.update(expert_model_parallel_size=1, transformer_impl="local")
    values["moe_variant"] = variant
    return configs_from_dict(values)


def _measure(rank, world, config_path: str, repeats: int, seed: int) -> dict:
    import torch
    from torch.profiler import profile

    from megatron.training.model_builder import build_model, causal_attention_mask
    from megatron.training.parallel import initialize_parallel

    torch.set_num_threads(1)
    models, shapes = {}, {}
    for variant in ("standard", "bigmac"):
        c = _model_config(config_path, variant)
        pgc = initialize_parallel(c.parallel, seed=seed)
        models[variant] = build_model(c.model, c.parallel, vocab_size=c.model.vocab_size or 1024, pg_collection=pgc)
        shapes[variant] = (c.training.micro_batch_size, c.model.seq_length, c.model.vocab_size or 1024)
    batch, seq, vocab = shapes["standard"]
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    pos = torch.arange(seq)[None].expand_as(x)
    mask = causal_attention_mask(seq)

    def step(model):
        t0 = time.perf_counter()
        loss = model(x, pos, mask, labels=y).sum()
        t1 = time.perf_counter()
        loss.backward()
        return t1 - t0, time.perf_counter() - t1

    times = {v: {"fwd": [], "bwd": []} for v in models}
    for _ in range(2):  # warm-up
        for m in models.values():
            step(m)
    for _ in range(repeats):
        for v, m in models.items():
            f, b = step(m)
            times[v]["fwd"].append(f)
            times[v]["bwd"].append(b)
    out = {}
    for v, m in models.items():
        with profile() as prof:
            step(m)
        matmul = other = 0.0
        top = []
        for e in prof.key_averages():
            if e.key.startswith("autograd::") or e.self_cpu_time_total <= 0:
                continue
            if e.key in _MATMUL:
                matmul += e.self_cpu_time_total
            else:
                other += e.self_cpu_time_total
            top.append((e.self_cpu_time_total, e.key))
        top.sort(reverse=True)
        out[v] = {
            "fwd_ms": 1e3 * statistics.median(times[v]["fwd"]),
            "bwd_ms": 1e3 * statistics.median(times[v]["bwd"]),
            "profile_matmul_ms": matmul / 1e3,
            "profile_other_ms": other / 1e3,
            "profile_top_ops_ms": {k: t / 1e3 for t, k in top[:8]},
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "examples", "bench_bigmac_top8_cpu.yaml"))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.config):
        ap.error(f"--config {args.config}: no such file")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    from megatron.training.testing import run_distributed

    res = run_distributed(_measure, 1, args.config, args.repeats, args.seed)[0]
    std, big = res["standard"], res["bigmac"]
    ratios = {k: big[k] / std[k] for k in ("fwd_ms", "bwd_ms", "profile_matmul_ms", "profile_other_ms")}
    print(f"{'variant':<10}{'fwd ms':>10}{'bwd ms':>10}{'matmul ms':>12}{'other ms':>10}   (one process, EP=1, "
          f"medians of {args.repeats} interleaved steps; profile of one step)")
    for name, r in (("standard", std), ("bigmac", big)):
        print(f"{name:<10}{r['fwd_ms']:>10.1f}{r['bwd_ms']:>10.1f}{r['profile_matmul_ms']:>12.1f}{r['profile_other_ms']:>10.1f}")
    print(f"{'ratio':<10}{ratios['fwd_ms']:>10.3f}{ratios['bwd_ms']:>10.3f}{ratios['profile_matmul_ms']:>12.3f}"
          f"{ratios['profile_other_ms']:>10.3f}")
    for name, r in (("standard", std), ("bigmac", big)):
        print(f"{name} top ops (self ms): " + ", ".join(f"{k} {v:.1f}" for k, v in r["profile_top_ops_ms"].items()))
    if args.json:
        from megatron.training.bench.schema import write_json_atomic

        write_json_atomic(args.json, {"command": sys.argv, "config": args.config, "repeats": args.repeats,
                                      "results": res, "ratios_bigmac_over_standard": ratios})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
