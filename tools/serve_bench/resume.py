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


# the arguments a served run's measurement does not depend on: output, analysis (SLOs, load marks), the
# number and rotation of runs, and the link search (--resume needs a fixed link)
NOT_MEASURED = frozenset({"json", "plots", "no_plots", "work_dir", "resume", "timeout_s", "slo_ttft", "slo_tpot",
                          "load_threshold", "strict", "runs", "variants", "target_comm_fraction", "probe_variant",
                          "probe_rounds", "max_probes"})


def run_key(args, variant: str, run: int) -> dict:
    """Every argument a variant-run's measurement depends on (all but ``NOT_MEASURED``; values naming
    an existing file or folder made absolute, variants' own path flags among them), as JSON would read
    it back."""
    key = {k: v for k, v in vars(args).items() if k not in NOT_MEASURED}
    key.update({k: os.path.abspath(v) for k, v in key.items() if isinstance(v, str) and v and os.path.exists(v)})
    return json.loads(json.dumps({"variant": variant, "run": run, **key}, sort_keys=True, default=str))


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
    differ = sorted(k for k in set(key) | set(done["key"]) if done["key"].get(k) != key.get(k))
    if differ:
        k = differ[0]
        raise UserError(f"--resume: {run_dir} was measured with {k}={done['key'].get(k)!r}, this command has "
                        f"{key.get(k)!r}; use another --work-dir or the same arguments")
    with open(os.path.join(run_dir, done["result"])) as f:
        return {p["name"]: p for p in json.load(f)["phases"]}, done["load"]
