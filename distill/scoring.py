"""Scoring a model against held-out text and lm-eval tasks: shared by the FCSD job (early stopping)
and the held-out report (``distill.report``)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from distill.losses import kl_divergence, student_ce
from megatron.common import collectives

__all__ = ["heldout_kl", "MAIN_METRICS", "main_metric", "LMEvalSpec", "lm_eval_scores", "make_lm_eval_spec"]


@torch.no_grad()
def heldout_kl(student, teacher, windows: torch.Tensor, *, micro_batch_size: int, pg_collection) -> dict:
    """Mean per-token KL(teacher || student) and the student's perplexity on fixed windows
    [N, S+1]; windows are dealt to data-parallel ranks with dummy batches for lockstep."""
    from moe_variants.builder import causal_attention_mask
    from megatron.components.parallel import device

    dp_rank, dp_size = dist.get_rank(pg_collection.dp), dist.get_world_size(pg_collection.dp)
    mine = windows[dp_rank::dp_size]
    count = torch.tensor([math.ceil(len(mine) / micro_batch_size)])
    collectives.all_reduce(count, op=dist.ReduceOp.MAX, group=pg_collection.dp)
    seq = windows.shape[1] - 1
    totals = torch.zeros(3, dtype=torch.float64)  # kl sum, nll sum, tokens
    was_training = student.training
    student.eval()
    try:
        for i in range(int(count.item())):
            chunk = mine[i * micro_batch_size:(i + 1) * micro_batch_size]
            weight = 1.0
            if len(chunk) == 0:  # dummy forward so every rank runs the same collectives
                chunk, weight = windows[:1], 0.0
            chunk = chunk.to(device())
            tokens, labels = chunk[:, :-1], chunk[:, 1:]
            positions = torch.arange(seq, device=tokens.device)[None].expand_as(tokens)
            mask = causal_attention_mask(seq, device=tokens.device)
            s_logits = student(tokens, positions, mask)
            t_logits = teacher(tokens, positions, mask)
            n = tokens.numel()
            totals[0] += weight * float(kl_divergence(s_logits, t_logits)) * n
            totals[1] += weight * float(student_ce(s_logits, labels).sum())
            totals[2] += weight * n
    finally:
        student.train(was_training)
    collectives.all_reduce(totals, group=pg_collection.dp)
    kl, nll = float(totals[0] / totals[2]), float(totals[1] / totals[2])
    return {"heldout_kl": kl, "heldout_loss": nll, "heldout_ppl": math.exp(min(nll, 50.0))}


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
        collectives.all_gather_object(every, scores)
        scores = next(s for s in every if s is not None)
    return scores


def make_lm_eval_spec(tasks: list[str], *, include_path: Optional[str], data_dir: Optional[str],
                      limit: Optional[float], batch_size: int, flags: dict) -> LMEvalSpec:
    """An ``LMEvalSpec`` checked before any model loads; one-line errors name the caller's
    ``flags`` (keys ``tasks``, ``include_path``, ``data_dir``, ``limit``)."""
    import argparse

    from megatron.training.evaluate_lm import INSTALL_HINT, task_manager, load_tasks

    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    for key, path in (("include_path", include_path), ("data_dir", data_dir)):
        if path is not None and not os.path.isdir(path):
            raise ValueError(f"{flags[key]} {path}: no such directory")
    if limit is not None and limit <= 0:
        raise ValueError(f"{flags['limit']} must be > 0, got {limit:g}")
    manager = task_manager(argparse.Namespace(include_path=include_path, data_dir=data_dir), tasks)
    unknown = [t for t in tasks if t not in set(manager.all_tasks)]
    if unknown:
        hint = "" if include_path else f" (the offline local_* tasks need {flags['include_path']} examples/lm_eval_tasks)"
        raise ValueError(f"{flags['tasks']}: unknown task {unknown[0]!r}{hint}")
    # build the tasks now: a missing data file fails before any model loads
    loaded = load_tasks(manager, tasks, flag=f"{flags['tasks']} {','.join(tasks)}")
    higher = {name: dict(task.higher_is_better() or {}) for name, task in loaded.items()}
    return LMEvalSpec(list(tasks), manager, limit, batch_size, higher_is_better=higher)
