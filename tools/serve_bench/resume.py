"""Completed variant-runs kept in ``--work-dir`` and reused by ``--resume``.

A comparison at a slow link takes hours; a killed or timed-out invocation should not lose the
runs it finished. After each variant-run the harness writes ``done.json`` in its run directory
(``serve-<variant>-run<r>``): the settings the measurement depends on, the client result that
holds the measured phases and the run's load mark. ``--resume`` reads those back instead of
serving again; a run directory without ``done.json`` (the run was cut off) is served anew, and one
made with other settings is refused in one line, so runs of two configurations never mix.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from megatron.common.cli import UserError
from megatron.common.files import write_json

DONE_FILE = "done.json"


def run_key(args, variant: str, run: int) -> dict:
    """What a variant-run's measurement depends on (the SLOs and plots do not: they are analysis)."""
    return {"variant": variant, "run": run, "load": os.path.abspath(args.load) if args.load else None,
            "config": args.config, "mode": args.mode, "link_gbit": args.link_gbit, "shaper": args.shaper,
            "no_netns": args.no_netns, "ranks": args.ranks, "tp": args.tensor_model_parallel_size,
            "ep": args.serve_ep, "request_rates": [f"{r:g}" for r in args.request_rates],
            "num_requests": args.num_requests, "duration": args.duration, "prompts": args.prompts,
            "input_len": args.input_len, "output_len": args.output_len, "max_output_len": args.max_output_len,
            "warmup_requests": args.warmup_requests, "seed": args.seed, "threads": args.threads}


def spans_of(spans_dir: str, num_ranks: int) -> list:
    """Every rank's step lines (``serve --a2a-spans``), or [] when no rank recorded an all-to-all."""
    out = []
    for r in range(num_ranks):
        try:
            with open(os.path.join(spans_dir, f"a2a_spans_rank{r}.jsonl")) as f:
                out.append([json.loads(line) for line in f if line.strip()])
        except (OSError, ValueError):
            out.append([])
    return out if any(out) else []


def mark_done(run_dir: str, key: dict, result_path: str, load: dict) -> None:
    """Record a finished variant-run (written last, so its presence means the run is whole)."""
    write_json(os.path.join(run_dir, DONE_FILE), {"key": key, "result": os.path.basename(result_path), "load": load})


def reuse(run_dir: str, key: dict) -> Optional[tuple]:
    """``(measured phases, load mark)`` of a finished run in ``run_dir``, or None when it did not
    finish. UserError when it was made with other settings than ``key``."""
    path = os.path.join(run_dir, DONE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        done = json.load(f)
    differ = [k for k in key if done["key"].get(k) != key[k]]
    if differ:
        k = differ[0]
        raise UserError(f"--resume: {run_dir} was measured with {k}={done['key'].get(k)!r}, this command has "
                        f"{key[k]!r}; use another --work-dir or the same arguments")
    with open(os.path.join(run_dir, done["result"])) as f:
        return {p["name"]: p for p in json.load(f)["phases"]}, done["load"]
