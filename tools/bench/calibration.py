"""Calibration (``--collectives``): time gloo collectives over the shaped link, write a CSV.

Worker (``python -m tools.bench.calibration SPEC.json``, one process per rank): for
each op and message size it runs ``warmup`` untimed calls, then ``repeats`` timed ones, each
preceded by a barrier so all ranks start together; messages under 1 MiB get more repeats (see
:func:`repeats_for`) because their times are short and scheduler noise on a busy CPU is large.
Every rank records when it entered and left each call on ``CLOCK_MONOTONIC``, which all
processes of the machine share (network namespaces do not change it).

Driver (:func:`run_calibration`): one launch per rank count on a fresh network with the same
link. A call's time runs from the last rank's entry to the last rank's exit, so the skew with
which ranks leave the barrier is not booked as communication; a row's ``seconds`` is the median
of that over repeats.

CSV columns ``op,ranks,bytes,seconds``:

* ``op``       ``all_to_all`` (``all_to_all_single``, equal splits) or ``all_reduce`` (sum, fp32).
* ``ranks``    number of ranks (one per namespace).
* ``bytes``    what *each rank contributes*: the size of its input tensor. For ``all_to_all``
               a rank sends ``bytes x (ranks-1)/ranks`` off-rank and keeps ``bytes/ranks``; for
               ``all_reduce`` every rank holds ``bytes`` (gloo's ring moves about
               ``2 x bytes x (ranks-1)/ranks`` through each rank's link each way).
* ``seconds``  median over repeats of (last exit - last entry) for one call.

A sidecar JSON next to the CSV records the exact command, link, date, repeats, machine load and
every repeat's time (min/median/max), so the fit can be reproduced and judged.
"""

from __future__ import annotations

import csv
import io
import os
import statistics
import sys
import time
from typing import Sequence

from .schema import WorkerSpec
from megatron.common.cli import UserError
from megatron.common.files import write_json, write_text
from megatron.common import collectives

__all__ = ["OPS", "default_sizes", "repeats_for", "aggregate_rows", "write_csv", "run_calibration", "main"]

OPS = ("all_to_all", "all_reduce")
WORKER_MODULE = "tools.bench.calibration"


def default_sizes(lo: int = 4 << 10, hi: int = 64 << 20, per_octave: int = 1) -> list[int]:
    """Log-spaced sizes from ``lo`` to ``hi`` bytes: ``per_octave`` points per factor of 2.

    Each size is rounded to a multiple of 64 bytes (divisible into 4 ranks' fp32 chunks).
    """
    if not 0 < lo <= hi:
        raise UserError(f"--sizes: need 0 < lo <= hi, got {lo}, {hi}")
    import math

    n = int(round(math.log2(hi / lo) * per_octave))
    sizes = {max(64, int(round(lo * 2 ** (i / per_octave) / 64)) * 64) for i in range(n + 1)}
    return sorted(sizes)


def repeats_for(num_bytes: int, repeats: int) -> int:
    """Timed calls for one size: ``repeats`` x (1 MiB / size), between ``repeats`` and 10 x ``repeats``."""
    return max(repeats, min(10 * repeats, -(-repeats * (1 << 20) // num_bytes)))


# --------------------------------------------------------------------------------- worker side


def _time_op(op: str, num_bytes: int, warmup: int, repeats: int, gap_s: float = 0.0,
             one_way: bool = False) -> tuple[list[float], list[float]]:
    """(entry times, exit times) of the timed calls, in CLOCK_MONOTONIC seconds; every rank idles
    ``gap_s`` before each call's barrier (the shaper's bucket refills, as between a step's calls).
    ``one_way`` (all_to_all): only rank 0 sends off-rank (its ``num_bytes`` split evenly); the others
    keep their one chunk, so every link carries traffic in one direction only."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    numel = num_bytes // 4
    if numel % world:
        raise ValueError(f"size {num_bytes} B is not divisible into {world} fp32 chunks")
    chunk = numel // world
    splits_in = splits_out = None
    if one_way and op == "all_to_all":
        splits_in = [chunk] * world if rank == 0 else [chunk if r == rank else 0 for r in range(world)]
        splits_out = [chunk if r == rank else 0 for r in range(world)] if rank == 0 else \
            [chunk if r in (0, rank) else 0 for r in range(world)]
        numel_in, numel_out = sum(splits_in), sum(splits_out)
    else:
        numel_in = numel_out = numel
    x = torch.ones(numel_in, dtype=torch.float32)
    out = torch.empty(numel_out, dtype=torch.float32)
    starts, ends = [], []
    for i in range(warmup + repeats):
        if gap_s:
            time.sleep(gap_s)
        collectives.barrier()
        t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
        if op == "all_to_all":
            collectives.all_to_all_single(out, x, output_split_sizes=splits_out, input_split_sizes=splits_in)
        elif op == "all_reduce":
            collectives.all_reduce(x)
        else:
            raise ValueError(f"unknown op {op!r}; known: {OPS}")
        t1 = time.clock_gettime(time.CLOCK_MONOTONIC)
        if i >= warmup:
            starts.append(t0)
            ends.append(t1)
        if op == "all_reduce":
            x.fill_(1.0)  # keep values finite over many repeats
    return starts, ends


def main(argv=None) -> int:
    from .worker_env import init_gloo_from_env, read_spec_from_argv

    spec = read_spec_from_argv(argv)
    opts = spec.options
    init_gloo_from_env(spec.num_threads)
    import torch.distributed as dist

    rows = []
    for op in opts["ops"]:
        for num_bytes in opts["sizes"]:
            starts, ends = _time_op(op, int(num_bytes), spec.warmup, repeats_for(int(num_bytes), spec.steps),
                                    float(opts.get("gap_s", 0.0)), bool(opts.get("one_way", False)))
            rows.append({"op": op, "bytes": int(num_bytes), "start": starts, "end": ends})
    rank, world = dist.get_rank(), dist.get_world_size()
    collectives.barrier()
    dist.destroy_process_group()
    write_json(spec.result_path(rank), {"rank": rank, "world_size": world, "rows": rows})
    return 0


# --------------------------------------------------------------------------------- driver side


def aggregate_rows(per_rank: Sequence[dict]) -> list[dict]:
    """Per (op, bytes): last exit - last entry per repeat, then median/min/max over repeats.

    ``per_rank`` are the workers' result dicts (same ops, sizes and repeat counts on every rank).
    """
    ranks = len(per_rank)
    out = []
    for i, row in enumerate(per_rank[0]["rows"]):
        for r in per_rank:
            assert r["rows"][i]["op"] == row["op"] and r["rows"][i]["bytes"] == row["bytes"]
        starts = zip(*(r["rows"][i]["start"] for r in per_rank))
        ends = zip(*(r["rows"][i]["end"] for r in per_rank))
        durations = [max(e) - max(s) for s, e in zip(starts, ends)]
        out.append({
            "op": row["op"], "ranks": ranks, "bytes": row["bytes"],
            "seconds": statistics.median(durations), "min_s": min(durations), "max_s": max(durations),
            "mean_s": statistics.fmean(durations),
            "repeats_s": durations,
        })  # fmt: skip
    return out


def write_csv(path: str, rows: Sequence[dict]) -> None:
    """``op,ranks,bytes,seconds`` (atomically: temporary file, then rename)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["op", "ranks", "bytes", "seconds"])
    for r in rows:
        w.writerow([r["op"], r["ranks"], r["bytes"], f"{r['seconds']:.6e}"])
    write_text(path, buf.getvalue())


def run_calibration(
    rank_counts: Sequence[int],
    link,
    sizes: Sequence[int],
    warmup: int,
    repeats: int,
    use_netns: bool,
    work_dir: str,
    timeout_s: float,
    ops: Sequence[str] = OPS,
    num_threads: int = 1,
    log=print,
    gap_s: float = 0.0,
    one_way: bool = False,
) -> tuple[list[dict], list[dict]]:
    """Run the sweep for each rank count; return (rows, networks described). ``gap_s``: idle time
    before each call; ``one_way``: only rank 0 sends (``_time_op``)."""
    from .launcher import launch
    from .netns import open_network

    for op in ops:
        if op not in OPS:
            raise UserError(f"--ops: unknown op {op!r}; known: {', '.join(OPS)}")
    rows, networks = [], []
    for ranks in rank_counts:
        with open_network(ranks, link, use_netns) as net:
            run_dir = os.path.join(work_dir, f"collectives-r{ranks}")
            spec = WorkerSpec(
                variant="collectives", output_dir=os.path.join(run_dir, "out"), warmup=warmup,
                steps=repeats, num_threads=num_threads, options={"ops": list(ops), "sizes": list(sizes), "gap_s": gap_s,
                                                       "one_way": one_way},
            )  # fmt: skip
            t0 = time.monotonic()
            per_rank = launch(net, WORKER_MODULE, spec, run_dir, timeout_s)
            log(f"collectives: {ranks} ranks done in {time.monotonic() - t0:.1f}s")
            rows.extend(aggregate_rows(per_rank))
            networks.append(net.describe())
    return rows, networks


if __name__ == "__main__":
    sys.exit(main())
