"""Side-by-side compute of the standard fine-grained MoE model and its BigMac twin (one process, EP=1).

Builds both models from a bench YAML (default ``examples/bench_bigmac_top8_cpu.yaml``), runs
forward + backward on the same tokens, interleaving the two models for ``--repeats`` rounds so
that host speed drifts hit both alike, and reports median forward / backward times, their ratio,
and a CPU profile of one step split into matrix products (mm/bmm/baddbmm) and everything else
(elementwise activations, permutations, ...), plus a per-op profile of the backward alone. No
communication happens at EP=1: this isolates the compute BigMac adds (its projections, and its
experts' r-times wider intermediate activations). ``--with-upstream-scaling`` adds a third model,
BigMac with megatron-core's expert probability scaling (on the F-wide activation instead of the
L-wide output; same weights' layout), timed in the same interleaved rounds.
Prints a table and writes JSON.

    python -m tools.bigmac.profile_layer --with-upstream-scaling --json runs/bigmac_compute.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

from tools import repo_root

_MATMUL = {"aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm", "aten::matmul"}


def _model_config(config_path: str, variant: str):
    from megatron.components.arguments import configs_from_dict, load_yaml

    values = load_yaml(config_path)
    # the profile of docs/design/bigmac.md runs the SequentialMLP loop's per-expert products
    values.update(expert_model_parallel_size=1, transformer_impl="local", moe_grouped_gemm=False)
    values["moe_variant"] = variant
    return configs_from_dict(values)


@contextlib.contextmanager
def _upstream_scaling():
    """Build BigMac's experts as megatron-core's plain ``SequentialMLP`` (the pre-fix formulation)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from moe_variants.bigmac import layer

    saved = layer.LatentSequentialMLP
    layer.LatentSequentialMLP = SequentialMLP
    try:
        yield
    finally:
        layer.LatentSequentialMLP = saved


def _self_ms(prof, skip=("autograd::",)) -> dict:
    """Self CPU ms per op name (profiler bookkeeping rows dropped)."""
    return {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()
            if e.self_cpu_time_total > 0 and not e.key.startswith(skip)}


def _measure(rank, world, config_path: str, repeats: int, seed: int, with_upstream: bool) -> dict:
    import torch
    from torch.profiler import profile

    from moe_variants.builder import build_model, causal_attention_mask
    from megatron.components.parallel import initialize_parallel

    torch.set_num_threads(1)
    models, shapes = {}, {}
    variants = ["standard", "bigmac"] + (["bigmac_upstream_scaling"] if with_upstream else [])
    for name in variants:
        c = _model_config(config_path, "standard" if name == "standard" else "bigmac")
        pgc = initialize_parallel(c.parallel, seed=seed)
        with _upstream_scaling() if name == "bigmac_upstream_scaling" else contextlib.nullcontext():
            models[name] = build_model(c.model, c.parallel, vocab_size=c.model.vocab_size or 1024, pg_collection=pgc)
        shapes[name] = (c.training.micro_batch_size, c.model.seq_length, c.model.vocab_size or 1024)
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
    bwd = {v: {} for v in models}  # backward alone, interleaved like the timings, mean per step
    for _ in range(repeats):
        for v, m in models.items():
            loss = m(x, pos, mask, labels=y).sum()
            with profile() as prof:
                loss.backward()
            for k, t in _self_ms(prof).items():
                bwd[v][k] = bwd[v].get(k, 0.0) + t / repeats
    out = {}
    for v, m in models.items():
        with profile() as prof:
            step(m)
        ops = _self_ms(prof)
        top = sorted(ops.items(), key=lambda kv: -kv[1])
        out[v] = {
            "fwd_ms": 1e3 * statistics.median(times[v]["fwd"]),
            "bwd_ms": 1e3 * statistics.median(times[v]["bwd"]),
            "profile_matmul_ms": sum(t for k, t in ops.items() if k in _MATMUL),
            "profile_other_ms": sum(t for k, t in ops.items() if k not in _MATMUL),
            "profile_top_ops_ms": dict(top[:8]),
            "backward_ops_ms": dict(sorted(bwd[v].items(), key=lambda kv: -kv[1])),
        }
    return out


def gemm_table(rows: int, hidden: int, ffn: int, latent: int, big_ffn: int, reps: int = 100) -> dict:
    """Single-thread GFLOP/s of one expert's six GEMMs (SwiGLU fc1 forward/dgrad/wgrad, fc2 likewise),
    fine-grained (hidden -> ffn -> hidden) and reversed (latent -> big_ffn -> latent), ``rows`` tokens,
    in the operand layouts megatron-core's linear layers use. Medians of 5 timings of ``reps`` calls."""
    import torch

    torch.set_num_threads(1)
    out = {}
    for name, i, f in (("standard", hidden, ffn), ("bigmac", latent, big_ffn)):
        x, a, g1, g2 = (torch.randn(rows, d) for d in (i, f, 2 * f, i))
        w1, w2 = torch.randn(2 * f, i), torch.randn(i, f)
        cases = {
            f"fc1 fwd [N,{i}]x[{i},{2 * f}]": lambda: x @ w1.t(),
            f"fc1 dgrad [N,{2 * f}]x[{2 * f},{i}]": lambda: g1 @ w1,
            f"fc1 wgrad [{2 * f},N]x[N,{i}]": lambda: g1.t() @ x,
            f"fc2 fwd [N,{f}]x[{f},{i}]": lambda: a @ w2.t(),
            f"fc2 dgrad [N,{i}]x[{i},{f}]": lambda: g2 @ w2,
            f"fc2 wgrad [{i},N]x[N,{f}]": lambda: g2.t() @ a,
        }
        flops = 2 * rows * i * f  # fc2's; fc1's are twice that (SwiGLU)
        for label, fn in cases.items():
            for _ in range(5):
                fn()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                ts.append((time.perf_counter() - t0) / reps)
            t = statistics.median(ts)
            out[f"{name} {label}"] = {"us": 1e6 * t, "gflops": (2 if "fc1" in label else 1) * flops / t / 1e9}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="profile_bigmac_layer.py", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(repo_root(), "examples", "bench_bigmac_top8_cpu.yaml"))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--with-upstream-scaling", action="store_true",
                    help="also time BigMac with megatron-core's probability scaling on the F-wide activation")
    ap.add_argument("--gemm-rows", type=int, default=0, metavar="N",
                    help="also time one expert's GEMMs at N rows (tokens per expert), both variants")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.config):
        ap.error(f"--config {args.config}: no such file")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    from tools.spawn import run_distributed

    res = run_distributed(_measure, 1, args.config, args.repeats, args.seed, args.with_upstream_scaling)[0]
    std, big = res["standard"], res["bigmac"]
    keys = ("fwd_ms", "bwd_ms", "profile_matmul_ms", "profile_other_ms")
    ratios = {k: big[k] / std[k] for k in keys}
    print(f"{'variant':<24}{'fwd ms':>9}{'bwd ms':>9}{'matmul ms':>11}{'other ms':>10}{'fwd x':>8}{'bwd x':>8}"
          f"   (one process, EP=1, medians of {args.repeats} interleaved steps; profile of one step; x = / standard)")
    for name, r in res.items():
        print(f"{name:<24}{r['fwd_ms']:>9.1f}{r['bwd_ms']:>9.1f}{r['profile_matmul_ms']:>11.1f}"
              f"{r['profile_other_ms']:>10.1f}{r['fwd_ms'] / std['fwd_ms']:>8.3f}{r['bwd_ms'] / std['bwd_ms']:>8.3f}")
    ops = sorted({k for r in res.values() for k in list(r["backward_ops_ms"])[:10]},
                 key=lambda k: -big["backward_ops_ms"].get(k, 0.0))
    print(f"\nbackward self ms per step by op (profiled, mean of {args.repeats}):")
    print(f"{'op':<28}" + "".join(f"{name:>24}" for name in res))
    for k in ops:
        print(f"{k[:27]:<28}" + "".join(f"{r['backward_ops_ms'].get(k, 0.0):>24.2f}" for r in res.values()))
    print(f"{'total':<28}" + "".join(f"{sum(r['backward_ops_ms'].values()):>24.2f}" for r in res.values()))
    gemms = None
    if args.gemm_rows > 0:
        from megatron.components.arguments import configs_from_dict, load_yaml
        from moe_variants.bigmac.config import BigMacConfig

        values = load_yaml(args.config)
        m = configs_from_dict({**values, "moe_variant": "bigmac"}).model
        bigmac = BigMacConfig.of(m)
        gemms = gemm_table(args.gemm_rows, m.hidden_size, m.moe_ffn_hidden_size, bigmac.latent_size(m.hidden_size),
                           bigmac.expert_ffn(m))
        print(f"\none expert's GEMMs at N = {args.gemm_rows} rows (single thread):")
        for k, r in gemms.items():
            print(f"  {k:<40}{r['us']:>9.1f} us{r['gflops']:>8.1f} GFLOP/s")
        for name in ("standard", "bigmac"):
            print(f"  {name} sum {sum(r['us'] for k, r in gemms.items() if k.startswith(name)):.1f} us")
    if args.json:
        from megatron.common.files import write_json

        write_json(args.json, {"command": sys.argv, "config": args.config, "repeats": args.repeats,
                                      "results": res, "ratios_bigmac_over_standard": ratios,
                                      "gemms": gemms})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
