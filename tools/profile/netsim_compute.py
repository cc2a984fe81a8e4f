"""Measure netsim's per-layer compute table on your GPU (the paper's Vidur-style single-GPU profiling).

    python -m tools.profile.netsim_compute --out runs/h100_measured.json           # full grid
    python -m tools.profile.netsim_compute --out runs/quick.json --quick           # coarser grid
    python -m netsim sweep --table runs/h100_measured.json --out runs/netsim_measured

Under tensor and expert parallelism every GPU of a group runs a shard of the same shape, so one GPU
is enough: for every layer kind (``netsim.model.LayerKind``) and every point of its grid (batch
sizes x parallel shapes x context lengths, ``netsim.compute.DEFAULT_GRID``) this script builds the
shard one GPU runs (DeepSeek-V3 shapes from ``netsim.model``), times it, and writes a
``netsim-compute-table/1`` JSON with ``provenance.method = "measured"``. FLOPs and bytes per point
come from ``netsim.model.kernel_work`` so the table can be projected to other GPUs
(``python -m netsim compute-table --project TABLE --gpu blackwell``).

How it measures, on CUDA: each op sequence is captured in a CUDA graph (decode serving runs under
CUDA graphs, so launch overhead is excluded, as in the paper) and replayed ``--replays`` times
between CUDA events after warm-up; the time is the mean replay. FP8 weight GEMMs use
``torch._scaled_mm`` (per-tensor scales, activations quantised inside the timed region) where the
GPU supports FP8, else BF16 (recorded in the provenance). MLA decode attention is the absorbed form
on a BF16 latent cache via ``scaled_dot_product_attention`` (a FlashMLA kernel would be faster; the
provenance names what ran). Grid points whose KV cache does not fit in memory are measured at the
largest request count that fits and scaled linearly in requests (counted in the provenance).

``--device cpu`` runs the same code on the CPU (wall-clock timing, no graphs, BF16 instead of FP8)
to check the script itself; such a table is marked ``cpu-smoke-test`` and is not meant for use.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from netsim.compute import (
    DEFAULT_GRID,
    ProfileTable,
    KindTable,
    default_table,
    generation_spec,
    kind_grid,
)
from netsim.model import DEEPSEEK_V3, KIND_AXES, LayerKind, ModelShape, kernel_work


class Bench:
    """Device, dtype choices and the timer."""

    def __init__(self, device: str, replays: int, warmup: int, use_graphs: bool):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.replays, self.warmup = replays, warmup
        self.use_graphs = use_graphs and self.cuda
        self.fp8 = self.cuda and hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn") and \
            torch.cuda.get_device_capability(self.device) >= (8, 9)  # fmt: skip
        self.attention_impl = "sdpa" if hasattr(F, "scaled_dot_product_attention") else "matmul"

    def time(self, fn) -> float:
        """Seconds per call of ``fn`` (no arguments; it allocates nothing it does not reuse)."""
        if not self.cuda:
            for _ in range(self.warmup):
                fn()
            ts = []
            for _ in range(self.replays):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(s)
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if self.use_graphs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            g.replay()
            torch.cuda.synchronize(self.device)
            start.record()
            for _ in range(self.replays):
                g.replay()
            end.record()
        else:
            start.record()
            for _ in range(self.replays):
                fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return start.elapsed_time(end) / 1e3 / self.replays


class Linear:
    """A weight GEMM ``[T, k] -> [T, n]``: FP8 (per-tensor scales) where supported, else BF16."""

    def __init__(self, bench: Bench, k: int, n: int, fp8: bool = True, dtype=torch.bfloat16):
        self.b = bench
        self.fp8 = fp8 and bench.fp8
        w = torch.randn(n, k, device=bench.device, dtype=torch.bfloat16) / math.sqrt(k)
        if self.fp8:
            self.w = w.to(torch.float8_e4m3fn)  # [n, k] row-major; passed transposed (column-major)
            self.scale_w = torch.ones((), device=bench.device, dtype=torch.float32)
            self.scale_x = torch.ones((), device=bench.device, dtype=torch.float32)
        else:
            self.w = w.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            pad = (-x.shape[0]) % 16  # _scaled_mm needs M % 16 == 0, as real FP8 kernels tile M
            xq = (F.pad(x, (0, 0, 0, pad)) if pad else x).to(torch.float8_e4m3fn)
            out = torch._scaled_mm(xq, self.w.t(), scale_a=self.scale_x, scale_b=self.scale_w, out_dtype=torch.bfloat16)
            return out[: x.shape[0]] if pad else out
        return x @ self.w.t()


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w


def _tokens(v: float) -> int:
    return max(1, int(round(v)))


# ------------------------------------------------------------------------------------- layer kinds
# Each builder returns a no-argument callable that runs the kind once on preallocated inputs.


def build_mla_proj(b: Bench, m: ModelShape, tokens: float, tp: float):
    t, heads = _tokens(tokens), int(m.num_heads // tp)
    h, qk = m.hidden, m.qk_nope_head_dim + m.qk_rope_head_dim
    x = torch.randn(t, h, device=b.device, dtype=torch.bfloat16)
    q_a, kv_a = Linear(b, h, m.q_lora_rank), Linear(b, h, m.kv_latent_dim)
    q_b, o = Linear(b, m.q_lora_rank, heads * qk), Linear(b, heads * m.v_head_dim, h)
    w_uk = torch.randn(heads, m.qk_nope_head_dim, m.kv_lora_rank, device=b.device, dtype=torch.bfloat16)
    w_uv = torch.randn(heads, m.kv_lora_rank, m.v_head_dim, device=b.device, dtype=torch.bfloat16)
    attn_out = torch.randn(heads, t, m.kv_lora_rank, device=b.device, dtype=torch.bfloat16)

    def run():
        q = q_b(q_a(x)).view(t, heads, qk)
        kv_a(x)
        torch.bmm(q[..., : m.qk_nope_head_dim].transpose(0, 1), w_uk)  # absorb W_UK into the query
        v = torch.bmm(attn_out, w_uv)  # absorb W_UV after attention
        o(v.transpose(0, 1).reshape(t, heads * m.v_head_dim))

    return run


def _cache_requests_that_fit(b: Bench, m: ModelShape, ctx: int, requests: int) -> int:
    per_req = ctx * m.kv_latent_dim * 2
    if b.cuda:
        free, _ = torch.cuda.mem_get_info(b.device)
        budget = 0.35 * free
    else:
        budget = 2e9
    return max(1, min(requests, int(budget // per_req)))


def build_mla_core(b: Bench, m: ModelShape, requests: float, ctx: float, q_len: float, tp: float):
    r_want, ctx, q, heads = _tokens(requests), int(ctx), int(q_len), int(m.num_heads // tp)
    r = _cache_requests_that_fit(b, m, ctx, r_want)
    lat = m.kv_latent_dim
    cache = torch.randn(r, 1, ctx, lat, device=b.device, dtype=torch.bfloat16)
    qry = torch.randn(r, heads, q, lat, device=b.device, dtype=torch.bfloat16)
    # chunk requests so the score matrix stays under ~1 GiB (the matmul fallback materialises it)
    chunk = max(1, min(r, int(2**30 // max(1, heads * q * ctx * 2))))
    scale = 1 / math.sqrt(m.qk_nope_head_dim + m.qk_rope_head_dim)

    def run():
        for s in range(0, r, chunk):
            k = cache[s : s + chunk]
            qq = qry[s : s + chunk]
            if b.attention_impl == "sdpa":
                F.scaled_dot_product_attention(qq, k.expand(-1, heads, -1, -1), k[..., : m.kv_lora_rank].expand(-1, heads, -1, -1),
                                               scale=scale)  # fmt: skip
            else:
                p = torch.softmax((qq @ k.transpose(-1, -2)).float() * scale, dim=-1).to(qq.dtype)
                p @ k[..., : m.kv_lora_rank]

    return run, r_want / r  # time scales linearly in requests when the cache had to be cut


def build_moe_experts(b: Bench, m: ModelShape, routed_tokens: float, experts: float):
    e = int(experts)
    rt = _tokens(routed_tokens)
    active = max(1, min(e, int(round(e * (1 - (1 - 1 / e) ** rt)))))
    per = [rt // active + (1 if i < rt % active else 0) for i in range(active)]
    h, inter = m.hidden, m.moe_ffn_hidden
    w1 = [Linear(b, h, 2 * inter) for _ in range(active)]
    w2 = [Linear(b, inter, h) for _ in range(active)]
    x = torch.randn(rt, h, device=b.device, dtype=torch.bfloat16)
    perm = torch.randperm(rt, device=b.device)
    out = torch.zeros(rt, h, device=b.device, dtype=torch.bfloat16)
    offs = np.concatenate([[0], np.cumsum(per)]).tolist()

    def run():
        xs = x.index_select(0, perm)  # permute tokens into expert order
        for i in range(active):
            if per[i] == 0:
                continue
            g, u = w1[i](xs[offs[i] : offs[i + 1]]).chunk(2, dim=-1)
            out[offs[i] : offs[i + 1]] = w2[i](F.silu(g) * u)
        x.index_add_(0, perm, out, alpha=0)  # unpermute (weighted sum at alpha 0 keeps x unchanged)

    return run


def build_ffn(b: Bench, m: ModelShape, tokens: float, inter: int):
    t = _tokens(tokens)
    x = torch.randn(t, m.hidden, device=b.device, dtype=torch.bfloat16)
    w1, w2 = Linear(b, m.hidden, 2 * inter), Linear(b, inter, m.hidden)

    def run():
        g, u = w1(x).chunk(2, dim=-1)
        w2(F.silu(g) * u)

    return run


def build_router(b: Bench, m: ModelShape, tokens: float):
    t = _tokens(tokens)
    x = torch.randn(t, m.hidden, device=b.device, dtype=torch.bfloat16)
    w = torch.randn(m.hidden, m.num_experts, device=b.device, dtype=torch.bfloat16)

    def run():
        torch.topk(torch.sigmoid((x @ w).float()), m.top_k, dim=-1)

    return run


def build_elementwise(b: Bench, m: ModelShape, tokens: float):
    t = _tokens(tokens)
    x = torch.randn(t, m.hidden, device=b.device, dtype=torch.bfloat16)
    y = torch.randn_like(x)
    w = torch.ones(m.hidden, device=b.device, dtype=torch.bfloat16)
    qdt = torch.float8_e4m3fn if b.fp8 else torch.bfloat16

    def run():
        a = _rms(x, w)  # input norm
        r = x + y  # residual after attention
        c = _rms(r, w)  # post-attention norm
        (r + a).to(qdt)  # residual after the MoE, activation quantisation
        c.to(qdt)

    return run


def build_lm_head(b: Bench, m: ModelShape, tokens: float, tp: float):
    t = _tokens(tokens)
    x = torch.randn(t, m.hidden, device=b.device, dtype=torch.bfloat16)
    w = torch.randn(int(m.vocab_size // tp), m.hidden, device=b.device, dtype=torch.bfloat16)

    def run():
        x @ w.t()

    return run


def build_latent_proj(b: Bench, m: ModelShape, tokens: float, latent: float):
    t = _tokens(tokens)
    x = torch.randn(t, m.hidden, device=b.device, dtype=torch.bfloat16)
    w = Linear(b, m.hidden, int(latent))

    def run():
        w(x)

    return run


def build(kind: LayerKind, b: Bench, m: ModelShape, **axes):
    """``(callable, time multiplier)`` for one grid point."""
    if kind == LayerKind.MLA_PROJ:
        return build_mla_proj(b, m, axes["tokens"], axes["tp"]), 1.0
    if kind == LayerKind.MLA_CORE:
        return build_mla_core(b, m, **axes)
    if kind == LayerKind.MOE_EXPERTS:
        return build_moe_experts(b, m, axes["routed_tokens"], axes["experts"]), 1.0
    if kind == LayerKind.SHARED_EXPERT:
        return build_ffn(b, m, axes["tokens"], m.num_shared_experts * m.moe_ffn_hidden), 1.0
    if kind == LayerKind.DENSE_FFN:
        return build_ffn(b, m, axes["tokens"], int(m.dense_ffn_hidden // axes["tp"])), 1.0
    if kind == LayerKind.ROUTER:
        return build_router(b, m, axes["tokens"]), 1.0
    if kind == LayerKind.ELEMENTWISE:
        return build_elementwise(b, m, axes["tokens"]), 1.0
    if kind == LayerKind.LM_HEAD:
        return build_lm_head(b, m, axes["tokens"], axes["tp"]), 1.0
    return build_latent_proj(b, m, axes["tokens"], axes["latent"]), 1.0


def _subgrid(grid: dict, quick: bool, max_points: int | None) -> dict:
    out = {}
    for k, v in grid.items():
        vals = list(v)
        if quick and len(vals) > 4:
            vals = vals[::2] if vals[-1] in vals[::2] else vals[::2] + [vals[-1]]
        if max_points:
            vals = vals[:max_points]
        out[k] = tuple(vals)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="profile_netsim_compute.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="table JSON to write")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (smoke test only)")
    p.add_argument("--gpu-spec", default="h100", choices=["h100", "blackwell", "rubin"],
                   help="datasheet numbers recorded for projecting this table (default h100)")  # fmt: skip
    p.add_argument("--kinds", help="comma-separated layer kinds to measure (default: all); the others are "
                   "copied from --base")  # fmt: skip
    p.add_argument("--base", help="table supplying kinds not measured (default: the shipped roofline estimate)")
    p.add_argument("--quick", action="store_true", help="every other grid point per axis")
    p.add_argument("--max-points", type=int, help="at most this many values per axis (smoke tests)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-graphs", action="store_true", help="time eager launches instead of CUDA graph replays")
    args = p.parse_args(argv)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu for a smoke test of this script)", file=sys.stderr)
        return 2
    bench = Bench(args.device, args.replays, args.warmup, not args.no_graphs)
    m = DEEPSEEK_V3
    kinds = [LayerKind(k.strip()) for k in args.kinds.split(",")] if args.kinds else list(LayerKind)
    grid = _subgrid(DEFAULT_GRID, args.quick, args.max_points)
    base = default_table()
    if args.base:
        from netsim.compute import load_table

        base = load_table(args.base)

    tables, extrapolated, t_start = {}, 0, time.perf_counter()
    for kind in kinds:
        axes = KIND_AXES[kind]
        g = kind_grid(kind, grid)
        shape = tuple(len(x) for x in g)
        secs = np.zeros(shape)
        for idx in np.ndindex(*shape):
            point = {a: float(g[i][j]) for i, (a, j) in enumerate(zip(axes, idx))}
            fn, mult = build(kind, bench, m, **point)
            secs[idx] = bench.time(fn) * mult
            extrapolated += mult != 1.0
            del fn
            if bench.cuda:
                torch.cuda.empty_cache()
        mesh = np.meshgrid(*g, indexing="ij")
        flops, nbytes, _, _ = kernel_work(kind, m, **dict(zip(axes, mesh)))
        tables[kind] = KindTable(axes, g, secs, np.broadcast_to(flops, shape).astype(float),
                                  np.broadcast_to(nbytes, shape).astype(float))  # fmt: skip
        print(f"{kind.value}: {secs.size} points, {secs.min() * 1e6:.1f} .. {secs.max() * 1e6:.1f} us "
              f"({time.perf_counter() - t_start:.0f}s)", flush=True)  # fmt: skip
    for kind in LayerKind:
        if kind not in tables:
            tables[kind] = base.kinds[kind]
    name = torch.cuda.get_device_name(bench.device) if bench.cuda else "CPU"
    spec = generation_spec(args.gpu_spec)
    if bench.cuda and args.gpu_spec == "h100" and "H100" not in name:
        print(f"warning: measured on {name!r} but recording H100 datasheet numbers for projection "
              "(pass --gpu-spec)", file=sys.stderr)  # fmt: skip
    prov = {
        "method": "measured" if bench.cuda else "cpu-smoke-test",
        "gpu": name,
        "note": ("measured with scripts/profile_netsim_compute.py" if bench.cuda else
                 "CPU smoke test of the profiling script: NOT a GPU measurement, do not use for projections"),
        "gpu_spec": spec.as_dict(),
        "kinds_measured": [k.value for k in kinds],
        "kinds_from_base": [k.value for k in LayerKind if k not in kinds],
        "base_table": base.provenance.get("method"),
        "fp8_gemms": bench.fp8,
        "attention_impl": bench.attention_impl,
        "cuda_graphs": bench.use_graphs,
        "replays": args.replays,
        "extrapolated_points": int(extrapolated),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["python", "scripts/profile_netsim_compute.py", *(argv if argv is not None else sys.argv[1:])],
        "wall_s": time.perf_counter() - t_start,
    }
    ProfileTable(prov, m, tables).save(args.out)
    print(f"wrote {args.out} ({prov['method']}, {name}, {sum(t.seconds.size for t in tables.values())} points)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
