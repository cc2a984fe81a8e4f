"""How fast this machine is, over time: the same small workloads timed at fixed intervals.

    python -m tools.profile.speed_probe --minutes 30 --every 10 --out runs/speed_probe.json

A compute profile (``serving_compute``) is only as stable as the machine under it. This probe
separates the two: every ``--every`` seconds it times three fixed workloads on one thread, each
the median of ``--reps`` repetitions, and reads the CPU time the hypervisor took from this VM
(``steal`` in ``/proc/stat``) over the interval:

* ``gemm_s``: fp32 matrix products (256 x 256, 64 of them): the experts' and attention's arithmetic;
* ``copy_s``: a 64 MiB tensor copy, 8 times: memory bandwidth;
* ``python_s``: a pure-Python loop of 200,000 iterations: the serving loop's interpreter work.

If the workloads move by more than a profile may, a profile cannot be stable here whatever its
method, and one taken in a slow stretch describes the stretch. The JSON keeps every sample and,
per workload, the median, the range and the spread ((max - min) / median); the table prints the same.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

SCHEMA = "speed-probe/1"
WORKLOADS = ("gemm_s", "copy_s", "python_s")


def cpu_ticks() -> "tuple[int, int] | None":
    """(steal, total) jiffies of all CPUs from /proc/stat, or None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def _workloads(reps: int) -> dict:
    import torch

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    src = torch.empty(16 * 2**20)  # 64 MiB of fp32
    dst = torch.empty_like(src)

    def gemm():
        for _ in range(64):
            torch.mm(a, b)

    def copy():
        for _ in range(8):
            dst.copy_(src)

    def python():
        total = 0
        for i in range(200_000):
            total += i & 7
        return total

    out = {}
    for name, fn in (("gemm_s", gemm), ("copy_s", copy), ("python_s", python)):
        fn()  # warm
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def summarize(samples: list) -> dict:
    """Per workload (and the steal fraction): median, min, max and spread over the samples."""
    out = {}
    for key in (*WORKLOADS, "steal_fraction"):
        values = [s[key] for s in samples if s.get(key) is not None]
        if values:
            med = statistics.median(values)
            out[key] = {"median": med, "min": min(values), "max": max(values), "n": len(values),
                        "spread": (max(values) - min(values)) / med if med else None}
    return out


def probe(minutes: float, every_s: float, reps: int, threads: int, report=print) -> dict:
    import torch

    torch.set_num_threads(threads)
    samples, start = [], time.monotonic()
    ticks = cpu_ticks()
    while True:
        t = time.monotonic() - start
        row = {"t_s": round(t, 3), **_workloads(reps)}
        now = cpu_ticks()
        if ticks and now and now[1] > ticks[1]:
            row["steal_fraction"] = (now[0] - ticks[0]) / (now[1] - ticks[1])
        ticks = now
        samples.append(row)
        report(f"{t:7.0f} s  gemm {row['gemm_s'] * 1e3:7.2f} ms  copy {row['copy_s'] * 1e3:7.2f} ms  "
               f"python {row['python_s'] * 1e3:7.2f} ms  steal {row.get('steal_fraction', float('nan')):.1%}")
        if time.monotonic() - start + every_s > minutes * 60:
            break
        time.sleep(max(0.0, every_s - (time.monotonic() - start - t)))
    return {"schema": SCHEMA, "minutes": minutes, "every_s": every_s, "reps": reps, "threads": threads,
            "samples": samples, "summary": summarize(samples)}


def main(argv=None) -> int:
    from megatron.common.cli import positive_float, positive_int, run_cli
    from megatron.common.files import write_json

    p = argparse.ArgumentParser(prog="python -m tools.profile.speed_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=positive_float, default=30.0, help="how long to probe (default 30)")
    p.add_argument("--every", type=positive_float, default=10.0, metavar="S", help="seconds between samples")
    p.add_argument("--reps", type=positive_int, default=5, help="repetitions per workload per sample (median)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1, as the profiles)")
    p.add_argument("--out", required=True, help="JSON to write")

    def body():
        args = p.parse_args(argv)
        result = probe(args.minutes, args.every, args.reps, args.threads)
        print(f"{'workload':<15} {'median':>10} {'min':>10} {'max':>10} {'spread':>8}")
        for key, s in result["summary"].items():
            scale, unit = (100, "%") if key == "steal_fraction" else (1e3, "ms")
            spread = "-" if s["spread"] is None else f"{s['spread']:.1%}"  # none around a median of 0
            print(f"{key:<15} " + " ".join(f"{s[k] * scale:>8.2f}{unit:>2}" for k in ("median", "min", "max"))
                  + f" {spread:>8}")
        write_json(args.out, result)
        print(f"wrote {args.out}")
        return 0

    return run_cli("python -m tools.profile.speed_probe", body)


if __name__ == "__main__":
    sys.exit(main())
