#!/usr/bin/env python
"""Turn the shared prompt sets into Sem-MoE PROMPTS.jsonl files with the paper's 20% / 80% split.

    python scripts/semmoe_prompts.py --data-dir ../shared/data/prompts --out-dir data/semmoe_prompts

writes, per dataset (``sharegpt``, ``mmlu``), ``<name>_profile.jsonl`` (20% of the requests, to
profile and solve on) and ``<name>_eval.jsonl`` (the other 80%, held out), plus
``<name>_all.jsonl`` and ``prompts_manifest.json`` (sources, counts, seed, sha256 of every output).
One JSON object per line: ``{"id": "<dataset>:<source id>", "text": "..."}``, the format
``python -m tools.semmoe profile --data`` reads.

* ShareGPT: the first ``human`` turn of every conversation in both shared files
  (``sg_90k_part1_html_cleaned_lang_first_sampled.json`` and ``ShareGPT_V3_filtered_500.json``),
  empty and duplicate texts dropped (first occurrence kept).
* MMLU: every test question (57 subjects), as ``question`` followed by the four lettered choices
  and ``Answer:`` (the usual zero-shot prompt; the answer itself is not included).

The split is deterministic: a ``numpy.random.default_rng(seed)`` permutation of the requests in
file order; each part keeps file order. Existing outputs are never overwritten (``--force``
replaces them, still atomically).
"""

from __future__ import annotations

import argparse
import csv
import glob
import hashlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_variants.common.files import write_json, write_text  # noqa: E402

SHAREGPT_FILES = ("sg_90k_part1_html_cleaned_lang_first_sampled.json", "ShareGPT_V3_filtered_500.json")


def sharegpt_prompts(directory: str) -> list[dict]:
    out, seen = [], set()
    for name in SHAREGPT_FILES:
        path = os.path.join(directory, "sharegpt", name)
        try:
            with open(path) as f:
                records = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read ShareGPT file ({e})") from None
        for rec in records:
            turns = [t for t in rec.get("conversations", []) if t.get("from") == "human"]
            if not turns:
                continue
            text = turns[0].get("value", "").strip()
            if not text or text in seen:
                continue
            seen.add(text)
            out.append({"id": f"sharegpt:{rec.get('id', len(out))}", "text": text})
    return out


def mmlu_prompts(directory: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(directory, "mmlu", "test", "*_test.csv")))
    if not files:
        raise ValueError(f"{directory}/mmlu/test: no *_test.csv files")
    out = []
    for path in files:
        subject = os.path.basename(path)[: -len("_test.csv")]
        with open(path, newline="") as f:
            for i, row in enumerate(csv.DictReader(f)):
                choices = "\n".join(f"{letter}. {row[f'choice{j}']}" for j, letter in enumerate("ABCD"))
                text = f"{row['question'].strip()}\n{choices}\nAnswer:"
                out.append({"id": f"mmlu:{subject}:{i}", "text": text})
    return out


def split(records: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(profile part, held-out part): a seeded permutation picks round(fraction * n) requests."""
    n = len(records)
    n_a = int(round(fraction * n))
    if not 0 < n_a < n:
        raise ValueError(f"cannot split {n} requests with fraction {fraction}")
    chosen = np.zeros(n, dtype=bool)
    chosen[np.random.default_rng(seed).permutation(n)[:n_a]] = True
    return [r for r, c in zip(records, chosen) if c], [r for r, c in zip(records, chosen) if not c]


def write_jsonl(path: str, records: list[dict], force: bool) -> str:
    if os.path.exists(path) and not force:
        raise ValueError(f"{path} exists (use --force to replace it)")
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    write_text(path, text)
    digest = hashlib.sha256(text.encode())
    return digest.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="../shared/data/prompts", help="the shared prompts directory")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--fraction", type=float, default=0.2, help="share of requests to profile on (paper: 0.2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--datasets", default="sharegpt,mmlu")
    ap.add_argument("--force", action="store_true", help="replace existing outputs")
    args = ap.parse_args(argv)
    builders = {"sharegpt": sharegpt_prompts, "mmlu": mmlu_prompts}
    try:
        names = [n.strip() for n in args.datasets.split(",") if n.strip()]
        unknown = [n for n in names if n not in builders]
        if unknown:
            raise ValueError(f"--datasets: unknown {unknown} (known: {', '.join(builders)})")
        if not os.path.isdir(args.data_dir):
            raise ValueError(f"--data-dir {args.data_dir}: no such directory")
        os.makedirs(args.out_dir, exist_ok=True)
        parts = {}
        for name in names:
            records = builders[name](args.data_dir)
            prof, held = split(records, args.fraction, args.seed)
            parts[name] = {"all": records, "profile": prof, "eval": held}
        for name in names:  # check every output before writing any
            for part in parts[name]:
                path = os.path.join(args.out_dir, f"{name}_{part}.jsonl")
                if os.path.exists(path) and not args.force:
                    raise ValueError(f"{path} exists (use --force to replace it)")
        manifest = {"data_dir": os.path.abspath(args.data_dir), "fraction": args.fraction, "seed": args.seed,
                    "files": {}}
        for name in names:
            for part, records in parts[name].items():
                path = os.path.join(args.out_dir, f"{name}_{part}.jsonl")
                sha = write_jsonl(path, records, args.force)
                manifest["files"][os.path.basename(path)] = {"requests": len(records), "sha256": sha}
                print(f"{path}: {len(records)} requests")
        write_jsonl_manifest = os.path.join(args.out_dir, "prompts_manifest.json")
        write_json(write_jsonl_manifest, manifest)
    except ValueError as e:
        print(f"semmoe_prompts.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
