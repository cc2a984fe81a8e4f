"""FCSD before/after report: held-out perplexity and KL to the teacher for every model of a conversion.

    python -m distill.report --teacher CKPT --text HELDOUT.txt --out report.json \\
        [--untrained all --untrained last:2] [--student "FCSD kl, all=RUN/best" ...] \\
        [--unigram-data PREFIX ...] [--max-windows N] [--micro-batch-size B] \
        [--lm-eval-tasks T1,T2 --include-path examples/lm_eval_tasks --data-dir ../shared/data --lm-eval-limit N]

Rows, all scored on the same windows of ``--text`` (``data.build_heldout_windows``: every token
after the first scored once):

* ``teacher``: the checkpoint with its own connectivity;
* ``untrained <spec>``: the teacher's weights loaded with ``--farskip <spec>`` and no training
  (paper Fig. 3: the conversion alone breaks the model);
* each ``--student LABEL=CKPT``: a distilled (or SFT) checkpoint with the connectivity it was
  saved with;
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
import dataclasses
import json
import math
import os
import sys
import tempfile
from typing import Optional

import numpy as np
import torch

__all__ = ["unigram_perplexity", "score_rows", "lm_eval_scores", "main_metric", "format_table", "main"]


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
                raise ValueError(f"--unigram-data {prefix}: no such file {prefix + suffix}")
        dtype = IndexedDataset(prefix).index.dtype
        ids = np.fromfile(prefix + ".bin", dtype=dtype)
        counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def _parse_student(spec: str) -> tuple[str, str]:
    label, sep, path = spec.rpartition("=")
    if not sep or not label or not path:
        raise ValueError(f"--student {spec!r}: expected LABEL=CHECKPOINT")
    if not os.path.exists(path):
        raise ValueError(f"--student {label}: no such checkpoint {path}")
    return label, path


# the metric a task's column shows, first one present wins
MAIN_METRICS = ("acc_norm,none", "acc,none", "word_perplexity,none", "perplexity,none", "exact_match,none")


def main_metric(task_results: dict) -> tuple[Optional[str], Optional[float]]:
    """(name, value) of a task's headline metric in lm-eval's results dict."""
    for key in MAIN_METRICS:
        if key in task_results:
            return key.split(",")[0], float(task_results[key])
    return None, None


@dataclasses.dataclass
class LMEvalSpec:
    """lm-eval tasks to run on every model of the report."""

    tasks: list
    manager: object  # lm_eval.tasks.TaskManager
    limit: Optional[float] = None
    batch_size: int = 8
    seed: int = 1234
    higher_is_better: dict = dataclasses.field(default_factory=dict)  # {task: {metric: bool}}

    def default_metric(self, task: str) -> Optional[str]:
        """The task's headline metric (as ``main_metric`` picks it), from its config."""
        names = self.higher_is_better.get(task, {})
        return next((k.split(",")[0] for k in MAIN_METRICS if k.split(",")[0] in names), None)


def lm_eval_scores(model, tokenizer, seq_length: int, pg_collection, spec: LMEvalSpec) -> dict:
    """{task: {metric: value}} of one loaded model (lm-eval's numeric metrics, stderr included),
    on every rank. Collective: every rank of the model's layout calls it. The caller's random
    states (python, numpy, torch) are restored afterwards: lm-eval reseeds them all, which would
    otherwise reset the training run's RNG at every evaluation."""
    import logging
    import random

    import lm_eval
    import torch.distributed as dist

    from megatron.training.lm_eval_adapter import MegatronCheckpointLM

    lm = MegatronCheckpointLM(model, tokenizer, max_length=seq_length, pg_collection=pg_collection,
                              batch_size=spec.batch_size)
    limit = None if spec.limit is None else (int(spec.limit) if spec.limit >= 1 else spec.limit)
    quiet = dist.is_initialized() and dist.get_rank() != 0
    log = logging.getLogger("lm_eval")
    level = log.level
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            if quiet:
                log.setLevel(logging.ERROR)
            results = lm_eval.simple_evaluate(
                model=lm, tasks=list(spec.tasks), limit=limit, task_manager=spec.manager, log_samples=False,
                bootstrap_iters=0, random_seed=spec.seed, numpy_random_seed=spec.seed,
                torch_random_seed=spec.seed, fewshot_random_seed=spec.seed,
            )
    finally:
        log.setLevel(level)
        random.setstate(py_state)
        np.random.set_state(np_state)
    scores = None
    if results:
        scores = {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
                  for task, metrics in results["results"].items()}
    # lm-eval returns results on local rank 0 only; every rank needs them (early stopping agrees)
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, scores)
        scores = next(s for s in every if s is not None)
    return scores


@torch.no_grad()
def score_rows(teacher_path: str, text: str, *, untrained: list[str], students: list[tuple[str, str]],
               max_windows: Optional[int], micro_batch_size: int,
               lm_eval_spec: Optional[LMEvalSpec] = None) -> tuple[list[dict], object]:
    """Held-out rows for the teacher, the untrained conversions and the students (one rank)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from distill.fcsd import heldout_kl
    from moe_variants.config import ParallelConfig
    from megatron.training.data import build_heldout_windows
    from megatron.training.loading import load_model
    from megatron.training.parallel import initialize_parallel

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

    rows = [row("teacher", teacher, configs.model.farskip)]
    for spec in untrained:
        model, *_ = load_model(teacher_path, parallel=ParallelConfig(), overrides={"farskip": spec})
        rows.append(row(f"untrained, farskip {spec}", model, spec))
        del model
    for label, path in students:
        model, student_configs, *_ = load_model(path, parallel=ParallelConfig())
        if student_configs.model.seq_length != configs.model.seq_length:
            raise ValueError(f"--student {label}: seq_length {student_configs.model.seq_length} "
                             f"differs from the teacher's {configs.model.seq_length}")
        rows.append(row(label, model, student_configs.model.farskip))
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
                   help="score the teacher's weights with --farskip SPEC and no training (repeatable)")
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


def make_lm_eval_spec(tasks: list[str], *, include_path: Optional[str], data_dir: Optional[str],
                      limit: Optional[float], batch_size: int, flags: dict) -> LMEvalSpec:
    """An ``LMEvalSpec`` checked before any model loads; one-line errors name the caller's
    ``flags`` (keys ``tasks``, ``include_path``, ``data_dir``, ``limit``)."""
    import argparse

    from megatron.training.evaluate_lm import INSTALL_HINT, _task_manager, load_tasks

    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    for key, path in (("include_path", include_path), ("data_dir", data_dir)):
        if path is not None and not os.path.isdir(path):
            raise ValueError(f"{flags[key]} {path}: no such directory")
    if limit is not None and limit <= 0:
        raise ValueError(f"{flags['limit']} must be > 0, got {limit:g}")
    manager = _task_manager(argparse.Namespace(include_path=include_path, data_dir=data_dir), tasks)
    unknown = [t for t in tasks if t not in set(manager.all_tasks)]
    if unknown:
        hint = "" if include_path else f" (the offline local_* tasks need {flags['include_path']} examples/lm_eval_tasks)"
        raise ValueError(f"{flags['tasks']}: unknown task {unknown[0]!r}{hint}")
    # build the tasks now: a missing data file fails before any model loads
    loaded = load_tasks(manager, tasks, flag=f"{flags['tasks']} {','.join(tasks)}")
    higher = {name: dict(task.higher_is_better() or {}) for name, task in loaded.items()}
    return LMEvalSpec(list(tasks), manager, limit, batch_size, higher_is_better=higher)


def _lm_eval_spec(args) -> Optional[LMEvalSpec]:
    if args.lm_eval_tasks is None:
        return None
    from megatron.training.evaluate_lm import _task_list

    return make_lm_eval_spec(
        _task_list(args.lm_eval_tasks), include_path=args.include_path, data_dir=args.data_dir,
        limit=args.lm_eval_limit, batch_size=args.lm_eval_batch_size,
        flags={"tasks": "--lm-eval-tasks", "include_path": "--include-path", "data_dir": "--data-dir",
               "limit": "--lm-eval-limit"})


def main(argv=None) -> int:
    import torch.distributed as dist

    from megatron import compat

    compat.quiet_warnings()
    args = build_parser().parse_args(argv)
    try:
        if not os.path.exists(args.teacher):
            raise ValueError(f"--teacher {args.teacher}: no such checkpoint")
        if not os.path.isfile(args.text):
            raise ValueError(f"--text {args.text}: no such file")
        students = [_parse_student(s) for s in args.student]
        spec = _lm_eval_spec(args)
        with tempfile.TemporaryDirectory(prefix="fcsd-report-") as tmp:
            dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
            try:
                rows, (windows, tokenizer) = score_rows(
                    args.teacher, args.text, untrained=args.untrained, students=students,
                    max_windows=args.max_windows, micro_batch_size=args.micro_batch_size, lm_eval_spec=spec)
            finally:
                from megatron.core import parallel_state

                parallel_state.destroy_model_parallel()
                dist.destroy_process_group()
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
        from tools.bench.schema import write_json_atomic

        write_json_atomic(args.out, payload)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(payload))
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
