"""Scale check for the Sem-MoE solver at DeepSeek-V3 table sizes.

Generates a synthetic skewed profile (61 MoE layers, 256 experts, top-8, 129,280-token vocabulary,
Zipf token popularity; 4,000 requests of 64-192 tokens by default), writes it to a temporary
directory, then runs ``python -m tools.semmoe solve --ep 64`` in a child process and reports
the child's wall time and peak resident memory (ru_maxrss, which includes loading the profile).
Prints a table and writes JSON.

    python -m tools.semmoe.scale_check --out runs/semmoe_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from megatron.common.files import atomic_write
from moe_variants.semmoe.profile import save_profile
from moe_variants.semmoe.synthetic import SyntheticConfig, synthetic_profile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="semmoe_scale_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--ep", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=192)
    ap.add_argument("--topics", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit-s", type=float, default=300.0, help="time budget the check is judged against")
    ap.add_argument("--out", default="semmoe_scale_check.json", help="JSON results path")
    args = ap.parse_args(argv)

    cfg = SyntheticConfig(
        num_requests=args.requests,
        min_len=args.min_len,
        max_len=args.max_len,
        vocab_size=args.vocab,
        num_layers=args.layers,
        num_experts=args.experts,
        top_k=args.top_k,
        num_topics=args.topics,
        hidden_size=7168,
    )
    t0 = time.perf_counter()
    profile = synthetic_profile(cfg, seed=args.seed)
    gen_s = time.perf_counter() - t0
    nnz = sum(c.nnz for c in profile.counts)
    num_tokens = profile.num_tokens
    with tempfile.TemporaryDirectory(prefix="semmoe-scale-") as tmp:
        prof_path = os.path.join(tmp, "profile.npz")
        save_profile(profile, prof_path)
        prof_bytes = os.path.getsize(prof_path)
        del profile
        cmd = [
            sys.executable, "-m", "tools.semmoe", "solve", "--profile", prof_path, "--ep", str(args.ep),
            "--method", "semmoe", "--seed", str(args.seed), "--out", os.path.join(tmp, "tables"),
        ]  # fmt: skip
        t1 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        solve_s = time.perf_counter() - t1
        if proc.returncode:
            sys.stderr.write(proc.stdout + proc.stderr)
            return proc.returncode
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        tables_bytes = sum(
            os.path.getsize(os.path.join(tmp, "tables", f)) for f in os.listdir(os.path.join(tmp, "tables"))
        )
    result = {
        "layers": args.layers,
        "experts": args.experts,
        "top_k": args.top_k,
        "vocab": args.vocab,
        "ep": args.ep,
        "requests": args.requests,
        "tokens": num_tokens,
        "count_nnz": int(nnz),
        "profile_mb": prof_bytes / 2**20,
        "tables_mb": tables_bytes / 2**20,
        "generate_s": gen_s,
        "solve_wall_s": solve_s,
        "solve_peak_rss_mb": peak_mb,
        "limit_s": args.limit_s,
        "within_limit": solve_s <= args.limit_s,
        "cpu_count": os.cpu_count(),
        "solver_log_tail": proc.stdout.strip().splitlines()[-3:],
    }
    print(f"{'quantity':<22}{'value':>14}")
    for k in ("count_nnz", "profile_mb", "tables_mb", "generate_s", "solve_wall_s", "solve_peak_rss_mb"):
        v = result[k]
        print(f"{k:<22}{v:>14.1f}" if isinstance(v, float) else f"{k:<22}{v:>14}")
    print(f"solve within {args.limit_s:.0f}s: {result['within_limit']}")
    atomic_write(args.out, lambda f: json.dump(result, f, indent=2), mode="w")
    return 0


if __name__ == "__main__":
    sys.exit(main())
