"""FCSD before/after report: held-out perplexity and KL to the teacher for every model of a conversion.

    python -m distill.report --teacher CKPT --text HELDOUT.txt --out report.json \\
        [--untrained all --untrained last:2] [--farskip-connectivity paper-text] \\
        [--student "FCSD kl, all=RUN/best" ...] \\
        [--unigram-data PREFIX ...] [--max-windows N] [--micro-batch-size B] \
        [--lm-eval-tasks T1,T2 --include-path examples/lm_eval_tasks --data-dir ../shared/data --lm-eval-limit N]

Rows, all scored on the same windows of ``--text`` (``data.build_heldout_windows``: every token
after the first scored once):

* ``teacher``: the checkpoint with its own connectivity;
* ``untrained <spec>``: the teacher's weights loaded with ``--farskip <spec>`` and no training
  (paper Fig. 3: the conversion alone breaks the model); ``<spec>@<mode>`` converts only one
  sub-block (``--farskip-mode attn-only``: only attention reads the earlier stream, ``mlp-only``:
  only the MoE), which says which of the two costs; ``--farskip-connectivity`` picks their wiring
  (default ``reference``; ``paper-text`` reproduces figures made before that option existed);
* each ``--student LABEL=CKPT``: a distilled (or SFT) checkpoint with the connectivity it was
  saved with (its wiring is recorded as ``farskip_connectivity``);
* ``unigram``: token frequencies of ``--unigram-data`` (add-one smoothed), the floor a language
  model must clearly beat.

Each row reports the held-out loss, perplexity, its gap to the teacher's perplexity (relative) and
the mean per-token KL(teacher || model); with ``--lm-eval-tasks`` also every model's lm-eval score
on those tasks (through ``megatron.training.lm_eval_adapter``; the table shows each task's main
metric, the JSON all of them). One process (a world of one gloo rank), EP=1: checkpoints
are layout-free, and the numbers do not depend on the layout they were trained at. The JSON is
written atomically; a markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional

import numpy as np
import torch

from megatron.components.checkpointing import CheckpointError
from megatron.components.parallel import single_process_group
from megatron.common.cli import UserError, run_cli, user_input
from megatron.common.files import write_json
from distill.scoring import LMEvalSpec, heldout_kl, lm_eval_scores, main_metric, make_lm_eval_spec
from moe_variants.farskip.config import FarSkipConfig, FarSkipConnectivity

__all__ = ["unigram_perplexity", "score_rows", "format_table", "main"]


def unigram_perplexity(train_counts: np.ndarray, heldout_labels: np.ndarray) -> dict:
    """Perplexity of ``heldout_labels`` under an add-one smoothed unigram fitted to ``train_counts``
    (one count per vocabulary entry)."""
    counts = np.asarray(train_counts, dtype=np.float64) + 1.0
    logp = np.log(counts) - math.log(counts.sum())
    loss = float(-logp[np.asarray(heldout_labels, dtype=np.int64)].mean())
    return {"loss": loss, "ppl": math.exp(loss), "tokens": int(np.asarray(heldout_labels).size)}


def _token_counts(prefixes: list[str], vocab_size: int) -> np.ndarray:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    counts = np.zeros(vocab_size, dtype=np.int64)
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                raise UserError(f"--unigram-data {prefix}: no such file {prefix + suffix}")
        dtype = IndexedDataset(prefix).index.dtype
        ids = np.fromfile(prefix + ".bin", dtype=dtype)
        counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def _parse_student(spec: str) -> tuple[str, str]:
    label, sep, path = spec.rpartition("=")
    if not sep or not label or not path:
        raise UserError(f"--student {spec!r}: expected LABEL=CHECKPOINT")
    if not os.path.exists(path):
        raise UserError(f"--student {label}: no such checkpoint {path}")
    return label, path


def _untrained_spec(spec: str) -> tuple[str, Optional[str]]:
    """``"last:1@mlp-only"`` -> ``("last:1", "mlp-only")``; no ``@``: the paper's full conversion (None)."""
    from moe_variants.farskip.config import FarSkipMode, LayerSelection

    layers, _, mode = spec.partition("@")
    with user_input():
        LayerSelection.parse(layers)  # a bad layer spec is its one-line error before any model is loaded
    if not mode:
        return layers, None
    modes = [m.value for m in FarSkipMode]
    if mode not in modes:
        raise UserError(f"--untrained {spec}: unknown FarSkip mode {mode!r} (one of {', '.join(modes)})")
    return layers, mode


@torch.no_grad()
def score_rows(teacher_path: str, text: str, *, untrained: list[str], students: list[tuple[str, str]],
               max_windows: Optional[int], micro_batch_size: int,
               lm_eval_spec: Optional[LMEvalSpec] = None,
               connectivity: Optional[str] = None) -> tuple[list[dict], object]:
    """Held-out rows for the teacher, the untrained conversions (``--farskip-connectivity
    connectivity``, default the config's) and the students (one rank)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from moe_variants.config import ParallelConfig
    from megatron.training.data import build_heldout_windows
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel

    initialize_parallel(ParallelConfig())
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    teacher, configs, tokenizer, _ = load_model(teacher_path, parallel=ParallelConfig())
    windows = build_heldout_windows(text, tokenizer, configs.model.seq_length)
    if max_windows:
        windows = windows[:max_windows]

    def row(label, model, farskip):
        r = heldout_kl(model, teacher, windows, micro_batch_size=micro_batch_size, pg_collection=pgc)
        out = {"model": label, "farskip": farskip, "loss": r["heldout_loss"], "ppl": r["heldout_ppl"],
               "kl_to_teacher": r["heldout_kl"]}
        if lm_eval_spec is not None:
            out["lm_eval"] = lm_eval_scores(model, tokenizer, configs.model.seq_length, pgc, lm_eval_spec)
        return out

    rows = [row("teacher", teacher, str(FarSkipConfig.of(configs.model).farskip))]
    for spec in untrained:
        layers, mode = _untrained_spec(spec)
        overrides = {"farskip": layers} if mode is None else {"farskip": layers, "farskip_mode": mode}
        if connectivity is not None:
            overrides["farskip_connectivity"] = connectivity
        model, untrained_configs, *_ = load_model(teacher_path, parallel=ParallelConfig(), overrides=overrides)
        rows.append(row(f"untrained, farskip {spec}", model, layers))
        rows[-1]["farskip_connectivity"] = FarSkipConfig.of(untrained_configs.model).farskip_connectivity.value
        if mode is not None:
            rows[-1]["farskip_mode"] = mode
        del model
    for label, path in students:
        model, student_configs, *_ = load_model(path, parallel=ParallelConfig())
        if student_configs.model.seq_length != configs.model.seq_length:
            raise UserError(f"--student {label}: seq_length {student_configs.model.seq_length} "
                            f"differs from the teacher's {configs.model.seq_length}")
        student_farskip = FarSkipConfig.of(student_configs.model)
        rows.append({**row(label, model, str(student_farskip.farskip)), "checkpoint": path,
                     "farskip_connectivity": student_farskip.farskip_connectivity.value})
        del model
    teacher_ppl = rows[0]["ppl"]
    for r in rows:
        r["ppl_gap_to_teacher"] = r["ppl"] / teacher_ppl - 1.0
    return rows, (windows, tokenizer)


def format_table(rows: list[dict]) -> str:
    tasks = list(dict.fromkeys(t for r in rows for t in r.get("lm_eval", {})))
    heads = []
    for t in tasks:
        name = next((main_metric(r["lm_eval"][t])[0] for r in rows if t in r.get("lm_eval", {})), None)
        heads.append(f"{t} {name}" if name else t)
    lines = ["| model | FarSkip layers | held-out loss | held-out ppl | vs teacher ppl | KL(teacher‖model) |"
             + "".join(f" {h} |" for h in heads),
             "|---|---|---:|---:|---:|---:|" + "---:|" * len(tasks)]
    for r in rows:
        kl = "" if r.get("kl_to_teacher") is None else f"{r['kl_to_teacher']:.4f}"
        cells = []
        for t in tasks:
            value = main_metric(r["lm_eval"][t])[1] if t in r.get("lm_eval", {}) else None
            cells.append("" if value is None else f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}")
        lines.append(f"| {r['model']} | {r.get('farskip') or 'none'} | {r['loss']:.4f} | {r['ppl']:.2f} | "
                     f"{100 * r['ppl_gap_to_teacher']:+.1f}% | {kl} |" + "".join(f" {c} |" for c in cells))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m distill.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", required=True, help="the source checkpoint (its own connectivity)")
    p.add_argument("--text", required=True, help="held-out text file (e.g. WikiText-2 test)")
    p.add_argument("--out", required=True, help="report JSON (written atomically)")
    p.add_argument("--untrained", action="append", default=[], metavar="SPEC",
                   help="score the teacher's weights with --farskip SPEC and no training (repeatable); "
                   "SPEC@MODE converts one sub-block only (attn-only, mlp-only)")
    p.add_argument("--farskip-connectivity", choices=[c.value for c in FarSkipConnectivity], default=None,
                   help="wiring of the --untrained conversions (default: reference; paper-text: the wiring of "
                   "checkpoints and figures made before this option)")
    p.add_argument("--student", action="append", default=[], metavar="LABEL=CKPT",
                   help="a distilled checkpoint to score (repeatable)")
    p.add_argument("--unigram-data", nargs="+", default=None, metavar="PREFIX",
                   help="indexed datasets whose token frequencies give the unigram row")
    p.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--lm-eval-tasks", default=None, metavar="T1,T2",
                   help="also score every model on these lm-eval tasks (needs lm-eval installed)")
    p.add_argument("--include-path", default=None, help="extra directory of lm-eval task YAMLs")
    p.add_argument("--data-dir", default=None, help="data directory of the offline local_* tasks")
    p.add_argument("--lm-eval-limit", type=float, default=None, help="examples per task (or a fraction)")
    p.add_argument("--lm-eval-batch-size", type=int, default=8)
    return p


def _lm_eval_spec(args) -> Optional[LMEvalSpec]:
    if args.lm_eval_tasks is None:
        return None
    from megatron.training.evaluate_lm import task_list

    return make_lm_eval_spec(
        task_list(args.lm_eval_tasks), include_path=args.include_path, data_dir=args.data_dir,
        limit=args.lm_eval_limit, batch_size=args.lm_eval_batch_size,
        flags={"tasks": "--lm-eval-tasks", "include_path": "--include-path", "data_dir": "--data-dir",
               "limit": "--lm-eval-limit"})


def main(argv=None) -> int:
    from megatron import compat

    compat.quiet_warnings()

    def body():
        args = build_parser().parse_args(argv)
        if not os.path.exists(args.teacher):
            raise UserError(f"--teacher {args.teacher}: no such checkpoint")
        if not os.path.isfile(args.text):
            raise UserError(f"--text {args.text}: no such file")
        students = [_parse_student(s) for s in args.student]
        for spec in args.untrained:
            _untrained_spec(spec)
        with user_input():
            spec = _lm_eval_spec(args)
        with single_process_group():
            rows, (windows, tokenizer) = score_rows(
                args.teacher, args.text, untrained=args.untrained, students=students,
                max_windows=args.max_windows, micro_batch_size=args.micro_batch_size, lm_eval_spec=spec,
                connectivity=args.farskip_connectivity)
        if args.unigram_data:
            counts = _token_counts(args.unigram_data, tokenizer.vocab_size)
            uni = unigram_perplexity(counts, windows[:, 1:].numpy())
            rows.append({"model": "unigram (training-corpus frequencies)", "farskip": None, "loss": uni["loss"],
                         "ppl": uni["ppl"], "kl_to_teacher": None, "ppl_gap_to_teacher": uni["ppl"] / rows[0]["ppl"] - 1})
        payload = {"text": args.text, "windows": int(windows.shape[0]), "tokens": int(windows[:, 1:].numel()),
                   "teacher": args.teacher, "rows": rows}
        if spec is not None:
            payload["lm_eval"] = {"tasks": spec.tasks, "limit": args.lm_eval_limit, "include_path": args.include_path,
                                  "data_dir": args.data_dir, "higher_is_better": spec.higher_is_better}
        write_json(args.out, payload)
        print(json.dumps(payload))
        print(format_table(rows))

    # a missing, corrupt or mismatched checkpoint is one line too
    return run_cli("distill.report", body, user_errors=(UserError, CheckpointError))


if __name__ == "__main__":
    sys.exit(main())
