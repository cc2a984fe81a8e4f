"""Write a benchmark JSON as docs/figures keeps it: everything but the raw per-request and per-rank lists.

    python -m tools.figure_summary runs/serve.json docs/figures/bench_serve_x.json
    python -m tools.figure_summary --check docs/figures        # no committed figure JSON holds raw lists

``bench_serve.py --json`` keeps every request of every run (``requests``), ``bench_ep.py
--json`` every rank's per-step lists (``per_rank``) and ``python -m tools.faults serving-chaos``
every request of its chaos run (``requests``): most of each file, and no doc table or plot
reads them (the tables and plots come from ``variants``, ``over_runs``, ``ratios`` and ``runs``).
The summary is the same JSON without those keys, with ``raw_removed`` naming what was left out and
the command that wrote the whole file (``command``) kept. A serving run that ``python -m netsim
validate`` replays needs its requests: keep that one whole and gzipped (``gzip -9 -n``), as
``docs/figures/netsim_validation/`` does (docs/figures/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

RAW = {"bench_serve": ("requests",), "bench_ep": ("per_rank",), "serving_chaos": ("requests",)}


def raw_keys(d) -> list:
    """The raw lists a benchmark JSON holds (by its schema's tool), [] for any other JSON."""
    schema = d.get("schema", "") if isinstance(d, dict) else ""
    return [k for k in RAW.get(schema.split("/")[0], ()) if k in d]


def summary(d: dict) -> dict:
    """``d`` without its raw lists, ``raw_removed`` naming them (added to any earlier ones)."""
    drop = raw_keys(d)
    if not drop:
        raise ValueError(f"no raw lists to remove (schema {d.get('schema')!r}: bench_serve/* keeps 'requests', "
                         "bench_ep/* 'per_rank')")
    out = {k: v for k, v in d.items() if k not in drop}
    out["raw_removed"] = sorted(set(d.get("raw_removed", [])) | set(drop))
    return out


def check(root: str) -> list:
    """``(path, raw keys)`` of the JSON files under ``root`` that still hold raw lists."""
    found = []
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if name.endswith(".json"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    keys = raw_keys(json.load(f))
                if keys:
                    found.append((path, keys))
    return found


def main(argv=None) -> int:
    from megatron.common.cli import UserError, run_cli
    from megatron.common.files import write_json

    p = argparse.ArgumentParser(prog="figure_summary.py", description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="a bench_serve.py / bench_ep.py --json output (or, with --check, a folder)")
    p.add_argument("out", nargs="?", help="where to write the summary (may be the input)")
    p.add_argument("--check", action="store_true", help="list the JSON files under the folder that hold raw lists")

    def body():
        args = p.parse_args(argv)
        if args.check:
            found = check(args.json)
            for path, keys in found:
                print(f"{path}: holds {', '.join(keys)}")
            return 1 if found else 0
        if not args.out:
            raise UserError("give the summary's path (OUT), or --check FOLDER")
        try:
            with open(args.json) as f:
                d = json.load(f)
        except (OSError, ValueError) as err:
            raise UserError(f"{args.json}: {getattr(err, 'strerror', None) or err}") from None
        before = os.path.getsize(args.json)
        write_json(args.out, summary(d))
        print(f"wrote {args.out}: {os.path.getsize(args.out) / 1024:.0f} KiB ({before / 1024:.0f} KiB with the raw lists)")
        return 0

    return run_cli("figure_summary.py", body)


if __name__ == "__main__":
    sys.exit(main())
