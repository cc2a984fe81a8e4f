"""Turn the shared prompt sets into Sem-MoE PROMPTS.jsonl files with the paper's 20% / 80% split.

    python -m tools.semmoe.prompts --data-dir ../shared/data/prompts --out-dir data/semmoe_prompts

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
* More domains, from the shared eval sets (``--eval-dir``), for per-domain routing statistics:
  ``mbpp`` (code: the task text and its reference solution), ``boolq`` (Wikipedia passages with a
  question), ``lambada`` (fiction passages), ``arc`` (grade-school science questions with their
  lettered choices, easy and challenge). Answers and labels are never included.

``--max-requests N`` keeps a seeded random N of a dataset's requests (file order) before the split;
``--mix NAME`` also writes ``NAME_{all,profile,eval}.jsonl``, the datasets' parts concatenated, to
solve on a mix of domains and evaluate per domain (the ids start with the dataset's name).

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

from megatron.common.cli import UserError, user_input
from megatron.common.files import write_json, write_text

PROG = "semmoe_prompts.py"

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
                text = _lettered(row["question"], [row[f"choice{j}"] for j in range(4)])
                out.append({"id": f"mmlu:{subject}:{i}", "text": text})
    return out


def _read_jsonl(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON lines ({e})") from None


def _lettered(query: str, choices: list) -> str:
    body = "\n".join(f"{letter}. {c}" for letter, c in zip("ABCDEFGH", choices))
    return f"{query.strip()}\n{body}\nAnswer:"


def mbpp_prompts(eval_dir: str) -> list[dict]:
    rows = _read_jsonl(os.path.join(eval_dir, "mbpp", "mbpp.jsonl"))
    return [{"id": f"mbpp:{r.get('task_id', i)}", "text": f"{r['text'].strip()}\n{r['code'].strip()}"}
            for i, r in enumerate(rows)]  # fmt: skip


def boolq_prompts(eval_dir: str) -> list[dict]:
    rows = _read_jsonl(os.path.join(eval_dir, "boolq", "boolq.jsonl"))
    return [{"id": f"boolq:{i}", "text": r["query"].strip()} for i, r in enumerate(rows)]


def lambada_prompts(eval_dir: str) -> list[dict]:
    rows = _read_jsonl(os.path.join(eval_dir, "lambada", "lambada_test.jsonl"))
    return [{"id": f"lambada:{i}", "text": r["text"].strip()} for i, r in enumerate(rows)]


def arc_prompts(eval_dir: str) -> list[dict]:
    out = []
    for part in ("easy", "challenge"):
        rows = _read_jsonl(os.path.join(eval_dir, "arc", f"arc_{part}.jsonl"))
        out += [{"id": f"arc:{part}:{i}", "text": _lettered(r["query"], r["choices"])} for i, r in enumerate(rows)]
    return out


def subsample(records: list[dict], n: int, seed: int) -> list[dict]:
    """A seeded random ``n`` of ``records`` in file order (all of them when there are fewer)."""
    if n <= 0 or n >= len(records):
        return records
    keep = np.sort(np.random.default_rng(seed).permutation(len(records))[:n])
    return [records[i] for i in keep]


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
        raise UserError(f"{path} exists (use --force to replace it)")
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    write_text(path, text)
    digest = hashlib.sha256(text.encode())
    return digest.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="../shared/data/prompts", help="the shared prompts directory")
    ap.add_argument("--eval-dir", default="../shared/data/eval", help="the shared eval sets (mbpp, boolq, lambada, arc)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--fraction", type=float, default=0.2, help="share of requests to profile on (paper: 0.2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--datasets", default="sharegpt,mmlu")
    ap.add_argument("--max-requests", type=int, default=0, help="keep a seeded random N of each dataset (0: all)")
    ap.add_argument("--mix", default=None, help="also write NAME_{all,profile,eval}.jsonl: every dataset's part")
    ap.add_argument("--force", action="store_true", help="replace existing outputs")
    args = ap.parse_args(argv)
    builders = {"sharegpt": sharegpt_prompts, "mmlu": mmlu_prompts, "mbpp": mbpp_prompts,
                "boolq": boolq_prompts, "lambada": lambada_prompts, "arc": arc_prompts}  # fmt: skip
    from_eval = {"mbpp", "boolq", "lambada", "arc"}
    try:
        names = [n.strip() for n in args.datasets.split(",") if n.strip()]
        unknown = [n for n in names if n not in builders]
        if unknown:
            raise UserError(f"--datasets: unknown {unknown} (known: {', '.join(builders)})")
        for flag, d, needed in (("--data-dir", args.data_dir, set(names) - from_eval),
                                ("--eval-dir", args.eval_dir, set(names) & from_eval)):  # fmt: skip
            if needed and not os.path.isdir(d):
                raise UserError(f"{flag} {d}: no such directory")
        if args.mix and args.mix in builders:
            raise UserError(f"--mix {args.mix}: the name of a dataset")
        os.makedirs(args.out_dir, exist_ok=True)
        parts = {}
        for name in names:
            try:
                with user_input():  # the dataset's files
                    records = builders[name](args.eval_dir if name in from_eval else args.data_dir)
            except (KeyError, TypeError, AttributeError) as e:
                raise UserError(f"{name}: a record is malformed ({type(e).__name__}: {e})") from None
            records = subsample(records, args.max_requests, args.seed)
            with user_input():  # --fraction
                prof, held = split(records, args.fraction, args.seed)
            parts[name] = {"all": records, "profile": prof, "eval": held}
        if args.mix:
            parts[args.mix] = {p: [r for n in names for r in parts[n][p]] for p in ("all", "profile", "eval")}
            names = names + [args.mix]
        for name in names:  # check every output before writing any
            for part in parts[name]:
                path = os.path.join(args.out_dir, f"{name}_{part}.jsonl")
                if os.path.exists(path) and not args.force:
                    raise UserError(f"{path} exists (use --force to replace it)")
        manifest = {"data_dir": os.path.abspath(args.data_dir), "eval_dir": os.path.abspath(args.eval_dir),
                    "fraction": args.fraction, "seed": args.seed, "max_requests": args.max_requests, "files": {}}
        for name in names:
            for part, records in parts[name].items():
                path = os.path.join(args.out_dir, f"{name}_{part}.jsonl")
                sha = write_jsonl(path, records, args.force)
                manifest["files"][os.path.basename(path)] = {"requests": len(records), "sha256": sha}
                print(f"{path}: {len(records)} requests")
        write_jsonl_manifest = os.path.join(args.out_dir, "prompts_manifest.json")
        write_json(write_jsonl_manifest, manifest)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
