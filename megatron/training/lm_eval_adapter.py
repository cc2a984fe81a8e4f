"""lm-evaluation-harness ``LM`` for this project's checkpoints, run under torchrun with TP/EP.

``MegatronCheckpointLM.from_checkpoint(path, tensor_model_parallel_size=, expert_model_parallel_size=)``
rebuilds the model and tokenizer (``offline_lm.CheckpointLM``, which needs no lm-eval) and implements
``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until``.

**Many ranks, one evaluation.** lm-eval sees a single worker (rank 0 of 1) in every process, so
every rank runs the whole lm-eval pipeline and receives the same requests in the same order (a
hash of each request list is all-gathered and compared; a mismatch raises instead of hanging).
The adapter shards the work itself: requests are sorted longest first, cut into batches, and batch
``i`` goes to data-parallel rank ``i mod DP`` (megatron-core's DP group; TP peers share a DP rank,
so they see the same batch, as tensor parallelism needs). A ``request_scheduler`` (Sem-MoE's
Algorithm 2) instead picks each request's DP rank, and each rank batches its own requests longest
first; a request's forward is then the same apart from which requests share its batch. Results are all-gathered over the DP
group and put back in request order, so every rank returns the same list.

**Lockstep.** Every MoE layer runs an all-to-all over its EP group, whose members hold different
batches; a rank that stops calling the model while a peer still does would hang that peer. So
ranks agree on the number of forwards: for scoring, one all-reduce(MAX) of the batch count, and a
rank that runs out of batches runs dummy forwards (one padding token, outputs dropped); for
generation, an all-reduce(MAX) of "still decoding" before every decoding step, with a dummy
forward on ranks whose batch has finished. The agreement is taken over the whole world, a
superset of every EP and TP group, so it holds for EP across all ranks, EP inside DP, and TP.

**Scoring.** Context + continuation is truncated from the left to ``seq_length + 1`` tokens; the
model reads all but the last and the continuation's tokens are scored with the log-softmax over
the tokenizer's vocabulary (the padded-vocabulary columns are not tokens and are dropped).
Batches are right-padded: under the causal mask, padding after a sequence cannot change its
logits, and in a dropless MoE (no ``moe_expert_capacity_factor``) padding tokens only add expert
work; with a capacity factor, tokens compete for capacity, so scores depend on the batching
(a warning says so). Rolling log-likelihood uses lm-eval's disjoint windows of ``seq_length``
(``get_rolling_token_windows`` + ``make_disjoint_window``) and sums the windows' scores.

**Generation** is ``offline_lm.GreedyBatch`` (greedy; ``kv_cache`` at TP 1, ``recompute`` at TP > 1;
see that module), stopping at lm-eval's ``until`` strings or ``max_gen_toks``.

Shape suffixes: ``B`` batch rows, ``S`` sequence positions, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from megatron.training.offline_lm import (CheckpointLM, GenerationMode, GenJob, GreedyBatch, continuation_score,
                                          greedy_stop, scoring_window)

__all__ = [
    "GenerationMode",
    "MegatronCheckpointLM",
    "scoring_window",
    "continuation_score",
    "greedy_stop",
]


class MegatronCheckpointLM(CheckpointLM, TemplateLM):
    """An lm-eval ``LM`` over a checkpoint (``CheckpointLM.from_checkpoint``; see the module docstring
    and ``offline_lm.CheckpointLM`` for the arguments)."""

    backend = "causal"

    # --- loglikelihood ----------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``requests``: ``((context, continuation), context_ids, continuation_ids)`` triples."""
        windows = [scoring_window(ctx, cont, self._max_length) for _, ctx, cont in requests]
        self._ranks.check_same("loglikelihood", windows)
        # nothing to score (an empty continuation): log 1 = 0, trivially greedy
        results: dict[int, tuple[float, bool]] = {i: (0.0, True) for i, w in enumerate(windows) if w[1] == 0}
        order = sorted((i for i in range(len(windows)) if i not in results), key=lambda i: (-len(windows[i][0]), i))
        mine = self._ranks.mine(order, self._batch_size, lambda i: windows[i][0][:-1], self._scheduler)
        for step in range(self._ranks.max(len(mine))):
            if step >= len(mine):
                self._dummy_forward()
                continue
            rows = [windows[i] for i in mine[step]]
            lengths = [len(tokens) - 1 for tokens, _ in rows]
            inputs_BS = torch.full((len(rows), max(lengths)), self.eot_token_id, dtype=torch.long)
            real_BS = torch.zeros(inputs_BS.shape, dtype=torch.bool)
            for b, (tokens, _) in enumerate(rows):
                inputs_BS[b, :lengths[b]] = torch.tensor(tokens[:-1])
                real_BS[b, :lengths[b]] = True
            logits_BSV = self._forward(inputs_BS, real_BS=real_BS).cpu()
            for b, (i, (tokens, num_scored)) in enumerate(zip(mine[step], rows)):
                end = lengths[b]
                targets_S = torch.tensor(tokens[-num_scored:])
                results[i] = continuation_score(logits_BSV[b, end - num_scored:end], targets_S)
        merged = self._ranks.gather(results)
        out = [merged[i] for i in range(len(windows))]
        for (pair, _, _), res in zip(requests, out):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pieces, owners = [], []
        for r, req in enumerate(requests):
            (string,) = req.args
            for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length, context_len=1)):
                pieces.append((None, ctx, pred))
                owners.append(r)
        scores = self._loglikelihood_tokens(pieces)
        totals = [0.0] * len(requests)
        for r, (score, _) in zip(owners, scores):
            totals[r] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generation -------------------------------------------------------------------------
    def _job(self, context: str, gen_kwargs: Optional[dict]) -> GenJob:
        kwargs = dict(gen_kwargs or {})
        if kwargs.get("do_sample"):
            raise ValueError("generate_until: only greedy decoding is supported (the task asks for do_sample)")
        until = kwargs.get("until")
        until = handle_stop_sequences(list(until) if isinstance(until, (list, tuple)) else until,
                                      eos=self.tok_decode([self.eot_token_id]))
        max_new = int(kwargs.get("max_gen_toks", self._max_gen_toks))
        prompt = self.tok_encode(context)[-self._max_length:] or [self.prefix_token_id]
        return GenJob(prompt, list(until), max(max_new, 0))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        jobs = [self._job(*req.args) for req in requests]
        self._ranks.check_same("generate_until", [dataclasses.astuple(j) for j in jobs])
        order = sorted(range(len(jobs)), key=lambda i: (-len(jobs[i].prompt), i))
        mine = self._ranks.mine(order, self._batch_size, lambda i: jobs[i].prompt, self._scheduler)
        results: dict[int, str] = {}
        for step in range(self._ranks.max(len(mine))):
            batch = mine[step] if step < len(mine) else []
            texts = self._generate_batch([jobs[i] for i in batch])
            results.update(zip(batch, texts))
        merged = self._ranks.gather(results)
        out = [merged[i] for i in range(len(jobs))]
        for req, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def _generate_batch(self, jobs: list[GenJob]) -> list[str]:
        """Greedy decoding of one batch (possibly empty), stepping in lockstep with every rank."""
        decoder = GreedyBatch(self, jobs) if jobs else None
        while self._ranks.max(decoder is not None and not decoder.finished):
            if decoder is not None and not decoder.finished:
                decoder.step()
            else:
                self._dummy_forward()
        return decoder.texts() if decoder else []
